#include "kv_memory_service/server/kv_server.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/address.h"
#include "common/log.h"
#include "common/server_tls.h"
#include "common/status.h"
#include "grpc/grpc.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"
#include "kv_memory_service/tcp/fetch_socket_server.h"
#include "kv_memory_service/server/kv_service.h"
#include "kv_memory_service/rdma/rdma_server.h"
#include "kv_memory_service/shm/shm_server.h"

namespace infinigen::kv_memory_service {

// The unary calls running now. A call counts from when its handler thread
// takes it up until its reply is sent. The drain waits for none to be
// running, and none to start for kQuiet after that: a call the server took
// just before the drain began may still be on its way to a handler thread.
class InFlightCalls {
 public:
  static constexpr absl::Duration kQuiet = absl::Milliseconds(50);

  void Enter() {
    absl::MutexLock lock(&mu_);
    ++running_;
  }
  void Leave() {
    absl::MutexLock lock(&mu_);
    --running_;
  }

  // True once none is running and none started for kQuiet; false at
  // `deadline` with calls still running.
  bool AwaitNone(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto none = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return running_ == 0;
    };
    auto some = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return running_ > 0;
    };
    while (true) {
      if (!mu_.AwaitWithDeadline(absl::Condition(&none), deadline)) {
        return false;
      }
      if (!mu_.AwaitWithDeadline(absl::Condition(&some),
                                 std::min(deadline, absl::Now() + kQuiet))) {
        return true;
      }
    }
  }

 private:
  absl::Mutex mu_;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
};

namespace {

// Counts each unary call, every service's, in an InFlightCalls while it
// lives (gRPC destroys a call's interceptors once its reply is sent).
// Streams are not counted: the drain ends them.
class CountingInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit CountingInterceptor(InFlightCalls* calls) : calls_(calls) {
    calls_->Enter();
  }
  ~CountingInterceptor() override { calls_->Leave(); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  InFlightCalls* const calls_;
};

class CountingInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CountingInterceptorFactory(InFlightCalls* calls) : calls_(calls) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY) {
      return nullptr;
    }
    return new CountingInterceptor(calls_);
  }

 private:
  InFlightCalls* const calls_;
};

// Raises the soft limit on open descriptors to the hard one and returns
// it (shared rows hold descriptors); what getrlimit says where it cannot.
int64_t RaiseDescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return limit.rlim_cur == RLIM_INFINITY
             ? int64_t{1} << 20
             : static_cast<int64_t>(limit.rlim_cur);
}

}  // namespace

KvServer::KvServer() : calls_(std::make_unique<InFlightCalls>()) {}

