// kv_memory_server: the KV memory node as a process.
//
//   kv_memory_server --listen=127.0.0.1:7070 --capacity_bytes=8000000000
//       --eviction=counter --auth_token_file=/run/secrets/kv_token
//
// Sequences belong to client sessions with a lease (--lease_timeout) that
// clients renew with heartbeats; a session that stops renewing has its
// sequences closed and their rows freed.
//
// Serves KvMemory and grpc.health.v1 until SIGTERM or SIGINT, then stops
// taking calls, lets calls in flight finish for --drain_timeout, and exits
// 0: at once when none is running, whatever connections and streams its
// clients keep open (those are closed). Bad flags exit 2 (1 for a flag absl
// itself rejects) with one line on stderr; a listen failure exits 1.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/flag_check.h"
#include "common/grpc_log.h"
#include "common/address.h"
#include "common/file.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/server_tls.h"
#include "kv_memory_service/server/node_log.h"
#include "kv_memory_service/server/kv_server.h"
#include "kv_memory_service/server/store_metrics.h"

ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT serving Prometheus metrics at /metrics (pool bytes and "
          "capacity, sequences, rows appended, fetched and evicted; per data "
          "plane: fetch and append latency, bytes served, requests refused "
          "by status); empty: none.");

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "HOST:PORT to listen on (port 0 picks a free one), or unix:PATH.");
ABSL_FLAG(int64_t, capacity_bytes, 0,
          "Most bytes of K/V rows all open sequences may reserve together; "
          "0 = unlimited. OpenSequence beyond it is RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, prefix_cache_bytes, int64_t{1} << 30,
          "Most bytes of shared prefix blocks held for reuse across "
          "requests and clients (KV rows of prompt prefixes, each counted "
          "once), on top of --capacity_bytes; least recently used blocks "
          "no sequence uses are dropped first. 0 = no prefix reuse.");
ABSL_FLAG(std::string, eviction, "lru",
          "What a full (layer, KV head) of a sequence drops before taking a "
          "new token: fifo, lru or counter.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the tokens clients may send (authorization: Bearer "
          "TOKEN), one per line as 'TOKEN [NAMESPACE [read-only]]': prefix "
          "blocks published under a credential are attached only under one "
          "of the same namespace (a bare token: the default one), and a "
          "read-only credential attaches and never publishes. Requests "
          "without a listed token get UNAUTHENTICATED. Empty = no auth.");
ABSL_FLAG(int32_t, max_message_bytes, 64 << 20,
          "Largest gRPC message either way (appends, fetch responses).");
ABSL_FLAG(int32_t, max_sequences, 1024, "Most sequences open at once.");
ABSL_FLAG(int32_t, gather_threads, 0,
          "Threads that share one large fetch's gather (over 1 MiB of rows), "
          "the serving thread included: 0 = one per core (at most 8), "
          "1 = the serving thread alone.");
ABSL_FLAG(int32_t, fetch_port, 0,
          "With a TCP --listen: the port of the socket fetch endpoint on "
          "the same host, which tcp:// clients use for fetches (faster than "
          "the gRPC stream); under --tls_cert it speaks TLS. 0 = any free "
          "port, -1 = none.");
ABSL_FLAG(int32_t, fetch_threads, 2,
          "Event-loop threads serving every fetch socket connection.");
ABSL_FLAG(int32_t, fetch_max_connections, 1024,
          "Most fetch socket connections past their Hello; more are "
          "refused (RESOURCE_EXHAUSTED).");
ABSL_FLAG(int32_t, fetch_max_connections_per_peer, 256,
          "Most fetch socket connections from one peer address.");
ABSL_FLAG(absl::Duration, fetch_handshake_timeout, absl::Seconds(5),
          "A fetch connection that has not completed its Hello (and, under "
          "--tls_cert, its TLS handshake) by then is closed (at most 64 "
          "wait at once, the oldest dropped first).");
ABSL_FLAG(absl::Duration, fetch_idle_timeout, absl::Minutes(10),
          "A fetch connection silent either way this long is closed (the "
          "client reconnects); 0 = never.");
