#include "gpu_worker/kv/kv_policy.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {

using kv_memory_service::OwnedFetchPlan;

absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name) {
  if (const PolicyEntry* entry = FindPolicy(name)) return entry->kind;
  return absl::InvalidArgumentError(
      absl::StrFormat("unknown policy '%s' (%s)", name, PolicyNames()));
}

const char* PolicyName(PolicyKind kind) { return PolicyEntryOf(kind).name; }

absl::Status SetTargetFetch(double fraction, int n_layers,
                            PolicyOptions& options) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the target fetch fraction must be in (0, 1], got %g", fraction));
  }
  const PolicyEntry& entry = PolicyEntryOf(options.kind);
  if (entry.set_target_fetch == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a target fetch applies to %s, not %s",
                        TargetFetchPolicyNames(), entry.name));
  }
  return entry.set_target_fetch(fraction, n_layers, options);
}

bool PolicyOptions::SpeculatesFromOwnInput() const {
  return same_layer_input || PolicyEntryOf(kind).traits.own_input;
}

bool PolicyOptions::SpeculatesAfterAttention() const {
  return PolicyEntryOf(kind).traits.speculates && !SpeculatesFromOwnInput() &&
         speculation_input == SpeculationInput::kPostAttention;
}

bool PolicyOptions::SelectsLayerZero() const {
  return dense_layers == 0 && PolicyEntryOf(kind).traits.selects;
}

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

absl::Status PolicyOptions::Validate() const {
  const PolicyEntry& entry = PolicyEntryOf(kind);
  if (entry.traits.speculates && skew == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the %s policy needs a skew", entry.name));
  }
  if (adaptive_budgets && !entry.traits.adaptive_budgets) {
    std::vector<std::string> takers;
    for (const PolicyEntry* e : Policies()) {
      if (e->traits.adaptive_budgets) takers.push_back(e->name);
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("adaptive budgets apply to %s, not %s",
                        absl::StrJoin(takers, " and "), entry.name));
  }
  return entry.validate == nullptr ? absl::OkStatus() : entry.validate(*this);
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

namespace {

// The registry entry of valid options.
absl::StatusOr<const PolicyEntry*> ValidEntry(const PolicyOptions& options) {
  IG_RETURN_IF_ERROR(options.Validate());
  return &PolicyEntryOf(options.kind);
}

}  // namespace

absl::StatusOr<int64_t> KvPolicy::StateBytes(const PolicyOptions& options,
                                              const Context& context) {
  IG_ASSIGN_OR_RETURN(const PolicyEntry* entry, ValidEntry(options));
  return entry->state_bytes(options, context);
}

absl::StatusOr<std::unique_ptr<KvPolicy>> KvPolicy::Create(
    const PolicyOptions& options, const Context& context) {
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> policy,
                      CreateUninitialized(options, context));
  IG_RETURN_IF_ERROR(policy->Init());
  return policy;
}

absl::StatusOr<std::unique_ptr<KvPolicy>> KvPolicy::CreateUninitialized(
    const PolicyOptions& options, const Context& context) {
  IG_ASSIGN_OR_RETURN(const PolicyEntry* entry, ValidEntry(options));
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> policy,
                      entry->create(options, context));
  policy->traits_ = entry->traits;
  return policy;
}

}  // namespace infinigen::gpu_worker
