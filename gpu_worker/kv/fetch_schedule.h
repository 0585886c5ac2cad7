// When, during a decode step, each layer's fetch leaves, and what its plan
// is ranked by. A policy's schedule is stated once (FetchSchedule::Of) and
// the offloaded cache reads it at each point of the step, issuing there the
// fetches that are due (kv_cache.h gives the step's call order):
//
//   kStepStart           BeginStep: nothing to rank by yet (every row)
//   kOwnInput            LayerInput(l): ranked by layer l's own attention
//                        input; the fetch overlaps nothing of the layer
//   kPreviousInput       LayerInput(l - 1): speculated from layer l - 1's
//                        attention input (InfiniGen); it overlaps layer
//                        l - 1's attention and MLP
//   kPreviousAttention   PostAttentionInput(l - 1): from layer l's norm of
//                        the residual after layer l - 1's attention; it
//                        overlaps layer l - 1's MLP
//
// Policies that read every row (full, int4) take kPreviousInput too: their
// plan needs no input, and the rows move while the previous layer computes.
#ifndef INFINIGEN_GPU_WORKER_KV_FETCH_SCHEDULE_H_
#define INFINIGEN_GPU_WORKER_KV_FETCH_SCHEDULE_H_

#include <vector>

#include "gpu_worker/kv/kv_policy.h"

namespace infinigen::gpu_worker {

enum class FetchPoint {
  kStepStart,
  kOwnInput,
  kPreviousInput,
  kPreviousAttention,
};

class FetchSchedule {
 public:
  // The schedule of `options`' policy on a model of n_layers layers.
  static FetchSchedule Of(const PolicyOptions& options, int n_layers);
  // The local cache's: no layer is fetched (DueAt is always -1).
  static FetchSchedule None() { return FetchSchedule(); }

  // When layer `layer`'s fetch leaves.
  FetchPoint at(int layer) const { return at_[layer]; }

  // The layer whose fetch is due at `point` of layer `layer`'s pass (the
  // step's start for kStepStart), or -1 if none.
  int DueAt(FetchPoint point, int layer) const;

  // Whether layer `layer`'s rows move to the backend while the layer before
  // it computes (its fetch left before that layer's end), rather than just
  // before its own attention.
  bool UploadsEarly(int layer) const {
    return layer > 0 && layer < n_layers() && at_[layer] != FetchPoint::kOwnInput;
  }

  // Whether any layer waits for PostAttentionInput: the engine computes the
  // next layer's norm of the residual after the attention only then.
  bool WantsPostAttentionInput() const;

  int n_layers() const { return static_cast<int>(at_.size()); }

 private:
  std::vector<FetchPoint> at_;  // [layer]
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_FETCH_SCHEDULE_H_
