// The registry of KV policies: for each policy its name, what the rest of
// the worker asks of it before it exists (its traits, its target-fetch rule,
// its state size, the options it checks and the flags that set them) and
// its factory. A policy is one file in this directory (its KvPolicy
// subclass and its PolicyEntry) plus its lines in registry.cc and its
// PolicyKind; the cache, the engine and the commands ask the registry,
// never a switch over kinds.
#ifndef INFINIGEN_GPU_WORKER_KV_POLICIES_REGISTRY_H_
#define INFINIGEN_GPU_WORKER_KV_POLICIES_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "gpu_worker/kv/kv_policy.h"

namespace infinigen::gpu_worker {

struct PolicyEntry {
  PolicyKind kind;
  const char* name;
  const char* summary;  // one line, for --help
  PolicyTraits traits;
  // Sets `options` so that the mean fraction of cached rows fetched per
  // step lands at `fraction` (SetTargetFetch); null where the fetch is not
  // chosen.
  absl::Status (*set_target_fetch)(double fraction, int n_layers,
                                   PolicyOptions& options);
  // The policy, its state not yet allocated (KvPolicy::CreateUninitialized,
  // options already validated).
  absl::StatusOr<std::unique_ptr<KvPolicy>> (*create)(
      const PolicyOptions& options, const KvPolicy::Context& context);
  // Bytes of its per-sequence state on the worker (KvPolicy::StateBytes).
  absl::StatusOr<int64_t> (*state_bytes)(const PolicyOptions& options,
                                         const KvPolicy::Context& context);
  // Checks the options structs it reads (SelectionOptions, InfiniGenOptions,
  // QuestOptions: PolicyOptions::Validate calls it); null where it reads
  // none.
  absl::Status (*validate)(const PolicyOptions& options);
  // The command-line flags that set the options it reads (without "--"),
  // for --help and for the warning when a flag set on the command line
  // has no effect on the chosen policy.
  absl::Span<const char* const> flags;
};

// Every policy, in the order --help lists them.
absl::Span<const PolicyEntry* const> Policies();
// The entry of `kind` (every kind has one).
const PolicyEntry& PolicyEntryOf(PolicyKind kind);
// The entry named `name`; null if none.
const PolicyEntry* FindPolicy(absl::string_view name);
// "full, infinigen, ...": the names, for messages.
std::string PolicyNames();
// The names of those that take a target fetch (set_target_fetch).
std::string TargetFetchPolicyNames();
// Every policy's flags (PolicyEntry::flags), each once, in the order the
// policies list them.
std::vector<std::string> PolicyFlagNames();
// The names of the policies whose options `flag` sets, "a, b and c".
std::string PoliciesReadingFlag(absl::string_view flag);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_POLICIES_REGISTRY_H_
