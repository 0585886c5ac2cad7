#include "kv_memory_service/shm/shm_append.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kv_memory_service/serving/serve_fetch.h"

namespace infinigen::kv_memory_service::shm {

absl::Status ServeAppend(KvStore& store, AppendFields a, uint64_t meta_bytes,
                         const uint16_t* data, size_t elements, int32_t* plan,
                         size_t plan_capacity, uint32_t* evicted) {
  *evicted = 0;
  const uint64_t slot_bytes = uint64_t{elements} * sizeof(uint16_t);
  if (a.values > elements / 2 ||
      meta_bytes > slot_bytes - 2 * a.values * sizeof(uint16_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm data plane: an append of 2 x ", a.values, " values and ",
        meta_bytes, " bytes of annotations does not fit the slot's ",
        elements, " values"));
  }
  a.prefix_meta = absl::string_view(
      reinterpret_cast<const char*>(data + 2 * a.values), meta_bytes);
  IG_ASSIGN_OR_RETURN(const AppendResult result,
                      AppendForResponse(store, a, data, plan_capacity / 3,
                                        "shm data plane"));
  WriteEvictedTriples(result.evicted, plan);
  *evicted = static_cast<uint32_t>(result.evicted.size());
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service::shm
