#include "gpu_worker/kv/kv_policy.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

using kv_memory_service::OwnedFetchPlan;

absl::Status SelectionOptions::Validate() const {
  if (!(budget > 0.0f && budget <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("budget must be in (0, 1], got %g", budget));
  }
  if (dense_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("dense_layers must be >= 0, got %d", dense_layers));
  }
  if (sink_tokens < 0 || recent_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sink_tokens and recent_tokens must be >= 0, got %d and %d",
        sink_tokens, recent_tokens));
  }
  return absl::OkStatus();
}

absl::Status InfiniGenOptions::Validate() const {
  if (!(alpha >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("alpha must be >= 0, got %g", alpha));
  }
  if (!(partial_ratio > 0.0f && partial_ratio <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "partial_ratio must be in (0, 1], got %g", partial_ratio));
  }
  if (!(score_mass >= 0.0f && score_mass <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "score_mass must be in [0, 1] (0: the alpha rule), got %g",
        score_mass));
  }
  if (adaptive_budgets) {
    if (profile == nullptr || profile->empty()) {
      return absl::InvalidArgumentError(
          "adaptive budgets need a head profile (written by 'infinigen "
          "skew' since the profile was added)");
    }
    if (!(budget_floor >= 0.0f && budget_floor <= 1.0f)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "budget_floor must be in [0, 1], got %g", budget_floor));
    }
  }
  return absl::OkStatus();
}

absl::Status QuestOptions::Validate() const {
  if (page_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("page_tokens must be >= 1, got %d", page_tokens));
  }
  return absl::OkStatus();
}


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
