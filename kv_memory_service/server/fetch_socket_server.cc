#include "kv_memory_service/server/fetch_socket_server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kv_memory_service/server/serve_fetch.h"
#include "kv_memory_service/tcp/fetch_wire.h"

namespace infinigen::kv_memory_service {
namespace {

// Sends one response; request_id 0 with an error tells the client the
// connection is about to close.
absl::Status Respond(int fd, uint64_t request_id, const absl::Status& status,
                     const void* rows, size_t rows_bytes) {
  fetch_wire::FetchResponseHeader header;
  header.status_code = static_cast<int32_t>(status.code());
  header.request_id = request_id;
  const absl::string_view message =
      status.message().substr(0, fetch_wire::kMaxMessageBytes);
  header.message_bytes = static_cast<uint32_t>(message.size());
  header.rows_bytes = status.ok() ? rows_bytes : 0;
  struct iovec iov[3] = {
      {&header, sizeof(header)},
      {const_cast<char*>(message.data()), message.size()},
      {const_cast<void*>(rows), static_cast<size_t>(header.rows_bytes)}};
  return fetch_wire::SendAll(fd, iov, 3);
}

absl::Status SendHelloReply(int fd, const absl::Status& status) {
  fetch_wire::HelloReply reply;
  reply.status_code = static_cast<int32_t>(status.code());
  const absl::string_view message =
      status.message().substr(0, fetch_wire::kMaxMessageBytes);
  reply.message_bytes = static_cast<uint32_t>(message.size());
  struct iovec iov[2] = {{&reply, sizeof(reply)},
                         {const_cast<char*>(message.data()), message.size()}};
  return fetch_wire::SendAll(fd, iov, 2);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FetchSocketServer>> FetchSocketServer::Start(
    std::shared_ptr<KvStore> store, const FetchSocketServerOptions& options) {
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
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
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
  return std::unique_ptr<FetchSocketServer>(
      new FetchSocketServer(std::move(store), options, fd, port));
}

FetchSocketServer::FetchSocketServer(std::shared_ptr<KvStore> store,
                                     const FetchSocketServerOptions& options,
                                     int listen_fd, int port)
    : store_(std::move(store)),
      options_(options),
      expected_token_(options.auth_token.empty()
                          ? ""
                          : "Bearer " + options.auth_token),
      listen_fd_(listen_fd),
      port_(port) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

FetchSocketServer::~FetchSocketServer() { Stop(); }

void FetchSocketServer::Stop() {
  std::list<std::unique_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    // Wakes accept() and every connection's recv().
    shutdown(listen_fd_, SHUT_RDWR);
    for (auto& c : connections_) {
      if (!c->closed) shutdown(c->fd, SHUT_RDWR);
    }
  }
  acceptor_.join();
  close(listen_fd_);
  {
    absl::MutexLock lock(&mu_);
    connections.swap(connections_);
  }
  for (auto& c : connections) c->thread.join();
}

void FetchSocketServer::AcceptLoop() {
  while (true) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
      if (errno == EMFILE || errno == ENFILE) {
        usleep(10000);  // out of descriptors: let connections close
        continue;
      }
      IG_LOG(ERROR) << "fetch socket: accept failed: " << std::strerror(errno);
      return;
    }
    absl::MutexLock lock(&mu_);
    // Reap the threads of connections that ended.
    for (auto it = connections_.begin(); it != connections_.end();) {
      if ((*it)->done.load()) {
        (*it)->thread.join();
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
    if (stopping_ ||
        static_cast<int32_t>(connections_.size()) >= options_.max_connections) {
      SendHelloReply(fd, stopping_ ? absl::UnavailableError(
                                         "the server is stopping")
                                   : absl::ResourceExhaustedError(
                                         "too many fetch connections"))
          .IgnoreError();
      close(fd);
      continue;
    }
    auto connection = std::make_unique<Connection>();
    connection->fd = fd;
    Connection* c = connection.get();
    connections_.push_back(std::move(connection));
    c->thread = std::thread([this, c] { Serve(c); });
  }
}

bool FetchSocketServer::Hello(int fd) {
  fetch_wire::Hello hello;
  if (!fetch_wire::RecvAll(fd, &hello, sizeof(hello)).ok()) return false;
  absl::Status status;
  std::string token;
  if (hello.magic != fetch_wire::kHelloMagic ||
      hello.version != fetch_wire::kVersion ||
      hello.token_bytes > fetch_wire::kMaxTokenBytes) {
    status = absl::InvalidArgumentError("not a fetch socket Hello");
  } else {
    token.resize(hello.token_bytes);
    if (!fetch_wire::RecvAll(fd, token.data(), token.size()).ok()) return false;
    const absl::string_view presented(token);
    status = CheckAuthorization(&presented, expected_token_);
  }
  return SendHelloReply(fd, status).ok() && status.ok();
}

void FetchSocketServer::Serve(Connection* connection) {
  const int fd = connection->fd;
  fetch_wire::TuneSocket(fd);
  if (Hello(fd)) {
    // Reused for every fetch: no allocation once grown.
    std::vector<int32_t> ints;
    std::vector<uint16_t> rows;
    const int64_t max_rows_bytes = options_.max_message_bytes - 1024;
    while (true) {
      fetch_wire::FetchRequestHeader q;
      if (!fetch_wire::RecvAll(fd, &q, sizeof(q)).ok()) break;
      if (q.magic != fetch_wire::kRequestMagic) {
        Respond(fd, 0, absl::InvalidArgumentError("malformed fetch request"),
                nullptr, 0)
            .IgnoreError();
        break;
      }
      const uint64_t n_ints = uint64_t{q.n_offsets} + q.n_indices;
      if (n_ints * sizeof(int32_t) + sizeof(q) >
          static_cast<uint64_t>(options_.max_message_bytes)) {
        Respond(fd, 0,
                absl::ResourceExhaustedError(absl::StrCat(
                    "a fetch request of ", n_ints * sizeof(int32_t),
                    " bytes exceeds the limit of ", options_.max_message_bytes)),
                nullptr, 0)
            .IgnoreError();
        break;
      }
      ints.resize(n_ints);
      if (!fetch_wire::RecvAll(fd, ints.data(), n_ints * sizeof(int32_t)).ok()) {
        break;
      }
      const FetchPlan plan{
          absl::Span<const int32_t>(ints.data() + q.n_offsets, q.n_indices),
          absl::Span<const int32_t>(ints.data(), q.n_offsets)};
      const absl::Status status =
          GatherForResponse(*store_, q.sequence_id, q.layer, plan,
                            q.dest_elements, max_rows_bytes, &rows);
      if (!Respond(fd, q.request_id, status, rows.data(),
                   rows.size() * sizeof(uint16_t))
               .ok()) {
        break;
      }
    }
  }
  {
    absl::MutexLock lock(&mu_);
    connection->closed = true;
    close(fd);
  }
  connection->done.store(true);
}

}  // namespace infinigen::kv_memory_service
