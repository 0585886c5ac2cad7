#include "kv_memory_service/serving/request_metrics.h"

#include <map>
#include <string>

#include "absl/status/status.h"

namespace infinigen::kv_memory_service {

const char* PlaneName(Plane plane) {
  switch (plane) {
    case Plane::kGrpc:
      return "grpc";
    case Plane::kTcp:
      return "tcp";
    case Plane::kShm:
      return "shm";
    case Plane::kRdma:
      return "rdma";
  }
  return "unknown";
}

namespace {

const char* OpName(RequestOp op) {
  return op == RequestOp::kFetch ? "fetch" : "append";
}

}  // namespace

RequestMetrics::RequestMetrics()
    : registry_(std::make_shared<prometheus::Registry>()) {
  // A fetch of one layer's selected rows takes microseconds over shm and
  // up to milliseconds over TCP; an append of a prefill chunk, more.
  const prometheus::Histogram::BucketBoundaries buckets = {
      0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
      0.0025,  0.005,    0.01,    0.025,  0.05,    0.1,    0.25, 1};
  auto& seconds = prometheus::BuildHistogram()
                      .Name("infinigen_kv_request_seconds")
                      .Help("Time the memory node spent on a fetch or append "
                            "it served (request read to reply ready), by "
                            "data plane.")
                      .Register(*registry_);
  auto& bytes = prometheus::BuildCounter()
                    .Name("infinigen_kv_served_bytes_total")
                    .Help("Bytes of K/V rows fetches sent and appends "
                          "received, by data plane.")
                    .Register(*registry_);
  rejected_ = &prometheus::BuildCounter()
                   .Name("infinigen_kv_rejected_requests_total")
                   .Help("Requests the memory node refused, by data plane and "
                         "status code (handshakes and control calls "
                         "included).")
                   .Register(*registry_);
  for (int p = 0; p < kPlanes; ++p) {
    for (int o = 0; o < kRequestOps; ++o) {
      const std::map<std::string, std::string> labels = {
          {"plane", PlaneName(static_cast<Plane>(p))},
          {"op", OpName(static_cast<RequestOp>(o))}};
      seconds_[p][o] = &seconds.Add(labels, buckets);
      bytes_[p][o] = &bytes.Add(labels);
    }
  }
}

double RequestMetrics::ServedBytes(RequestOp op) const {
  double bytes = 0;
  for (int p = 0; p < kPlanes; ++p) {
    bytes += bytes_[p][static_cast<int>(op)]->Value();
  }
  return bytes;
}

void RequestMetrics::Served(Plane plane, RequestOp op, absl::Duration elapsed,
                            int64_t row_bytes) {
  const int p = static_cast<int>(plane);
  const int o = static_cast<int>(op);
  seconds_[p][o]->Observe(absl::ToDoubleSeconds(elapsed));
  if (row_bytes > 0) bytes_[p][o]->Increment(static_cast<double>(row_bytes));
}

void RequestMetrics::Rejected(Plane plane, const absl::Status& status) {
  if (status.ok()) return;
  rejected_
      ->Add({{"plane", PlaneName(plane)},
             {"code", absl::StatusCodeToString(status.code())}})
      .Increment();
}

}  // namespace infinigen::kv_memory_service
