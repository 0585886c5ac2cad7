#include "gpu_worker/serving/worker_metrics.h"

#include "common/metrics.h"
#include "prometheus/family.h"

namespace infinigen::gpu_worker {
namespace {

using prometheus::MetricType;

// The scheduler's SchedulerStats as metric families, read at scrape time.
class SchedulerCollector : public prometheus::Collectable {
 public:
  explicit SchedulerCollector(
      std::shared_ptr<std::atomic<const GenerationScheduler*>> scheduler)
      : scheduler_(std::move(scheduler)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const GenerationScheduler* s = scheduler_->load();
    if (s == nullptr) return {};
    const SchedulerStats st = s->stats();
    prometheus::MetricFamily requests = NewFamily(
        "infinigen_worker_requests_total",
        "Generation requests by outcome: completed, cancelled (the client "
        "went away or a stop sequence ended it), failed, rejected (bad "
        "request, queue full or draining).",
        MetricType::Counter);
    AddSample(&requests, st.completed, {{"outcome", "completed"}});
    AddSample(&requests, st.cancelled, {{"outcome", "cancelled"}});
    AddSample(&requests, st.failed, {{"outcome", "failed"}});
    AddSample(&requests, st.rejected, {{"outcome", "rejected"}});
    prometheus::MetricFamily queue =
        NewFamily("infinigen_worker_queue_depth",
                  "Requests waiting for a sequence slot.", MetricType::Gauge);
    AddSample(&queue, st.queued);
    prometheus::MetricFamily running = NewFamily(
        "infinigen_worker_running_sequences",
        "Sequences in a slot now (the running batch).", MetricType::Gauge);
    AddSample(&running, st.active);
    prometheus::MetricFamily slots =
        NewFamily("infinigen_worker_sequence_slots",
                  "Sequences the engine decodes at once (--max_batch).",
                  MetricType::Gauge);
    AddSample(&slots, s->slots());
    prometheus::MetricFamily recoveries = NewFamily(
        "infinigen_worker_kv_recoveries_total",
        "Times the memory node lost sequences' KV (restart, eviction) and "
        "the worker recomputed it from their tokens (--on_kv_loss=recompute).",
        MetricType::Counter);
    AddSample(&recoveries, st.kv_recoveries);
    prometheus::MetricFamily row_cache = NewFamily(
        "infinigen_worker_kv_row_cache_bytes",
        "Bytes of K and V rows the sequences' row caches hold on the worker "
        "now (--row_cache).",
        MetricType::Gauge);
    AddSample(&row_cache, static_cast<double>(st.row_cache_bytes));
    return {requests, queue, running, slots, recoveries, row_cache};
  }

 private:
  const std::shared_ptr<std::atomic<const GenerationScheduler*>> scheduler_;
};

prometheus::Histogram* NewHistogram(prometheus::Registry& registry,
                                    const std::string& name,
                                    const std::string& help,
                                    const prometheus::Histogram::BucketBoundaries&
                                        buckets) {
  return &prometheus::BuildHistogram()
              .Name(name)
              .Help(help)
              .Register(registry)
              .Add({}, buckets);
}

prometheus::Counter* NewCounter(prometheus::Registry& registry,
                                const std::string& name,
                                const std::string& help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add(
      {});
}

}  // namespace

WorkerMetrics::WorkerMetrics()
    : scheduler_(std::make_shared<std::atomic<const GenerationScheduler*>>(
          nullptr)),
      registry_(std::make_shared<prometheus::Registry>()),
      scheduler_collector_(std::make_shared<SchedulerCollector>(scheduler_)) {
  const prometheus::Histogram::BucketBoundaries latency = {
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  ttft_ = NewHistogram(*registry_, "infinigen_worker_time_to_first_token_seconds",
                       "Arrival to the first generated token, per sequence.",
                       latency);
  tpot_ = NewHistogram(
      *registry_, "infinigen_worker_time_per_output_token_seconds",
      "Mean time between a sequence's tokens after its first.", latency);
  fetch_fraction_ = NewHistogram(
      *registry_, "infinigen_worker_kv_fetch_fraction",
      "Rows fetched / rows cached, a sequence's mean over its decode steps "
      "(offloaded KV policies).",
      {0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1});
  fetch_wait_per_step_ = NewHistogram(
      *registry_, "infinigen_worker_kv_fetch_wait_seconds_per_step",
      "Time a decode step waited on KV fetches, a sequence's mean.",
      {0.00001, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1});
  prompt_tokens_ = NewCounter(*registry_, "infinigen_worker_prompt_tokens_total",
                              "Prompt tokens of the sequences served.");
  cached_prompt_tokens_ = NewCounter(
      *registry_, "infinigen_worker_prompt_tokens_cached_total",
      "Prompt tokens whose KV the memory node already held (prefix reuse): "
      "not prefilled again.");
  generated_tokens_ =
      NewCounter(*registry_, "infinigen_worker_generated_tokens_total",
                 "Tokens generated.");
  kv_bytes_fetched_ =
      NewCounter(*registry_, "infinigen_worker_kv_bytes_fetched_total",
                 "K and V bytes fetched from the KV memory node (as stored).");
  kv_fetch_wait_ =
      NewCounter(*registry_, "infinigen_worker_kv_fetch_wait_seconds_total",
                 "Time decode steps spent waiting on KV fetches.");
  row_cache_lookups_ = NewCounter(
      *registry_, "infinigen_worker_kv_row_cache_lookups_total",
      "Selected rows a decode step looked up in the worker's row cache "
      "(--row_cache), all layers and KV heads.");
  row_cache_hits_ = NewCounter(
      *registry_, "infinigen_worker_kv_row_cache_hits_total",
      "Of the row cache's lookups, the rows it held: not fetched from the "
      "memory node.");
}

void WorkerMetrics::OnSequenceDone(const SequenceRecord& r) {
  prompt_tokens_->Increment(r.prompt_tokens);
  cached_prompt_tokens_->Increment(r.cached_tokens);
  generated_tokens_->Increment(r.generated_tokens);
  if (r.ttft_seconds >= 0) ttft_->Observe(r.ttft_seconds);
  if (r.tpot_seconds >= 0) tpot_->Observe(r.tpot_seconds);
  kv_bytes_fetched_->Increment(static_cast<double>(r.fetch.bytes_fetched));
  kv_fetch_wait_->Increment(r.fetch.wait_seconds);
  row_cache_lookups_->Increment(static_cast<double>(r.fetch.row_cache_lookups));
  row_cache_hits_->Increment(static_cast<double>(r.fetch.row_cache_hits));
  if (r.fetch.steps > 0) {
    fetch_fraction_->Observe(r.fetch.fraction_mean());
    fetch_wait_per_step_->Observe(r.fetch.wait_seconds / r.fetch.steps);
  }
}

}  // namespace infinigen::gpu_worker
