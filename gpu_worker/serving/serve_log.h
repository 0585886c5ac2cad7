// ServeLog: what `infinigen serve` writes to its log while it serves, as
// vLLM's engine does: every `interval` while busy one line of generation
// and prompt tokens per second, running and waiting requests, and KV bytes
// fetched per generated token with the fraction of cached rows fetched;
// with log_requests also one line per finished request.
//
// Owns the thread that writes the periodic lines (started by Start, ended
// by Stop or the destructor); reads the scheduler it is given, which must
// outlive Stop. OnSequenceDone is thread-safe (the scheduler thread calls
// it).
#ifndef INFINIGEN_GPU_WORKER_SERVING_SERVE_LOG_H_
#define INFINIGEN_GPU_WORKER_SERVING_SERVE_LOG_H_

#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gpu_worker/serving/generation_scheduler.h"

namespace infinigen::gpu_worker {

// What finished sequences added up to, since a point in time.
struct ServeTotals {
  long requests = 0;
  long generated_tokens = 0;
  long bytes_fetched = 0;
  double fraction_sum = 0;  // of sequences' mean fetch fractions
  long fraction_count = 0;  // sequences that decoded through a policy
};

// One periodic line: `prompt` and `generated` tokens over `seconds`, the
// requests `finished` in that time, `running` and `waiting` now.
std::string ServeSummaryLine(long prompt, long generated,
                             const ServeTotals& finished, double seconds,
                             int running, int waiting);
// One finished request's line.
std::string RequestLine(const SequenceRecord& r);

class ServeLog {
 public:
  ServeLog(absl::Duration interval, bool log_requests)
      : interval_(interval), log_requests_(log_requests) {}
  ~ServeLog() { Stop(); }
  ServeLog(const ServeLog&) = delete;
  ServeLog& operator=(const ServeLog&) = delete;

  // For GenerationSchedulerOptions::on_sequence_done.
  void OnSequenceDone(const SequenceRecord& r);
  // Starts the periodic lines about `scheduler` (none when interval is 0).
  void Start(const GenerationScheduler* scheduler);
  void Stop();

 private:
  void Run(const GenerationScheduler* scheduler);

  const absl::Duration interval_;
  const bool log_requests_;
  absl::Mutex mu_;
  ServeTotals totals_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_SERVE_LOG_H_
