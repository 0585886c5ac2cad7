#include "gpu_worker/kv/policies/registry.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "common/log.h"

namespace infinigen::gpu_worker {

namespace {

const PolicyEntry* const kPolicies[] = {
    &kFullPolicy,  &kInfiniGenPolicy, &kH2OPolicy,
    &kInt4Policy,  &kOraclePolicy,    &kQuestPolicy,
};

}  // namespace

absl::Span<const PolicyEntry* const> Policies() { return kPolicies; }

const PolicyEntry& PolicyEntryOf(PolicyKind kind) {
  for (const PolicyEntry* entry : kPolicies) {
    if (entry->kind == kind) return *entry;
  }
  // A kind added without its registry line: a programming error.
  IG_LOG(ERROR) << "policy kind " << static_cast<int>(kind)
                << " has no registry entry";
  std::abort();
}

const PolicyEntry* FindPolicy(absl::string_view name) {
  for (const PolicyEntry* entry : kPolicies) {
    if (name == entry->name) return entry;
  }
  return nullptr;
}

std::string PolicyNames() {
  return absl::StrJoin(kPolicies, ", ",
                       [](std::string* out, const PolicyEntry* entry) {
                         out->append(entry->name);
                       });
}

std::string TargetFetchPolicyNames() {
  std::vector<std::string> names;
  for (const PolicyEntry* entry : kPolicies) {
    if (entry->set_target_fetch != nullptr) names.push_back(entry->name);
  }
  return absl::StrJoin(names, ", ");
}

}  // namespace infinigen::gpu_worker
