// What the data planes' servers share, so that each checks the same things
// in the same order with the same codes: the server side of one fetch (the
// gRPC service and the fetch socket) and of one append whose shape came as
// raw counts (a shm slot, the fetch socket); their tokens: credentials.h.
// Thread-safe as KvStore.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVING_SERVE_FETCH_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVING_SERVE_FETCH_H_

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// An append whose shape came as raw counts (a shm slot's fields, a fetch
// socket frame's header), with its K values and then as many V values in
// the plane's memory.
struct AppendFields {
  SequenceId sequence = 0;
  SessionId session = 0;
  int32_t first_layer = 0;
  uint64_t n_layers = 0;
  uint64_t n_tokens = 0;
  uint64_t values = 0;  // K values (and as many V)
  // The block's prefix annotations, as EncodePrefixMeta writes them (the
  // plane's memory; empty: none).
  absl::string_view prefix_meta;
};

// OK when `a`'s counts describe a block of sequence geometry `g` with
// a.values K values (in 128 bits: the counts may be anything) whose
// evicted tokens, at most one per layer, token and KV head, are no more
// than max_evicted; InvalidArgument, naming `plane`, otherwise. Layer range
// and token limits are the store's to check.
inline absl::Status CheckAppendShape(const SequenceGeometry& g,
                                     const AppendFields& a,
                                     uint64_t max_evicted,
                                     absl::string_view plane) {
  const unsigned __int128 want = static_cast<unsigned __int128>(a.n_layers) *
                                 a.n_tokens * g.n_kv_heads * g.head_dim;
  if (a.n_layers == 0 || a.n_tokens == 0 || a.n_layers > INT32_MAX ||
      a.n_tokens > INT32_MAX || want != a.values) {
    return absl::InvalidArgumentError(absl::StrCat(
        plane, ": an append of ", a.n_layers, " layers x ", a.n_tokens,
        " tokens has ", a.n_layers, " x ", a.n_tokens, " x ",
        g.n_kv_heads * g.head_dim, " K values (and as many V), the request ",
        a.values));
  }
  if (a.n_layers * a.n_tokens * static_cast<uint64_t>(g.n_kv_heads) >
      max_evicted) {
    return absl::InvalidArgumentError(
        absl::StrCat(plane, ": no room for the append's evicted tokens"));
  }
  return absl::OkStatus();
}

// The evicted tokens as the shm slot and the fetch socket answer them:
// (layer, kv_head, position) int32 triples, into out[0, 3 * size).
inline void WriteEvictedTriples(absl::Span<const EvictedToken> evicted,
                                int32_t* out) {
  for (size_t i = 0; i < evicted.size(); ++i) {
    out[3 * i] = evicted[i].layer;
    out[3 * i + 1] = evicted[i].kv_head;
    out[3 * i + 2] = evicted[i].position;
  }
}

// Appends `a`'s block from data[0, 2 * a.values) (K, then V), with its
// prefix annotations, for a.session: the same NotFound as
// GatherForResponse for a sequence the session may not use,
// CheckAppendShape's and DecodePrefixMeta's InvalidArgument, then
// KvStore::Append's errors, with nothing appended on any.
inline absl::StatusOr<AppendResult> AppendForResponse(
    KvStore& store, const AppendFields& a, const uint16_t* data,
    uint64_t max_evicted, absl::string_view plane) {
  IG_ASSIGN_OR_RETURN(const SequenceGeometry g,
                      store.Geometry(a.sequence, a.session));
  IG_RETURN_IF_ERROR(CheckAppendShape(g, a, max_evicted, plane));
  std::vector<std::string> meta;
  AppendBlock block;
  if (absl::Status decoded = DecodePrefixMeta(
          a.prefix_meta, &meta, &block.prefix_meta_first_block);
      !decoded.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(plane, ": ", decoded.message()));
  }
  block.prefix_meta = meta;
  block.first_layer = a.first_layer;
  block.n_layers = static_cast<int32_t>(a.n_layers);
  block.n_tokens = static_cast<int32_t>(a.n_tokens);
  block.k = absl::MakeConstSpan(data, a.values);
  block.v = absl::MakeConstSpan(data + a.values, a.values);
  return store.Append(a.sequence, block);
}

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVING_SERVE_FETCH_H_
