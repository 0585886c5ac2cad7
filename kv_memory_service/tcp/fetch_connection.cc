#include "kv_memory_service/tcp/fetch_connection.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "grpcpp/client_context.h"
#include "kv_memory_service/control/proto_convert.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_wire.h"

namespace infinigen::kv_memory_service {
namespace {

// Fetches over the gRPC FetchStream (unix sockets, in-process channels,
// servers without a fetch socket). Rows arrive in the response message and
// are copied into the buffer.
class StreamConnection final : public FetchConnection {
 public:
  StreamConnection(kv::KvMemory::StubInterface* stub, const std::string& auth) {
    if (!auth.empty()) ctx_.AddMetadata("authorization", auth);
    rw_ = stub->FetchStream(&ctx_);
    reader_ = std::thread([this] { ReadLoop(); });
  }
  ~StreamConnection() override {
    ctx_.TryCancel();
    reader_.join();
  }

 private:
  void Write(GrpcFetchBuffer* buffer) override {
    // After Finish the stream takes no writes; the reader has failed (or
    // is failing) this fetch with the others.
    absl::MutexLock lock(&write_mu_);
    if (!finished_) rw_->Write(buffer->request);
  }
  void Cut() override { ctx_.TryCancel(); }

  void ReadLoop() {
    kv::FetchResponse resp;
    while (rw_->Read(&resp)) {
      GrpcFetchBuffer* buffer = Take(resp.request_id());
      if (buffer == nullptr) continue;
      absl::Status status(static_cast<absl::StatusCode>(resp.status_code()),
                          resp.status_message());
      if (status.ok()) {
        const std::string& rows = resp.rows();
        if (rows.size() > buffer->size() * sizeof(uint16_t)) {
          status = absl::InternalError(absl::StrCat(
              "the server sent ", rows.size(), " bytes of rows for a ",
              buffer->size() * sizeof(uint16_t), "-byte fetch buffer"));
        } else {
          std::memcpy(buffer->data(), rows.data(), rows.size());
        }
      }
      buffer->Complete(std::move(status));
    }
    grpc::Status end;
    {
      absl::MutexLock lock(&write_mu_);
      end = rw_->Finish();
      finished_ = true;
    }
    if (end.ok() || end.error_code() == grpc::StatusCode::CANCELLED) {
      Break(absl::UnavailableError(
          absl::StrCat("the KV memory server closed the fetch stream",
                       end.ok() ? "" : ": ", end.error_message())));
    } else {
      Break(FromGrpcStatus(end));
    }
  }

  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriterInterface<kv::FetchRequest, kv::FetchResponse>>
      rw_;
  absl::Mutex write_mu_;  // one Write at a time, as gRPC requires
  bool finished_ ABSL_GUARDED_BY(write_mu_) = false;
  std::thread reader_;  // last: starts after everything above exists
};

// Fetches over the server's fetch socket, plaintext or TLS: the request
// goes out from the caller's thread (plaintext: one sendmsg; TLS: one
// record); the reader receives the rows straight into the buffer.
class SocketConnection final : public FetchConnection {
 public:
  ~SocketConnection() override {
    Cut();
    if (reader_.joinable()) reader_.join();
    close(fd_);
  }

  // Connects to host:port (each address it resolves to, in turn) within
  // `timeout`, through TLS when `tls` is set (the server's certificate
  // checked against `server_name`), and says Hello. Unavailable,
  // DeadlineExceeded, or the server's refusal (Unauthenticated;
  // FailedPrecondition from a TLS socket to a plaintext client).
  static absl::StatusOr<std::shared_ptr<SocketConnection>> Connect(
      const std::string& host, int port, const std::string& token, SSL_CTX* tls,
      const std::string& server_name, absl::Duration timeout) {
    struct addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    struct addrinfo* found = nullptr;
    const std::string service = absl::StrCat(port);
    if (getaddrinfo(host.c_str(), service.c_str(), &hints, &found) != 0 ||
        found == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("cannot resolve fetch host '", host, "'"));
    }
    int fd = -1;
    absl::Status status;
    for (const struct addrinfo* a = found; a != nullptr; a = a->ai_next) {
      fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        status = absl::UnavailableError("cannot create a socket");
        continue;
      }
      status = ConnectWithin(fd, a, timeout);
      if (status.ok()) break;
      close(fd);
      fd = -1;
    }
    freeaddrinfo(found);
    if (fd < 0) return status;
    std::unique_ptr<fetch_tls::TlsClientStream> stream;
    if (tls != nullptr) {
      absl::StatusOr<std::unique_ptr<fetch_tls::TlsClientStream>> made =
          fetch_tls::TlsClientStream::Connect(fd, tls, server_name, timeout);
      if (!made.ok()) {
        close(fd);
        return made.status();
      }
      stream = *std::move(made);
    }
    std::shared_ptr<SocketConnection> connection(
        new SocketConnection(fd, std::move(stream), timeout));
    IG_RETURN_IF_ERROR(connection->SayHello(token, timeout));
    connection->reader_ =
        std::thread([c = connection.get()] { c->ReadLoop(); });
    return connection;
  }

