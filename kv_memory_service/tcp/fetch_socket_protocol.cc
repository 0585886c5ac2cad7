#include "kv_memory_service/tcp/fetch_socket_loop.h"

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

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kv_memory_service/serving/serve_fetch.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_wire.h"
#include "openssl/err.h"

namespace infinigen::kv_memory_service {
namespace {

// A request body's buffer starts at this and doubles when full: it is never
// more than about twice the bytes that came.
constexpr size_t kFirstBodyChunk = 4096;

absl::string_view Truncated(const absl::Status& status) {
  return status.message().substr(0, fetch_wire::kMaxMessageBytes);
}

}  // namespace

ssize_t FetchSocketLoop::Receive(Connection* c, char* dst, size_t want) {
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

bool FetchSocketLoop::Handshake(Connection* c) {
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

void FetchSocketLoop::Read(Connection* c) {
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
      case Connection::State::kAppendTail:
        dst = reinterpret_cast<char*>(&c->append_meta_bytes) + c->got;
        want = sizeof(c->append_meta_bytes) - c->got;
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

bool FetchSocketLoop::Advance(Connection* c) {
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
          server_->credentials_.Authenticate(&presented).status();
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
    case Connection::State::kAppendTail:
      return JudgeAppend(c);
    case Connection::State::kBody:
      return Serve(c);
    case Connection::State::kTls:
    case Connection::State::kDiscard:
    case Connection::State::kSending:
      break;
  }
  return true;
}

bool FetchSocketLoop::HelloReply(Connection* c, const absl::Status& status) {
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

bool FetchSocketLoop::Respond(Connection* c, uint64_t request_id, const absl::Status& status,
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

bool FetchSocketLoop::Judge(Connection* c) {
  const fetch_wire::FetchRequestHeader& q = c->q;
  const int32_t max_message = server_->options_.max_message_bytes;
  if (q.magic != fetch_wire::kRequestMagic &&
      q.magic != fetch_wire::kHeldMagic &&
      q.magic != fetch_wire::kAppendMagic) {
    c->close_after_send = true;
    return Respond(c, 0, absl::InvalidArgumentError("malformed fetch request"),
                   0, Connection::State::kHeader);
  }
  if (q.magic == fetch_wire::kAppendMagic) {
    c->state = Connection::State::kAppendTail;
    return true;
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
  absl::StatusOr<SequenceGeometry> g =
      server_->store_->Geometry(q.sequence_id, q.session_id);
  absl::Status status =
      g.ok() ? ValidatePlanHeadCount(q.n_offsets, g->n_kv_heads) : g.status();
  if (status.ok() && q.magic == fetch_wire::kRequestMagic) {
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

namespace {

// An append's fields in a request header (fetch_wire.h).
AppendFields AppendOf(const fetch_wire::FetchRequestHeader& q) {
  AppendFields a;
  a.sequence = q.sequence_id;
  a.session = q.session_id;
  a.first_layer = q.layer;
  a.n_layers = q.n_offsets;
  a.n_tokens = q.n_indices;
  a.values = q.dest_elements;
  return a;
}

// The bytes of an append's body: K, V, then its annotations.
uint64_t AppendRowBytes(const fetch_wire::FetchRequestHeader& q) {
  return 4 * q.dest_elements;
}

// The evicted tokens one response's rows hold.
uint64_t MaxEvicted(int32_t max_message) {
  return static_cast<uint64_t>(max_message - 1024) / (3 * sizeof(int32_t));
}

}  // namespace

bool FetchSocketLoop::JudgeAppend(Connection* c) {
  const fetch_wire::FetchRequestHeader& q = c->q;
  const int32_t max_message = server_->options_.max_message_bytes;
  // K and V, 2 bytes a value, and the annotations; in 64 bits only once
  // each part is bounded.
  const uint64_t limit = static_cast<uint64_t>(max_message);
  if (q.dest_elements > limit / 4 || c->append_meta_bytes > limit ||
      AppendRowBytes(q) + c->append_meta_bytes + sizeof(q) > limit) {
    c->close_after_send = true;
    return Respond(c, 0,
                   absl::ResourceExhaustedError(absl::StrCat(
                       "an append of 2 x ", q.dest_elements, " values and ",
                       c->append_meta_bytes,
                       " bytes of annotations exceeds the limit of ",
                       max_message, " bytes")),
                   0, Connection::State::kHeader);
  }
  const uint64_t body_bytes = AppendRowBytes(q) + c->append_meta_bytes;
  absl::StatusOr<SequenceGeometry> g =
      server_->store_->Geometry(q.sequence_id, q.session_id);
  const absl::Status status =
      g.ok() ? CheckAppendShape(*g, AppendOf(q), MaxEvicted(max_message),
                                "fetch socket")
             : g.status();
  if (!status.ok()) {
    c->discard_left = body_bytes;
    return Respond(c, q.request_id, status, 0,
                   body_bytes > 0 ? Connection::State::kDiscard
                                  : Connection::State::kHeader);
  }
  // A block of the sequence's own shape: its buffer at once, not grown as
  // the bytes come (which would copy a prefill's rows over and over).
  c->body_bytes = body_bytes;
  if (c->body.size() * 4 < body_bytes) c->body.resize((body_bytes + 3) / 4);
  Account(c);
  c->state = Connection::State::kBody;
  return true;
}

bool FetchSocketLoop::Serve(Connection* c) {
  const fetch_wire::FetchRequestHeader& q = c->q;
  if (q.magic == fetch_wire::kAppendMagic) {
    const absl::Time start = absl::Now();
    AppendFields fields = AppendOf(q);
    fields.prefix_meta = absl::string_view(
        reinterpret_cast<const char*>(c->body.data()) + AppendRowBytes(q),
        c->append_meta_bytes);
    absl::StatusOr<AppendResult> result = AppendForResponse(
        *server_->store_, fields,
        reinterpret_cast<const uint16_t*>(c->body.data()),
        MaxEvicted(server_->options_.max_message_bytes), "fetch socket");
    size_t rows_bytes = 0;
    if (result.ok()) {
      const std::vector<EvictedToken>& evicted = result->evicted;
      rows_bytes = evicted.size() * 3 * sizeof(int32_t);
      c->rows.resize(rows_bytes / sizeof(uint16_t));
      WriteEvictedTriples(evicted, reinterpret_cast<int32_t*>(c->rows.data()));
      if (server_->options_.metrics != nullptr) {
        server_->options_.metrics->Served(
            Plane::kTcp, RequestOp::kAppend, absl::Now() - start,
            static_cast<int64_t>(c->body_bytes));
      }
    }
    Account(c);
    return Respond(c, q.request_id, result.status(), rows_bytes,
                   Connection::State::kHeader);
  }
  const FetchPlan plan{
      absl::Span<const int32_t>(c->body.data() + q.n_offsets, q.n_indices),
      absl::Span<const int32_t>(c->body.data(), q.n_offsets)};
  if (q.magic == fetch_wire::kHeldMagic) {
    const absl::Status status = NoteHeldForResponse(
        *server_->store_, q.sequence_id, q.session_id, q.layer, plan);
    return Respond(c, q.request_id, status, 0, Connection::State::kHeader);
  }
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

bool FetchSocketLoop::StartSend(Connection* c) {
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

bool FetchSocketLoop::Send(Connection* c) {
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
  return Sent(c);
}

bool FetchSocketLoop::Sent(Connection* c) {
  if (c->close_after_send) {
    Close(c);
    return false;
  }
  c->state = c->after;
  WaitFor(c, /*write=*/false);
  return true;
}

bool FetchSocketLoop::SendTls(Connection* c) {
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
  return Sent(c);
}

}  // namespace infinigen::kv_memory_service
