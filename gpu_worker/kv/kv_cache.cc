// The KvCache factory and the worker-memory limit: which cache a policy
// gets (local_kv_cache.cc, hybrid_kv_cache.cc, offloaded_kv_cache.cc).
#include "gpu_worker/kv/kv_cache.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "gpu_worker/kv/kv_cache_impl.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {

void FetchStats::Add(const FetchStats& o) {
  steps += o.steps;
  fraction_sum += o.fraction_sum;
  fraction_max = std::max(fraction_max, o.fraction_max);
  rows_fetched += o.rows_fetched;
  rows_read_in_place += o.rows_read_in_place;
  bytes_fetched += o.bytes_fetched;
  wait_seconds += o.wait_seconds;
  open_seconds += o.open_seconds;
  prefill_append_wait_seconds += o.prefill_append_wait_seconds;
}

absl::Status KvOptions::Validate() const {
  if (policy) {
    IG_RETURN_IF_ERROR(policy->Validate());
    if (kv_client == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "policy %s needs a KV memory node (kv_client)", policy_name()));
    }
  }
  if (!(kv_capacity > 0.0 && kv_capacity <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kv_capacity must be in (0, 1], got %g", kv_capacity));
  }
  if (max_worker_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_worker_bytes must be >= 0, got %d", max_worker_bytes));
  }
  if (prefix_block_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prefix_block_tokens must be >= 0, got %d", prefix_block_tokens));
  }
  return absl::OkStatus();
}

const char* KvOptions::policy_name() const {
  return policy ? PolicyName(policy->kind) : kLocalCacheName;
}

absl::Status ChoosePolicy(absl::string_view name, KvOptions& kv) {
  if (name == kLocalCacheName) {
    kv.policy.reset();
    return absl::OkStatus();
  }
  if (const PolicyEntry* entry = FindPolicy(name)) {
    if (!kv.policy) kv.policy.emplace();
    kv.policy->kind = entry->kind;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown policy '%s' (%s, %s)", name, kLocalCacheName, PolicyNames()));
}

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
