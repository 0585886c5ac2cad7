#include "gpu_worker/serving/serve_log.h"

#include "absl/strings/str_format.h"
#include "common/log.h"

namespace infinigen::gpu_worker {

std::string ServeSummaryLine(long prompt, long generated,
                             const ServeTotals& t, double seconds, int running,
                             int waiting) {
  const double s = seconds > 0 ? seconds : 1;
  std::string line = absl::StrFormat(
      "infinigen serve: generation %.1f tokens/s, prompt %.1f tokens/s, %d "
      "running, %d waiting, %d finished",
      generated / s, prompt / s, running, waiting, t.requests);
  if (t.fraction_count > 0 && t.generated_tokens > 0) {
    line += absl::StrFormat(
        ", KV %.1f KiB fetched per token (%.1f%% of cached rows)",
        static_cast<double>(t.bytes_fetched) / t.generated_tokens / 1024,
        100.0 * t.fraction_sum / t.fraction_count);
  }
  return line;
}

std::string RequestLine(const SequenceRecord& r) {
  std::string line = absl::StrFormat(
      "infinigen serve: request done: prompt %d tokens (%d reused), %d "
      "generated",
      r.prompt_tokens, r.cached_tokens, r.generated_tokens);
  if (r.ttft_seconds >= 0) {
    line += absl::StrFormat(", first token %.1f ms", 1e3 * r.ttft_seconds);
  }
  if (r.tpot_seconds >= 0) {
    line += absl::StrFormat(", %.1f ms per token", 1e3 * r.tpot_seconds);
  }
  if (r.fetch.steps > 0) {
    line += absl::StrFormat(", KV %.1f%% of cached rows fetched",
                            100.0 * r.fetch.fraction_mean());
  }
  return line;
}

void ServeLog::OnSequenceDone(const SequenceRecord& r) {
  {
    absl::MutexLock lock(&mu_);
    ++totals_.requests;
    totals_.generated_tokens += r.generated_tokens;
    totals_.bytes_fetched += r.fetch.bytes_fetched;
    if (r.fetch.steps > 0) {
      totals_.fraction_sum += r.fetch.fraction_mean();
      ++totals_.fraction_count;
    }
  }
  if (log_requests_) {
    IG_LOG(INFO) << RequestLine(r);
  }
}

void ServeLog::Start(const GenerationScheduler* scheduler) {
  if (interval_ <= absl::ZeroDuration() || thread_.joinable()) return;
  thread_ = std::thread([this, scheduler] { Run(scheduler); });
}

void ServeLog::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ServeLog::Run(const GenerationScheduler* scheduler) {
  absl::Time since = absl::Now();
  SchedulerStats last = scheduler->stats();
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval_)) {
    const ServeTotals finished = totals_;
    totals_ = ServeTotals();
    const absl::Time now = absl::Now();
    const double seconds = absl::ToDoubleSeconds(now - since);
    since = now;
    mu_.Unlock();
    const SchedulerStats stats = scheduler->stats();
    const long prompt = stats.prompt_tokens - last.prompt_tokens;
    const long generated = stats.generated_tokens - last.generated_tokens;
    last = stats;
    // Quiet while idle: a line only when something ran or waits.
    if (generated > 0 || prompt > 0 || finished.requests > 0 ||
        stats.active > 0 || stats.queued > 0) {
      IG_LOG(INFO) << ServeSummaryLine(prompt, generated, finished, seconds,
                                       stats.active, stats.queued);
    }
    mu_.Lock();
  }
}

}  // namespace infinigen::gpu_worker
