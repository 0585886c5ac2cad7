// ShmServer: the server side of the shared-memory data plane (`shm:`).
//
// Listens on a unix socket; each client that connects passes it a control
// region and one memfd per FetchBuffer (layout and protocol in
// shm_protocol.h). One thread per connection serves that client's fetches by
// gathering from the KvStore straight into the client's buffer. Control
// calls (Open, Append, Close, statistics) do not come here: the Hello tells
// the client the gRPC address to use for them (`control_address`).
//
// A connection thread polls its client's slots for `spin` after each fetch
// and then sleeps on a futex in the shared region, so back-to-back fetches
// see no system call and an idle client costs nothing but a wake-up every
// 50 ms (to notice a client that died).
//
// Thread-safety: Start and the destructor from one thread; the store is
// shared with whoever else serves it (the gRPC service).
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_SERVER_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_SERVER_H_

#include <atomic>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/acceptor.h"
#include "kv_memory_service/serving/credentials.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/serving/request_metrics.h"

namespace infinigen::kv_memory_service {

struct ShmServerOptions {
  // Where to listen: "unix:PATH". The server holds PATH.lock (flock) while
  // it serves: Start fails with FailedPrecondition while another live
  // server holds it; a stale socket file at PATH is replaced.
  std::string listen_address;
  // The address clients use for control calls, sent in the Hello; e.g.
  // "unix:/run/kv.sock" or "tcp://127.0.0.1:7070".
  std::string control_address;
  // When not empty, a client must present this token when it attaches.
  Credentials credentials;
  // How long a connection thread keeps polling for the next fetch before it
  // sleeps. Longer: lower latency for fetches spaced by up to this much, at
  // the price of a busy core.
  absl::Duration spin = absl::Microseconds(200);
  // Most clients connected at once; more are refused.
  int max_connections = 256;
  // Most bytes of FetchBuffer slots one client may have mapped at once, and
  // all clients together; a MapSlot beyond either is ResourceExhausted.
  // Slots are mapped without pre-populating: only pages written cost memory.
  int64_t max_client_slot_bytes = int64_t{4} << 30;
  int64_t max_total_slot_bytes = int64_t{16} << 30;
  // Records each fetch served and each Attach, socket request or fetch
  // refused (not owned, outlives the server; null: none).
  RequestMetrics* metrics = nullptr;
};

class ShmServer {
 public:
  // Binds the socket and starts accepting. InvalidArgument for a bad
  // address; Internal/Unavailable when the socket cannot be made.
  static absl::StatusOr<std::unique_ptr<ShmServer>> Start(
      std::shared_ptr<KvStore> store, ShmServerOptions options);

  // Stops accepting, disconnects every client (their waits fail with
  // Unavailable), joins the threads and removes the socket file.
  ~ShmServer();
  ShmServer(const ShmServer&) = delete;
  ShmServer& operator=(const ShmServer&) = delete;

  // The address a client connects to: "shm:unix:PATH".
  std::string client_address() const;
  int active_connections() const;
  // Handshakes dropped for newer ones (admission, AcceptLoop), life total.
  int64_t dropped_handshakes() const {
    absl::MutexLock lock(&mu_);
    return dropped_handshakes_;
  }

 private:
  class Connection;

  ShmServer(std::shared_ptr<KvStore> store, ShmServerOptions options,
            std::string path, int listen_fd, int stop_fd, int lock_fd);
  void AcceptLoop();
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<KvStore> store_;
  const ShmServerOptions options_;
  const std::string path_;
  const int listen_fd_;
  const int stop_fd_;  // eventfd: wakes the accept loop at shutdown
  const int lock_fd_;  // holds PATH.lock
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> slot_bytes_{0};  // mapped by all connections

  mutable absl::Mutex mu_;
  std::list<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  int64_t dropped_handshakes_ ABSL_GUARDED_BY(mu_) = 0;
  Acceptor acceptor_;  // used by the accept thread alone
  std::thread accept_thread_;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_SERVER_H_
