// Quest's options (PolicyOptions::quest).
#ifndef INFINIGEN_GPU_WORKER_KV_POLICIES_QUEST_OPTIONS_H_
#define INFINIGEN_GPU_WORKER_KV_POLICIES_QUEST_OPTIONS_H_

#include "absl/status/status.h"

namespace infinigen::gpu_worker {

// Quest's own options.
struct QuestOptions {
  int page_tokens = 16;  // tokens per page

  absl::Status Validate() const;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_POLICIES_QUEST_OPTIONS_H_
