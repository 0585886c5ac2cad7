// The KvCache factory and the worker-memory limit: which cache a policy
// gets (local_kv_cache.cc, hybrid_kv_cache.cc, offloaded_kv_cache.cc).
#include <memory>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/kv_cache_impl.h"

namespace infinigen::gpu_worker {

absl::StatusOr<int64_t> KvCache::WorkerBytes(const model::Weights& weights,
                                             const KvCacheOptions& options) {
  IG_RETURN_IF_ERROR(options.kv.Validate());
  if (!options.kv.policy) {
    return LocalKvCacheBytes(weights.config, options);
  }
  if (weights.config.sliding_window > 0) {
    return HybridKvCacheBytes(weights, options);
  }
  return OffloadedKvCacheBytes(weights, options);
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options) {
  if (options.batch <= 0 || options.max_seq_len <= 0 ||
      options.max_chunk <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kv cache: batch %d, max_seq_len %d and max_chunk %d must be "
        "positive",
        options.batch, options.max_seq_len, options.max_chunk));
  }
  // WorkerBytes validates the KV options.
  IG_ASSIGN_OR_RETURN(const int64_t need, WorkerBytes(weights, options));
  if (options.kv.max_worker_bytes > 0 && need > options.kv.max_worker_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "policy %s needs %.1f MiB of worker KV memory for batch %d x %d "
        "positions, above the limit of %.1f MiB (--max_worker_kv_bytes=%d)",
        options.kv.policy_name(), need / 1048576.0, options.batch,
        options.max_seq_len, options.kv.max_worker_bytes / 1048576.0,
        options.kv.max_worker_bytes));
  }
  if (!options.kv.policy) {
    return NewLocalKvCache(weights, backend, options);
  }
  if (weights.config.sliding_window > 0) {
    return NewHybridKvCache(weights, backend, options);
  }
  return NewOffloadedKvCache(weights, backend, options);
}

}  // namespace infinigen::gpu_worker
