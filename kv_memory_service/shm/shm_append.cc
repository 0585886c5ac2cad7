#include "kv_memory_service/shm/shm_append.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kv_memory_service/serving/serve_fetch.h"

namespace infinigen::kv_memory_service::shm {

absl::Status ServeAppend(KvStore& store, const AppendFromSlot& a,
                         const uint16_t* data, size_t elements, int32_t* plan,
                         size_t plan_capacity, uint32_t* evicted) {
  *evicted = 0;
  const uint64_t slot_bytes = uint64_t{elements} * sizeof(uint16_t);
  if (a.values > elements / 2 ||
      a.meta_bytes > slot_bytes - 2 * a.values * sizeof(uint16_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm data plane: an append of 2 x ", a.values, " values and ",
        a.meta_bytes, " bytes of annotations does not fit the slot's ",
        elements, " values"));
  }
  AppendFields fields;
  fields.sequence = a.sequence;
  fields.session = a.session;
  fields.first_layer = a.first_layer;
  fields.n_layers = a.n_layers;
  fields.n_tokens = a.n_tokens;
  fields.values = a.values;
  fields.prefix_meta = absl::string_view(
      reinterpret_cast<const char*>(data + 2 * a.values), a.meta_bytes);
  IG_ASSIGN_OR_RETURN(const AppendResult result,
                      AppendForResponse(store, fields, data, plan_capacity / 3,
                                        "shm data plane"));
  for (size_t i = 0; i < result.evicted.size(); ++i) {
    plan[3 * i] = result.evicted[i].layer;
    plan[3 * i + 1] = result.evicted[i].kv_head;
    plan[3 * i + 2] = result.evicted[i].position;
  }
  *evicted = static_cast<uint32_t>(result.evicted.size());
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service::shm
