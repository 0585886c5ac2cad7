// FetchSocketServer: the server side of the plain-socket fetch path of the
// TCP data plane (protocol in kv_memory_service/tcp/fetch_wire.h). Listens
// on a TCP port beside the gRPC one; each connection gets a thread that
// reads a request, gathers straight into its reusable response buffer and
// writes the response with one sendmsg. Same checks and codes as the gRPC
// Fetch (serve_fetch.h), the same auth token (in the Hello).
//
// KvServer owns one when it listens on TCP and advertises its port through
// GetServerInfo. Thread-safe; Stop() closes every connection (clients see
// Unavailable) and waits for their threads.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SERVER_FETCH_SOCKET_SERVER_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SERVER_FETCH_SOCKET_SERVER_H_

#include <atomic>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kv_memory_service/kv_store.h"

namespace infinigen::kv_memory_service {

struct FetchSocketServerOptions {
  std::string host = "127.0.0.1";  // to bind; "0.0.0.0" / "::" for all
  int port = 0;                    // 0: any free port
  std::string auth_token;          // empty: no check
  // Largest request frame and largest response rows.
  int32_t max_message_bytes = 64 << 20;
  int32_t max_connections = 1024;
};

class FetchSocketServer {
 public:
  // Unavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<FetchSocketServer>> Start(
      std::shared_ptr<KvStore> store, const FetchSocketServerOptions& options);
  ~FetchSocketServer();  // Stop()

  int port() const { return port_; }
  void Stop();

 private:
  FetchSocketServer(std::shared_ptr<KvStore> store,
                    const FetchSocketServerOptions& options, int listen_fd,
                    int port);
  struct Connection {
    int fd = -1;
    bool closed = false;  // guarded by mu_
    std::atomic<bool> done{false};  // its thread has finished
    std::thread thread;
  };

  void AcceptLoop();
  void Serve(Connection* connection);
  bool Hello(int fd);

  const std::shared_ptr<KvStore> store_;
  const FetchSocketServerOptions options_;
  const std::string expected_token_;  // "Bearer TOKEN", or empty
  const int listen_fd_;
  const int port_;
  std::thread acceptor_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SERVER_FETCH_SOCKET_SERVER_H_
