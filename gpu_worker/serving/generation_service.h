// The GPU worker's generation API on the network.
//
// GenerationService is the Worker gRPC service (proto/worker.proto) over a
// GenerationScheduler, and the only place where absl::Status becomes
// grpc::Status: it converts the request, submits it, and writes the
// stream's tokens as the scheduler produces them. A client that goes away
// (cancelled call, failed write) cancels its stream, which frees its
// sequence slot.
//
// GenerationServer is a running `infinigen serve`: it owns the scheduler,
// the service, the standard grpc.health.v1 service and the gRPC server
// listening on a TCP port or a unix socket (or in-process only, for tests).
//
// Health. The server-wide status ("") and the Worker service's status are
// what a readiness probe reads: SERVING while the server takes requests and
// its dependency (options.dependency_health: `serve` passes its KV memory
// node's KvClient::Health) answers; NOT_SERVING while the dependency fails
// (polled every health_poll_interval, each flip logged once) and from
// Shutdown on. kLivenessService stays SERVING until Shutdown whatever the
// dependency says: a liveness probe reads it, so that a memory node outage
// takes workers out of rotation without restarting them.
//
// Thread-safe: gRPC calls the service from many threads; Shutdown and Wait
// may be called from any thread.
#ifndef INFINIGEN_GPU_WORKER_SERVING_GENERATION_SERVICE_H_
#define INFINIGEN_GPU_WORKER_SERVING_GENERATION_SERVICE_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/server_tls.h"
#include "gpu_worker/serving/generation_scheduler.h"
#include "grpcpp/channel.h"
#include "grpcpp/server.h"
#include "proto/worker.grpc.pb.h"

namespace infinigen::gpu_worker {

class GenerationService final : public worker::Worker::Service {
 public:
  // `scheduler` is not owned and outlives the service.
  // `api_key` not empty: every call must carry the metadata
  // "authorization: Bearer <api_key>" (else UNAUTHENTICATED).
  explicit GenerationService(GenerationScheduler* scheduler,
                             std::string api_key = "")
      : scheduler_(scheduler), api_key_(std::move(api_key)) {}

  grpc::Status Generate(
      grpc::ServerContext* ctx, const worker::GenerateRequest* request,
      grpc::ServerWriter<worker::GenerateResponse>* writer) override;

 private:
  GenerationScheduler* const scheduler_;
  const std::string api_key_;
};

struct GenerationServerOptions {
  // "HOST:PORT" (port 0 picks a free one; see GenerationServer::port),
  // "unix:PATH", or empty: no listening socket, InProcessChannel only.
  std::string listen;
  // Whether what the server needs besides itself (the KV memory node)
  // works: OK, or why not. Called from the server's health thread, so it
  // must be cheap and thread-safe. Null: nothing to check.
  std::function<absl::Status()> dependency_health;
  // Not empty: the key every Worker call must carry (GenerationService).
  std::string api_key;
  // TLS on `listen` when tls.enabled() (mutual when tls.mutual()); the
  // in-process channel stays plaintext.
  ServerTlsPem tls;
  // How often dependency_health is polled.
  absl::Duration health_poll_interval = absl::Milliseconds(250);
};

class GenerationServer {
 public:
  // The grpc.health.v1 service name a liveness probe reads (see above).
  static constexpr char kLivenessService[] = "infinigen.worker.Liveness";

  // Serves `scheduler` (which it owns; the caller Starts it, before or
  // after). InvalidArgument for a malformed listen address or half a TLS
  // configuration; Unavailable when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<GenerationServer>> Start(
      std::unique_ptr<GenerationScheduler> scheduler,
      const GenerationServerOptions& options);
  ~GenerationServer();  // Shutdown(absl::ZeroDuration()) and Wait

  // The bound TCP port (0 for a unix socket or in-process only).
  int port() const { return port_; }
  // A channel to this server inside this process.
  std::shared_ptr<grpc::Channel> InProcessChannel();
  GenerationScheduler& scheduler() { return *scheduler_; }
  // What the health service reports for "" and the Worker service now.
  bool serving() const;

  // Marks the health service NOT_SERVING, stops taking requests (new calls
  // get UNAVAILABLE), lets queued and active generations finish for up to
  // `grace`, ends the rest with UNAVAILABLE, then stops the gRPC server.
  void Shutdown(absl::Duration grace);
  // Blocks until the server has shut down.
  void Wait();

 private:
  GenerationServer() = default;

  // Polls dependency_health until Shutdown, publishing each change.
  void WatchHealth();
  // Checks the dependency and publishes the result, logging a change.
  void UpdateHealth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(health_mu_);
  void StopHealthThread();

  std::unique_ptr<GenerationScheduler> scheduler_;
  std::unique_ptr<GenerationService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::function<absl::Status()> dependency_health_;
  absl::Duration health_poll_interval_;

  mutable absl::Mutex health_mu_;
  bool serving_ ABSL_GUARDED_BY(health_mu_) = false;
  bool published_ ABSL_GUARDED_BY(health_mu_) = false;  // serving_ is set
  bool shut_down_ ABSL_GUARDED_BY(health_mu_) = false;
  std::thread health_thread_;  // joinable while dependency_health is polled
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_GENERATION_SERVICE_H_
