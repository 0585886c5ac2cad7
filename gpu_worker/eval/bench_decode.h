// The decode benchmark behind `infinigen bench-decode`: prefill a batch of
// sequences, then time decode steps of all of them together through one
// Engine, with the fetch statistics and memory the run held.
#ifndef INFINIGEN_GPU_WORKER_EVAL_BENCH_DECODE_H_
#define INFINIGEN_GPU_WORKER_EVAL_BENCH_DECODE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/kv/kv_cache.h"

namespace infinigen::gpu_worker {

struct DecodeBenchResult {
  std::string policy;
  std::string backend;
  int ctx = 0;
  int batch = 0;
  int steps = 0;
  std::vector<double> step_seconds;  // one DecodeBatch of every sequence
  // Each step's row cache hit rate over the batch (empty without lookups),
  // and per layer the share of the step's selection that the previous
  // step selected too (where a row cache watches; from the second step).
  std::vector<double> step_row_cache_hit_rate;
  std::vector<std::vector<double>> step_layer_overlap;
  double seconds = 0;                // all decode steps
  double prefill_seconds = 0;
  double warmup_seconds = 0;  // the warm-up before the prefills
  long cached_tokens = 0;  // prefill tokens reused from the memory node
  FetchStats fetch;        // summed over the sequences
  int64_t worker_kv_bytes = 0;    // K/V, staging and policy state
  int64_t memory_node_bytes = 0;  // reserved on the node for the run
  int64_t peak_rss_bytes = 0;     // this process's, so far

  long tokens() const { return static_cast<long>(steps) * batch; }
  double tokens_per_second() const { return tokens() / seconds; }
  double step_ms(double percentile) const;  // of step_seconds
};

// `need` tokens of benchmark input: `text` repeated to fill, or (empty
// text) a deterministic pseudo-random stream of ids below `vocab`.
std::vector<int> DecodeBenchSource(absl::Span<const int> text, size_t need,
                                   int vocab);

// Prompt tokens of the warm-up RunDecodeBench runs first (at most ctx).
inline constexpr int kWarmupTokens = 16;

// First a warm-up: a prompt of min(ctx, kWarmupTokens) tokens and one
// decode step in slot 0, which is then reset (its time is warmup_seconds).
// Then sequence b (of engine.batch()) takes source[b * (ctx + steps), ...): its
// first ctx tokens are prefilled into slot b, the next `steps` are decoded
// one step at a time with every other sequence. The engine's slots must be
// empty and hold ctx + steps positions; `source` must hold
// batch * (ctx + steps) tokens (InvalidArgument otherwise). `on_prefilled`,
// when set, runs after each sequence's prefill, `on_step` after each decode
// step (steps done so far).
absl::StatusOr<DecodeBenchResult> RunDecodeBench(
    Engine& engine, absl::Span<const int> source, int ctx, int steps,
    const std::function<void(int prefilled)>& on_prefilled = nullptr,
    const std::function<void(int step)>& on_step = nullptr);

// The p-th percentile (0..100) of `v` (nearest rank); 0 for an empty v.
double Percentile(std::vector<double> v, double p);

// This process's peak resident set so far, in bytes (0 if unknown).
int64_t PeakRssBytes();

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_EVAL_BENCH_DECODE_H_
