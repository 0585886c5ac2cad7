// What kv_cache.h's options and statistics do themselves: FetchStats
// sums, KvOptions' checks and --policy's names (ChoosePolicy). Which cache
// a policy gets is kv_cache_factory.cc's.
#include "gpu_worker/kv/kv_cache.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status.h"
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
  prefill_policy_seconds += o.prefill_policy_seconds;
  row_cache_lookups += o.row_cache_lookups;
  row_cache_hits += o.row_cache_hits;
  for (auto [mine, theirs] :
       {std::pair{&row_cache_layer_lookups, &o.row_cache_layer_lookups},
        std::pair{&row_cache_layer_hits, &o.row_cache_layer_hits},
        std::pair{&selection_layer_repeats, &o.selection_layer_repeats},
        std::pair{&watched_layer_candidates, &o.watched_layer_candidates},
        std::pair{&watched_layer_selected, &o.watched_layer_selected}}) {
    if (mine->size() < theirs->size()) mine->resize(theirs->size(), 0);
    for (size_t l = 0; l < theirs->size(); ++l) (*mine)[l] += (*theirs)[l];
  }
  row_cache_bytes += o.row_cache_bytes;
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
  if (!(row_cache >= 0.0 && row_cache <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "row_cache must be in [0, 1], got %g", row_cache));
  }
  if (max_worker_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_worker_bytes must be >= 0, got %d", max_worker_bytes));
  }
  if (prefix_block_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prefix_block_tokens must be >= 0, got %d", prefix_block_tokens));
  }
  for (size_t i = 0; i < watch_positions.size(); ++i) {
    if (watch_positions[i] < 0 ||
        (i > 0 && watch_positions[i] <= watch_positions[i - 1])) {
      return absl::InvalidArgumentError(
          "watch_positions must be positions >= 0, increasing");
    }
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

}  // namespace infinigen::gpu_worker
