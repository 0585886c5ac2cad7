#include "gpu_worker/kv/fetch_schedule.h"

#include <algorithm>

namespace infinigen::gpu_worker {

FetchSchedule FetchSchedule::Of(const PolicyOptions& options, int n_layers) {
  FetchSchedule s;
  s.at_.resize(n_layers);
  for (int l = 0; l < n_layers; ++l) {
    if (l == 0) {
      // Layer 0 has no previous layer: all of it at the step's start, or,
      // where it selects, chosen from its own input.
      s.at_[l] = options.SelectsLayerZero() ? FetchPoint::kOwnInput
                                            : FetchPoint::kStepStart;
    } else if (options.SpeculatesFromOwnInput()) {
      s.at_[l] = FetchPoint::kOwnInput;
    } else if (options.SpeculatesAfterAttention()) {
      s.at_[l] = FetchPoint::kPreviousAttention;
    } else {
      s.at_[l] = FetchPoint::kPreviousInput;
    }
  }
  return s;
}

int FetchSchedule::DueAt(FetchPoint point, int layer) const {
  int due = -1;
  switch (point) {
    case FetchPoint::kStepStart:
      due = 0;
      break;
    case FetchPoint::kOwnInput:
      due = layer;
      break;
    case FetchPoint::kPreviousInput:
    case FetchPoint::kPreviousAttention:
      due = layer + 1;
      break;
  }
  if (due < 0 || due >= n_layers() || at_[due] != point) return -1;
  return due;
}

bool FetchSchedule::WantsPostAttentionInput() const {
  return std::find(at_.begin(), at_.end(), FetchPoint::kPreviousAttention) !=
         at_.end();
}

}  // namespace infinigen::gpu_worker