absl::StatusOr<std::unique_ptr<KvServer>> KvServer::Start(
    const KvServerOptions& options) {
  IG_ASSIGN_OR_RETURN(const ListenAddress listen,
                      ParseListenAddress(options.listen));
  const bool unix_socket = listen.is_unix();
  const ServerTlsPem tls_pem{options.tls_cert_pem, options.tls_key_pem,
                             options.tls_client_ca_pem};
  IG_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                      GrpcServerCredentials(tls_pem));
  const bool tls = tls_pem.enabled();
  if (options.max_message_bytes < 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes must be at least 4096, got ",
        options.max_message_bytes));
  }
  if (options.store.max_sequences <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_sequences must be positive, got ", options.store.max_sequences));
  }
  if (options.store.lease_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease_timeout must not be negative, got ",
        absl::FormatDuration(options.store.lease_timeout)));
  }
  if (options.store.capacity_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "capacity_bytes must not be negative, got ",
        options.store.capacity_bytes));
  }

  std::unique_ptr<KvServer> server(new KvServer);
  KvStoreOptions store_options = options.store;
  if (!options.shm_listen.empty() && store_options.max_shared_sequences == 0) {
    // Readers on this host map a sequence's rows (one-sided reads over
    // shm): two descriptors a sequence, within a quarter of the process's
    // descriptor limit so that sockets never run short.
    store_options.max_shared_sequences =
        static_cast<int32_t>(std::min<int64_t>(store_options.max_sequences,
                                               RaiseDescriptorLimit() / 8));
  }
  server->store_ = std::make_shared<KvStore>(store_options);
  if (!unix_socket && options.fetch_port >= 0) {
    FetchSocketServerOptions fetch_options;
    fetch_options.host = options.listen.substr(0, options.listen.rfind(':'));
    if (fetch_options.host.size() > 2 && fetch_options.host.front() == '[') {
      fetch_options.host =
          fetch_options.host.substr(1, fetch_options.host.size() - 2);
    }
    fetch_options.port = options.fetch_port;
    fetch_options.credentials = options.credentials;
    fetch_options.max_message_bytes = options.max_message_bytes;
    fetch_options.threads = options.fetch_threads;
    fetch_options.max_connections = options.fetch_max_connections;
    fetch_options.max_connections_per_peer =
        options.fetch_max_connections_per_peer;
    fetch_options.handshake_timeout = options.fetch_handshake_timeout;
    fetch_options.idle_timeout = options.fetch_idle_timeout;
    fetch_options.metrics = server->request_metrics_.get();
    if (tls) {
      IG_ASSIGN_OR_RETURN(fetch_options.tls, NewServerTlsContext(tls_pem));
    }
    absl::StatusOr<std::unique_ptr<FetchSocketServer>> fetch_server =
        FetchSocketServer::Start(server->store_, fetch_options);
    if (!fetch_server.ok()) return fetch_server.status();
    server->fetch_server_ = *std::move(fetch_server);
    server->fetch_port_ = server->fetch_server_->port();
  }
  server->service_ = std::make_unique<KvMemoryService>(
      server->store_, options.credentials, options.max_message_bytes,
      server->fetch_port_, tls, server->request_metrics_.get());

  if (!options.rdma_device.empty()) {
    RdmaServerOptions rdma_options;
    rdma_options.device = options.rdma_device == "any" ? "" : options.rdma_device;
    rdma_options.credentials = options.credentials;
    rdma_options.metrics = server->request_metrics_.get();
    absl::StatusOr<std::unique_ptr<RdmaServer>> rdma =
        RdmaServer::Start(server->store_, rdma_options);
    if (!rdma.ok()) return rdma.status();
    server->rdma_server_ = *std::move(rdma);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, credentials, &port);
  builder.RegisterService(server->service_.get());
  if (server->rdma_server_ != nullptr) {
    builder.RegisterService(server->rdma_server_->service());
  }
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  // A second server on the same port must fail, not share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients send keepalive pings to notice a dead or hung server; allow them.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  std::vector<std::unique_ptr<
      grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(
      std::make_unique<CountingInterceptorFactory>(server->calls_.get()));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || port == 0) {
    const std::string why = WhyNotListening(options.listen);
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on '", options.listen, "': ",
        why.empty() ? "the address is taken or not allowed" : why));
  }
  server->server_->GetHealthCheckService()->SetServingStatus(true);
  if (unix_socket) {
    server->client_address_ = options.listen;
  } else {
    server->port_ = port;
    const std::string host = options.listen.substr(0, options.listen.rfind(':'));
    const bool any = host == "0.0.0.0" || host == "[::]";
    server->client_address_ =
        absl::StrCat("tcp://", any ? "127.0.0.1" : host, ":", port);
  }
  if (!options.shm_listen.empty()) {
    ShmServerOptions shm_options;
    shm_options.listen_address = options.shm_listen;
    shm_options.control_address = server->client_address_;
    shm_options.credentials = options.credentials;
    shm_options.max_client_slot_bytes = options.shm_max_client_bytes;
    shm_options.max_total_slot_bytes = options.shm_max_total_bytes;
    shm_options.metrics = server->request_metrics_.get();
    absl::StatusOr<std::unique_ptr<ShmServer>> shm =
        ShmServer::Start(server->store_, shm_options);
    if (!shm.ok()) return shm.status();
    server->shm_server_ = *std::move(shm);
    server->shm_client_address_ = server->shm_server_->client_address();
  }
  if (options.store.lease_timeout > absl::ZeroDuration()) {
    KvServer* raw = server.get();
    server->lease_thread_ = std::thread([raw] { raw->ExpireLeases(); });
  }
  IG_LOG(INFO) << "kv_memory_server: listening on " << options.listen
               << " (clients: " << server->client_address_ << "), eviction "
               << EvictionPolicyName(options.store.eviction) << ", capacity "
               << (options.store.capacity_bytes == 0
                       ? std::string("unlimited")
                       : absl::StrCat(options.store.capacity_bytes, " bytes"))
               << ", auth "
               << (options.credentials.empty()
                       ? std::string("off")
                       : absl::StrCat("on (", options.credentials.size(),
                                      " credentials)"))
               << ", TLS "
               << (!tls                                ? "off"
                   : options.tls_client_ca_pem.empty() ? "on"
                                                       : "on (mutual)")
               << ", fetch socket "
               << (server->fetch_port_ == 0
                       ? std::string("off")
                       : absl::StrCat("port ", server->fetch_port_,
                                      tls ? " (TLS)" : ""))
               << ", lease "
               << (options.store.lease_timeout > absl::ZeroDuration()
                       ? absl::FormatDuration(options.store.lease_timeout)
                       : std::string("off"));
  return server;
}

