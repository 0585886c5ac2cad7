#include "gpu_worker/kv/offloaded/layout.h"

#include <algorithm>
#include <memory>

#include "common/status.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace offloaded {

namespace {

// The row cache yields to the rest of the cache under a worker limit
// (KvOptions::max_worker_bytes): its fraction shrinks to what the limit
// leaves; where not even its maps fit, there is none.
void FitRowCache(const model::ModelConfig& c, const KvCacheOptions& o,
                 Layout& z) {
  if (o.kv.max_worker_bytes <= 0) return;
  const double wanted = z.row_cache;
  z.row_cache = 0;
  const int64_t room = o.kv.max_worker_bytes -
                       (o.batch * z.PerSequence(c, o.max_seq_len) +
                        z.Shared(c, o.max_seq_len, o.max_chunk));
  if (room <= 0) return;
  z.row_cache = std::min(
      wanted, RowCache::FractionWithin(room / o.batch, c.n_layers,
                                       c.n_kv_heads, o.max_seq_len,
                                       z.row_width, z.row_cache_replacement));
}

}  // namespace

absl::StatusOr<Layout> MakeLayout(const model::Weights& weights,
                                  bool operates_on_host,
                                  const KvCacheOptions& options) {
  KvPolicy::Context ctx;
  ctx.weights = &weights;
  ctx.max_seq_len = options.max_seq_len;
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> policy,
                      KvPolicy::CreateUninitialized(*options.kv.policy, ctx));
  Layout z;
  z.row_width = policy->RowWidth();
  z.plan_rows = static_cast<size_t>(weights.config.n_kv_heads) *
                policy->MaxPlanRows(options.max_seq_len);
  z.fetch_values = 2 * z.plan_rows * z.row_width;
  z.staged = !operates_on_host;
  const bool backend_plans = policy->MaxBackendPlanRows(options.max_seq_len) > 0;
  // As Init's geometry: a node that never evicts keeps positions at their
  // slots, which one-sided reads and the node's notes of held rows need.
  const bool own_slots =
      std::max(1, static_cast<int>(options.kv.kv_capacity *
                                   options.max_seq_len)) >= options.max_seq_len;
  const bool reads_direct = z.staged && options.kv.direct_reads && own_slots;
  z.plan_buffers = z.staged || backend_plans;
  z.plan_room = reads_direct || backend_plans ? z.plan_rows : 0;
  z.attention_probs = policy->WantsAttentionProbs();
  z.prefill_probs = policy->WantsAttentionProbs();
  z.half_rows = z.staged && options.half_local_kv &&
                policy->row_format() == KvRowFormat::kHalf &&
                policy->ReusesPrefix() && !z.prefill_probs;
  // A row cache: for a policy whose fetch is chosen (it takes a target
  // fetch: it selects rows that later steps select again; the others read
  // every row); on a device, where attention reads the rows by slot in one
  // operation (no probabilities).
  const PolicyEntry& entry = PolicyEntryOf(options.kv.policy->kind);
  if ((!z.staged || !z.attention_probs) && entry.set_target_fetch != nullptr) {
    z.row_cache = options.kv.row_cache;
    z.row_cache_replacement = options.kv.row_cache_replacement;
  }
  IG_ASSIGN_OR_RETURN(z.policy_bytes,
                      KvPolicy::StateBytes(*options.kv.policy, ctx));
  if (z.row_cache > 0) FitRowCache(weights.config, options, z);
  return z;
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
