#include "kv_memory_service/tcp/fetch_tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "openssl/err.h"
#include "openssl/x509v3.h"

namespace infinigen::kv_memory_service::fetch_tls {
namespace {

struct SocketBioState {
  int fd = -1;
  bool eof = false;  // a read saw the peer's end
};

SocketBioState* State(BIO* bio) {
  return static_cast<SocketBioState*>(BIO_get_data(bio));
}

int SocketBioWrite(BIO* bio, const char* data, int len) {
  BIO_clear_retry_flags(bio);
  ssize_t n;
  do {
    n = send(State(bio)->fd, data, static_cast<size_t>(len), MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    BIO_set_retry_write(bio);
  }
  return static_cast<int>(n);
}

int SocketBioRead(BIO* bio, char* data, int len) {
  BIO_clear_retry_flags(bio);
  ssize_t n;
  do {
    n = recv(State(bio)->fd, data, static_cast<size_t>(len), 0);
  } while (n < 0 && errno == EINTR);
  if (n == 0) State(bio)->eof = true;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    BIO_set_retry_read(bio);
  }
  return static_cast<int>(n);
}

int SocketBioPuts(BIO* bio, const char* text) {
  return SocketBioWrite(bio, text, static_cast<int>(std::strlen(text)));
}

long SocketBioCtrl(BIO* bio, int cmd, long, void*) {  // NOLINT(runtime/int)
  switch (cmd) {
    case BIO_CTRL_FLUSH:  // sends are not buffered
      return 1;
    case BIO_CTRL_EOF:
      return State(bio)->eof ? 1 : 0;
    default:
      return 0;
  }
}

int SocketBioDestroy(BIO* bio) {
  delete State(bio);
  BIO_set_data(bio, nullptr);
  return 1;
}

BIO_METHOD* SocketBioMethod() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK,
                                 "infinigen fetch socket");
    if (m != nullptr) {
      BIO_meth_set_write(m, SocketBioWrite);
      BIO_meth_set_read(m, SocketBioRead);
      BIO_meth_set_puts(m, SocketBioPuts);
      BIO_meth_set_ctrl(m, SocketBioCtrl);
      BIO_meth_set_destroy(m, SocketBioDestroy);
    }
    return m;
  }();
  return method;
}

bool IsIpAddress(const std::string& name) {
  unsigned char addr[sizeof(struct in6_addr)];
  return inet_pton(AF_INET, name.c_str(), addr) == 1 ||
         inet_pton(AF_INET6, name.c_str(), addr) == 1;
}

// Why an SSL call on `ssl` failed with SSL_get_error's `err` (errno was
// `saved_errno` right after it). Call on the thread that made the call.
std::string Failure(SSL* ssl, int err, int saved_errno) {
  switch (err) {
    case SSL_ERROR_ZERO_RETURN:
      return "closed";
    case SSL_ERROR_SYSCALL: {
      const std::string queued = TakeError();
      if (!queued.empty()) return queued;
      return saved_errno == 0 ? "closed" : std::strerror(saved_errno);
    }
    default: {
      std::string why = TakeError();
      if (why.empty()) why = absl::StrCat("TLS error ", err);
      const long verify = SSL_get_verify_result(ssl);  // NOLINT(runtime/int)
      if (verify != X509_V_OK) {
        absl::StrAppend(&why, " (", X509_verify_cert_error_string(verify), ")");
      }
      return why;
    }
  }
}

// Waits until `fd` is ready for `events` (or has an error the next call
// reports). DeadlineExceeded at `deadline`.
absl::Status WaitFor(int fd, short events, absl::Time deadline,  // NOLINT
                     const char* what) {
  while (true) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(
            absl::StrCat("fetch connection ", what, " timed out"));
      }
      timeout_ms = static_cast<int>(std::min<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
          INT_MAX));
    }
    struct pollfd p = {fd, events, 0};
    const int n = poll(&p, 1, timeout_ms);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) {
      return absl::UnavailableError(
          absl::StrCat("fetch connection ", what, ": ", std::strerror(errno)));
    }
  }
}

}  // namespace

BIO* NewSocketBio(int fd) {
  BIO_METHOD* method = SocketBioMethod();
  BIO* bio = method == nullptr ? nullptr : BIO_new(method);
  if (bio == nullptr) return nullptr;
  BIO_set_data(bio, new SocketBioState{fd});
  BIO_set_init(bio, 1);
  return bio;
}

std::string TakeError() {
  const unsigned long e = ERR_get_error();  // NOLINT(runtime/int)
  ERR_clear_error();
  if (e == 0) return "";
  char text[256];
  ERR_error_string_n(e, text, sizeof(text));
  return text;
}

