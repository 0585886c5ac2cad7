#include "gpu_worker/eval/bench_decode.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::gpu_worker {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

}  // namespace

double DecodeBenchResult::step_ms(double percentile) const {
  return 1e3 * Percentile(step_seconds, percentile);
}

std::vector<int> DecodeBenchSource(absl::Span<const int> text, size_t need,
                                   int vocab) {
  std::vector<int> source(text.begin(), text.end());
  if (!text.empty()) {
    for (size_t i = 0; source.size() < need; ++i) source.push_back(text[i % text.size()]);
    return source;
  }
  uint64_t x = 88172645463325252ull;  // xorshift64
  while (source.size() < need) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    source.push_back(static_cast<int>(x % vocab));
  }
  return source;
}

absl::StatusOr<DecodeBenchResult> RunDecodeBench(
    Engine& engine, absl::Span<const int> source, int ctx, int steps,
    const std::function<void(int prefilled)>& on_prefilled,
    const std::function<void(int step)>& on_step) {
  const int batch = engine.batch();
  if (ctx < 1 || steps < 1) {
    return absl::InvalidArgumentError("ctx and steps must be >= 1");
  }
  if (ctx + steps > engine.max_seq_len()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ctx + steps = %d exceeds the engine's %d positions", ctx + steps,
        engine.max_seq_len()));
  }
  const size_t stride = static_cast<size_t>(ctx) + steps;
  if (source.size() < stride * batch) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d tokens of input for %d sequences of %d", source.size(), batch,
        stride));
  }
  DecodeBenchResult r;
  r.policy = engine.policy_name();
  r.backend = engine.backend().name();
  r.ctx = ctx;
  r.batch = batch;
  r.steps = steps;
  // A warm-up, as the Transformers baseline takes (bench/hf_baseline.py):
  // a short prompt and one step in slot 0, which is then emptied, so that
  // what a backend sets up on first use (its kernels, fp16 copies of the
  // weights) stays out of the timings. Its prompt repeats one token, so no
  // sequence's prompt finds it as a prefix to reuse.
  auto t0 = std::chrono::steady_clock::now();
  const std::vector<int> warm(std::min(ctx, kWarmupTokens), source[0]);
  IG_RETURN_IF_ERROR(engine.Forward(0, warm, false).status());
  const int warm_slot = 0, warm_next = source[0];
  IG_RETURN_IF_ERROR(engine
                         .DecodeBatch(absl::MakeConstSpan(&warm_slot, 1),
                                      absl::MakeConstSpan(&warm_next, 1))
                         .status());
  IG_RETURN_IF_ERROR(engine.Reset(0));
  r.warmup_seconds = SecondsSince(t0);
  t0 = std::chrono::steady_clock::now();
  std::vector<int> slots(batch), next(batch);
  for (int b = 0; b < batch; ++b) {
    slots[b] = b;
    IG_RETURN_IF_ERROR(
        engine.Forward(b, source.subspan(b * stride, ctx), false).status());
    r.cached_tokens += engine.cached_tokens(b);
    if (on_prefilled) on_prefilled(b + 1);
  }
  r.prefill_seconds = SecondsSince(t0);
  t0 = std::chrono::steady_clock::now();
  // The row caches' counts after the previous step (the prefill looks
  // nothing up).
  FetchStats last;
  // A layer's count since the previous step (0 before its first).
  auto since = [](const std::vector<long>& count,
                  const std::vector<long>& before, size_t l) {
    return count[l] - (l < before.size() ? before[l] : 0);
  };
  for (int step = 0; step < steps; ++step) {
    for (int b = 0; b < batch; ++b) next[b] = source[b * stride + ctx + step];
    const auto s0 = std::chrono::steady_clock::now();
    IG_RETURN_IF_ERROR(engine.DecodeBatch(slots, next).status());
    r.step_seconds.push_back(SecondsSince(s0));
    FetchStats now;
    for (int b = 0; b < batch; ++b) now.Add(engine.fetch_stats(b));
    const long lookups = now.row_cache_lookups - last.row_cache_lookups;
    if (lookups > 0) {
      r.step_row_cache_hit_rate.push_back(
          static_cast<double>(now.row_cache_hits - last.row_cache_hits) /
          lookups);
    }
    if (step > 0 && !now.selection_layer_repeats.empty()) {
      std::vector<double> overlap;
      for (size_t l = 0; l < now.selection_layer_repeats.size(); ++l) {
        const long n = since(now.row_cache_layer_lookups,
                             last.row_cache_layer_lookups, l);
        const long repeated = since(now.selection_layer_repeats,
                                    last.selection_layer_repeats, l);
        overlap.push_back(n > 0 ? static_cast<double>(repeated) / n : 0.0);
      }
      r.step_layer_overlap.push_back(std::move(overlap));
    }
    last = std::move(now);
    if (on_step) on_step(step + 1);
  }
  r.seconds = SecondsSince(t0);
  for (int b = 0; b < batch; ++b) r.fetch.Add(engine.fetch_stats(b));
  r.worker_kv_bytes = engine.worker_kv_bytes();
  r.memory_node_bytes = engine.node_kv_bytes();
  r.peak_rss_bytes = PeakRssBytes();
  return r;
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i =
      std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * v.size()));
  return v[i];
}

int64_t PeakRssBytes() {
  struct rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux: KiB
}

}  // namespace infinigen::gpu_worker