FetchSocketStats KvServer::fetch_socket_stats() const {
  return fetch_server_ == nullptr ? FetchSocketStats{}
                                  : fetch_server_->GetStats();
}

KvServer::~KvServer() {
  if (server_ != nullptr) {
    Shutdown(absl::ZeroDuration());
    Wait();
  }
  StopLeases();
}

void KvServer::ExpireLeases() {
  // A tenth of the lease: a dead client's rows are freed within 1.1 leases.
  const absl::Duration period =
      std::clamp(store_->options().lease_timeout / 10, absl::Milliseconds(20),
                 absl::Seconds(1));
  while (true) {
    {
      absl::MutexLock lock(&lease_mu_);
      if (lease_mu_.AwaitWithTimeout(absl::Condition(&leases_stopped_),
                                     period)) {
        return;
      }
    }
    for (const ExpiredSession& e : store_->ExpireSessions()) {
      IG_LOG(INFO) << "kv_memory_server: session " << e.session
                   << " expired (no heartbeat for "
                   << absl::FormatDuration(
                          absl::Trunc(e.idle, absl::Milliseconds(1)))
                   << "): closed " << e.sequences << " sequences, "
                   << "released their " << e.bytes_freed
                   << " reserved bytes"
                   << (e.shared > 0
                           ? absl::StrCat("; ", e.shared,
                                          " of them had their rows mapped by "
                                          "the client, whose pages stay "
                                          "pinned (pinned_bytes) until it "
                                          "lets them go")
                           : "");
    }
  }
}

void KvServer::StopLeases() {
  {
    absl::MutexLock lock(&lease_mu_);
    leases_stopped_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
}

std::shared_ptr<grpc::Channel> KvServer::InProcessChannel() {
  grpc::ChannelArguments args;
  return server_->InProcessChannel(args);
}

void KvServer::Shutdown(absl::Duration grace) {
  const absl::Time deadline = absl::Now() + grace;
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  // Clients cannot renew while the server drains; nothing expires now.
  StopLeases();
  // Shared-memory clients see their socket close: waits fail Unavailable.
  shm_server_.reset();
  server_->GetHealthCheckService()->SetServingStatus(false);
  service_->CancelStreams();
  if (fetch_server_ != nullptr) fetch_server_->Stop();
  // No new call or connection from here (gRPC's own shutdown, begun
  // without waiting; grpc::Server::Shutdown below joins it): clients get a
  // GOAWAY, new calls UNAVAILABLE.
  grpc_completion_queue* shutdown_cq =
      grpc_completion_queue_create_for_pluck(nullptr);
  int shutdown_tag = 0;
  grpc_server_shutdown_and_notify(server_->c_server(), shutdown_cq,
                                  &shutdown_tag);
  // The unary calls in flight finish (up to the grace). Then nothing is
  // left but what idles: open channels, whose clients would read the
  // GOAWAY only at their next call (a heartbeat, up to a second away; a
  // client that calls nothing, never), and streams such as a health Watch.
  // grpc::Server::Shutdown waits for those until its deadline, so its
  // deadline is now: it cancels them and closes every connection.
  if (!calls_->AwaitNone(deadline) && grace > absl::ZeroDuration()) {
    IG_LOG(WARNING) << "kv_memory_server: calls still running after the "
                    << absl::FormatDuration(grace)
                    << " drain; cancelling them";
  }
  server_->Shutdown(std::chrono::system_clock::now());
  // Done: our notification is in (gRPC notifies every shutdown at once).
  grpc_completion_queue_pluck(shutdown_cq, &shutdown_tag,
                              gpr_inf_future(GPR_CLOCK_REALTIME), nullptr);
  grpc_completion_queue_shutdown(shutdown_cq);
  grpc_completion_queue_destroy(shutdown_cq);
}

void KvServer::Wait() { server_->Wait(); }

}  // namespace infinigen::kv_memory_service