 private:
  // Takes `fd`, connected, and its TLS session (null: plaintext).
  SocketConnection(int fd, std::unique_ptr<fetch_tls::TlsClientStream> tls,
                   absl::Duration send_timeout)
      : fd_(fd), tls_(std::move(tls)), send_timeout_(send_timeout) {}

  static absl::Status ConnectWithin(int fd, const struct addrinfo* addr,
                                    absl::Duration timeout) {
    // Non-blocking connect, bounded by poll, then back to blocking.
    const int flags = fcntl(fd, F_GETFL, 0);
    fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    if (connect(fd, addr->ai_addr, addr->ai_addrlen) != 0 &&
        errno != EINPROGRESS) {
      return absl::UnavailableError(absl::StrCat(
          "cannot connect to the fetch socket: ", std::strerror(errno)));
    }
    struct pollfd p = {fd, POLLOUT, 0};
    const int ready = poll(&p, 1, absl::ToInt64Milliseconds(timeout));
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (ready <= 0 || err != 0) {
      return absl::UnavailableError(absl::StrCat(
          "cannot connect to the fetch socket: ",
          ready <= 0 ? "timed out" : std::strerror(err)));
    }
    fcntl(fd, F_SETFL, flags);
    fetch_wire::TuneSocket(fd);
    // Sends never block for long: a server that stops reading fails them.
    struct timeval tv = {static_cast<time_t>(absl::ToInt64Seconds(timeout)), 0};
    if (tv.tv_sec == 0) tv.tv_sec = 1;
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    return absl::OkStatus();
  }

  // Whole sends and receives, through the TLS session when there is one.
  // A plaintext socket times sends out by SO_SNDTIMEO, and receives by
  // SO_RCVTIMEO where set, not by `deadline`.
  absl::Status SendAll(struct iovec* iov, int iovcnt) {
    return tls_ != nullptr ? tls_->Send(iov, iovcnt, send_timeout_)
                           : fetch_wire::SendAll(fd_, iov, iovcnt);
  }
  absl::Status RecvAll(void* data, size_t bytes,
                       absl::Time deadline = absl::InfiniteFuture()) {
    return tls_ != nullptr ? tls_->Recv(data, bytes, deadline)
                           : fetch_wire::RecvAll(fd_, data, bytes);
  }
  absl::Status Discard(size_t bytes) {
    return tls_ != nullptr ? tls_->Discard(bytes)
                           : fetch_wire::Discard(fd_, bytes);
  }

  absl::Status SayHello(const std::string& token, absl::Duration timeout) {
    fetch_wire::Hello hello;
    hello.token_bytes = static_cast<uint32_t>(token.size());
    struct iovec iov[2] = {{&hello, sizeof(hello)},
                           {const_cast<char*>(token.data()), token.size()}};
    IG_RETURN_IF_ERROR(SendAll(iov, 2));
    // The reply, within the timeout.
    const absl::Time deadline = absl::Now() + timeout;
    struct timeval tv = {static_cast<time_t>(absl::ToInt64Seconds(timeout)), 0};
    if (tv.tv_sec == 0) tv.tv_sec = 1;
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    fetch_wire::HelloReply reply;
    IG_RETURN_IF_ERROR(RecvAll(&reply, sizeof(reply), deadline));
    if (reply.magic != fetch_wire::kHelloMagic ||
        reply.message_bytes > fetch_wire::kMaxMessageBytes) {
      return absl::UnavailableError("the fetch socket spoke an unknown protocol");
    }
    std::string message(reply.message_bytes, '\0');
    IG_RETURN_IF_ERROR(RecvAll(message.data(), message.size(), deadline));
    struct timeval none = {0, 0};  // replies to fetches: the waiter's timeout
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
    return absl::Status(static_cast<absl::StatusCode>(reply.status_code),
                        message);
  }

