// The memory node's Prometheus metrics, read at scrape time from its
// KvStore's own StoreStats (the numbers GetStats reports): pool bytes in use
// and capacity, sequences and sessions, rows appended, fetched and evicted
// (by the pool's eviction policy), fetches, expired leases.
// Thread-safe as KvStore::GetStoreStats.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVER_STORE_METRICS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVER_STORE_METRICS_H_

#include <vector>

#include "kv_memory_service/store/kv_store.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace infinigen::kv_memory_service {

class StoreMetrics : public prometheus::Collectable {
 public:
  // `store` is not owned and outlives every Collect.
  explicit StoreMetrics(const KvStore* store) : store_(store) {}

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const KvStore* const store_;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVER_STORE_METRICS_H_
