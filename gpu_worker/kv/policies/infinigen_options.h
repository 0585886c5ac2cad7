// InfiniGen's options (PolicyOptions::infinigen; read by infinigen.cc and
// the oracle, which ranks with its machinery).
#ifndef INFINIGEN_GPU_WORKER_KV_POLICIES_INFINIGEN_OPTIONS_H_
#define INFINIGEN_GPU_WORKER_KV_POLICIES_INFINIGEN_OPTIONS_H_

#include "absl/status/status.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

// InfiniGen's own options (the oracle ranks with the same machinery and
// reads those of its ranking: alpha, score_mass, adaptive budgets).
struct InfiniGenOptions {
  // A token is a candidate when its speculated score is within alpha of the
  // head's maximum.
  float alpha = 5.0f;
  // Fraction of each head's columns kept in the partial query weight and
  // partial key cache (4-bit rows, speculator/partial_keys.h).
  float partial_ratio = 0.3f;
  // How partial columns are ranked over the prompt. false: by the summed
  // |q A| (the reference); true: by summed |q A| times summed |k A|, the
  // columns whose products carry the scores (our variant).
  bool rank_columns_by_keys = false;
  // Diagnostic (accuracy only): speculate each layer's selection from that
  // layer's own attention input instead of the previous layer's, so the
  // fetch cannot leave early. Separates the loss of attending to a subset
  // from the error of speculating one layer ahead.
  bool same_layer_input = false;
  // Where layer l + 1's query is speculated from. kLayerInput (the paper):
  // layer l's attention input (its norm of the residual stream), so the
  // fetch overlaps layer l's attention and MLP. kPostAttention: layer l +
  // 1's attention norm of the residual stream after layer l's attention,
  // the input layer l + 1 would see if layer l's MLP added nothing; the
  // fetch overlaps layer l's MLP only.
  enum class SpeculationInput { kLayerInput, kPostAttention };
  SpeculationInput speculation_input = SpeculationInput::kLayerInput;
  // Diagnostic: fp32 partial key rows instead of 4-bit ones
  // (speculator/partial_keys.h), to measure what the 4 bits cost. The
  // oracle and same_layer_input always rank by fp32 keys.
  bool exact_partial_keys = false;
  // The skew matrices (not owned; must outlive the engine). Required.
  const speculator::SkewMatrices* skew = nullptr;
  // infinigen and oracle: 0 selects by alpha (the paper's rule, one k per
  // layer); in (0, 1], each KV head takes its top tokens until they carry
  // this share of its speculated attention, at most `budget` of the cached
  // tokens (speculator::SelectByMass: budgets adapt across layers and
  // heads).
  float score_mass = 0.0f;
  // infinigen and oracle: each (layer, KV head) of the selecting layers
  // takes its own share of the cached tokens, allocated from `profile`
  // (speculator::AllocateBudgets) so that their mean is `budget` and the
  // summed calibration error is least (infinigen: the error of its
  // speculated ranking; oracle: of the exact one); each takes at least
  // budget_floor times `budget`. Replaces the alpha rule and score_mass.
  bool adaptive_budgets = false;
  float budget_floor = 0.25f;
  // The calibration's head profile (not owned; must outlive the engine).
  // Required with adaptive_budgets.
  const speculator::HeadProfile* profile = nullptr;

  // InvalidArgument naming the field out of range or what is missing.
  absl::Status Validate() const;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_POLICIES_INFINIGEN_OPTIONS_H_
