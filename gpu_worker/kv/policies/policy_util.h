// Helpers the policy files share: a query projected for speculation, and
// the target-fetch rule of the policies that read their first layers whole.
#ifndef INFINIGEN_GPU_WORKER_KV_POLICIES_POLICY_UTIL_H_
#define INFINIGEN_GPU_WORKER_KV_POLICIES_POLICY_UTIL_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/kv_policy.h"
#include "model/weights.h"

namespace infinigen::gpu_worker {

// One token's query of layer `w` from x (that layer's input, or the previous
// layer's as InfiniGen speculates): x Wq (+ bq), rotated at position p on
// Llama. *position_host is the source of an asynchronous copy: the caller
// must not change it again before a call that waits for copies (CopyToHost).
void ProjectQuery(Backend& b, const model::ModelConfig& m,
                  const model::LayerWeights& w, const float* x, int p,
                  int* position_host, int* position_device, float* q);

// An alpha at or above this turns the alpha rule off: every finite score is
// within it of the head's max, so the cap alone decides (SetTargetFetch's).
constexpr float kAlphaOff = 1e9f;

// SetTargetFetch for a policy that reads its first
// options.selection.dense_layers layers whole and selects in the others: the
// selecting layers take budget (fraction * n_layers - D) / (n_layers - D), the
// alpha rule off and no score mass. InvalidArgument where the dense layers
// alone fetch more.
absl::Status SetSelectedLayersTargetFetch(double fraction, int n_layers,
                                          PolicyOptions& options);

// PolicyEntry::validate of the selecting policies: SelectionOptions, and
// with it InfiniGenOptions (infinigen, oracle) or QuestOptions (quest).
absl::Status ValidateSelection(const PolicyOptions& options);
absl::Status ValidateSelectionAndInfiniGen(const PolicyOptions& options);
absl::Status ValidateSelectionAndQuest(const PolicyOptions& options);

// PolicyEntry::state_bytes of a policy that keeps no per-token state.
absl::StatusOr<int64_t> NoStateBytes(const PolicyOptions& options,
                                     const KvPolicy::Context& context);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_POLICIES_POLICY_UTIL_H_
