// CalibrateSkew: InfiniGen's offline skewing pass (ALGORITHM.md) over
// calibration tokens, with the reference CPU engine.
#ifndef INFINIGEN_GPU_WORKER_CALIBRATE_H_
#define INFINIGEN_GPU_WORKER_CALIBRATE_H_

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/weights.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

// Runs `tokens` through the model densely, captures every layer's post-RoPE
// queries, keys and values, computes one skew per (layer, KV head) from the
// group's stacked queries and the head's keys (speculator::ComputeSkew),
// and measures the head profile (speculator::HeadProfile) with the exact
// ranking and with InfiniGen's, speculated one layer ahead through
// partial_ratio of the columns. InvalidArgument when there are fewer tokens
// than head_dim or more than the model's context.
absl::StatusOr<speculator::SkewMatrices> CalibrateSkew(
    const model::Weights& weights, absl::Span<const int> tokens,
    double partial_ratio = 0.3);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_CALIBRATE_H_
