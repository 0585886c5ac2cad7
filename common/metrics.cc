#include "common/metrics.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/address.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"

namespace infinigen {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen,
    std::vector<std::shared_ptr<prometheus::Collectable>> collectables) {
  auto address = ParseHostPort(listen, "metrics listen");
  if (!address.ok()) return address.status();
  const std::string& host = address->host;
  int port = address->port;
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->server_ = std::make_unique<httplib::Server>();
  s->server_->new_task_queue = [] { return new httplib::ThreadPool(2); };
  s->server_->Get("/metrics", [collectables](const httplib::Request&,
                                             httplib::Response& res) {
    res.set_content(MetricsText(collectables), "text/plain; version=0.0.4");
  });
  if (port == 0) {
    port = s->server_->bind_to_any_port(host);
  } else if (!s->server_->bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    const std::string why = WhyNotListening(listen);
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", listen, ": ",
        why.empty() ? "the address is taken or not allowed" : why));
  }
  s->port_ = port;
  s->thread_ =
      std::thread([server = s->server_.get()] { server->listen_after_bind(); });
  return s;
}

MetricsServer::~MetricsServer() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

std::string MetricsText(
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables) {
  std::vector<prometheus::MetricFamily> families;
  for (const auto& c : collectables) {
    std::vector<prometheus::MetricFamily> more = c->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()),
                    std::make_move_iterator(more.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

prometheus::MetricFamily NewFamily(const std::string& name,
                                   const std::string& help,
                                   prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

void AddSample(prometheus::MetricFamily* family, double value,
               const std::vector<std::pair<std::string, std::string>>& labels) {
  prometheus::ClientMetric m;
  for (const auto& [name, v] : labels) m.label.push_back({name, v});
  if (family->type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  family->metric.push_back(std::move(m));
}

}  // namespace infinigen
