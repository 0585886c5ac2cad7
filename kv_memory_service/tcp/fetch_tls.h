// TLS on the fetch socket (fetch_wire.h), with Debian's OpenSSL: the same
// frames inside a TLS session. A node under TLS advertises its socket as
// GetServerInfo's fetch_tls_port, not fetch_port, so a client that does not
// speak TLS there never sends it plaintext frames (an older one takes the
// gRPC stream). FetchSocketServer runs OpenSSL itself on its non-blocking
// event loops; this file holds what both ends share and the client's end.
//
// TlsClientStream is one client session over a connected socket. One
// thread may Send while another Recvs: an SSL object must not be used by
// two threads at once, so each call holds a lock only while OpenSSL runs
// on the non-blocking socket, and waits for the socket outside it.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_TLS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_TLS_H_

#include <sys/uio.h>

#include <cstddef>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "openssl/ssl.h"

namespace infinigen::kv_memory_service::fetch_tls {

// The first byte a TLS client sends (a handshake record). A plaintext Hello
// starts with fetch_wire::kHelloMagic's low byte instead.
inline constexpr unsigned char kHandshakeRecord = 0x16;

// A BIO over socket `fd` (not owned, never closed) that sends with
// MSG_NOSIGNAL: OpenSSL's own socket BIO write()s, and a peer that has gone
// would raise SIGPIPE. Null if OpenSSL cannot allocate.
BIO* NewSocketBio(int fd);

// OpenSSL's reason for the last failure on this thread (the oldest error in
// its queue, which is then cleared), or "" when the queue is empty.
std::string TakeError();

struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};
using SslPtr = std::unique_ptr<SSL, SslFree>;

class TlsClientStream {
 public:
  // Handshakes as a client over connected socket `fd` (not owned; made
  // non-blocking) within `timeout`, checking the server's certificate
  // against `ctx`'s CA and `server_name` (a DNS name, or an IP address the
  // certificate must list). Unavailable with OpenSSL's reason when either
  // side refuses; DeadlineExceeded at the timeout.
  static absl::StatusOr<std::unique_ptr<TlsClientStream>> Connect(
      int fd, SSL_CTX* ctx, const std::string& server_name,
      absl::Duration timeout);

  // Writes every byte of the iovecs, in one TLS record where they fit,
  // waiting at most `timeout` each time the socket takes nothing.
  // Unavailable when the connection fails; DeadlineExceeded at the timeout.
  absl::Status Send(const struct iovec* iov, int iovcnt,
                    absl::Duration timeout);
  // Reads exactly `bytes` by `deadline`. Unavailable when the peer closes or
  // the connection fails (or is shut down); DeadlineExceeded at `deadline`.
  absl::Status Recv(void* data, size_t bytes,
                    absl::Time deadline = absl::InfiniteFuture());
  // Reads and drops `bytes`.
  absl::Status Discard(size_t bytes);

 private:
  TlsClientStream(int fd, SslPtr ssl) : fd_(fd), ssl_(std::move(ssl)) {}

  const int fd_;
  absl::Mutex mu_;  // held only while OpenSSL runs
  const SslPtr ssl_ ABSL_PT_GUARDED_BY(mu_);
  absl::Mutex send_mu_;  // one Send at a time
  std::string send_buffer_ ABSL_GUARDED_BY(send_mu_);
};

}  // namespace infinigen::kv_memory_service::fetch_tls

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_TLS_H_
