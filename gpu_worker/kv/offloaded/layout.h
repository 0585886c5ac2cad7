// The offloaded cache's buffer sizes (Layout), from its options alone:
// Init allocates exactly these and the cache's worker_bytes is their sum;
// OffloadedKvCacheBytes reports the same without allocating.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_LAYOUT_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/offloaded/row_cache.h"
#include "model/weights.h"

namespace infinigen::gpu_worker {
namespace offloaded {

struct Layout {
  int row_width = 0;        // uint16 per stored row
  size_t plan_rows = 0;     // most rows of one layer's plan, all heads
  // Plan buffers (plan_dev, and on a device plan_host) per sequence: where
  // a device stages fetched rows (their head offsets) or the policy plans
  // on the backend; with room for plan_room indices before the head
  // offsets (plan_rows where the indices go there: one-sided reads onto a
  // device, plans made on the backend; else none).
  bool plan_buffers = false;
  size_t plan_room = 0;
  size_t fetch_values = 0;  // uint16 per fetch buffer: K then V rows
  bool staged = false;      // fetched rows copied to device staging
  bool attention_probs = false;
  bool prefill_probs = false;
  // A prefill layer's rows also kept in fp16 (half_rows), which its
  // attention reads: a device computing in fp16 (KvCacheOptions::
  // half_local_kv), fp16 stored rows, a policy that attends over the rows
  // as stored (KvPolicy::ReusesPrefix), no prefill probabilities. The same
  // values as the fp32 rows, at half the bytes to read.
  bool half_rows = false;
  int64_t policy_bytes = 0;
  // The row cache's fraction (KvOptions::row_cache) where a sequence may
  // have one: a policy that selects rows (one that takes a target fetch),
  // a node that never evicts, on a host backend or, for a policy that
  // wants no attention probabilities, a device; else 0. Less, or 0,
  // where the rest leaves less under max_worker_bytes.
  double row_cache = 0.0;
  RowCacheReplacement row_cache_replacement = RowCacheReplacement::kRecency;

  int64_t PerSequence(const model::ModelConfig& c, int max_seq) const {
    const int64_t fetch = 2 * static_cast<int64_t>(fetch_values) * 2;
    // Two plan buffers, on the backend and (devices) pinned on the host.
    const int64_t plans =
        plan_buffers ? int64_t{staged ? 2 : 1} * 2 *
                           (plan_room + c.n_kv_heads + 1) * 4
                     : 0;
    return fetch * (staged ? 2 : 1) + plans +
           int64_t{2} * c.n_layers * c.kv_dim() * 4 +        // step rows
           int64_t{2} * c.n_layers * c.n_kv_heads * row_width * 2 +  // encoded
           int64_t{c.n_layers} * c.n_kv_heads * max_seq +    // presence
           int64_t{c.n_layers} * 8 + policy_bytes +
           (row_cache > 0 ? RowCache::Bytes(c.n_layers, c.n_kv_heads, max_seq,
                                            row_width, row_cache,
                                            row_cache_replacement)
                          : 0);
  }
  int64_t Shared(const model::ModelConfig& c, int max_seq,
                 int max_chunk) const {
    const int64_t decoded =
        int64_t{2} * c.n_kv_heads * (max_seq + 1) * c.head_dim * 4;
    // Two stages of a prefill layer's K and V rows.
    const int64_t stage =
        int64_t{2} * 2 * max_seq * c.n_kv_heads * row_width * 2;
    const int64_t host_rows =  // prefill chunk's K, V and step rows, read here
        int64_t{max_chunk} * 2 * c.kv_dim() * 4 +
        int64_t{2} * c.n_layers * c.kv_dim() * 4;
    // A prefill chunk's rows decoded from their stored form, and (device
    // backends) that form staged on the device.
    const int64_t chunk_rows =
        int64_t{2} * max_chunk * c.kv_dim() * 4 +
        (staged ? int64_t{2} * max_chunk * c.n_kv_heads * row_width * 2 : 0);
    // Probabilities (h2o): on the backend and their host copies.
    return decoded + (half_rows ? decoded / 2 : 0) + stage + host_rows +
           chunk_rows +
           (attention_probs ? int64_t{2} * c.n_heads * (max_seq + 1) * 4 : 0) +
           (prefill_probs ? int64_t{2} * c.n_heads * max_seq * 4 : 0);
  }
};

absl::StatusOr<Layout> MakeLayout(const model::Weights& weights,
                                  bool operates_on_host,
                                  const KvCacheOptions& options);

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_LAYOUT_H_
