#include "gpu_worker/kv/policies/policy_util.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

// One token's query of layer `w` from x (that layer's input, or the previous
// layer's as InfiniGen speculates): x Wq (+ bq), rotated at position p on
// Llama. *position_host is the source of an asynchronous copy: the caller
// must not change it again before a call that waits for copies (CopyToHost).
void ProjectQuery(Backend& b, const model::ModelConfig& m,
                  const model::LayerWeights& w, const float* x, int p,
                  int* position_host, int* position_device, float* q) {
  b.Linear(x, 1, m.dim, w.wq.data(), w.bq.empty() ? nullptr : w.bq.data(),
           m.q_dim(), q);
  if (m.arch == model::Architecture::kGemma3) {
    // As the layer does: each head's query normalized, then rotated.
    b.RmsNorm(q, m.n_heads, m.head_dim, w.q_norm.data(), m.norm_eps, q);
  }
  if (m.arch != model::Architecture::kOpt) {
    *position_host = p;
    b.CopyFromHost(position_device, position_host, sizeof(int),
                   b.MarkIssued());
    b.Rope(q, 1, m.n_heads, m.head_dim, position_device, m.rope_theta);
  }
}

absl::Status SetSelectedLayersTargetFetch(double fraction, int n_layers,
                                          PolicyOptions& options) {
  const int dense_layers = options.selection.dense_layers;  // read whole
  const double dense = static_cast<double>(dense_layers) / n_layers;
  if (dense_layers >= n_layers || fraction <= dense) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a target fetch of %g is not reachable with %s on %d layers: "
        "its %d dense layers alone fetch %g of the rows",
        fraction, PolicyName(options.kind), n_layers, dense_layers,
        std::min(1.0, dense)));
  }
  options.selection.budget =
      static_cast<float>((fraction - dense) / (1.0 - dense));
  options.infinigen.alpha = kAlphaOff;
  options.infinigen.score_mass = 0.0f;
  return absl::OkStatus();
}

absl::Status ValidateSelection(const PolicyOptions& options) {
  return options.selection.Validate();
}

absl::Status ValidateSelectionAndInfiniGen(const PolicyOptions& options) {
  IG_RETURN_IF_ERROR(options.selection.Validate());
  return options.infinigen.Validate();
}

absl::Status ValidateSelectionAndQuest(const PolicyOptions& options) {
  IG_RETURN_IF_ERROR(options.selection.Validate());
  return options.quest.Validate();
}

absl::StatusOr<int64_t> NoStateBytes(const PolicyOptions&,
                                     const KvPolicy::Context&) {
  return int64_t{0};
}

}  // namespace infinigen::gpu_worker
