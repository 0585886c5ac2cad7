// infinigen serve: the Worker gRPC API and the OpenAI-compatible HTTP API
// over one generation scheduler, until SIGTERM or SIGINT.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/file.h"
#include "common/log.h"
#include "common/status.h"
#include "common/metrics.h"
#include "common/server_tls.h"
#include "gpu_worker/serving/chat_template.h"
#include "common/grpc_log.h"
#include "gpu_worker/commands/common.h"
#include "gpu_worker/serving/generation_scheduler.h"
#include "gpu_worker/serving/generation_service.h"
#include "gpu_worker/serving/http_api.h"
#include "gpu_worker/serving/serve_log.h"
#include "gpu_worker/kv/policies/registry.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/serving/worker_metrics.h"

ABSL_FLAG(std::string, listen, "",
          "serve: HOST:PORT to listen on (port 0 picks a free one), or "
          "unix:PATH.");
ABSL_FLAG(absl::Duration, log_interval, absl::Seconds(10),
          "serve: while busy, log generation and prompt tokens per second, "
          "running and waiting requests and the KV fetched per token this "
          "often; 0: never.");
ABSL_FLAG(bool, log_requests, false,
          "serve: log one line per finished request (prompt and generated "
          "tokens, time to first token, time per token, rows fetched).");
ABSL_FLAG(std::string, http_listen, "",
          "serve: HOST:PORT for the OpenAI-compatible HTTP API "
          "(/v1/completions, /v1/chat/completions, /v1/models, /health) "
          "beside --listen; empty: none.");
ABSL_FLAG(std::string, served_model_name, "",
          "serve: the model id of the HTTP API; empty: --model's file name "
          "without its extension.");
ABSL_FLAG(std::string, api_key_file, "",
          "serve: file holding the API key every request must carry: HTTP as "
          "'Authorization: Bearer KEY' (/health excepted), gRPC Worker calls "
          "as the metadata 'authorization: Bearer KEY' (grpc.health.v1 "
          "excepted); empty: none.");
ABSL_FLAG(std::string, tls_cert, "",
          "serve: PEM file: serve --listen (gRPC) and --http_listen (HTTPS) "
          "over TLS with this certificate chain; needs --tls_key. "
          "--metrics_listen stays plaintext.");
ABSL_FLAG(std::string, tls_key, "",
          "serve: PEM file: the private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "serve: PEM file: with --tls_cert, every gRPC and HTTP client must "
          "present a certificate this CA signed (mutual TLS).");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve: HOST:PORT serving Prometheus metrics at /metrics (they are "
          "also at /metrics of --http_listen); empty: none.");
ABSL_FLAG(int, max_batch, 8,
          "serve: sequences generating at once (the engine's slots); more "
          "requests wait in the queue.");
ABSL_FLAG(int, max_prefills_per_step, 1,
          "serve: new requests prefilled between two decode steps (0: all "
          "that have a slot); small values keep running streams smooth.");
