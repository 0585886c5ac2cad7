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
#include "kv_memory_service/server/serve_fetch.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_wire.h"
#include "openssl/err.h"

namespace infinigen::kv_memory_service {
namespace {

// A request body's buffer starts at this and doubles when full: it is never
// more than about twice the bytes that came.
constexpr size_t kFirstBodyChunk = 4096;

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

absl::string_view Truncated(const absl::Status& status) {
  return status.message().substr(0, fetch_wire::kMaxMessageBytes);
}

}  // namespace

// One connection, served by one loop. Fields below `loop` are touched only
// by that loop's thread; the flags are the server's (mu_).
struct FetchSocketServer::Connection {
  enum class State {
    kTls,      // the TLS handshake (TLS servers only)
    kHello,    // reading the Hello
    kToken,    // reading its token
    kHeader,   // reading a request header
    kBody,     // reading a request body
    kDiscard,  // dropping the body of a refused request
    kSending,  // writing a reply; then `after`
  };

  int fd = -1;
  std::string peer;
  // TLS servers: the session, once the peer's first byte began a TLS
  // handshake; until then, and for a plaintext peer, null.
  fetch_tls::SslPtr ssl;
  bool plaintext_on_tls = false;  // refused at its Hello
  // Server flags (mu_).
  bool handshake = true;  // counted in handshakes_ and its peer
  bool counted = false;   // counted as a connection
  bool dropped = false;   // dropped for a newer handshake: shut down
  Loop* loop = nullptr;

  State state = State::kHello;
  State after = State::kHeader;  // once the reply is sent
  bool close_after_send = false;
  size_t got = 0;  // bytes of the current part
  fetch_wire::Hello hello;
  std::string token;
  fetch_wire::FetchRequestHeader q;
  size_t body_bytes = 0;      // the current body, as announced
  std::vector<int32_t> body;  // grows as its bytes arrive
  size_t discard_left = 0;
  std::string out;              // reply header and message
  std::vector<uint16_t> rows;   // reply rows
  size_t out_rows_bytes = 0;
  size_t rows_in_out = 0;  // TLS: the first rows' bytes, copied into `out`
  size_t sent = 0;
  bool want_write = false;  // registered for EPOLLOUT
  absl::Time deadline = absl::InfiniteFuture();
  int64_t buffer_counted = 0;  // bytes of body and rows in buffer_bytes_
};

// An event loop: one epoll set, the connections it owns, a thread.
class FetchSocketServer::Loop {
 public:
  static absl::StatusOr<std::unique_ptr<Loop>> Create() {
    const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;
    if (epoll_fd < 0 || wake_fd < 0 ||
        epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &ev) != 0) {
      const int err = errno;
      if (epoll_fd >= 0) close(epoll_fd);
      if (wake_fd >= 0) close(wake_fd);
      return absl::UnavailableError(
          absl::StrCat("fetch socket: cannot make an event loop: ",
                       std::strerror(err)));
    }
    return std::unique_ptr<Loop>(new Loop(epoll_fd, wake_fd));
  }
  ~Loop() {
    close(epoll_fd_);
    close(wake_fd_);
  }

