// What a FetchSocketServer shares with its event loops
// (fetch_socket_loop.h): its options, store and credentials, the byte
// counts the loops keep, and the admission calls they make. The server
// derives from FetchSocketHost, and a loop holds it as its host, so the
// loops build on this header alone and not on the server's. Private to
// tcp/ but for the options, which fetch_socket_server.h offers.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_HOST_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_HOST_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kv_memory_service/serving/credentials.h"
#include "kv_memory_service/serving/request_metrics.h"
#include "kv_memory_service/store/kv_store.h"
#include "openssl/ssl.h"

namespace infinigen::kv_memory_service {

struct FetchSocketServerOptions {
  std::string host = "127.0.0.1";  // to bind; "0.0.0.0" / "::" for all
  int port = 0;                    // 0: any free port
  Credentials credentials;         // empty: no check
  // Largest request frame and largest response rows.
  int32_t max_message_bytes = 64 << 20;
  // Event-loop threads serving all connections.
  int32_t threads = 2;
  // Most connections past the Hello, in all and from one peer address.
  // Beyond them a Hello is answered ResourceExhausted.
  int32_t max_connections = 1024;
  int32_t max_connections_per_peer = 256;
  // Most connections waiting for their Hello, in all and from one peer
  // address; one more drops the oldest.
  int32_t max_handshakes = 64;
  int32_t max_handshakes_per_peer = 16;
  // A connection must complete its Hello within handshake_timeout, and is
  // closed after idle_timeout without progress either way (zero: never).
  absl::Duration handshake_timeout = absl::Seconds(5);
  absl::Duration idle_timeout = absl::Minutes(10);
  // Records each fetch served and each Hello or request refused (not owned,
  // outlives the server; null: none).
  RequestMetrics* metrics = nullptr;
  // A server context (NewServerTlsContext, common/server_tls.h): every
  // connection speaks TLS. Null: plaintext.
  std::shared_ptr<SSL_CTX> tls;
};

struct FetchSocketConnection;  // fetch_socket_loop.h
class FetchSocketLoop;         // fetch_socket_loop.h

class FetchSocketHost {
 public:
  virtual ~FetchSocketHost() = default;

  // The Hello of `c` was valid: OK if it may become a connection (counted
  // as one from now), ResourceExhausted at the limits.
  virtual absl::Status Admit(FetchSocketConnection* c) = 0;
  // A Hello refused for its form or its token.
  virtual void CountRefused() = 0;
  // Uncounts `c` (counting a timeout if it `timed_out`) and closes its
  // descriptor; it leaves every list.
  virtual void Release(FetchSocketConnection* c, bool timed_out) = 0;

  const std::shared_ptr<KvStore> store_;
  const FetchSocketServerOptions options_;
  const Credentials credentials_;
  // Request and reply buffers of every connection, and request bodies over
  // the server's life, in bytes.
  std::atomic<int64_t> buffer_bytes_{0};
  std::atomic<int64_t> body_bytes_received_{0};

 protected:
  FetchSocketHost(std::shared_ptr<KvStore> store,
                  const FetchSocketServerOptions& options)
      : store_(std::move(store)),
        options_(options),
        credentials_(options.credentials) {}
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_HOST_H_