  bool carries_appends() const override { return true; }

  void Write(GrpcFetchBuffer* buffer) override {
    if (buffer->append != nullptr) return WriteAppend(buffer);
    const kv::FetchRequest& req = buffer->request;
    fetch_wire::FetchRequestHeader header;
    if (req.held()) header.magic = fetch_wire::kHeldMagic;
    header.n_offsets = static_cast<uint32_t>(req.plan().head_offsets_size());
    header.n_indices = static_cast<uint32_t>(req.plan().indices_size());
    header.layer = req.layer();
    header.request_id = req.request_id();
    header.sequence_id = req.sequence_id();
    header.session_id = req.session_id();
    header.dest_elements = req.dest_elements();
    struct iovec iov[3] = {
        {&header, sizeof(header)},
        {const_cast<int32_t*>(req.plan().head_offsets().data()),
         header.n_offsets * sizeof(int32_t)},
        {const_cast<int32_t*>(req.plan().indices().data()),
         header.n_indices * sizeof(int32_t)}};
    absl::Status sent;
    {
      absl::MutexLock lock(&write_mu_);
      sent = SendAll(iov, 3);
    }
    if (!sent.ok()) Cut();
  }

  // An append's header and its K and V, straight from the caller's block.
  void WriteAppend(GrpcFetchBuffer* buffer) {
    const kv::FetchRequest& req = buffer->request;
    const AppendBlock& block = *buffer->append;
    fetch_wire::FetchRequestHeader header;
    header.magic = fetch_wire::kAppendMagic;
    header.n_offsets = static_cast<uint32_t>(block.n_layers);
    header.n_indices = static_cast<uint32_t>(block.n_tokens);
    header.layer = block.first_layer;
    header.request_id = req.request_id();
    header.sequence_id = req.sequence_id();
    header.session_id = req.session_id();
    header.dest_elements = block.k.size();
    uint64_t meta_bytes = buffer->append_meta.size();
    const size_t bytes = block.k.size() * sizeof(uint16_t);
    struct iovec iov[5] = {
        {&header, sizeof(header)},
        {&meta_bytes, sizeof(meta_bytes)},
        {const_cast<uint16_t*>(block.k.data()), bytes},
        {const_cast<uint16_t*>(block.v.data()), bytes},
        {buffer->append_meta.data(), buffer->append_meta.size()}};
    absl::Status sent;
    {
      absl::MutexLock lock(&write_mu_);
      sent = SendAll(iov, 5);
    }
    if (!sent.ok()) Cut();
  }

  void Cut() override { shutdown(fd_, SHUT_RDWR); }

  void ReadLoop() {
    std::string message;
    absl::Status error;
    while (true) {
      fetch_wire::FetchResponseHeader header;
      error = RecvAll(&header, sizeof(header));
      if (!error.ok()) break;
      if (header.magic != fetch_wire::kResponseMagic ||
          header.message_bytes > fetch_wire::kMaxMessageBytes) {
        error = absl::InternalError("malformed response on the fetch socket");
        break;
      }
      message.resize(header.message_bytes);
      error = RecvAll(message.data(), message.size());
      if (!error.ok()) break;
      const absl::Status status(
          static_cast<absl::StatusCode>(header.status_code), message);
      if (header.request_id == 0) {  // the server is closing on us
        error = status.ok() ? absl::UnavailableError("fetch socket closed")
                            : status;
        break;
      }
      GrpcFetchBuffer* buffer = Take(header.request_id);
      if (buffer == nullptr) {  // abandoned after a timeout
        error = Discard(header.rows_bytes);
        if (!error.ok()) break;
        continue;
      }
      if (buffer->append != nullptr) {  // the evicted tokens
        error = ReceiveEvicted(buffer, header.rows_bytes, status);
        if (!error.ok()) break;
        continue;
      }
      if (header.rows_bytes > buffer->size() * sizeof(uint16_t)) {
        buffer->Complete(absl::InternalError(absl::StrCat(
            "the server sent ", header.rows_bytes, " bytes of rows for a ",
            buffer->size() * sizeof(uint16_t), "-byte fetch buffer")));
        error = absl::InternalError("oversized response on the fetch socket");
        break;
      }
      error = RecvAll(buffer->data(), header.rows_bytes);
      if (!error.ok()) {
        buffer->Complete(error);
        break;
      }
      buffer->Complete(status);
    }
    Break(error.code() == absl::StatusCode::kUnavailable
              ? absl::UnavailableError(absl::StrCat(
                    "lost the KV memory server's fetch socket: ",
                    error.message()))
              : error);
  }

