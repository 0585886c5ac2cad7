// The KvCache implementations (kv_cache.h) and what they share; private
// to gpu_worker's :kv_cache target.
#ifndef INFINIGEN_GPU_WORKER_KV_KV_CACHE_IMPL_H_
#define INFINIGEN_GPU_WORKER_KV_KV_CACHE_IMPL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/kv_cache.h"
#include "model/weights.h"

namespace infinigen::gpu_worker {

// Local (ideal): WorkerBytes without allocating, and the cache.
// only_windows: the sliding-window layers alone (the hybrid's part).
int64_t LocalKvCacheBytes(const model::ModelConfig& config,
                          const KvCacheOptions& options,
                          bool only_windows = false);
absl::StatusOr<std::unique_ptr<KvCache>> NewLocalKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options, bool only_windows = false);

// Hybrid (a policy on a model with sliding-window layers, hybrid_kv_cache.cc):
// the sliding-window layers local, the global layers offloaded.
absl::StatusOr<int64_t> HybridKvCacheBytes(const model::Weights& weights,
                                           const KvCacheOptions& options);
absl::StatusOr<std::unique_ptr<KvCache>> NewHybridKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options);

// Offloaded (every other policy).
absl::StatusOr<int64_t> OffloadedKvCacheBytes(const model::Weights& weights,
                                              const KvCacheOptions& options);
absl::StatusOr<std::unique_ptr<KvCache>> NewOffloadedKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options);

// Queues causal attention of n queries q [n, n_heads, head_dim] (into out,
// same shape) over k, v [n_kv_heads, kv_stride, head_dim]: query i sees
// rows [0, kv_len0 + i), or its last `window` of them when window > 0
// (the layer's ModelConfig::AttentionWindow). prob_sums as in
// AttentionParams. k_half and v_half, where set, are the rows in fp16
// instead (k and v unused; no prob_sums).
void QueueAttention(Backend& backend, const model::ModelConfig& config,
                    const float* q, const float* k, const float* v,
                    int kv_stride, int n, int kv_len0, int window, float* out,
                    float* prob_sums, const uint16_t* k_half = nullptr,
                    const uint16_t* v_half = nullptr);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_KV_CACHE_IMPL_H_