ABSL_FLAG(int, max_queue, 64,
          "serve: requests waiting for a slot; beyond it requests get "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(int, http_max_connections, 1024,
          "serve --http_listen: connections served at once, each on its own "
          "thread (idle ones close after 5 s without a request); beyond it "
          "new ones wait.");
ABSL_FLAG(absl::Duration, kv_down_wait, absl::Seconds(5),
          "serve: how long queued requests wait for a memory node that stopped "
          "answering (timed out, or its heartbeats fail) to come back, as "
          "after a restart; after that they fail at once and new requests "
          "get UNAVAILABLE (HTTP 503) naming the node, until it answers.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "serve: on SIGTERM or SIGINT, how long queued and active "
          "generations may take to finish before they are cut short.");


namespace infinigen::commands {
namespace {

// The SIGTERM/SIGINT handler writes the signal to this pipe and RunServe
// waits on it. A handler, not sigwait: OpenBLAS starts threads before
// main, so the signals cannot be blocked in every thread.
int stop_pipe[2] = {-1, -1};

extern "C" void OnStopSignal(int signal) {
  const char c = static_cast<char>(signal);
  [[maybe_unused]] ssize_t n = write(stop_pipe[1], &c, 1);
}

absl::Status InstallStopHandler() {
  if (pipe(stop_pipe) != 0) return absl::InternalError("pipe() failed");
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  return absl::OkStatus();
}

// Blocks until SIGTERM or SIGINT; returns which.
int WaitForStopSignal() {
  char signal = 0;
  while (read(stop_pipe[0], &signal, 1) < 0 && errno == EINTR) {
  }
  return signal;
}

// "models/SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct.Q4_1".
std::string ModelIdFromPath(const std::string& path) {
  std::string name = path.substr(path.rfind('/') + 1);
  if (const size_t dot = name.rfind('.'); dot != std::string::npos && dot > 0) {
    name.resize(dot);
  }
  return name;
}

// The flags serve checks before it loads anything.
absl::Status CheckServeFlags() {
  if (absl::GetFlag(FLAGS_listen).empty()) {
    return absl::InvalidArgumentError(
        "--listen is required (HOST:PORT or unix:PATH)");
  }
  if (absl::GetFlag(FLAGS_max_batch) < 1) {
    return absl::InvalidArgumentError("--max_batch must be at least 1");
  }
  if (absl::GetFlag(FLAGS_drain_timeout) < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--drain_timeout must not be negative");
  }
  if (absl::GetFlag(FLAGS_http_max_connections) < 2) {
    return absl::InvalidArgumentError("--http_max_connections must be >= 2");
  }
  if (absl::GetFlag(FLAGS_log_interval) < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--log_interval must not be negative");
  }
  if (absl::GetFlag(FLAGS_kv_down_wait) < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--kv_down_wait must not be negative");
  }
  gpu_worker::KvOptions chosen;
  IG_RETURN_IF_ERROR(
      gpu_worker::ChoosePolicy(ReadEngineFlags().policy, chosen));
  return absl::OkStatus();
}

// The HTTP API's settings (model id, chat template, API key, TLS),
// checked before anything starts: InvalidArgument for a bad flag or file.
absl::StatusOr<gpu_worker::HttpApiOptions> HttpOptionsFromFlags(
    const ServerTlsPem& tls, std::shared_ptr<gpu_worker::WorkerMetrics> metrics) {
  gpu_worker::HttpApiOptions http;
  http.listen = absl::GetFlag(FLAGS_http_listen);
  http.model_id = absl::GetFlag(FLAGS_served_model_name);
  const ModelFlags flags = ReadModelFlags();
  if (http.model_id.empty()) http.model_id = ModelIdFromPath(flags.path);
  http.chat_template =
      gpu_worker::ChatTemplateForModel(flags.path, flags.chat_template);
  if (!http.chat_template.ok() &&
      http.chat_template.status().code() ==
          absl::StatusCode::kInvalidArgument &&
      !flags.chat_template.empty()) {
    return http.chat_template.status();
  }
  if (const std::string key_file = absl::GetFlag(FLAGS_api_key_file);
      !key_file.empty()) {
    auto key = ReadTokenFile(key_file);
    if (!key.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--api_key_file: ", key.status().message()));
    }
    http.api_key = *std::move(key);
  }
  http.tls = tls;
  http.metrics = [metrics] { return MetricsText(metrics->collectables()); };
  http.max_connections = absl::GetFlag(FLAGS_http_max_connections);
  return http;
}

// The engine with the policy flags, inside a generation scheduler that
// reports finished sequences to `metrics`; 0, or the exit status after
// reporting why not. `setup` holds the memory node the engine uses.
int StartScheduler(const model::LoadedModel& m,
                   const kv_memory_service::KvClientOptions& kv_options,
                   std::shared_ptr<gpu_worker::WorkerMetrics> metrics,
                   std::shared_ptr<gpu_worker::ServeLog> serve_log,
                   PolicySetup& setup,
                   std::unique_ptr<gpu_worker::GenerationScheduler>& out) {
  auto s = SetUpPolicy(ReadEngineFlags().policy, m, kv_options,
                       /*serving=*/true);
  if (!s.ok()) return SetupFailure(s.status());
  WarnIgnoredPolicyFlags({ReadEngineFlags().policy});
  setup = *std::move(s);
  setup.options.max_seq_len = ReadModelFlags().max_seq_len;
  setup.options.batch = absl::GetFlag(FLAGS_max_batch);
  auto engine =
      CreateEngine(m.weights, setup.options, /*prefill_progress=*/false);
  if (!engine.ok()) return EngineFailure(engine.status());
  gpu_worker::GenerationSchedulerOptions options;
  options.max_queue = absl::GetFlag(FLAGS_max_queue);
  options.max_prefills_per_step = absl::GetFlag(FLAGS_max_prefills_per_step);
  options.on_sequence_done = [metrics, serve_log](
                                 const gpu_worker::SequenceRecord& r) {
    metrics->OnSequenceDone(r);
    serve_log->OnSequenceDone(r);
  };
  options.kv_down_wait = absl::GetFlag(FLAGS_kv_down_wait);
  if (const kv_memory_service::KvClient* kv = setup.client.get();
      kv != nullptr) {
    // A node that timed out, or whose heartbeats fail, is down: requests
    // wait for it kv_down_wait, then fail at once, naming it, until it
    // answers again.
    options.kv_health = [kv] {
      absl::Status down = kv->Unanswered();
      if (down.ok()) down = kv->Health();
      return kv_memory_service::AtNode(kv->address(), down);
    };
  }
  auto scheduler = gpu_worker::GenerationScheduler::Create(
      std::move(*engine), *m.tokenizer, options);
  if (!scheduler.ok()) return Fail(kExitUsage, scheduler.status());
  out = *std::move(scheduler);
  metrics->set_scheduler(out.get());
  return 0;
}

// The servers of one `serve`: gRPC always, HTTP and metrics when asked.
struct Servers {
  std::unique_ptr<gpu_worker::GenerationServer> grpc;
  std::unique_ptr<gpu_worker::HttpApiServer> http;
  std::unique_ptr<MetricsServer> metrics;

  // Stops everything at once (a failed start).
  void Abort() {
    if (http != nullptr) http->Stop();
    metrics.reset();
    grpc->Shutdown(absl::ZeroDuration());
    grpc->Wait();
  }
};

// Starts the HTTP API (when --http_listen) and the metrics listener (when
// --metrics_listen) beside the running gRPC server.
absl::Status StartSideServers(Servers& servers,
                              const model::Tokenizer& tokenizer,
                              gpu_worker::HttpApiOptions http_options,
                              const gpu_worker::WorkerMetrics& metrics) {
  if (!http_options.listen.empty()) {
    gpu_worker::GenerationServer* grpc = servers.grpc.get();
    http_options.serving = [grpc] { return grpc->serving(); };
    if (!http_options.chat_template.ok()) {
      IG_LOG(INFO) << "infinigen serve: no chat completions: "
                   << http_options.chat_template.status().message();
    }
    IG_ASSIGN_OR_RETURN(servers.http,
                        gpu_worker::HttpApiServer::Start(
                            &grpc->scheduler(), &tokenizer,
                            std::move(http_options)));
    IG_LOG(INFO) << "infinigen serve: HTTP API on port "
                 << servers.http->port();
  }
  if (const std::string listen = absl::GetFlag(FLAGS_metrics_listen);
      !listen.empty()) {
    IG_ASSIGN_OR_RETURN(servers.metrics,
                        MetricsServer::Start(listen, metrics.collectables()));
    IG_LOG(INFO) << "infinigen serve: metrics on port "
                 << servers.metrics->port();
  }
  return absl::OkStatus();
}

// Waits for SIGTERM or SIGINT, then drains for --drain_timeout and stops.
void ServeUntilStopped(Servers& servers, gpu_worker::WorkerMetrics& metrics) {
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  const int signal = WaitForStopSignal();
  IG_LOG(INFO) << "infinigen serve: "
               << (signal == SIGTERM ? "SIGTERM" : "SIGINT")
               << ", draining for up to " << absl::FormatDuration(drain);
  servers.grpc->Shutdown(drain);
  if (servers.http != nullptr) servers.http->Stop();  // drained with gRPC
  servers.metrics.reset();
  metrics.set_scheduler(nullptr);
  servers.grpc->Wait();
  const gpu_worker::SchedulerStats stats = servers.grpc->scheduler().stats();
  IG_LOG(INFO) << "infinigen serve: stopped; " << stats.completed
               << " generations completed, " << stats.cancelled
               << " cancelled, " << stats.failed << " failed, "
               << stats.rejected << " requests refused";
}

int RunServe() {
  if (absl::Status ok = CheckServeFlags(); !ok.ok()) {
    return Fail(kExitUsage, ok);
  }
  absl::StatusOr<ServerTlsPem> tls = ReadServerTlsFiles(
      absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
      absl::GetFlag(FLAGS_tls_client_ca));
  if (!tls.ok()) return Fail(kExitUsage, tls.status());
  auto kv_options = KvClientOptionsFromFlags();
  if (!kv_options.ok()) return Fail(kExitUsage, kv_options.status());
  auto m = LoadFromFlags(/*need_tokenizer=*/true);
  if (!m.ok()) return LoadFailure(m.status());
  auto metrics = std::make_shared<gpu_worker::WorkerMetrics>();
  auto serve_log = std::make_shared<gpu_worker::ServeLog>(
      absl::GetFlag(FLAGS_log_interval), absl::GetFlag(FLAGS_log_requests));
  PolicySetup setup;
  std::unique_ptr<gpu_worker::GenerationScheduler> scheduler;
  if (int code = StartScheduler(*m, *kv_options, metrics, serve_log, setup,
                                scheduler);
      code != 0) {
    return code;
  }
  if (absl::Status ok = InstallStopHandler(); !ok.ok()) {
    return Fail(kExitFailure, ok);
  }
  auto http_options = HttpOptionsFromFlags(*tls, metrics);
  if (!http_options.ok()) return Fail(kExitUsage, http_options.status());

  scheduler->Start();
  gpu_worker::GenerationServerOptions server_options;
  server_options.listen = absl::GetFlag(FLAGS_listen);
  server_options.api_key = http_options->api_key;
  server_options.tls = *tls;
  if (const kv_memory_service::KvClient* kv = setup.client.get();
      kv != nullptr) {
    // Readiness follows the memory node's heartbeats (KvClient::Health).
    server_options.dependency_health = [kv] {
      return kv_memory_service::AtNode(kv->address(), kv->Health());
    };
  }
  Servers servers;
  auto grpc = gpu_worker::GenerationServer::Start(std::move(scheduler),
                                                  server_options);
  if (!grpc.ok()) return UsageOrFailure(grpc.status());
  servers.grpc = *std::move(grpc);
  if (absl::Status ok = StartSideServers(servers, *m->tokenizer,
                                         *std::move(http_options), *metrics);
      !ok.ok()) {
    metrics->set_scheduler(nullptr);
    servers.Abort();
    return UsageOrFailure(ok);
  }
  SetGrpcLogStarting(false);  // started: gRPC's errors are news now
  serve_log->Start(&servers.grpc->scheduler());
  ServeUntilStopped(servers, *metrics);
  serve_log->Stop();  // before the scheduler it reads goes
  return 0;
}

}  // namespace

const Command& ServeCommand() {
  static const Command* command = new Command{
      "serve",
      "Serves the Worker gRPC generation API (proto/worker.proto) and "
      "grpc.health.v1 on --listen, and with --http_listen the "
      "OpenAI-compatible HTTP API over the same batches: token streams to "
      "many clients, --max_batch sequences decoded together. Health is "
      "NOT_SERVING while a remote --kv_service does not answer its "
      "heartbeats (about once a second; the service infinigen.worker.Liveness "
      "stays SERVING), SERVING again once it does. SIGTERM or SIGINT stops "
      "taking requests, lets streams finish for --drain_timeout, exits 0.",
      WithServingFlags({"model", "tokenizer", "listen", "http_listen",
                        "tls_cert", "tls_key", "tls_client_ca",
                        "served_model_name", "api_key_file", "chat_template",
                        "metrics_listen", "max_batch", "max_queue",
                        "max_prefills_per_step", "kv_down_wait",
                        "http_max_connections",
                        "drain_timeout", "calibration_tokens",
                        "log_interval", "log_requests",
                        "max_seq_len"}),
      RunServe};
  return *command;
}

}  // namespace infinigen::commands