ABSL_FLAG(absl::Duration, log_interval, absl::Seconds(10),
          "While serving, log the sequences, sessions and bytes held and the "
          "fetch and append bandwidth this often (only when something "
          "changed); 0: never.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(5),
          "On SIGTERM, how long calls in flight may take to finish; open "
          "connections and streams are closed, not waited for.");
ABSL_FLAG(std::string, shm_listen, "",
          "unix:PATH: also serve the shared-memory data plane (same-host "
          "clients connect to shm:unix:PATH; control calls use --listen). "
          "Empty = off.");
ABSL_FLAG(int64_t, shm_max_client_bytes, int64_t{4} << 30,
          "With --shm_listen: most bytes of fetch-buffer slots one client may "
          "have mapped; a buffer beyond it is RESOURCE_EXHAUSTED. Slots cost "
          "the server memory only as it writes them.");
ABSL_FLAG(int64_t, shm_max_total_bytes, int64_t{16} << 30,
          "With --shm_listen: most bytes of slots all clients together may "
          "have mapped.");
ABSL_FLAG(int32_t, shm_max_pinned_sequences, 64,
          "With --shm_listen: most closed sequences whose rows one client "
          "session may keep mapped or held (one-sided reads); mapping the "
          "rows of another sequence beyond it is RESOURCE_EXHAUSTED. Such "
          "rows count against --capacity_bytes until released either way.");
ABSL_FLAG(int32_t, shm_spare_rows, 1,
          "With --shm_listen: closed sequences per client session whose "
          "shared rows the node keeps for the session's next sequence of the "
          "same size, so that a worker that kept them mapped and registered "
          "with its GPU does neither again. They count against "
          "--capacity_bytes until reused, and go when the session ends or "
          "another sequence needs the room. 0 = rows leave at the close.");
ABSL_FLAG(std::string, rdma_device, "",
          "Also serve the RDMA data plane (clients connect to "
          "rdma://HOST:PORT of --listen) on this ibverbs device, or on the "
          "first one with an active port for \"any\". Empty = off. Fails "
          "with \"no RDMA device\" where there is none.");
ABSL_FLAG(absl::Duration, lease_timeout, absl::Seconds(10),
          "How long a client session lives without a heartbeat (clients "
          "renew every third of it, and at least once a second). When it "
          "runs out (the worker died or "
          "was cut off) its sequences are closed and their rows freed; the "
          "client then gets NOT_FOUND for them. Keep it above the workers' "
          "fetch timeout (5s). 0 = never expire.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM file: serve gRPC over TLS with this certificate chain (needs "
          "--tls_key). The fetch socket (--fetch_port) then speaks TLS "
          "with the same certificate, and client CA.");
ABSL_FLAG(std::string, tls_key, "", "PEM file: the private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM file: with --tls_cert, require every client to present a "
          "certificate this CA signed (mutual TLS; counts as auth for a "
          "non-loopback listen).");
ABSL_FLAG(bool, allow_insecure, false,
          "Listen on a non-loopback address without --auth_token_file. "
          "Without it the server refuses: every host that reaches such a "
          "port could read and close every sequence.");
ABSL_FLAG(std::string, ready_file, "",
          "If set, once listening, write the address clients should use "
          "(tcp://HOST:PORT or unix:PATH) to this file.");