absl::StatusOr<std::unique_ptr<TlsClientStream>> TlsClientStream::Connect(
    int fd, SSL_CTX* ctx, const std::string& server_name,
    absl::Duration timeout) {
  if (server_name.empty()) {
    return absl::InvalidArgumentError(
        "a TLS fetch connection needs the server's name");
  }
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return absl::UnavailableError(
        absl::StrCat("fetch connection: cannot make the socket non-blocking: ",
                     std::strerror(errno)));
  }
  ERR_clear_error();
  SslPtr ssl(SSL_new(ctx));
  BIO* bio = ssl == nullptr ? nullptr : NewSocketBio(fd);
  if (bio == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot make a TLS session: ", TakeError()));
  }
  SSL_set_bio(ssl.get(), bio, bio);  // the session owns it
  const bool named =
      IsIpAddress(server_name)
          ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()),
                                          server_name.c_str()) == 1
          : SSL_set_tlsext_host_name(ssl.get(), server_name.c_str()) == 1 &&
                SSL_set1_host(ssl.get(), server_name.c_str()) == 1;
  if (!named) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("'", server_name, "' is not a name TLS can check"));
  }
  SSL_set_mode(ssl.get(), SSL_MODE_ENABLE_PARTIAL_WRITE |
                              SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Several records per recv; Recv waits on the socket only once OpenSSL
  // wants more than it holds.
  SSL_set_read_ahead(ssl.get(), 1);
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    ERR_clear_error();
    errno = 0;
    const int r = SSL_connect(ssl.get());
    const int saved_errno = errno;
    if (r == 1) break;
    const int err = SSL_get_error(ssl.get(), r);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      absl::Status ready =
          WaitFor(fd, err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline,
                  "TLS handshake");
      if (!ready.ok()) return ready;
      continue;
    }
    return absl::UnavailableError(
        absl::StrCat("TLS handshake with the fetch socket failed: ",
                     Failure(ssl.get(), err, saved_errno)));
  }
  return std::unique_ptr<TlsClientStream>(
      new TlsClientStream(fd, std::move(ssl)));
}

absl::Status TlsClientStream::Send(const struct iovec* iov, int iovcnt,
                                   absl::Duration timeout) {
  absl::MutexLock send_lock(&send_mu_);
  // One record for a request's header and body (each SSL_write is one).
  send_buffer_.clear();
  for (int i = 0; i < iovcnt; ++i) {
    send_buffer_.append(static_cast<const char*>(iov[i].iov_base),
                        iov[i].iov_len);
  }
  size_t sent = 0;
  while (sent < send_buffer_.size()) {
    int n, err = SSL_ERROR_NONE;
    std::string why;
    {
      absl::MutexLock lock(&mu_);
      ERR_clear_error();
      errno = 0;
      n = SSL_write(ssl_.get(), send_buffer_.data() + sent,
                    static_cast<int>(
                        std::min<size_t>(send_buffer_.size() - sent, INT_MAX)));
      const int saved_errno = errno;
      if (n <= 0) {
        err = SSL_get_error(ssl_.get(), n);
        if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
          why = Failure(ssl_.get(), err, saved_errno);
        }
      }
    }
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      absl::Status ready =
          WaitFor(fd_, err == SSL_ERROR_WANT_WRITE ? POLLOUT : POLLIN,
                  absl::Now() + timeout, "send");
      if (!ready.ok()) return ready;
      continue;
    }
    return absl::UnavailableError(absl::StrCat("fetch connection send: ", why));
  }
  return absl::OkStatus();
}

absl::Status TlsClientStream::Recv(void* data, size_t bytes,
                                   absl::Time deadline) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    int n, err = SSL_ERROR_NONE;
    std::string why;
    {
      absl::MutexLock lock(&mu_);
      ERR_clear_error();
      errno = 0;
      n = SSL_read(ssl_.get(), p,
                   static_cast<int>(std::min<size_t>(bytes, INT_MAX)));
      const int saved_errno = errno;
      if (n <= 0) {
        err = SSL_get_error(ssl_.get(), n);
        if (err != SSL_ERROR_WANT_READ && err != SSL_ERROR_WANT_WRITE) {
          why = Failure(ssl_.get(), err, saved_errno);
        }
      }
    }
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      absl::Status ready =
          WaitFor(fd_, err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline,
                  "receive");
      if (!ready.ok()) return ready;
      continue;
    }
    if (why == "closed") {
      return absl::UnavailableError("fetch connection closed");
    }
    return absl::UnavailableError(
        absl::StrCat("fetch connection receive: ", why));
  }
  return absl::OkStatus();
}

absl::Status TlsClientStream::Discard(size_t bytes) {
  char sink[16384];
  while (bytes > 0) {
    const size_t chunk = std::min(bytes, sizeof(sink));
    absl::Status s = Recv(sink, chunk);
    if (!s.ok()) return s;
    bytes -= chunk;
  }
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service::fetch_tls
