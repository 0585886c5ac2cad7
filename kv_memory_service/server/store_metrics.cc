#include "kv_memory_service/server/store_metrics.h"

#include <string>

#include "common/metrics.h"

namespace infinigen::kv_memory_service {

std::vector<prometheus::MetricFamily> StoreMetrics::Collect() const {
  using prometheus::MetricType;
  const StoreStats st = store_->GetStoreStats();
  std::vector<prometheus::MetricFamily> out;
  auto add = [&out](const char* name, const char* help, MetricType type,
                    double value) {
    out.push_back(NewFamily(name, help, type));
    AddSample(&out.back(), value);
  };
  add("infinigen_kv_pool_bytes_used",
      "Bytes reserved by the open sequences.", MetricType::Gauge,
      st.bytes_reserved);
  add("infinigen_kv_pool_capacity_bytes",
      "The pool's capacity (--capacity_bytes; 0: unlimited).",
      MetricType::Gauge, st.capacity_bytes);
  add("infinigen_kv_pinned_bytes",
      "Bytes of closed sequences' rows that clients on this host still map "
      "or hold (one-sided reads); counted against the capacity.",
      MetricType::Gauge, st.pinned_bytes);
  add("infinigen_kv_pinned_sequences",
      "Closed sequences whose rows a client still maps or holds.",
      MetricType::Gauge, st.pinned_sequences);
  add("infinigen_kv_spare_bytes",
      "Bytes of closed sequences' shared rows kept for their sessions' next "
      "sequences (--shm_spare_rows); counted against the capacity.",
      MetricType::Gauge, st.spare_bytes);
  add("infinigen_kv_reused_row_sequences_total",
      "Sequences opened in a closed sequence's kept rows (nothing mapped or "
      "registered again by their client).",
      MetricType::Counter, st.reused_row_sequences);
  add("infinigen_kv_sequences", "Open sequences.", MetricType::Gauge,
      st.open_sequences);
  add("infinigen_kv_sessions", "Open client sessions (leases).",
      MetricType::Gauge, st.open_sessions);
  add("infinigen_kv_appended_rows_total", "K/V rows appended.",
      MetricType::Counter, st.appended_rows);
  add("infinigen_kv_fetches_total", "Fetches served.", MetricType::Counter,
      st.fetches);
  add("infinigen_kv_fetched_rows_total", "K/V rows served by fetches.",
      MetricType::Counter, st.fetched_rows);
  add("infinigen_kv_expired_sessions_total",
      "Sessions whose lease ran out (their sequences closed).",
      MetricType::Counter, st.expired_sessions);
  out.push_back(NewFamily("infinigen_kv_evicted_rows_total",
                          "Rows evicted to stay within capacity, by policy.",
                          MetricType::Counter));
  AddSample(&out.back(), st.evicted_rows,
            {{"policy", std::string(EvictionPolicyName(st.eviction))}});
  return out;
}

}  // namespace infinigen::kv_memory_service
