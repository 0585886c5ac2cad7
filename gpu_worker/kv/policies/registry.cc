#include "gpu_worker/kv/policies/registry.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_join.h"
#include "common/log.h"

namespace infinigen::gpu_worker {

namespace {

const PolicyEntry kIdealPolicy = {
    PolicyKind::kIdeal, "ideal",
    "the whole cache local; nothing is fetched (the bound of every other)",
    PolicyTraits().Local(),
    /*set_target_fetch=*/nullptr,
    /*create=*/nullptr,
    /*state_bytes=*/nullptr,
};

const PolicyEntry* const kPolicies[] = {
    &kIdealPolicy, &kFullPolicy,   &kInfiniGenPolicy, &kH2OPolicy,
    &kInt4Policy,  &kOraclePolicy, &kQuestPolicy,
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

}  // namespace infinigen::gpu_worker
