// Prometheus plumbing shared by `infinigen serve` and kv_memory_server, on
// Debian's prometheus-cpp (core): a /metrics listener (--metrics_listen), the text
// format of a set of collectables, and metric families computed at scrape
// time from a component's own counters (so that a component's stats stay
// the one source and are not counted twice).
// Thread-safe as prometheus-cpp is.
#ifndef INFINIGEN_COMMON_METRICS_H_
#define INFINIGEN_COMMON_METRICS_H_

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace httplib {
class Server;
}

namespace infinigen {

// Serves the Prometheus text of `collectables` at http://LISTEN/metrics
// from a background thread (cpp-httplib; Debian's prometheus-cpp-pull
// exposer crashes in civetweb on its first scrape). LISTEN is HOST:PORT,
// port 0 picking a free one.
class MetricsServer {
 public:
  // InvalidArgument for a malformed address; Unavailable when it cannot be
  // bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& listen,
      std::vector<std::shared_ptr<prometheus::Collectable>> collectables);
  ~MetricsServer();  // stops serving

  int port() const { return port_; }

 private:
  MetricsServer() = default;

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

// The Prometheus text format of `collectables`, for a /metrics route of
// another HTTP server.
std::string MetricsText(
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables);

// A family with no samples yet, for Collectable::Collect; `type` is
// Counter or Gauge.
prometheus::MetricFamily NewFamily(const std::string& name,
                                   const std::string& help,
                                   prometheus::MetricType type);
// Adds a sample of `value` with `labels` ({name, value} pairs) to `family`.
void AddSample(prometheus::MetricFamily* family, double value,
               const std::vector<std::pair<std::string, std::string>>& labels =
                   {});

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_METRICS_H_
