// What kv_policy.h answers by a policy's kind or name: each from the
// policy's registry entry (registry.h), the one place that lists them.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {

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
  return infinigen.same_layer_input || PolicyEntryOf(kind).traits.own_input;
}

bool PolicyOptions::SpeculatesAfterAttention() const {
  return PolicyEntryOf(kind).traits.speculates && !SpeculatesFromOwnInput() &&
         infinigen.speculation_input ==
             InfiniGenOptions::SpeculationInput::kPostAttention;
}

bool PolicyOptions::SelectsLayerZero() const {
  return selection.dense_layers == 0 && PolicyEntryOf(kind).traits.selects;
}

absl::Status PolicyOptions::Validate() const {
  const PolicyEntry& entry = PolicyEntryOf(kind);
  if (entry.traits.speculates && infinigen.skew == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the %s policy needs a skew", entry.name));
  }
  if (infinigen.adaptive_budgets && !entry.traits.adaptive_budgets) {
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
