#include "gpu_worker/kv/policies/registry.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"

namespace infinigen::gpu_worker {

// Each policy's entry, defined in its file.
extern const PolicyEntry kFullPolicy;
extern const PolicyEntry kInfiniGenPolicy;
extern const PolicyEntry kH2OPolicy;
extern const PolicyEntry kInt4Policy;
extern const PolicyEntry kOraclePolicy;
extern const PolicyEntry kQuestPolicy;

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

std::vector<std::string> PolicyFlagNames() {
  std::vector<std::string> names;
  for (const PolicyEntry* entry : kPolicies) {
    for (const char* flag : entry->flags) {
      if (std::find(names.begin(), names.end(), flag) == names.end()) {
        names.push_back(flag);
      }
    }
  }
  return names;
}

std::string PoliciesReadingFlag(absl::string_view flag) {
  std::vector<std::string> readers;
  for (const PolicyEntry* entry : kPolicies) {
    for (const char* f : entry->flags) {
      if (flag == f) readers.push_back(entry->name);
    }
  }
  if (readers.size() <= 1) return absl::StrJoin(readers, "");
  const std::string last = readers.back();
  readers.pop_back();
  return absl::StrCat(absl::StrJoin(readers, ", "), " and ", last);
}

}  // namespace infinigen::gpu_worker
