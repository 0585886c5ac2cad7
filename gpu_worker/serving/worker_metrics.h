// The Prometheus metrics of `infinigen serve` (prometheus-cpp): requests by
// outcome, queue depth, running batch and the row caches' bytes (read from
// the scheduler's own SchedulerStats at scrape time), and, per sequence as
// it leaves its slot (GenerationSchedulerOptions::on_sequence_done), time
// to first token, time per output token, prompt and generated tokens, and
// what its KV policy fetched: bytes, the fraction of cached rows fetched (a
// sequence's mean over its decode steps), the fetch wait per step and the
// row cache's lookups and hits.
//
// Thread-safe: OnSequenceDone runs on the scheduler thread, Collect on a
// scraper's.
#ifndef INFINIGEN_GPU_WORKER_SERVING_WORKER_METRICS_H_
#define INFINIGEN_GPU_WORKER_SERVING_WORKER_METRICS_H_

#include <atomic>
#include <memory>
#include <vector>

#include "gpu_worker/serving/generation_scheduler.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace infinigen::gpu_worker {

class WorkerMetrics {
 public:
  WorkerMetrics();

  // The scheduler whose stats are reported from now on (null: none). Not
  // owned; it must outlive the scrapes, or be unset first.
  void set_scheduler(const GenerationScheduler* scheduler) {
    scheduler_->store(scheduler);
  }
  // For GenerationSchedulerOptions::on_sequence_done.
  void OnSequenceDone(const SequenceRecord& r);

  // What a /metrics endpoint serves.
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables() const {
    return {registry_, scheduler_collector_};
  }

 private:
  std::shared_ptr<std::atomic<const GenerationScheduler*>> scheduler_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> scheduler_collector_;
  prometheus::Histogram* ttft_;
  prometheus::Histogram* tpot_;
  prometheus::Histogram* fetch_fraction_;
  prometheus::Histogram* fetch_wait_per_step_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* cached_prompt_tokens_;
  prometheus::Counter* generated_tokens_;
  prometheus::Counter* kv_bytes_fetched_;
  prometheus::Counter* kv_fetch_wait_;
  prometheus::Counter* row_cache_lookups_;
  prometheus::Counter* row_cache_hits_;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_WORKER_METRICS_H_
