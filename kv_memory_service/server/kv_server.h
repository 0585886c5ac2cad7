// KvServer: a running KV memory node. Owns a KvStore, the gRPC KvMemory
// service in front of it (kv_service.h), the standard grpc.health.v1
// service, and the gRPC server listening on a TCP port or a unix socket.
// When options.store.lease_timeout is set, a lease thread expires the
// sessions of clients that stopped renewing (KvStore::ExpireSessions),
// logging one line per expired session.
// kv_memory_server's main() is flags + Start + wait for a signal +
// Shutdown; tests start one in-process the same way.
//
// Thread-safe: the service runs on gRPC's threads; Shutdown and Wait may be
// called from any thread, Shutdown more than once.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVER_KV_SERVER_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVER_KV_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/server.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/serving/credentials.h"
#include "kv_memory_service/serving/request_metrics.h"
#include "kv_memory_service/tcp/fetch_socket_server.h"

namespace infinigen::kv_memory_service {

class KvMemoryService;  // kv_service.h

class InFlightCalls;  // kv_server.cc
class ShmServer;   // kv_memory_service/shm/shm_server.h
class RdmaServer;  // kv_memory_service/rdma/rdma_server.h

struct KvServerOptions {
  // "HOST:PORT" (port 0 picks a free one; see KvServer::port) or
  // "unix:PATH".
  std::string listen = "127.0.0.1:7070";
  KvStoreOptions store;
  // Requests must carry "authorization: Bearer TOKEN" of one of these
  // (each its prefix namespace; credentials.h); empty = no check. Health
  // checks never need it.
  Credentials credentials;
  // Largest gRPC message either way. Larger requests are rejected by gRPC
  // with RESOURCE_EXHAUSTED, fetches whose rows would not fit by the
  // service with the same code.
  int32_t max_message_bytes = 64 << 20;
  // TCP listen only: the port of the plain-socket fetch endpoint on the
  // same host (tcp/fetch_wire.h), which tcp:// clients use for fetches
  // instead of the gRPC stream. 0 = any free port, -1 = none.
  int fetch_port = 0;
  // The fetch endpoint's event-loop threads, connection limits (past the
  // Hello, in all and per peer address) and timeouts
  // (FetchSocketServerOptions).
  // gRPC over TLS when tls_cert_pem is set: the server's certificate chain
  // and private key (PEM). With tls_client_ca_pem too, clients must present
  // a certificate that CA signed (mutual TLS). The fetch socket then speaks
  // TLS with the same certificate and client CA, and GetServerInfo
  // advertises it as fetch_tls_port.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  std::string tls_client_ca_pem;
  int32_t fetch_threads = 2;
  int32_t fetch_max_connections = 1024;
  int32_t fetch_max_connections_per_peer = 256;
  absl::Duration fetch_handshake_timeout = absl::Seconds(5);
  absl::Duration fetch_idle_timeout = absl::Minutes(10);
  // "unix:PATH": also serve the shared-memory data plane there (clients
  // connect to shm:unix:PATH; control calls come to `listen`). Empty = off.
  std::string shm_listen;
  // shm: most bytes of fetch-buffer slots one client, and all clients
  // together, may have mapped (ShmServerOptions).
  int64_t shm_max_client_bytes = int64_t{4} << 30;
  int64_t shm_max_total_bytes = int64_t{16} << 30;
  // Also serve the RDMA data plane (clients connect to rdma://HOST:PORT of
  // `listen`) on this ibverbs device, or on the first with an active port
  // for "any". Empty = off. Start fails with Unavailable("no RDMA device:
  // ...") where there is none.
  std::string rdma_device;
};

class KvServer {
 public:
  // InvalidArgument for an empty or malformed listen address; Unavailable
  // when the address cannot be bound (in use, no permission).
  static absl::StatusOr<std::unique_ptr<KvServer>> Start(
      const KvServerOptions& options);
  ~KvServer();  // Shutdown(absl::ZeroDuration()) and Wait

  // The bound TCP port (0 for a unix socket).
  int port() const { return port_; }
  // The fetch socket's port (0 when there is none; under TLS it speaks TLS).
  int fetch_port() const { return fetch_port_; }
  // What the fetch socket holds and has refused (zeros when there is none).
  FetchSocketStats fetch_socket_stats() const;
  // What a client passes to ConnectKvClient: tcp://HOST:PORT or unix:PATH.
  const std::string& client_address() const { return client_address_; }
  // shm:unix:PATH when serving the shm data plane, else empty.
  const std::string& shm_client_address() const { return shm_client_address_; }
  // A channel to this server inside this process (tests).
  std::shared_ptr<grpc::Channel> InProcessChannel();
  KvStore& store() { return *store_; }
  // Every plane's per-request metrics (latency, bytes, refusals), for
  // /metrics; they live as long as the server.
  std::shared_ptr<prometheus::Collectable> request_metrics() const {
    return request_metrics_->registry();
  }
  // Bytes of K/V rows every plane served by `op` so far.
  double ServedBytes(RequestOp op) const {
    return request_metrics_->ServedBytes(op);
  }

  // The drain. Stops accepting calls and connections (new calls get
  // UNAVAILABLE), marks the health service NOT_SERVING, disconnects the
  // shared-memory clients, closes the fetch socket's connections and ends
  // the fetch streams (their clients see UNAVAILABLE); lets the unary calls
  // in flight finish for up to `grace`; then, as soon as none is running
  // (or at `grace`), cancels whatever is left and closes every connection.
  // What is left then is idle: a client's open channel, a health Watch
  // stream. An idle node is down at once, whatever its clients keep open:
  // a gRPC client reads the server's GOAWAY only when it next calls, so
  // waiting for idle channels to go by themselves would wait on clients.
  // Returns once the server is down. A second call does nothing.
  void Shutdown(absl::Duration grace);
  // Blocks until the server has shut down.
  void Wait();

 private:
  KvServer();

  // The lease thread: expires sessions until StopLeases.
  void ExpireLeases();
  void StopLeases();

  // First, so that every plane holding a pointer to it is gone before it.
  const std::unique_ptr<RequestMetrics> request_metrics_ =
      std::make_unique<RequestMetrics>();
  // The unary gRPC calls running now, every service (counted by a server
  // interceptor; kv_server.cc), for the drain. Outlives server_.
  const std::unique_ptr<InFlightCalls> calls_;
  std::shared_ptr<KvStore> store_;
  std::unique_ptr<KvMemoryService> service_;
  std::unique_ptr<RdmaServer> rdma_server_;  // its service outlives server_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  int fetch_port_ = 0;
  std::unique_ptr<FetchSocketServer> fetch_server_;
  std::string client_address_;
  std::string shm_client_address_;
  std::unique_ptr<ShmServer> shm_server_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;

  absl::Mutex lease_mu_;
  bool leases_stopped_ ABSL_GUARDED_BY(lease_mu_) = false;
  std::thread lease_thread_;  // joinable while leases are on
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVER_KV_SERVER_H_
