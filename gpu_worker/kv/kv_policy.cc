#include "gpu_worker/kv/kv_policy.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

using kv_memory_service::OwnedFetchPlan;

int KvPolicy::RowWidth() const {
  return KvRowWidth(row_format(), config().head_dim);
}

void KvPolicy::EncodeRows(const float* rows, int n_rows, uint16_t* out) const {
  EncodeKvRows(row_format(), rows, n_rows, config().head_dim, out);
}

PlanMade KvPolicy::PlanEveryRow(const PlanRequest& request,
                                OwnedFetchPlan& plan) const {
  if (!request.every_row_ok) {
    PlanAllPresent(request.p, request.present, plan);
    return PlanMade::kIndices;
  }
  const int n_kv = config().n_kv_heads;
  plan.indices.clear();
  plan.head_offsets.resize(n_kv + 1);
  for (int g = 0; g <= n_kv; ++g) plan.head_offsets[g] = g * request.p;
  return PlanMade::kEveryRow;
}

void KvPolicy::PlanAllPresent(int p, const uint8_t* present,
                              OwnedFetchPlan& plan) const {
  const int n_kv = config().n_kv_heads;
  plan.indices.clear();
  plan.head_offsets.resize(n_kv + 1);
  plan.head_offsets[0] = 0;
  // Branch-free: every position is written at the next free index, which
  // advances only where the token is present.
  plan.indices.resize(static_cast<size_t>(n_kv) * std::max(p, 0));
  int32_t* out = plan.indices.data();
  int32_t taken = 0;
  for (int g = 0; g < n_kv; ++g) {
    const uint8_t* pr = present + static_cast<size_t>(g) * ctx_.max_seq_len;
    for (int t = 0; t < p; ++t) {
      out[taken] = t;
      taken += pr[t] != 0;
    }
    plan.head_offsets[g + 1] = taken;
  }
  plan.indices.resize(taken);
}

}  // namespace infinigen::gpu_worker
