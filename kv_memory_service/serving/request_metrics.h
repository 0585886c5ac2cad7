// Per-request metrics of the memory node, by data plane: time in the server
// and bytes of rows moved for each fetch and append it served, and the
// requests it refused, by status code (Prometheus, prometheus-cpp core).
// The store's own totals (pool, sequences, rows) are StoreMetrics'; this is
// what only the planes see. The servers of every plane hold a pointer to
// one RequestMetrics (null: nothing recorded), which the node's main owns
// and serves on --metrics_listen.
// Thread-safe: every plane records from its own threads.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVING_REQUEST_METRICS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVING_REQUEST_METRICS_H_

#include <array>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace infinigen::kv_memory_service {

// Where a request came in: the gRPC service (control calls, appends, and
// fetches over its stream), the TCP fetch socket, shared memory, RDMA.
enum class Plane { kGrpc = 0, kTcp, kShm, kRdma };
inline constexpr int kPlanes = 4;
const char* PlaneName(Plane plane);

enum class RequestOp { kFetch = 0, kAppend };
inline constexpr int kRequestOps = 2;

class RequestMetrics {
 public:
  RequestMetrics();

  // A request served: its time in the server (request read to reply ready)
  // and the bytes of K/V rows it moved (fetch: sent; append: received).
  void Served(Plane plane, RequestOp op, absl::Duration elapsed,
              int64_t row_bytes);
  // A request refused with `status` (OK: nothing recorded). Covers every
  // request of the plane, control calls and handshakes included.
  void Rejected(Plane plane, const absl::Status& status);
  // Served when `status` is OK, else Rejected.
  void Record(Plane plane, RequestOp op, absl::Duration elapsed,
              int64_t row_bytes, const absl::Status& status) {
    if (status.ok()) {
      Served(plane, op, elapsed, row_bytes);
    } else {
      Rejected(plane, status);
    }
  }

  // Bytes of K/V rows served by `op` so far, every plane together.
  double ServedBytes(RequestOp op) const;

  // What a /metrics endpoint serves.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* rejected_;
  std::array<std::array<prometheus::Histogram*, kRequestOps>, kPlanes> seconds_;
  std::array<std::array<prometheus::Counter*, kRequestOps>, kPlanes> bytes_;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVING_REQUEST_METRICS_H_
