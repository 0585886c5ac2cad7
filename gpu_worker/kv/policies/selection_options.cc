#include "gpu_worker/kv/policies/selection_options.h"

#include "absl/strings/str_format.h"

namespace infinigen::gpu_worker {

absl::Status SelectionOptions::Validate() const {
  if (!(budget > 0.0f && budget <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("budget must be in (0, 1], got %g", budget));
  }
  if (dense_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("dense_layers must be >= 0, got %d", dense_layers));
  }
  if (sink_tokens < 0 || recent_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sink_tokens and recent_tokens must be >= 0, got %d and %d",
        sink_tokens, recent_tokens));
  }
  return absl::OkStatus();
}

}  // namespace infinigen::gpu_worker