namespace infinigen::kv_memory_service {
namespace {

constexpr int kExitUsage = 2;
constexpr int kExitFailure = 1;

const char kSummary[] =
    "kv_memory_server: the KV memory node. Holds the KV cache of many "
    "sequences and answers index-based fetches (gRPC KvMemory service, plus "
    "grpc.health.v1).";

std::string Usage() {
  std::string s = absl::StrFormat(
      "%s\n\nUsage: kv_memory_server [--flag=value ...]\n\nFlags:\n", kSummary);
  for (const char* name :
       {"listen", "capacity_bytes", "prefix_cache_bytes", "eviction",
        "auth_token_file",
        "max_message_bytes", "max_sequences", "gather_threads", "fetch_port",
        "fetch_threads",
        "fetch_max_connections", "fetch_max_connections_per_peer",
        "fetch_handshake_timeout", "fetch_idle_timeout", "drain_timeout",
        "log_interval",
        "shm_listen", "shm_max_client_bytes", "shm_max_total_bytes",
        "shm_max_pinned_sequences", "shm_spare_rows",
        "rdma_device", "lease_timeout", "tls_cert", "tls_key",
        "tls_client_ca", "allow_insecure",
        "ready_file", "metrics_listen"}) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    s += absl::StrFormat("  --%s (default: \"%s\")\n      %s\n", name,
                         flag->DefaultValue(), flag->Help());
  }
  return s;
}

// Whether clients can reach `listen` only from this host: a unix socket, or
// a HOST:PORT whose host is or resolves only to loopback addresses.
bool LoopbackOnly(const std::string& listen) {
  if (absl::StartsWith(listen, "unix:")) return true;
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) return false;  // ":PORT" is every interface
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool loopback = found != nullptr;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      loopback &= (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      loopback &= IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) != 0;
    } else {
      loopback = false;
    }
  }
  freeaddrinfo(found);
  return loopback;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "kv_memory_server: %s\n", message.c_str());
  return kExitUsage;
}

