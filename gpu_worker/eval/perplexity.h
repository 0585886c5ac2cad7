// Perplexity of a token stream through an Engine, in windows of `ctx`
// tokens: the loop behind `infinigen perplexity`.
//
// Dense scoring runs each window in chunks with all logits (no KV policy is
// involved). Teacher-forced scoring (prompt_tokens > 0) prefills the first
// prompt_tokens of each window densely, then decodes the rest one token at
// a time through the engine's KV policy, scoring each next token, and sums
// the policy's fetch statistics over the windows.
#ifndef INFINIGEN_GPU_WORKER_EVAL_PERPLEXITY_H_
#define INFINIGEN_GPU_WORKER_EVAL_PERPLEXITY_H_

#include <cmath>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/kv/kv_cache.h"

namespace infinigen::gpu_worker {

struct PerplexityOptions {
  int ctx = 512;          // tokens per window, BOS included; >= 2
  int max_windows = 0;    // score at most this many windows; 0: all
  int prompt_tokens = 0;  // dense prefix per window; 0: all dense
  int bos = -1;           // prepended to every window when >= 0
  // Called for every scored token in order: its window (0-based), its
  // position in the window (BOS at 0), the token and its log-probability.
  std::function<void(int window, int position, int token, double logprob)>
      on_token;
};

// Where a run stands after a window, for progress lines.
struct PerplexityProgress {
  int window = 0;  // 1-based
  int windows = 0;
  long predicted = 0;
  double nll_sum = 0;
  double fetch_fraction_mean = 0;
  double seconds = 0;
};

struct PerplexityResult {
  int windows = 0;
  long predicted = 0;   // tokens scored
  double nll = 0;       // mean negative log-likelihood (nats)
  FetchStats fetch;     // over all windows (teacher-forced only)
  double seconds = 0;
  double perplexity() const { return std::exp(nll); }
};

// The windows `n_tokens` text tokens give under `options`: every full
// window, one short window for a text shorter than one window (when it
// holds at least 2 tokens), capped at max_windows. InvalidArgument for
// options out of range; 0 when the text is too short to score.
absl::StatusOr<int> PerplexityWindows(size_t n_tokens,
                                      const PerplexityOptions& options);

// Scores `tokens` (without BOS). The engine must hold ctx positions
// (InvalidArgument otherwise, or when there is nothing to score); it is
// Reset before every window. `progress`, when set, runs after each window.
absl::StatusOr<PerplexityResult> ScorePerplexity(
    Engine& engine, absl::Span<const int> tokens,
    const PerplexityOptions& options,
    const std::function<void(const PerplexityProgress&)>& progress = nullptr);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_EVAL_PERPLEXITY_H_
