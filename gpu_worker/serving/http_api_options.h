// How the OpenAI-compatible HTTP API serves (HttpApiServer, http_api.h):
// its address, model id, chat template, key, limits, health and metrics
// callbacks and TLS.
#ifndef INFINIGEN_GPU_WORKER_SERVING_HTTP_API_OPTIONS_H_
#define INFINIGEN_GPU_WORKER_SERVING_HTTP_API_OPTIONS_H_

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "common/server_tls.h"
#include "gpu_worker/serving/chat_template.h"

namespace infinigen::gpu_worker {

struct HttpApiOptions {
  // "HOST:PORT"; port 0 picks a free one (see HttpApiServer::port).
  std::string listen;
  // The id /v1/models lists; a request naming another model gets 404.
  std::string model_id;
  // The template of /v1/chat/completions, or why there is none (chat
  // requests then get 400 with that message).
  absl::StatusOr<ChatTemplate> chat_template =
      absl::NotFoundError("no chat template");
  // When not empty, every route but /health needs
  // "Authorization: Bearer <api_key>".
  std::string api_key;
  // Larger request bodies get 413.
  size_t max_body_bytes = 1 << 20;
  // What GET /health reports: 200 while true, 503 otherwise. Null: 200.
  std::function<bool()> serving;
  // Not null: GET /metrics answers its Prometheus text (no key needed, as
  // for /health).
  std::function<std::string()> metrics;
  // Connections served at once, each on its own thread (a streaming
  // request holds one; an idle one until the 5 s keep-alive timeout);
  // beyond it, new connections wait for one to end.
  int max_connections = 1024;
  // HTTPS when tls.enabled(); with tls.mutual(), clients must present a
  // certificate tls.client_ca signed.
  ServerTlsPem tls;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_HTTP_API_OPTIONS_H_