int Run() {
  KvServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.fetch_port = absl::GetFlag(FLAGS_fetch_port);
  if (options.fetch_port < -1 || options.fetch_port > 65535) {
    return UsageError(absl::StrCat("--fetch_port must be -1..65535, got ",
                                   options.fetch_port));
  }
  options.fetch_threads = absl::GetFlag(FLAGS_fetch_threads);
  options.fetch_max_connections = absl::GetFlag(FLAGS_fetch_max_connections);
  options.fetch_max_connections_per_peer =
      absl::GetFlag(FLAGS_fetch_max_connections_per_peer);
  options.fetch_handshake_timeout =
      absl::GetFlag(FLAGS_fetch_handshake_timeout);
  options.fetch_idle_timeout = absl::GetFlag(FLAGS_fetch_idle_timeout);
  if (options.fetch_threads < 1 || options.fetch_max_connections < 1 ||
      options.fetch_max_connections_per_peer < 1 ||
      options.fetch_handshake_timeout <= absl::ZeroDuration() ||
      options.fetch_idle_timeout < absl::ZeroDuration()) {
    return UsageError(
        "--fetch_threads, --fetch_max_connections, "
        "--fetch_max_connections_per_peer and --fetch_handshake_timeout must "
        "be positive, --fetch_idle_timeout not negative");
  }
  options.shm_listen = absl::GetFlag(FLAGS_shm_listen);
  options.rdma_device = absl::GetFlag(FLAGS_rdma_device);
  options.shm_max_client_bytes = absl::GetFlag(FLAGS_shm_max_client_bytes);
  options.shm_max_total_bytes = absl::GetFlag(FLAGS_shm_max_total_bytes);
  if (options.shm_max_client_bytes <= 0 || options.shm_max_total_bytes <= 0) {
    return UsageError("--shm_max_client_bytes and --shm_max_total_bytes must "
                      "be positive");
  }
  options.store.max_pinned_sequences =
      absl::GetFlag(FLAGS_shm_max_pinned_sequences);
  if (options.store.max_pinned_sequences < 0) {
    return UsageError("--shm_max_pinned_sequences must not be negative");
  }
  options.store.spare_rows_per_session = absl::GetFlag(FLAGS_shm_spare_rows);
  if (options.store.spare_rows_per_session < 0) {
    return UsageError("--shm_spare_rows must not be negative");
  }
  options.store.capacity_bytes = absl::GetFlag(FLAGS_capacity_bytes);
  options.store.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  options.store.gather_threads = absl::GetFlag(FLAGS_gather_threads);
  if (options.store.gather_threads < 0 || options.store.gather_threads > 64) {
    return UsageError(absl::StrCat("--gather_threads must be in [0, 64], got ",
                                   options.store.gather_threads));
  }
  options.store.prefix_cache_bytes = absl::GetFlag(FLAGS_prefix_cache_bytes);
  if (options.store.prefix_cache_bytes < 0) {
    return UsageError("--prefix_cache_bytes must not be negative");
  }
  absl::StatusOr<EvictionPolicy> eviction =
      ParseEvictionPolicy(absl::GetFlag(FLAGS_eviction));
  if (!eviction.ok()) {
    return UsageError(absl::StrCat("--eviction: ", eviction.status().message()));
  }
  options.store.eviction = *eviction;
  options.store.lease_timeout = absl::GetFlag(FLAGS_lease_timeout);
  if (options.store.lease_timeout < absl::ZeroDuration()) {
    return UsageError("--lease_timeout must not be negative");
  }
  if (absl::GetFlag(FLAGS_log_interval) < absl::ZeroDuration()) {
    return UsageError("--log_interval must not be negative");
  }
  if (absl::GetFlag(FLAGS_drain_timeout) < absl::ZeroDuration()) {
    return UsageError("--drain_timeout must not be negative");
  }
  const std::string token_file = absl::GetFlag(FLAGS_auth_token_file);
  if (!token_file.empty()) {
    absl::StatusOr<std::string> text = ReadFileToString(token_file);
    absl::StatusOr<Credentials> credentials =
        text.ok() ? Credentials::Parse(*text, token_file)
                  : absl::StatusOr<Credentials>(text.status());
    if (!credentials.ok()) {
      return UsageError(absl::StrCat("--auth_token_file: ",
                                     credentials.status().message()));
    }
    options.credentials = *std::move(credentials);
  }
  absl::StatusOr<ServerTlsPem> tls = ReadServerTlsFiles(
      absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
      absl::GetFlag(FLAGS_tls_client_ca));
  if (!tls.ok()) return UsageError(std::string(tls.status().message()));
  options.tls_cert_pem = std::move(tls->cert);
  options.tls_key_pem = std::move(tls->key);
  options.tls_client_ca_pem = std::move(tls->client_ca);
  if (absl::StatusOr<ListenAddress> listen = ParseListenAddress(options.listen);
      !listen.ok()) {
    return UsageError(absl::StrCat("--listen: ", listen.status().message()));
  }
  if (options.credentials.empty() && options.tls_client_ca_pem.empty() &&
      !absl::GetFlag(FLAGS_allow_insecure) && !LoopbackOnly(options.listen)) {
    return UsageError(absl::StrCat(
        "refusing to listen on non-loopback '", options.listen,
        "' without --auth_token_file or --tls_client_ca: any host that "
        "reaches it could read and close every sequence (pass "
        "--allow_insecure to do it anyway)"));
  }

  // Every thread gRPC starts inherits this mask, so only sigwait below sees
  // SIGTERM and SIGINT.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // A failed start is this binary's one line, not gRPC's dump before it.
  RouteGrpcLogs(/*starting=*/true);
  absl::StatusOr<std::unique_ptr<KvServer>> server = KvServer::Start(options);
  SetGrpcLogStarting(false);
  if (!server.ok()) {
    const bool usage = server.status().code() == absl::StatusCode::kInvalidArgument;
    std::fprintf(stderr, "kv_memory_server: %s\n",
                 std::string(server.status().message()).c_str());
    return usage ? kExitUsage : kExitFailure;
  }
  std::unique_ptr<MetricsServer> metrics_server;
  if (const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
      !metrics_listen.empty()) {
    auto started = MetricsServer::Start(
        metrics_listen,
        {std::shared_ptr<prometheus::Collectable>(
             std::make_shared<StoreMetrics>(&(*server)->store())),
         (*server)->request_metrics()});
    if (!started.ok()) {
      std::fprintf(stderr, "kv_memory_server: %s\n",
                   std::string(started.status().message()).c_str());
      (*server)->Shutdown(absl::ZeroDuration());
      (*server)->Wait();
      return started.status().code() == absl::StatusCode::kInvalidArgument
                 ? kExitUsage
                 : kExitFailure;
    }
    metrics_server = *std::move(started);
    IG_LOG(INFO) << "kv_memory_server: metrics on port "
                 << metrics_server->port();
  }
  const std::string ready_file = absl::GetFlag(FLAGS_ready_file);
  if (!ready_file.empty()) {
    // Written whole, then renamed, so a reader never sees half an address.
    const std::string tmp = ready_file + ".tmp";
    {
      std::ofstream out(tmp);
      out << (*server)->client_address() << "\n";
    }
    if (std::rename(tmp.c_str(), ready_file.c_str()) != 0) {
      std::fprintf(stderr, "kv_memory_server: cannot write --ready_file %s\n",
                   ready_file.c_str());
      return kExitFailure;
    }
  }

  // The periodic line, until the stop signal.
  absl::Notification stop_logging;
  std::thread logger;
  if (const absl::Duration every = absl::GetFlag(FLAGS_log_interval);
      every > absl::ZeroDuration()) {
    KvServer* s = server->get();
    logger = std::thread([s, every, &stop_logging] {
      StoreStats before = s->store().GetStoreStats();
      ServedBytes total{s->ServedBytes(RequestOp::kFetch),
                        s->ServedBytes(RequestOp::kAppend)};
      absl::Time since = absl::Now();
      while (!stop_logging.WaitForNotificationWithTimeout(every)) {
        const StoreStats now = s->store().GetStoreStats();
        const ServedBytes now_total{s->ServedBytes(RequestOp::kFetch),
                                    s->ServedBytes(RequestOp::kAppend)};
        const ServedBytes served{now_total.fetched - total.fetched,
                                 now_total.appended - total.appended};
        const absl::Time t = absl::Now();
        if (NodeWasBusy(now, before, served)) {
          IG_LOG(INFO) << NodeSummaryLine(now, before, served,
                                          absl::ToDoubleSeconds(t - since));
        }
        before = now;
        total = now_total;
        since = t;
      }
    });
  }
  int signal = 0;
  sigwait(&signals, &signal);
  stop_logging.Notify();
  if (logger.joinable()) logger.join();
  IG_LOG(INFO) << "kv_memory_server: " << (signal == SIGTERM ? "SIGTERM" : "SIGINT")
               << ", draining for up to "
               << absl::FormatDuration(absl::GetFlag(FLAGS_drain_timeout));
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  // Shutdown cancels what is still running at the deadline; a handler
  // that does not notice gets one more second, then the process ends
  // anyway: the drain is bounded whatever is in flight.
  std::thread([drain] {
    absl::SleepFor(drain + absl::Seconds(1));
    IG_LOG(WARNING) << "kv_memory_server: calls still running "
                    << absl::FormatDuration(drain + absl::Seconds(1))
                    << " after the signal; exiting without them";
    std::_Exit(kExitFailure);
  }).detach();
  (*server)->Shutdown(drain);
  (*server)->Wait();
  const StoreStats stats = (*server)->store().GetStoreStats();
  IG_LOG(INFO) << "kv_memory_server: stopped; served " << stats.fetches
               << " fetches (" << stats.fetched_rows << " rows), "
               << stats.appended_rows << " rows appended, "
               << stats.expired_sessions << " sessions expired ("
               << stats.expired_sequences << " sequences closed)";
  // Drained: out now, without the destructors. They would gain nothing
  // (the rows are not kept anywhere) and can take seconds: the metrics
  // server waits out a scraper's idle keep-alive connection (up to 5 s),
  // freeing the store touches every page of its rows, and grpc::Server's
  // destructor shuts the gRPC library down, joining its executor threads,
  // one of which may be parked for up to 10 s in the poller gRPC starts
  // after a write that filled a socket (a large fetch response, say).
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(0);
}

}  // namespace
}  // namespace infinigen::kv_memory_service

int main(int argc, char** argv) {
  using namespace infinigen::kv_memory_service;
  absl::SetProgramUsageMessage(kSummary);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "--helpfull" || a == "-help") {
      std::fputs(Usage().c_str(), stdout);
      return 0;
    }
  }
  if (absl::Status flags = infinigen::CheckFlags(
          absl::MakeConstSpan(argv + 1, argv + argc));
      !flags.ok()) {
    return UsageError(std::string(flags.message()));
  }
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    return UsageError(absl::StrCat("unexpected argument '", rest[1],
                                   "' (try --help)"));
  }
  return Run();
}
