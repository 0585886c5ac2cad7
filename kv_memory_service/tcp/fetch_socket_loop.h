// The fetch socket's event loops (fetch_socket_server.h): a connection's
// state, and a FetchSocketLoop, one epoll set with the connections it owns
// and its thread, serving for its host (fetch_socket_host.h: the server).
// fetch_socket_loop.cc runs the loop (epoll, deadlines, closing);
// fetch_socket_protocol.cc moves bytes (TLS, framing, judging requests,
// replies). Private to tcp/.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_LOOP_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_LOOP_H_

#include <sys/epoll.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_memory_service/tcp/fetch_socket_host.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_wire.h"

namespace infinigen::kv_memory_service {

// One connection, served by one loop. Fields below `loop` are touched only
// by that loop's thread; the flags are the server's (mu_).
struct FetchSocketConnection {
  enum class State {
    kTls,      // the TLS handshake (TLS servers only)
    kHello,    // reading the Hello
    kToken,    // reading its token
    kHeader,   // reading a request header
    kAppendTail,  // reading an append header's annotation size
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
  FetchSocketLoop* loop = nullptr;

  State state = State::kHello;
  State after = State::kHeader;  // once the reply is sent
  bool close_after_send = false;
  size_t got = 0;  // bytes of the current part
  fetch_wire::Hello hello;
  std::string token;
  fetch_wire::FetchRequestHeader q;
  uint64_t append_meta_bytes = 0;  // an append's, after its header
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


class FetchSocketLoop {
 public:
  using Connection = FetchSocketConnection;

  static absl::StatusOr<std::unique_ptr<FetchSocketLoop>> Create();
  ~FetchSocketLoop() {
    close(epoll_fd_);
    close(wake_fd_);
  }

  void Start(FetchSocketHost* server) {
    server_ = server;
    thread_ = std::thread([this] { Run(); });
  }
  // Hands a new connection to the loop (any thread).
  void Add(std::unique_ptr<Connection> c);
  // Closes every connection and ends the thread (after Start).
  void Stop();

 private:
  FetchSocketLoop(int epoll_fd, int wake_fd)
      : epoll_fd_(epoll_fd), wake_fd_(wake_fd) {}

  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  void Run();

  // Registers the connections the acceptor handed over. False once the
  // loop is to stop.
  bool TakeIncoming();

  void CloseAll();

  // TLS connections whose session holds bytes it has already taken off the
  // socket, which epoll cannot report: Read stopped at its step limit.
  void ReadReady();

  void ExpireDeadlines();

  // Progress on `c`: an authenticated connection's idle clock restarts (a
  // handshake keeps its first deadline).
  void Touch(Connection* c);

  void Close(Connection* c, bool timed_out = false);

  // Counts the capacity of c's buffers in buffer_bytes_.
  void Account(Connection* c);

  void Handle(Connection* c, uint32_t events);

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
  ssize_t Receive(Connection* c, char* dst, size_t want);

  // The TLS handshake of `c`, on a TLS server. True once it is done (`c`
  // is then at its Hello), or when the peer turned out to speak plaintext;
  // false while it waits for the socket or when `c` is closed.
  bool Handshake(Connection* c);

  // Reads what has arrived, a bounded number of parts so that one busy
  // connection does not hold the loop.
  void Read(Connection* c);

  // The current part is complete. False when `c` is closed or is waiting
  // for its reply to be written.
  bool Advance(Connection* c);

  bool HelloReply(Connection* c, const absl::Status& status);

  bool Respond(Connection* c, uint64_t request_id, const absl::Status& status,
               size_t rows_bytes, Connection::State after);

  // A request header: refused at once (its body then dropped as it comes)
  // unless the sequence it names can need a body and rows of that size.
  bool Judge(Connection* c);
  // An append's header (kAppendMagic) and annotation size: refused at once
  // unless it is a block of the sequence's shape within the size limit;
  // its body's buffer is sized for it.
  bool JudgeAppend(Connection* c);

  bool Serve(Connection* c);

  bool StartSend(Connection* c);

  // Writes what the socket takes. False when `c` is closed or the reply is
  // not all written (the loop then waits for EPOLLOUT).
  bool Send(Connection* c);

  // Send through the TLS session: `out` (the header, the message and the
  // first rows), then the other rows (with partial writes, a record at a
  // time).
  bool SendTls(Connection* c);

  // The reply is all written: closes `c` if it was to be, else moves it to
  // its next state, reading again. False when `c` is closed.
  bool Sent(Connection* c);

  void Watch(Connection* c, uint32_t events);

  const int epoll_fd_;
  const int wake_fd_;
  FetchSocketHost* server_ = nullptr;
  std::thread thread_;

  absl::Mutex mu_;
  std::vector<std::unique_ptr<Connection>> incoming_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // The loop thread's own.
  absl::flat_hash_map<Connection*, std::unique_ptr<Connection>> conns_;
  absl::flat_hash_set<Connection*> ready_;          // see ReadReady
  absl::Time next_check_ = absl::InfiniteFuture();  // earliest deadline
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_SOCKET_LOOP_H_
