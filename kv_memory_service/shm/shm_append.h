// The server's side of an append through a slot (shm_protocol.h,
// kAppend): the block's shape, as the client's fields give it, checked
// against the sequence's geometry and the slot; the rows appended from
// where the client wrote them; the evicted tokens written back. Private to
// kv_memory_service/shm/.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_APPEND_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_APPEND_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kv_memory_service/client/kv_types.h"
#include "kv_memory_service/serving/serve_fetch.h"
#include "kv_memory_service/store/kv_store.h"

namespace infinigen::kv_memory_service::shm {

// Appends `a`'s block (SlotControl's fields, read once out of shared
// memory) from data[0, elements): K, then V, then `meta_bytes` of its
// prefix annotations (a.prefix_meta is set from there), to the store, for a.session (NotFound, as for a fetch, for
// another's sequence), and writes the evicted tokens to plan[0,
// plan_capacity) as (layer, kv_head, position) triples, their count to
// *evicted. InvalidArgument for a shape whose values are not a.values,
// annotations that do not decode, or a block that does not fit the slot;
// otherwise the store's errors, with nothing appended.
absl::Status ServeAppend(KvStore& store, AppendFields a, uint64_t meta_bytes,
                         const uint16_t* data, size_t elements, int32_t* plan,
                         size_t plan_capacity, uint32_t* evicted);

}  // namespace infinigen::kv_memory_service::shm

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_APPEND_H_
