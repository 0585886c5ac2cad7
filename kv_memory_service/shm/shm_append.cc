#include "kv_memory_service/shm/shm_append.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status.h"

namespace infinigen::kv_memory_service::shm {

absl::Status ServeAppend(KvStore& store, const AppendFromSlot& a,
                         const uint16_t* data, size_t elements, int32_t* plan,
                         size_t plan_capacity, uint32_t* evicted) {
  *evicted = 0;
  IG_ASSIGN_OR_RETURN(const SequenceGeometry g,
                      store.Geometry(a.sequence, a.session));
  // In 128 bits: the client's counts may be anything.
  const unsigned __int128 want = static_cast<unsigned __int128>(a.n_layers) *
                                 a.n_tokens * g.n_kv_heads * g.head_dim;
  if (a.n_layers == 0 || a.n_tokens == 0 || a.n_layers > INT32_MAX ||
      a.n_tokens > INT32_MAX || want != a.values) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm data plane: an append of ", a.n_layers, " layers x ",
        a.n_tokens, " tokens has ", a.n_layers, " x ", a.n_tokens, " x ",
        g.n_kv_heads * g.head_dim, " K values (and as many V), the slot ",
        a.values));
  }
  if (a.values > elements / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm data plane: an append of 2 x ", a.values,
                     " values does not fit the slot's ", elements));
  }
  const uint64_t most_evicted =
      static_cast<uint64_t>(a.n_layers) * a.n_tokens * g.n_kv_heads;
  if (3 * most_evicted > plan_capacity) {
    return absl::InvalidArgumentError(
        "shm data plane: the slot has no room for the append's evictions");
  }
  AppendBlock block;
  block.first_layer = a.first_layer;
  block.n_layers = static_cast<int32_t>(a.n_layers);
  block.n_tokens = static_cast<int32_t>(a.n_tokens);
  block.k = absl::MakeConstSpan(data, a.values);
  block.v = absl::MakeConstSpan(data + a.values, a.values);
  IG_ASSIGN_OR_RETURN(const AppendResult result,
                      store.Append(a.sequence, block));
  for (size_t i = 0; i < result.evicted.size(); ++i) {
    plan[3 * i] = result.evicted[i].layer;
    plan[3 * i + 1] = result.evicted[i].kv_head;
    plan[3 * i + 2] = result.evicted[i].position;
  }
  *evicted = static_cast<uint32_t>(result.evicted.size());
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service::shm
