// The TCP client's fetch path: a fetch buffer in plain host memory, and a
// long-lived fetch connection per client with a reader thread that
// completes fetches as their responses arrive, over the server's fetch
// socket (fetch_wire.h, plaintext or TLS) or the gRPC FetchStream. Private
// to the control client (control/grpc_client.cc), which owns one connection
// at a time.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_CONNECTION_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_CONNECTION_H_

#include <openssl/ssl.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_memory_service/client/kv_client.h"
#include "proto/kv_memory.grpc.pb.h"

namespace infinigen::kv_memory_service {

class GrpcFetchBuffer;

// What a GrpcFetchBuffer's WaitForFetch calls: its client's wait (deadline,
// abandoning a late fetch).
class FetchWaiter {
 public:
  virtual ~FetchWaiter() = default;
  virtual absl::Status WaitFor(GrpcFetchBuffer* buffer) = 0;
};

class FetchConnection;


// Plain host memory, the request it reuses for every fetch, and the
// connection its fetch in flight went out on.
class GrpcFetchBuffer final : public FetchBuffer {
 public:
  // `memory` (malloc'd, freed with the buffer) of `size` values, owned by
  // `client`, whose fetches `waiter` waits for.
  GrpcFetchBuffer(KvClient* client, FetchWaiter* waiter, uint16_t* memory,
                  size_t size)
      : FetchBuffer(client, memory, size), waiter_(waiter), memory_(memory) {}
  ~GrpcFetchBuffer() override { std::free(memory_); }

  void Complete(absl::Status status) { CompleteFetch(std::move(status)); }
  bool Await(absl::Time deadline) { return AwaitCompletion(deadline); }
  absl::Status Take() { return TakeResult(); }

  // Set by FetchAsync before the request leaves; read by the waiter and the
  // connection.
  kv::FetchRequest request;  // the gRPC stream's request
  uint64_t request_id = 0;
  absl::Time deadline;
  std::shared_ptr<FetchConnection> connection;
  // An append through this buffer (a connection that carries_appends):
  // the block sent, in place of the request's plan (whose sequence,
  // session and ids it uses), and the evicted tokens its response brings,
  // as (layer, kv_head, position) triples, in place of rows.
  const AppendBlock* append = nullptr;
  std::string append_meta;  // its annotations (EncodePrefixMeta)
  std::vector<int32_t> evicted;

 private:
  absl::Status WaitForFetch() override { return waiter_->WaitFor(this); }

  FetchWaiter* const waiter_;
  uint16_t* const memory_;
};

// The fetch path of one client: a long-lived connection, a reader thread
// that completes fetches as their responses arrive, and the fetches still
// waiting. Two kinds: the plain socket (fetch_wire.h) and the gRPC
// FetchStream. Once broken (the server went away, or a fetch timed out and
// the connection was cut), it fails every pending fetch and takes no more;
// the client opens a new one.
class FetchConnection {
 public:
  virtual ~FetchConnection() = default;

  bool broken() const {
    absl::MutexLock lock(&mu_);
    return broken_;
  }

  // Whether Send takes a buffer's append (the fetch socket does; the gRPC
  // stream does not: its appends are unary calls).
  virtual bool carries_appends() const { return false; }

  // Registers `buffer` (request filled in) and sends its request. A failed
  // send breaks the connection, which fails the fetch with the others.
  void Send(GrpcFetchBuffer* buffer) {
    {
      absl::MutexLock lock(&mu_);
      if (broken_) {
        buffer->Complete(error_);
        return;
      }
      pending_[buffer->request_id] = buffer;
    }
    Write(buffer);
  }

  // For a waiter whose deadline passed: true if its fetch was still pending
  // (now removed: nothing will write into the buffer; the connection is cut
  // since the server is hung or far behind); false if the reader is
  // completing it right now.
  bool Abandon(uint64_t request_id) {
    {
      absl::MutexLock lock(&mu_);
      if (pending_.erase(request_id) == 0) return false;
      timed_out_ = true;
    }
    Cut();
    return true;
  }

 protected:
  // Sends the request of a registered fetch; on failure, Cut().
  virtual void Write(GrpcFetchBuffer* buffer) = 0;
  // Ends the connection so that the reader thread stops.
  virtual void Cut() = 0;

  // Reader thread: takes the pending fetch `request_id`, or null when it was
  // abandoned.
  GrpcFetchBuffer* Take(uint64_t request_id) {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(request_id);
    if (it == pending_.end()) return nullptr;
    GrpcFetchBuffer* buffer = it->second;
    pending_.erase(it);
    return buffer;
  }

  // Reader thread, at the end: fails every pending fetch with `error` (or
  // DeadlineExceeded if a timeout cut the connection).
  void Break(absl::Status error) {
    absl::flat_hash_map<uint64_t, GrpcFetchBuffer*> failed;
    {
      absl::MutexLock lock(&mu_);
      if (timed_out_) {
        error = absl::DeadlineExceededError(
            "the KV memory server did not answer a fetch in time; the fetch "
            "connection was cut");
      }
      broken_ = true;
      error_ = error;
      failed.swap(pending_);
    }
    for (auto& [id, buffer] : failed) buffer->Complete(error);
  }

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, GrpcFetchBuffer*> pending_ ABSL_GUARDED_BY(mu_);
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// A client's appends over its fetch socket (fetch_wire.h, kAppendMagic),
// one at a time, through a buffer of its own that the responses' evicted
// tokens come into. Thread-safe.
class SocketAppender {
 public:
  // For `client`, whose fetches `waiter` waits for (both outlive it).
  SocketAppender(KvClient* client, FetchWaiter* waiter)
      : client_(client), waiter_(waiter) {}

  // Appends `block`, with `meta` (its annotations, EncodePrefixMeta's),
  // to `seq` for `session` over `connection` (which carries_appends) as
  // request `request_id`, and waits for the answer as for a fetch due at
  // `deadline` (the waiter's timeout and abandoning). The evicted tokens,
  // or the fetch's errors and the store's append errors.
  absl::StatusOr<AppendResult> Append(
      std::shared_ptr<FetchConnection> connection, SequenceId seq,
      SessionId session, uint64_t request_id, absl::Time deadline,
      const AppendBlock& block, std::string meta);

 private:
  KvClient* const client_;
  FetchWaiter* const waiter_;
  absl::Mutex mu_;
  std::unique_ptr<GrpcFetchBuffer> buffer_ ABSL_GUARDED_BY(mu_);
};

// A FetchConnection over the gRPC FetchStream of `stub` (which outlives
// it); `auth` is the authorization metadata ("Bearer TOKEN", or empty).
std::shared_ptr<FetchConnection> NewStreamConnection(
    kv::KvMemory::StubInterface* stub, const std::string& auth);

// Connects to the fetch socket at host:port (each address it resolves to,
// in turn) within `timeout`, through TLS when `tls` is set (the server's
// certificate checked against `server_name`), and says Hello with `token`.
// Unavailable, DeadlineExceeded, or the server's refusal (Unauthenticated;
// FailedPrecondition from a TLS socket to a plaintext client).
absl::StatusOr<std::shared_ptr<FetchConnection>> ConnectFetchSocket(
    const std::string& host, int port, const std::string& token, SSL_CTX* tls,
    const std::string& server_name, absl::Duration timeout);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TCP_FETCH_CONNECTION_H_
