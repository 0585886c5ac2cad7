// CalibrateSkew: InfiniGen's offline skewing pass (Lee et al., OSDI 2024) over
// calibration tokens, with the reference CPU engine or another backend's.
#ifndef INFINIGEN_GPU_WORKER_EVAL_CALIBRATE_H_
#define INFINIGEN_GPU_WORKER_EVAL_CALIBRATE_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu_worker/backend/backend.h"
#include "model/weights.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

// Runs `tokens` through the model densely, captures every layer's post-RoPE
// queries, keys and values, computes one skew per (layer, KV head) from the
// group's stacked queries and the head's keys (speculator::ComputeSkew),
// and measures the head profile (speculator::HeadProfile) with the exact
// ranking and with InfiniGen's, speculated one layer ahead as `speculation`
// says. The dense pass runs on `backend` (the CPU backend when null; a
// device backend is given back before this returns, so that the engine
// made next has its memory). `progress`, when given, hears after the dense
// pass and after each layer's skews and profile how many of the total
// steps are done. InvalidArgument when there are fewer tokens than head_dim
// or more than the model's context.
struct SpeculationOptions {
  double partial_ratio = 0.3;  // of each head's columns
  // From the residual after the previous layer's attention
  // (InfiniGenOptions::SpeculationInput::kPostAttention), else from the
  // previous layer's input.
  bool post_attention = false;
  // fp32 partial keys (PolicyOptions::exact_partial_keys), else 4-bit rows.
  bool exact_keys = false;
  // The layers that read every row (PolicyOptions::dense_layers): their
  // speculated profile is the exact one; a speculated layer 0 ranks by its
  // own input.
  int dense_layers = 2;
};
absl::StatusOr<speculator::SkewMatrices> CalibrateSkew(
    const model::Weights& weights, absl::Span<const int> tokens,
    const SpeculationOptions& speculation = {},
    std::unique_ptr<Backend> backend = nullptr,
    const std::function<void(int done, int total)>& progress = nullptr);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_EVAL_CALIBRATE_H_
