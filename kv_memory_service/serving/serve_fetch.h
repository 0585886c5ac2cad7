// What the gRPC service and the fetch socket share, so that both check the
// same things in the same order with the same codes: the server side of
// one fetch (their tokens: credentials.h). Thread-safe as KvStore.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVING_SERVE_FETCH_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVING_SERVE_FETCH_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/status.h"
#include "kv_memory_service/store/kv_store.h"

namespace infinigen::kv_memory_service {

// Sizes `rows` (a std::string or std::vector<uint16_t>, resized in place:
// no allocation once it has grown) to the plan's rows and gathers them.
// NotFound for an unknown sequence and for one `session` does not own
// (KvStore::CheckOwner); InvalidArgument when the client's destination
// (dest_elements, 0 = unknown) is smaller than the plan needs;
// ResourceExhausted when the rows exceed max_rows_bytes; then
// KvStore::Gather's errors. On error `rows` holds garbage.
template <typename Rows>
absl::Status GatherForResponse(KvStore& store, SequenceId seq,
                               SessionId session, int32_t layer,
                               const FetchPlan& plan, uint64_t dest_elements,
                               int64_t max_rows_bytes, Rows* rows) {
  IG_ASSIGN_OR_RETURN(SequenceGeometry g, store.Geometry(seq, session));
  const size_t elements = FetchElements(plan, g.head_dim);
  if (dest_elements != 0 && elements > dest_elements) {
    return absl::InvalidArgumentError(absl::StrCat(
        "destination holds ", dest_elements, " values; the plan's ",
        plan.indices.size(), " rows of K and V need ", elements));
  }
  const int64_t bytes = static_cast<int64_t>(elements * sizeof(uint16_t));
  if (bytes > max_rows_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the fetch's ", bytes, " bytes of rows exceed the limit of ",
        max_rows_bytes, " bytes per response"));
  }
  rows->resize(static_cast<size_t>(bytes) / sizeof(*rows->data()));
  return store.Gather(
      seq, layer, plan,
      absl::Span<uint16_t>(reinterpret_cast<uint16_t*>(rows->data()),
                           elements));
}

// A note of `plan`'s rows of `layer`, which the caller holds
// (KvStore::NoteHeld). The same NotFound as GatherForResponse for a
// sequence `session` may not use, then KvStore::NoteHeld's errors.
inline absl::Status NoteHeldForResponse(KvStore& store, SequenceId seq,
                                        SessionId session, int32_t layer,
                                        const FetchPlan& plan) {
  IG_RETURN_IF_ERROR(store.CheckOwner(seq, session));
  return store.NoteHeld(seq, layer, plan);
}

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVING_SERVE_FETCH_H_
