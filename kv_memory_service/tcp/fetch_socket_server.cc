#include "kv_memory_service/tcp/fetch_socket_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kv_memory_service/serving/serve_fetch.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_socket_loop.h"
#include "kv_memory_service/tcp/fetch_wire.h"
#include "openssl/err.h"

namespace infinigen::kv_memory_service {
namespace {

// The peer's IP address as text ("?" if unknown).
std::string PeerAddress(int fd) {
  struct sockaddr_storage addr = {};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<struct sockaddr*>(&addr), &len) != 0) {
    return "?";
  }
  char text[INET6_ADDRSTRLEN] = {};
  const void* ip =
      addr.ss_family == AF_INET6
          ? static_cast<const void*>(
                &reinterpret_cast<struct sockaddr_in6*>(&addr)->sin6_addr)
          : static_cast<const void*>(
                &reinterpret_cast<struct sockaddr_in*>(&addr)->sin_addr);
  if (inet_ntop(addr.ss_family, ip, text, sizeof(text)) == nullptr) return "?";
  return text;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FetchSocketServer>> FetchSocketServer::Start(
    std::shared_ptr<KvStore> store, const FetchSocketServerOptions& options) {
  if (options.threads < 1 || options.max_connections < 1 ||
      options.max_connections_per_peer < 1 || options.max_handshakes < 1 ||
      options.max_handshakes_per_peer < 1 ||
      options.handshake_timeout <= absl::ZeroDuration() ||
      options.idle_timeout < absl::ZeroDuration() ||
      options.max_message_bytes <= 2048) {
    return absl::InvalidArgumentError(
        "fetch socket: threads, connection and handshake limits and the "
        "handshake timeout must be positive, the idle timeout not negative, "
        "max_message_bytes over 2048");
  }
  std::vector<std::unique_ptr<Loop>> loops;
  for (int i = 0; i < options.threads; ++i) {
    absl::StatusOr<std::unique_ptr<Loop>> loop = Loop::Create();
    if (!loop.ok()) return loop.status();
    loops.push_back(*std::move(loop));
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  struct addrinfo* found = nullptr;
  const std::string service = absl::StrCat(options.port);
  if (getaddrinfo(options.host.c_str(), service.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve fetch socket host '", options.host, "'"));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = fd >= 0 &&
                     bind(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                     listen(fd, 128) == 0;
  const int err = errno;
  freeaddrinfo(found);
  if (!bound) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen for fetches on ", options.host, ":",
                     options.port, ": ", std::strerror(err)));
  }
  struct sockaddr_storage addr = {};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<struct sockaddr*>(&addr), &len);
  const int port =
      addr.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<struct sockaddr_in6*>(&addr)->sin6_port)
          : ntohs(reinterpret_cast<struct sockaddr_in*>(&addr)->sin_port);
  std::unique_ptr<FetchSocketServer> server(
      new FetchSocketServer(std::move(store), options, fd, port));
  server->loops_ = std::move(loops);
  for (auto& loop : server->loops_) loop->Start(server.get());
  server->acceptor_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

FetchSocketServer::FetchSocketServer(std::shared_ptr<KvStore> store,
                                     const FetchSocketServerOptions& options,
                                     int listen_fd, int port)
    : FetchSocketHost(std::move(store), options),
      listen_fd_(listen_fd),
      port_(port) {}

FetchSocketServer::~FetchSocketServer() { Stop(); }

void FetchSocketServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
  }
  acceptor_.join();
  close(listen_fd_);
  for (auto& loop : loops_) loop->Stop();
}

FetchSocketStats FetchSocketServer::GetStats() const {
  FetchSocketStats s;
  absl::MutexLock lock(&mu_);
  s.handshakes = static_cast<int32_t>(handshakes_.size());
  s.connections = connections_;
  s.buffer_bytes = buffer_bytes_.load();
  s.body_bytes_received = body_bytes_received_.load();
  s.dropped_handshakes = dropped_handshakes_;
  s.refused = refused_;
  s.timed_out = timed_out_;
  return s;
}

void FetchSocketServer::AcceptLoop() {
  size_t next_loop = 0;
  while (true) {
    // Out of descriptors, the pending peer is shed and the loop backs off
    // (acceptor.h) until connections close.
    const int fd = accept_.Accept(listen_fd_, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
      if (err == EMFILE || err == ENFILE) continue;
      errno = err;
      IG_LOG(ERROR) << "fetch socket: accept failed: " << std::strerror(errno);
      return;
    }
    fetch_wire::TuneSocket(fd);
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    c->peer = PeerAddress(fd);
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      close(fd);
      return;
    }
    MakeRoomForHandshakeLocked(c->peer);
    handshakes_.push_back(c.get());
    ++peers_[c->peer].handshakes;
    loops_[next_loop++ % loops_.size()]->Add(std::move(c));
  }
}

void FetchSocketServer::MakeRoomForHandshakeLocked(const std::string& peer) {
  auto drop = [&](std::vector<Connection*>::iterator it) {
    Connection* c = *it;
    handshakes_.erase(it);
    --peers_[c->peer].handshakes;
    c->handshake = false;
    c->dropped = true;
    ++dropped_handshakes_;
    shutdown(c->fd, SHUT_RDWR);  // its loop sees the end and closes it
  };
  if (peers_[peer].handshakes >= options_.max_handshakes_per_peer) {
    auto oldest = std::find_if(handshakes_.begin(), handshakes_.end(),
                               [&](Connection* c) { return c->peer == peer; });
    if (oldest != handshakes_.end()) drop(oldest);
  }
  if (!handshakes_.empty() &&
      static_cast<int32_t>(handshakes_.size()) >= options_.max_handshakes) {
    drop(handshakes_.begin());
  }
}

absl::Status FetchSocketServer::Admit(Connection* c) {
  absl::MutexLock lock(&mu_);
  if (c->dropped) {
    return absl::UnavailableError("the handshake was dropped for a newer one");
  }
  ForgetHandshakeLocked(c);
  PeerCount& peer = peers_[c->peer];
  if (connections_ >= options_.max_connections ||
      peer.connections >= options_.max_connections_per_peer) {
    ++refused_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "too many fetch connections (", connections_, " in all, ",
        peer.connections, " from ", c->peer, ")"));
  }
  ++connections_;
  ++peer.connections;
  c->counted = true;
  return absl::OkStatus();
}

void FetchSocketServer::ForgetHandshakeLocked(Connection* c) {
  auto it = std::find(handshakes_.begin(), handshakes_.end(), c);
  if (it != handshakes_.end()) handshakes_.erase(it);
  --peers_[c->peer].handshakes;
  c->handshake = false;
}

void FetchSocketServer::CountRefused() {
  absl::MutexLock lock(&mu_);
  ++refused_;
}

void FetchSocketServer::Release(Connection* c, bool timed_out) {
  absl::MutexLock lock(&mu_);
  if (c->handshake || c->counted) {
    PeerCount& peer = peers_[c->peer];
    if (c->handshake) ForgetHandshakeLocked(c);
    if (c->counted) {
      --connections_;
      --peer.connections;
    }
  }
  auto it = peers_.find(c->peer);
  if (it != peers_.end() && it->second.handshakes == 0 &&
      it->second.connections == 0) {
    peers_.erase(it);
  }
  if (timed_out) ++timed_out_;
  close(c->fd);
}

}  // namespace infinigen::kv_memory_service