  // An append's response: `bytes` of evicted-token triples into the
  // buffer's `evicted`, at most one per layer, token and KV head (at most
  // one per K value); completes the buffer with `status`. Not OK when the
  // connection can no longer be read.
  absl::Status ReceiveEvicted(GrpcFetchBuffer* buffer, uint64_t bytes,
                              const absl::Status& status) {
    const AppendBlock& block = *buffer->append;
    if (bytes % (3 * sizeof(int32_t)) != 0 ||
        bytes / (3 * sizeof(int32_t)) > block.k.size()) {
      buffer->Complete(absl::InternalError(absl::StrCat(
          "the server sent ", bytes, " bytes of evicted tokens for an append "
          "of ", block.k.size(), " values")));
      return absl::InternalError("oversized response on the fetch socket");
    }
    buffer->evicted.resize(bytes / sizeof(int32_t));
    absl::Status got = RecvAll(buffer->evicted.data(), bytes);
    buffer->Complete(got.ok() ? status : got);
    return got;
  }

  const int fd_;
  const std::unique_ptr<fetch_tls::TlsClientStream> tls_;  // null: plaintext
  const absl::Duration send_timeout_;
  absl::Mutex write_mu_;  // one request on the wire at a time
  std::thread reader_;    // started once the Hello has passed
};

}  // namespace

absl::StatusOr<AppendResult> SocketAppender::Append(
    std::shared_ptr<FetchConnection> connection, SequenceId seq,
    SessionId session, uint64_t request_id, absl::Time deadline,
    const AppendBlock& block, std::string meta) {
  absl::MutexLock lock(&mu_);
  if (buffer_ == nullptr) {
    IG_ASSIGN_OR_RETURN(uint16_t* memory, AllocateFetchMemory(1));
    buffer_ = std::make_unique<GrpcFetchBuffer>(client_, waiter_, memory, 1);
  }
  IG_ASSIGN_OR_RETURN(
      GrpcFetchBuffer * buffer,
      FetchBuffer::Claim<GrpcFetchBuffer>(client_, buffer_.get()));
  buffer->request_id = request_id;
  buffer->deadline = deadline;
  kv::FetchRequest& req = buffer->request;
  req.Clear();
  req.set_sequence_id(seq);
  req.set_session_id(session);
  req.set_layer(block.first_layer);
  req.set_request_id(request_id);
  buffer->append = &block;
  buffer->append_meta = std::move(meta);
  buffer->connection = std::move(connection);
  buffer->connection->Send(buffer);
  const absl::Status status = FetchHandle(buffer).Wait();
  buffer->append = nullptr;
  IG_RETURN_IF_ERROR(status);
  AppendResult result;
  result.evicted =
      EvictedFromTriples(buffer->evicted.data(), buffer->evicted.size() / 3);
  return result;
}

std::shared_ptr<FetchConnection> NewStreamConnection(
    kv::KvMemory::StubInterface* stub, const std::string& auth) {
  return std::make_shared<StreamConnection>(stub, auth);
}

absl::StatusOr<std::shared_ptr<FetchConnection>> ConnectFetchSocket(
    const std::string& host, int port, const std::string& token, SSL_CTX* tls,
    const std::string& server_name, absl::Duration timeout) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<SocketConnection> connection,
                      SocketConnection::Connect(host, port, token, tls,
                                                server_name, timeout));
  return std::shared_ptr<FetchConnection>(std::move(connection));
}

}  // namespace infinigen::kv_memory_service
