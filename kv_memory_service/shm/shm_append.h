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
#include "kv_memory_service/store/kv_store.h"

namespace infinigen::kv_memory_service::shm {

// SlotControl's fields of an append, read once out of shared memory.
struct AppendFromSlot {
  SequenceId sequence = 0;
  SessionId session = 0;
  int32_t first_layer = 0;
  uint32_t n_layers = 0;
  uint32_t n_tokens = 0;
  uint64_t values = 0;  // K values, then as many V values, in `data`
  uint64_t meta_bytes = 0;  // then the prefix annotations' bytes
};

// Appends `a`'s block from data[0, elements) (K, then V, then its prefix
// annotations) to the store, for a.session (NotFound, as for a fetch, for
// another's sequence), and writes the evicted tokens to plan[0,
// plan_capacity) as (layer, kv_head, position) triples, their count to
// *evicted. InvalidArgument for a shape whose values are not a.values,
// annotations that do not decode, or a block that does not fit the slot;
// otherwise the store's errors, with nothing appended.
absl::Status ServeAppend(KvStore& store, const AppendFromSlot& a,
                         const uint16_t* data, size_t elements, int32_t* plan,
                         size_t plan_capacity, uint32_t* evicted);

}  // namespace infinigen::kv_memory_service::shm

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_APPEND_H_
