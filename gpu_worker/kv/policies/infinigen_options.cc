#include "gpu_worker/kv/policies/infinigen_options.h"

#include "absl/strings/str_format.h"

namespace infinigen::gpu_worker {

absl::Status InfiniGenOptions::Validate() const {
  if (!(alpha >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("alpha must be >= 0, got %g", alpha));
  }
  if (!(partial_ratio > 0.0f && partial_ratio <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "partial_ratio must be in (0, 1], got %g", partial_ratio));
  }
  if (!(score_mass >= 0.0f && score_mass <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "score_mass must be in [0, 1] (0: the alpha rule), got %g",
        score_mass));
  }
  if (adaptive_budgets) {
    if (profile == nullptr || profile->empty()) {
      return absl::InvalidArgumentError(
          "adaptive budgets need a head profile (written by 'infinigen "
          "skew' since the profile was added)");
    }
    if (!(budget_floor >= 0.0f && budget_floor <= 1.0f)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "budget_floor must be in [0, 1], got %g", budget_floor));
    }
  }
  return absl::OkStatus();
}

}  // namespace infinigen::gpu_worker
