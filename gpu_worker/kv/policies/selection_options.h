// The options every policy that chooses its rows reads (PolicyOptions::
// selection; their flags: the registry entries' `flags`).
#ifndef INFINIGEN_GPU_WORKER_KV_POLICIES_SELECTION_OPTIONS_H_
#define INFINIGEN_GPU_WORKER_KV_POLICIES_SELECTION_OPTIONS_H_

#include "absl/status/status.h"

namespace infinigen::gpu_worker {

// What the policies that choose their rows read (infinigen, oracle, quest;
// h2o its budget).
struct SelectionOptions {
  // infinigen: cap on the tokens fetched per head, as a fraction of the
  // cached tokens; oracle, quest: the fraction (of tokens, of pages) each
  // head takes. h2o: the kept fraction (half heavy hitters, half recent).
  float budget = 0.2f;
  // infinigen, oracle and quest: the first sink_tokens positions (attention
  // sinks) and the last recent_tokens before the new token are fetched at
  // every speculated layer, besides the speculated selection (quest: the
  // pages that hold them).
  int sink_tokens = 0;
  int recent_tokens = 0;
  // infinigen, oracle and quest: the first dense_layers layers read every
  // row (the paper's InfiniGen and Quest: 2). With 0, layer 0 ranks its
  // rows by its own attention input (exact for its query; its fetch leaves
  // at the start of the layer, where the whole layer's left at the start
  // of the step) and every layer shares the budget.
  int dense_layers = 2;

  // InvalidArgument naming the field out of range.
  absl::Status Validate() const;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_POLICIES_SELECTION_OPTIONS_H_
