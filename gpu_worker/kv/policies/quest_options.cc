#include "gpu_worker/kv/policies/quest_options.h"

#include "absl/strings/str_format.h"

namespace infinigen::gpu_worker {

absl::Status QuestOptions::Validate() const {
  if (page_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("page_tokens must be >= 1, got %d", page_tokens));
  }
  return absl::OkStatus();
}

}  // namespace infinigen::gpu_worker
