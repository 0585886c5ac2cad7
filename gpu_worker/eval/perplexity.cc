#include "gpu_worker/eval/perplexity.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "gpu_worker/serving/sampler.h"

namespace infinigen::gpu_worker {
namespace {

absl::Status CheckOptions(const PerplexityOptions& o) {
  if (o.ctx < 2) return absl::InvalidArgumentError("--ctx must be >= 2");
  if (o.max_windows < 0) {
    return absl::InvalidArgumentError("--max_windows must be >= 0");
  }
  if (o.prompt_tokens < 0 || o.prompt_tokens >= o.ctx) {
    return absl::InvalidArgumentError("--prompt_tokens must be in [0, ctx)");
  }
  return absl::OkStatus();
}

int TextPerWindow(const PerplexityOptions& o) {
  return o.bos >= 0 ? o.ctx - 1 : o.ctx;
}

// One scored token of a window: its position, the token, its log-prob.
using TokenScored = std::function<void(int position, int token, double lp)>;

// Scores one window teacher-forced: a dense prefix, then one token at a
// time; position i's logits predict token i + 1, for i >= prefix - 1.
absl::Status ScoreDecoded(Engine& engine, absl::Span<const int> window,
                          int prompt_tokens, const TokenScored& scored,
                          double& nll_sum, long& predicted) {
  const int len = static_cast<int>(window.size());
  const int prefix = std::min(prompt_tokens, len - 1);
  auto logits = engine.Forward(window.subspan(0, prefix), /*all_logits=*/false);
  for (int i = prefix - 1; i + 1 < len; ++i) {
    if (!logits.ok()) return logits.status();
    const double lp = LogProb(*logits, window[i + 1]);
    if (scored) scored(i + 1, window[i + 1], lp);
    nll_sum -= lp;
    ++predicted;
    if (i + 2 < len) logits = engine.Forward({window[i + 1]}, false);
  }
  return absl::OkStatus();
}

// Scores every position of one window densely, in the engine's chunks.
absl::Status ScoreDense(Engine& engine, absl::Span<const int> window,
                        const TokenScored& scored, double& nll_sum,
                        long& predicted) {
  const int len = static_cast<int>(window.size());
  const int vocab = engine.config().vocab_size;
  for (int start = 0; start + 1 < len; start += engine.max_chunk()) {
    const int n = std::min(engine.max_chunk(), len - 1 - start);
    IG_ASSIGN_OR_RETURN(absl::Span<const float> logits,
                        engine.Forward(window.subspan(start, n),
                                       /*all_logits=*/true));
    for (int i = 0; i < n; ++i) {
      const int target = window[start + i + 1];
      const double lp =
          LogProb(logits.subspan(static_cast<size_t>(i) * vocab, vocab), target);
      if (scored) scored(start + i + 1, target, lp);
      nll_sum -= lp;
    }
    predicted += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int> PerplexityWindows(size_t n_tokens,
                                      const PerplexityOptions& options) {
  IG_RETURN_IF_ERROR(CheckOptions(options));
  int windows = static_cast<int>(n_tokens / TextPerWindow(options));
  if (windows == 0 && n_tokens >= 2) windows = 1;  // short text: one window
  if (options.max_windows > 0) windows = std::min(windows, options.max_windows);
  return windows;
}

absl::StatusOr<PerplexityResult> ScorePerplexity(
    Engine& engine, absl::Span<const int> tokens,
    const PerplexityOptions& options,
    const std::function<void(const PerplexityProgress&)>& progress) {
  IG_ASSIGN_OR_RETURN(const int windows,
                      PerplexityWindows(tokens.size(), options));
  if (windows == 0) {
    return absl::InvalidArgumentError("the text holds too little to score");
  }
  if (options.ctx > engine.max_seq_len()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--ctx %d exceeds the engine's %d positions", options.ctx,
        engine.max_seq_len()));
  }
  const int text_per_window = TextPerWindow(options);
  PerplexityResult r;
  r.windows = windows;
  double nll_sum = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int> window;
  for (int w = 0; w < windows; ++w) {
    window.clear();
    if (options.bos >= 0) window.push_back(options.bos);
    const size_t begin = static_cast<size_t>(w) * text_per_window;
    const size_t end = std::min(tokens.size(), begin + text_per_window);
    window.insert(window.end(), tokens.begin() + begin, tokens.begin() + end);
    IG_RETURN_IF_ERROR(engine.Reset());
    TokenScored scored;
    if (options.on_token) {
      scored = [&options, w](int position, int token, double lp) {
        options.on_token(w, position, token, lp);
      };
    }
    if (options.prompt_tokens > 0) {
      IG_RETURN_IF_ERROR(ScoreDecoded(engine, window, options.prompt_tokens,
                                      scored, nll_sum, r.predicted));
      r.fetch.Add(engine.fetch_stats());
    } else {
      IG_RETURN_IF_ERROR(
          ScoreDense(engine, window, scored, nll_sum, r.predicted));
    }
    r.seconds = std::chrono::duration<double>(
                    std::chrono::steady_clock::now() - t0)
                    .count();
    if (progress) {
      progress({w + 1, windows, r.predicted, nll_sum,
                r.fetch.fraction_mean(), r.seconds});
    }
  }
  r.nll = nll_sum / r.predicted;
  return r;
}

}  // namespace infinigen::gpu_worker
