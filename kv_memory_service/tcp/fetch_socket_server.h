// FetchSocketServer: the server side of the plain-socket fetch path of the
// TCP data plane (protocol in kv_memory_service/tcp/fetch_wire.h). Listens
// on a TCP port beside the gRPC one. Same checks and codes as the gRPC
// Fetch (serve_fetch.h), the same auth token (in the Hello).
//
// Bounded under hostile peers. A fixed number of event-loop threads serve
// every connection with non-blocking sockets (no thread per connection).
// Each frame's header is read first and judged against the sequence it
// names (its head count, and the rows one response may carry) before the
// body is read; a body is buffered only as its bytes arrive, and the body
// of a refused frame is dropped as it arrives. A connection that has not
// passed the Hello is a handshake: handshakes wait in a small pool of their
// own (max_handshakes, max_handshakes_per_peer; when it is full the oldest
// is dropped) for at most handshake_timeout, so peers that connect and say
// nothing cannot take the slots of authenticated clients; a wrong token or
// a malformed Hello closes the connection at the first frame.
// Authenticated connections are limited in total and per peer address and
// closed after idle_timeout without a byte either way.
//
// With a TLS context (KvServer's, under --tls_cert) every connection is a
// TLS session first (fetch_tls.h): the TLS handshake is part of the
// handshake above, under the same pool and timeout, and the context's
// client CA, if any, must have signed the peer's certificate. A peer that
// fails the TLS handshake is dropped at once; one that sends a plaintext
// Hello is answered, in plaintext, FailedPrecondition ("speaks TLS") and
// closed. The loops run OpenSSL on their non-blocking sockets, waiting for
// whichever direction it wants.
//
// KvServer owns one when it listens on TCP and advertises its port through
// GetServerInfo (fetch_port, or fetch_tls_port under TLS). Thread-safe;
// Stop() closes every connection (clients see Unavailable) and waits for
// the threads.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_SERVER_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/acceptor.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/tcp/fetch_socket_host.h"

namespace infinigen::kv_memory_service {

// What the server holds now, and what it has refused.
struct FetchSocketStats {
  int32_t handshakes = 0;      // connections waiting for their Hello
  int32_t connections = 0;     // connections past the Hello
  int64_t buffer_bytes = 0;    // request and reply buffers, all connections
  int64_t body_bytes_received = 0;   // request bodies, over the server's life
  int64_t dropped_handshakes = 0;    // oldest handshakes dropped for newer
  int64_t refused = 0;  // refused at the limits, a bad Hello, a failed TLS
                        // handshake, plaintext on a TLS socket
  int64_t timed_out = 0;             // handshake or idle timeout
};

class FetchSocketServer final : private FetchSocketHost {
 public:
  // Unavailable when the address cannot be bound; InvalidArgument for an
  // option out of range.
  static absl::StatusOr<std::unique_ptr<FetchSocketServer>> Start(
      std::shared_ptr<KvStore> store, const FetchSocketServerOptions& options);
  ~FetchSocketServer();  // Stop()

  int port() const { return port_; }
  FetchSocketStats GetStats() const;
  void Stop();

 private:
  using Loop = FetchSocketLoop;
  using Connection = FetchSocketConnection;

  FetchSocketServer(std::shared_ptr<KvStore> store,
                    const FetchSocketServerOptions& options, int listen_fd,
                    int port);
  void AcceptLoop();
  // Makes room for one more handshake from `peer`: drops the oldest
  // handshake of the peer, or of all, when a pool is full.
  void MakeRoomForHandshakeLocked(const std::string& peer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Admit(Connection* c) override;
  // `c`, counted as a handshake, is one no longer.
  void ForgetHandshakeLocked(Connection* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountRefused() override;
  void Release(Connection* c, bool timed_out) override;

  const int listen_fd_;
  const int port_;
  std::vector<std::unique_ptr<Loop>> loops_;
  Acceptor accept_;  // used by the acceptor thread alone
  std::thread acceptor_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Handshakes, oldest first; Connection::closed guards against a second
  // shutdown once a loop has closed one.
  std::vector<Connection*> handshakes_ ABSL_GUARDED_BY(mu_);
  int32_t connections_ ABSL_GUARDED_BY(mu_) = 0;
  struct PeerCount {
    int32_t handshakes = 0;
    int32_t connections = 0;
  };
  absl::flat_hash_map<std::string, PeerCount> peers_ ABSL_GUARDED_BY(mu_);
  int64_t dropped_handshakes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t timed_out_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_SERVER_H_