  void Start(FetchSocketServer* server) {
    server_ = server;
    thread_ = std::thread([this] { Run(); });
  }
  // Hands a new connection to the loop (any thread).
  void Add(std::unique_ptr<Connection> c) {
    c->loop = this;
    {
      absl::MutexLock lock(&mu_);
      incoming_.push_back(std::move(c));
    }
    Wake();
  }
  // Closes every connection and ends the thread (after Start).
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    Wake();
    thread_.join();
  }

 private:
  Loop(int epoll_fd, int wake_fd) : epoll_fd_(epoll_fd), wake_fd_(wake_fd) {}

  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  void Run() {
    struct epoll_event events[64];
    while (true) {
      int timeout_ms = -1;
      if (!ready_.empty()) {
        timeout_ms = 0;
      } else if (next_check_ != absl::InfiniteFuture()) {
        const absl::Duration left = next_check_ - absl::Now();
        timeout_ms = left <= absl::ZeroDuration()
                         ? 0
                         : static_cast<int>(std::min<int64_t>(
                               absl::ToInt64Milliseconds(left) + 1, 60000));
      }
      const int n = epoll_wait(epoll_fd_, events, 64, timeout_ms);
      if (n < 0 && errno != EINTR) {
        IG_LOG(ERROR) << "fetch socket: epoll_wait failed: "
                      << std::strerror(errno);
      }
      for (int i = 0; i < n; ++i) {
        Connection* c = static_cast<Connection*>(events[i].data.ptr);
        if (c == nullptr) {
          if (!TakeIncoming()) {
            CloseAll();
            return;
          }
          continue;
        }
        Handle(c, events[i].events);
      }
      ReadReady();
      if (absl::Now() >= next_check_) ExpireDeadlines();
    }
  }

  // Registers the connections the acceptor handed over. False once the
  // loop is to stop.
  bool TakeIncoming() {
    uint64_t count;
    (void)!read(wake_fd_, &count, sizeof(count));
    std::vector<std::unique_ptr<Connection>> incoming;
    bool stop;
    {
      absl::MutexLock lock(&mu_);
      incoming.swap(incoming_);
      stop = stop_;
    }
    const absl::Time now = absl::Now();
    for (auto& owned : incoming) {
      Connection* c = owned.get();
      if (server_->options_.tls != nullptr) c->state = Connection::State::kTls;
      conns_[c] = std::move(owned);
      c->deadline = now + server_->options_.handshake_timeout;
      next_check_ = std::min(next_check_, c->deadline);
      struct epoll_event ev = {};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.ptr = c;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &ev) != 0) Close(c);
    }
    return !stop;
  }

  void CloseAll() {
    {
      absl::MutexLock lock(&mu_);
      for (auto& c : incoming_) conns_[c.get()] = std::move(c);
      incoming_.clear();
    }
    while (!conns_.empty()) Close(conns_.begin()->first);
  }

  // TLS connections whose session holds bytes it has already taken off the
  // socket, which epoll cannot report: Read stopped at its step limit.
  void ReadReady() {
    if (ready_.empty()) return;
    std::vector<Connection*> ready(ready_.begin(), ready_.end());
    ready_.clear();
    // Read closes only the connection it reads.
    for (Connection* c : ready) {
      if (c->state != Connection::State::kSending) Read(c);
    }
  }

  void ExpireDeadlines() {
    const absl::Time now = absl::Now();
    next_check_ = absl::InfiniteFuture();
    std::vector<Connection*> expired;
    for (auto& [c, owned] : conns_) {
      if (c->deadline <= now) {
        expired.push_back(c);
      } else {
        next_check_ = std::min(next_check_, c->deadline);
      }
    }
    for (Connection* c : expired) Close(c, /*timed_out=*/true);
  }

  // Progress on `c`: an authenticated connection's idle clock restarts (a
  // handshake keeps its first deadline).
  void Touch(Connection* c) {
    if (c->state == Connection::State::kTls ||
        c->state == Connection::State::kHello ||
        c->state == Connection::State::kToken) {
      return;
    }
    const absl::Duration idle = server_->options_.idle_timeout;
    c->deadline = idle > absl::ZeroDuration() ? absl::Now() + idle
                                              : absl::InfiniteFuture();
    next_check_ = std::min(next_check_, c->deadline);
  }

  void Close(Connection* c, bool timed_out = false) {
    if (c->ssl != nullptr && SSL_is_init_finished(c->ssl.get())) {
      // close_notify, best effort: the peer reads a clean end, not a cut.
      ERR_clear_error();
      SSL_shutdown(c->ssl.get());
      ERR_clear_error();
    }
    ready_.erase(c);
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
    server_->buffer_bytes_.fetch_sub(c->buffer_counted);
    server_->Release(c, timed_out);
    conns_.erase(c);
  }

  // Counts the capacity of c's buffers in buffer_bytes_.
  void Account(Connection* c) {
    const int64_t now = static_cast<int64_t>(c->body.capacity() * 4 +
                                             c->rows.capacity() * 2);
    server_->buffer_bytes_.fetch_add(now - c->buffer_counted);
    c->buffer_counted = now;
  }

  void Handle(Connection* c, uint32_t events) {
    if (c->state == Connection::State::kSending) {
      // Done sending: the session may hold the next request already.
      if (Send(c)) Read(c);
      return;
    }
    // A TLS read that wanted the socket writable has its chance now.
    if (c->want_write) Watch(c, EPOLLIN | EPOLLRDHUP);
    Read(c);
  }

  // Waits for `c`'s socket to be readable (TLS: or writable, when OpenSSL
  // wants to write first).
  void WaitFor(Connection* c, bool write) {
    if (write != c->want_write) {
      Watch(c, write ? EPOLLOUT : EPOLLIN | EPOLLRDHUP);
    }
  }

  // Reads up to `want` bytes, through the TLS session when there is one.
  // >0: bytes read; 0: `c` is closed (the peer went, or the connection
  // failed); -1: nothing yet (the loop waits for the socket).
  ssize_t Receive(Connection* c, char* dst, size_t want) {
    if (c->ssl == nullptr) {
      while (true) {
        const ssize_t n = recv(c->fd, dst, want, 0);
        if (n > 0) return n;
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return -1;
        Close(c);
        return 0;
      }
    }
    ERR_clear_error();
    const int n = SSL_read(c->ssl.get(), dst,
                           static_cast<int>(std::min<size_t>(want, INT_MAX)));
    if (n > 0) return n;
    switch (SSL_get_error(c->ssl.get(), n)) {
      case SSL_ERROR_WANT_READ:
        WaitFor(c, /*write=*/false);
        return -1;
      case SSL_ERROR_WANT_WRITE:
        WaitFor(c, /*write=*/true);
        return -1;
      default:
        ERR_clear_error();
        Close(c);
        return 0;
    }
  }

  // The TLS handshake of `c`, on a TLS server. True once it is done (`c`
  // is then at its Hello), or when the peer turned out to speak plaintext;
  // false while it waits for the socket or when `c` is closed.
  bool Handshake(Connection* c) {
    if (c->ssl == nullptr) {
      unsigned char first;
      ssize_t n;
      do {
        n = recv(c->fd, &first, 1, MSG_PEEK);
      } while (n < 0 && errno == EINTR);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      if (n <= 0) {
        Close(c);
        return false;
      }
      if (first != fetch_tls::kHandshakeRecord) {
        // Read as a plaintext Hello, to be told what this socket speaks.
        c->plaintext_on_tls = true;
        c->state = Connection::State::kHello;
        return true;
      }
      ERR_clear_error();
      c->ssl.reset(SSL_new(server_->options_.tls.get()));
      BIO* bio = c->ssl == nullptr ? nullptr : fetch_tls::NewSocketBio(c->fd);
      if (bio == nullptr) {
        IG_LOG(ERROR) << "fetch socket: cannot make a TLS session: "
                      << fetch_tls::TakeError();
        Close(c);
        return false;
      }
      SSL_set_bio(c->ssl.get(), bio, bio);
      SSL_set_mode(c->ssl.get(), SSL_MODE_ENABLE_PARTIAL_WRITE |
                                     SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
      // Several records per recv. What the session holds is read before the
      // loop waits on the socket again (Read, ReadReady, after a send).
      SSL_set_read_ahead(c->ssl.get(), 1);
      SSL_set_accept_state(c->ssl.get());
    }
    ERR_clear_error();
    const int r = SSL_do_handshake(c->ssl.get());
    if (r == 1) {
      c->state = Connection::State::kHello;
      return true;
    }
    const int err = SSL_get_error(c->ssl.get(), r);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      WaitFor(c, err == SSL_ERROR_WANT_WRITE);
      return false;
    }
    if (err == SSL_ERROR_SSL && ERR_GET_REASON(ERR_peek_error()) !=
                                    SSL_R_UNEXPECTED_EOF_WHILE_READING) {
      // Refused: no or a stranger's certificate, not TLS after all, no
      // common version or cipher. A peer that merely went (or a handshake
      // dropped for a newer one) is not counted.
      const absl::Status refused = absl::UnauthenticatedError(
          absl::StrCat("TLS handshake failed: ", fetch_tls::TakeError()));
      server_->CountRefused();
      if (server_->options_.metrics != nullptr) {
        server_->options_.metrics->Rejected(Plane::kTcp, refused);
      }
    }
    ERR_clear_error();
    Close(c);
    return false;
  }

  // Reads what has arrived, a bounded number of parts so that one busy
  // connection does not hold the loop.
  void Read(Connection* c) {
    char scratch[16384];
    for (int steps = 0; steps < 64; ++steps) {
      char* dst = nullptr;
      size_t want = 0;
      switch (c->state) {
        case Connection::State::kTls:
          if (!Handshake(c)) return;
          continue;
        case Connection::State::kHello:
          dst = reinterpret_cast<char*>(&c->hello) + c->got;
          want = sizeof(c->hello) - c->got;
          break;
        case Connection::State::kToken:
          dst = c->token.data() + c->got;
          want = c->token.size() - c->got;
          break;
        case Connection::State::kHeader:
          dst = reinterpret_cast<char*>(&c->q) + c->got;
          want = sizeof(c->q) - c->got;
          break;
        case Connection::State::kBody: {
          if (c->body.size() * 4 <= c->got) {
            // Full: grow to twice what came (first kFirstBodyChunk), never
            // past the announced body.
            const size_t bytes = std::min(
                c->body_bytes, std::max(kFirstBodyChunk, 2 * c->got));
            c->body.resize((bytes + 3) / 4);
            Account(c);
          }
          want = std::min(c->body_bytes, c->body.size() * 4) - c->got;
          dst = reinterpret_cast<char*>(c->body.data()) + c->got;
          break;
        }
        case Connection::State::kDiscard:
          dst = scratch;
          want = std::min(c->discard_left, sizeof(scratch));
          break;
        case Connection::State::kSending:
          return;
      }
      const ssize_t n = Receive(c, dst, want);
      if (n <= 0) return;  // closed, or waiting for the socket
      Touch(c);
      if (c->state == Connection::State::kDiscard) {
        c->discard_left -= static_cast<size_t>(n);
        if (c->discard_left == 0) c->state = Connection::State::kHeader;
        continue;
      }
      if (c->state == Connection::State::kBody) {
        server_->body_bytes_received_.fetch_add(n);
      }
      c->got += static_cast<size_t>(n);
      // `want` is the rest of the part, except for a body, whose buffer
      // may not hold all of it yet.
      if (c->state == Connection::State::kBody ? c->got < c->body_bytes
                                               : static_cast<size_t>(n) < want) {
        continue;
      }
      if (!Advance(c)) return;  // closed, or waiting to send
    }
    // Out of steps: what the session has decrypted already stays unseen by
    // epoll; come back to it after the other connections.
    if (c->ssl != nullptr) ready_.insert(c);
  }

  // The current part is complete. False when `c` is closed or is waiting
  // for its reply to be written.
  bool Advance(Connection* c) {
    c->got = 0;
    switch (c->state) {
      case Connection::State::kHello: {
        const fetch_wire::Hello& h = c->hello;
        if (h.magic != fetch_wire::kHelloMagic ||
            h.token_bytes > fetch_wire::kMaxTokenBytes) {
          server_->CountRefused();
          return HelloReply(
              c, absl::InvalidArgumentError("not a fetch socket Hello"));
        }
        if (h.version != fetch_wire::kVersion) {
          server_->CountRefused();
          return HelloReply(
              c, absl::FailedPreconditionError(absl::StrCat(
                     "fetch protocol version ", h.version,
                     "; this node speaks ", fetch_wire::kVersion,
                     " (run the same infinigen release on both sides)")));
        }
        if (c->plaintext_on_tls) {
          server_->CountRefused();
          return HelloReply(
              c, absl::FailedPreconditionError(
                     "this fetch socket speaks TLS: the client needs the "
                     "node's CA (tls_ca_pem, --kv_tls_ca)"));
        }
        c->token.resize(h.token_bytes);
        c->state = Connection::State::kToken;
        if (h.token_bytes > 0) return true;
        [[fallthrough]];
      }
      case Connection::State::kToken: {
        const absl::string_view presented(c->token);
        absl::Status status =
            CheckAuthorization(&presented, server_->expected_token_);
        if (!status.ok()) {
          server_->CountRefused();
        } else {
          status = server_->Admit(c);
        }
        std::string().swap(c->token);
        return HelloReply(c, status);
      }
      case Connection::State::kHeader:
        return Judge(c);
      case Connection::State::kBody:
        return Serve(c);
      case Connection::State::kTls:
      case Connection::State::kDiscard:
      case Connection::State::kSending:
        break;
    }
    return true;
  }

  bool HelloReply(Connection* c, const absl::Status& status) {
    if (server_->options_.metrics != nullptr) {
      server_->options_.metrics->Rejected(Plane::kTcp, status);
    }
    fetch_wire::HelloReply reply;
    reply.status_code = static_cast<int32_t>(status.code());
    const absl::string_view message = Truncated(status);
    reply.message_bytes = static_cast<uint32_t>(message.size());
    c->out.assign(reinterpret_cast<const char*>(&reply), sizeof(reply));
    c->out.append(message.data(), message.size());
    c->out_rows_bytes = 0;
    c->close_after_send = !status.ok();
    c->after = Connection::State::kHeader;
    return StartSend(c);
  }

  bool Respond(Connection* c, uint64_t request_id, const absl::Status& status,
               size_t rows_bytes, Connection::State after) {
    if (server_->options_.metrics != nullptr) {
      server_->options_.metrics->Rejected(Plane::kTcp, status);
    }
    fetch_wire::FetchResponseHeader header;
    header.status_code = static_cast<int32_t>(status.code());
    header.request_id = request_id;
    const absl::string_view message = Truncated(status);
    header.message_bytes = static_cast<uint32_t>(message.size());
    header.rows_bytes = status.ok() ? rows_bytes : 0;
    c->out.assign(reinterpret_cast<const char*>(&header), sizeof(header));
    c->out.append(message.data(), message.size());
    c->out_rows_bytes = header.rows_bytes;
    c->after = after;
    return StartSend(c);
  }

  // A request header: refused at once (its body then dropped as it comes)
  // unless the sequence it names can need a body and rows of that size.
  bool Judge(Connection* c) {
    const fetch_wire::FetchRequestHeader& q = c->q;
    const int32_t max_message = server_->options_.max_message_bytes;
    if (q.magic != fetch_wire::kRequestMagic) {
      c->close_after_send = true;
      return Respond(c, 0, absl::InvalidArgumentError("malformed fetch request"),
                     0, Connection::State::kHeader);
    }
    const uint64_t body_bytes =
        (uint64_t{q.n_offsets} + q.n_indices) * sizeof(int32_t);
    if (body_bytes + sizeof(q) > static_cast<uint64_t>(max_message)) {
      c->close_after_send = true;
      return Respond(c, 0,
                     absl::ResourceExhaustedError(absl::StrCat(
                         "a fetch request of ", body_bytes,
                         " bytes exceeds the limit of ", max_message)),
                     0, Connection::State::kHeader);
    }
    absl::Status status;
    absl::StatusOr<SequenceGeometry> g =
        server_->store_->Geometry(q.sequence_id, q.session_id);
    if (!g.ok()) {
      status = g.status();
    } else if (q.n_offsets != static_cast<uint32_t>(g->n_kv_heads) + 1) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "plan has ", q.n_offsets, " head offsets; the sequence has ",
          g->n_kv_heads, " KV heads, so it needs ", g->n_kv_heads + 1));
    } else {
      // Each index brings a K and a V row of head_dim 2-byte values.
      const int64_t max_indices = std::min<int64_t>(
          server_->store_->options().max_fetch_indices,
          (int64_t{max_message} - 1024) / (int64_t{4} * g->head_dim));
      if (q.n_indices > max_indices) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "a fetch of ", q.n_indices, " indices exceeds the ", max_indices,
            " whose rows fit one response"));
      }
    }
    if (!status.ok()) {
      c->discard_left = body_bytes;
      return Respond(c, q.request_id, status, 0,
                     body_bytes > 0 ? Connection::State::kDiscard
                                    : Connection::State::kHeader);
    }
    c->body_bytes = body_bytes;
    c->state = Connection::State::kBody;
    if (body_bytes > 0) return true;
    return Serve(c);
  }

  bool Serve(Connection* c) {
    const fetch_wire::FetchRequestHeader& q = c->q;
    const FetchPlan plan{
        absl::Span<const int32_t>(c->body.data() + q.n_offsets, q.n_indices),
        absl::Span<const int32_t>(c->body.data(), q.n_offsets)};
    const absl::Time start = absl::Now();
    const absl::Status status = GatherForResponse(
        *server_->store_, q.sequence_id, q.session_id, q.layer, plan,
        q.dest_elements,
        server_->options_.max_message_bytes - 1024, &c->rows);
    if (server_->options_.metrics != nullptr && status.ok()) {
      server_->options_.metrics->Served(
          Plane::kTcp, RequestOp::kFetch, absl::Now() - start,
          static_cast<int64_t>(c->rows.size() * sizeof(uint16_t)));
    }
    Account(c);
    return Respond(c, q.request_id, status, c->rows.size() * sizeof(uint16_t),
                   Connection::State::kHeader);
  }

  bool StartSend(Connection* c) {
    c->state = Connection::State::kSending;
    c->sent = 0;
    c->rows_in_out = 0;
    if (c->ssl != nullptr && c->out_rows_bytes > 0 &&
        c->out.size() < SSL3_RT_MAX_PLAIN_LENGTH) {
      // One TLS record for the header, the message and the first rows.
      c->rows_in_out = std::min(c->out_rows_bytes,
                                SSL3_RT_MAX_PLAIN_LENGTH - c->out.size());
      c->out.append(reinterpret_cast<const char*>(c->rows.data()),
                    c->rows_in_out);
    }
    return Send(c);
  }

  // Writes what the socket takes. False when `c` is closed or the reply is
  // not all written (the loop then waits for EPOLLOUT).
  bool Send(Connection* c) {
    if (c->ssl != nullptr) return SendTls(c);
    const size_t total = c->out.size() + c->out_rows_bytes;
    while (c->sent < total) {
      struct iovec iov[2];
      int iovcnt = 0;
      if (c->sent < c->out.size()) {
        iov[iovcnt++] = {c->out.data() + c->sent, c->out.size() - c->sent};
        if (c->out_rows_bytes > 0) {
          iov[iovcnt++] = {c->rows.data(), c->out_rows_bytes};
        }
      } else {
        const size_t off = c->sent - c->out.size();
        iov[iovcnt++] = {reinterpret_cast<char*>(c->rows.data()) + off,
                         c->out_rows_bytes - off};
      }
      struct msghdr msg = {};
      msg.msg_iov = iov;
      msg.msg_iovlen = iovcnt;
      const ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          Watch(c, EPOLLOUT);
          return false;
        }
        Close(c);
        return false;
      }
      c->sent += static_cast<size_t>(n);
      Touch(c);
    }
    if (c->close_after_send) {
      Close(c);
      return false;
    }
    c->state = c->after;
    if (c->want_write) Watch(c, EPOLLIN | EPOLLRDHUP);
    return true;
  }

  // Send through the TLS session: `out` (the header, the message and the
  // first rows), then the other rows (with partial writes, a record at a
  // time).
  bool SendTls(Connection* c) {
    const size_t total = c->out.size() + c->out_rows_bytes - c->rows_in_out;
    while (c->sent < total) {
      const char* data;
      size_t left;
      if (c->sent < c->out.size()) {
        data = c->out.data() + c->sent;
        left = c->out.size() - c->sent;
      } else {
        const size_t off = c->rows_in_out + (c->sent - c->out.size());
        data = reinterpret_cast<const char*>(c->rows.data()) + off;
        left = c->out_rows_bytes - off;
      }
      ERR_clear_error();
      const int n =
          SSL_write(c->ssl.get(), data,
                    static_cast<int>(std::min<size_t>(left, INT_MAX)));
      if (n <= 0) {
        const int err = SSL_get_error(c->ssl.get(), n);
        if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
          WaitFor(c, err == SSL_ERROR_WANT_WRITE);
          return false;
        }
        ERR_clear_error();
        Close(c);
        return false;
      }
      c->sent += static_cast<size_t>(n);
      Touch(c);
    }
    if (c->close_after_send) {
      Close(c);
      return false;
    }
    c->state = c->after;
    WaitFor(c, /*write=*/false);
    return true;
  }

  void Watch(Connection* c, uint32_t events) {
    struct epoll_event ev = {};
    ev.events = events;
    ev.data.ptr = c;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_write = (events & EPOLLOUT) != 0;
  }

  const int epoll_fd_;
  const int wake_fd_;
  FetchSocketServer* server_ = nullptr;
  std::thread thread_;

  absl::Mutex mu_;
  std::vector<std::unique_ptr<Connection>> incoming_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // The loop thread's own.
  absl::flat_hash_map<Connection*, std::unique_ptr<Connection>> conns_;
  absl::flat_hash_set<Connection*> ready_;          // see ReadReady
  absl::Time next_check_ = absl::InfiniteFuture();  // earliest deadline
};

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
    : store_(std::move(store)),
      options_(options),
      expected_token_(options.auth_token.empty()
                          ? ""
                          : "Bearer " + options.auth_token),
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
    const int fd =
        accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
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
