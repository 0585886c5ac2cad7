// KvClient: the worker's view of a KV memory node, the same for every data
// plane. ConnectKvClient picks the data plane from the address:
//
//   inproc:               a KvStore in this process (the embedded default)
//   tcp://HOST:PORT       gRPC control; fetches on the server's plain
//                         fetch socket (tcp/fetch_wire.h), or inline on a
//                         gRPC stream when it has none
//   unix:PATH             gRPC over a unix-domain socket, fetches on the
//                         gRPC stream
//   shm:unix:PATH         same host: PATH is the server's shm socket
//                         (kv_memory_server --shm_listen=unix:PATH); the
//                         server gathers into memfd slots shared with the
//                         client, signalled through futexes; control calls
//                         go to the gRPC address the server announces
//                         (shm/shm_client.h)
//   rdma://HOST:PORT      another host over libibverbs: one RDMA WRITE per
//                         fetch into a registered buffer; queue pairs set
//                         up over gRPC at HOST:PORT (kv_memory_server
//                         --rdma_device). Optional ?device=NAME&port=N&
//                         gid_index=N. Unavailable("no RDMA device: ...")
//                         on hosts without one (rdma/rdma_client.h)
//
// Fetch flow. At setup the caller asks the client for FetchBuffers (one per
// fetch it wants in flight, sized for its largest plan). A buffer is memory
// the data plane chose so the server can write into it directly: plain host
// memory for inproc and TCP, a slot of the shared region for shm (registered
// with CUDA as pinned memory when CUDA is present), a registered memory
// region for RDMA. FetchAsync starts a gather of one layer's rows into a
// buffer and returns at once with a FetchHandle; Wait() returns when the rows
// are in the buffer (layout in kv_types.h, FetchPlan) or the fetch failed.
// Neither allocates.
//
//   auto client = ConnectKvClient("tcp://10.0.0.2:7070", {});
//   SequenceGeometry g;  // 30 layers, 3 KV heads, head_dim 64, 4096 tokens
//   g.n_layers = 30; g.n_kv_heads = 3; g.head_dim = 64; g.max_tokens = 4096;
//   auto seq = client->Open(g);
//   auto buf = client->NewFetchBuffer(2 * kMaxIndices * 64);
//   FetchHandle h = client->FetchAsync(*seq, layer + 1, plan, buf->get());
//   ... compute layer `layer` ...
//   IG_RETURN_IF_ERROR(h.Wait());   // rows of layer + 1 are in (*buf)->data()
//
// Errors follow KvStore's contract (kv_store.h) whatever the data plane; a
// remote client adds Unauthenticated (wrong or missing token), Unavailable
// (server gone) and DeadlineExceeded (no answer within the options'
// timeouts): a dead or hung server gives an error in bounded time, never a
// hang.
//
// Leases. A remote client owns its sequences through a session on the
// memory node and renews the session's lease from a heartbeat thread (at
// least every options.heartbeat_interval, and every third of the server's
// --lease_timeout). If the client dies, the node frees its sequences once
// the lease runs out. If the client is cut off for longer than the lease,
// its sequences are gone when it comes back (NotFound); it opens a new
// session by itself, so new sequences work. Destroying a remote client ends
// its session, closing the sequences it still owns. Health() reports
// whether the heartbeats get answers. The in-process client has no lease.
// A sequence belongs to the session that opened it: another client's
// Append, Close or GetSequenceStats on it gets NotFound, and sequence ids
// are random, so they cannot be guessed from one's own.
//
// Thread-safety: every KvClient method may be called from several threads.
// A FetchBuffer carries one fetch at a time: FetchAsync into a buffer whose
// previous fetch has not been waited on fails with FailedPrecondition.
// Buffers must be destroyed before the client that made them.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv_memory_service/client/kv_store_options.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

class KvStore;  // kv_store.h

struct KvClientOptions {
  // Sent as "authorization: Bearer <token>" with every request when not
  // empty; a server started with --auth_token_file needs it.
  std::string auth_token;
  // Deadline of each control call (Open, Close, statistics).
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Longest a fetch may take from FetchAsync to the end of Wait, and an
  // Append (the data path, where a hung node must be found out soonest);
  // then DeadlineExceeded.
  absl::Duration fetch_timeout = absl::Seconds(5);
  // How long ConnectKvClient waits for a remote server to accept the
  // connection; Unavailable after that.
  absl::Duration connect_timeout = absl::Seconds(5);
  // Largest gRPC message sent or received; match the server's limit.
  int32_t max_message_bytes = 64 << 20;
  // tcp://: fetch over the server's fetch socket when it offers one (a
  // socket round trip instead of a gRPC stream message: several times
  // faster); false = always the gRPC FetchStream.
  bool tcp_fetch_socket = true;
  // tcp://: gRPC, and the fetch socket, over TLS when tls_ca_pem is set:
  // the CA (PEM) the server's certificate must chain to. tls_cert_pem and
  // tls_key_pem: this client's certificate and key, for a server that
  // requires them (mutual TLS). tls_server_name: the name to check the
  // certificate against, when not the host of the address.
  std::string tls_ca_pem;
  std::string tls_cert_pem;
  std::string tls_key_pem;
  std::string tls_server_name;
  // Remote clients: the longest time between two heartbeats (lease
  // renewals and Health() checks); a third of the server's lease when that
  // is shorter.
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // shm:: closed sequences whose rows (GetDirectRows) the client keeps
  // mapped, and registered with CUDA, after Close: the node opens the
  // session's next sequence of the same size in the same memory
  // (KvStoreOptions::spare_rows_per_session), which is then neither mapped
  // nor registered again. 0: unmapped at the close.
  int32_t shm_kept_rows = 1;
  // inproc: the store to serve from (shared with whoever else holds it);
  // null = a new store private to the client, made with
  // inproc_store_options.
  std::shared_ptr<KvStore> inproc_store;
  KvStoreOptions inproc_store_options;
};

class FetchHandle;

// Page-aligned host memory for a fetch buffer of `elements` uint16_t values
// (rounded up to whole pages, so it can be pinned), freed with std::free;
// ResourceExhausted when it cannot be had. For the data planes whose
// buffers are plain host memory (inproc, gRPC).
absl::StatusOr<uint16_t*> AllocateFetchMemory(size_t elements);

// A destination for fetches, made by KvClient::NewFetchBuffer, holding
// size() uint16_t values. The rows of a completed fetch are at data() in
// FetchPlan's layout. The memory stays valid, at the same address, for the
// buffer's whole life, so a GPU copy may read it directly.
//
// Data planes subclass it to attach what they need (a shared-memory slot, a
// registered region, a reusable request) and use the protected completion
// calls: BeginFetch when a fetch starts, CompleteFetch from whichever thread
// learns the outcome, and WaitForFetch (overridable, e.g. to poll shared
// memory or to cancel on timeout) behind FetchHandle::Wait.
class FetchBuffer {
 public:
  virtual ~FetchBuffer() = default;
  FetchBuffer(const FetchBuffer&) = delete;
  FetchBuffer& operator=(const FetchBuffer&) = delete;

  uint16_t* data() const { return data_; }
  size_t size() const { return size_; }  // in uint16_t values
  absl::Span<uint16_t> span() const { return absl::Span<uint16_t>(data_, size_); }

  // The client that made this buffer; a client rejects others' buffers.
  const void* owner() const { return owner_; }

  // The prologue of every data plane's FetchAsync: `dest` as the Buffer
  // type `client` made, its fetch begun (BeginFetch). InvalidArgument for
  // a buffer another client (or nobody) made; FailedPrecondition for one
  // whose last fetch was not waited on. On error, FetchAsync returns
  // FetchHandle(status) at once.
  template <typename Buffer>
  static absl::StatusOr<Buffer*> Claim(const void* client, FetchBuffer* dest) {
    if (dest == nullptr || dest->owner() != client) {
      return absl::InvalidArgumentError(
          "the fetch buffer was not made by this client");
    }
    if (absl::Status begun = dest->BeginFetch(); !begun.ok()) return begun;
    return static_cast<Buffer*>(dest);
  }

 protected:
  // `data` (size values) must outlive this object; the subclass owns it.
  FetchBuffer(const void* owner, uint16_t* data, size_t size)
      : owner_(owner), data_(data), size_(size) {}

  // Marks a fetch as started. FailedPrecondition if the previous one has
  // not been waited on yet.
  absl::Status BeginFetch();
  // Records the outcome of the fetch started last and wakes its waiter.
  // Call exactly once per successful BeginFetch.
  void CompleteFetch(absl::Status status);
  // Blocks until CompleteFetch; returns its status and frees the buffer for
  // the next fetch. Data planes whose completion may never come (a remote
  // server) override it to give up at a deadline, making sure that nothing
  // writes into the buffer afterwards.
  virtual absl::Status WaitForFetch();

  // Helpers for WaitForFetch overrides. AwaitCompletion: true when
  // CompleteFetch has run, false at `deadline`. TakeResult: the status
  // CompleteFetch recorded; ends the fetch (requires completion).
  bool AwaitCompletion(absl::Time deadline);
  absl::Status TakeResult();

 private:
  friend class FetchHandle;

  const void* const owner_;
  uint16_t* const data_;
  const size_t size_;

  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;  // BeginFetch, not yet taken
  bool done_ ABSL_GUARDED_BY(mu_) = false;     // CompleteFetch ran
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// The fetch started by FetchAsync. Move-only, allocation-free. Wait() once;
// a handle destroyed without Wait() waits (and drops the status) so that no
// fetch outlives its handle.
class FetchHandle {
 public:
  FetchHandle() = default;  // a handle whose Wait() returns OK at once
  // A fetch that failed before it started (bad argument, busy buffer).
  explicit FetchHandle(absl::Status failed) : failed_(std::move(failed)) {}
  // A fetch in flight into `buffer` (its BeginFetch succeeded).
  explicit FetchHandle(FetchBuffer* buffer) : buffer_(buffer) {}
  FetchHandle(FetchHandle&& other) noexcept;
  FetchHandle& operator=(FetchHandle&& other) noexcept;
  FetchHandle(const FetchHandle&) = delete;
  FetchHandle& operator=(const FetchHandle&) = delete;
  ~FetchHandle();

  // Blocks until the rows are in the buffer (OK) or the fetch failed. A
  // second call returns the same status without blocking.
  absl::Status Wait();

 private:
  FetchBuffer* buffer_ = nullptr;
  absl::Status failed_;
};

class KvClient {
 public:
  virtual ~KvClient() = default;

  // Opens a sequence; the memory node reserves its rows now.
  absl::StatusOr<SequenceId> Open(const SequenceGeometry& geometry) {
    absl::StatusOr<OpenedSequence> opened =
        OpenSequence(geometry, PrefixRequest());
    if (!opened.ok()) return opened.status();
    return opened->id;
  }
  // Opens a sequence reusing and sharing prefix blocks (kv_store.h,
  // "Prefix sharing"): cached_tokens leading tokens are attached from
  // blocks the node already holds (0 on a miss, or where the node or data
  // plane shares nothing), and the later blocks of `prefix` are shared
  // once appended.
  virtual absl::StatusOr<OpenedSequence> OpenSequence(
      const SequenceGeometry& geometry, const PrefixRequest& prefix) = 0;

  // Appends the rows of new tokens of one or more layers (AppendBlock) and
  // returns the tokens evicted to make room.
  virtual absl::StatusOr<AppendResult> Append(SequenceId seq,
                                              const AppendBlock& block) = 0;

  // A destination for fetches of up to `elements` uint16_t values
  // (FetchElements(plan, head_dim) of the largest plan). Made at setup, not
  // per fetch. InvalidArgument for 0; ResourceExhausted past the data
  // plane's limit (for TCP: the message size).
  virtual absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) = 0;

  // Starts gathering `plan`'s rows of `layer` into `dest` (a buffer from this
  // client, large enough for the plan). The plan's arrays may be reused as
  // soon as FetchAsync returns. Errors come from Wait(): those of
  // KvStore::Gather, InvalidArgument for another client's buffer,
  // FailedPrecondition for a buffer still in use.
  virtual FetchHandle FetchAsync(SequenceId seq, int32_t layer,
                                 const FetchPlan& plan, FetchBuffer* dest) = 0;

  // FetchAsync + Wait.
  absl::Status Fetch(SequenceId seq, int32_t layer, const FetchPlan& plan,
                     FetchBuffer* dest) {
    return FetchAsync(seq, layer, plan, dest).Wait();
  }

  // One-sided reads, where the node is on this host (inproc: its memory;
  // shm: its rows mapped read-only into this process): `seq`'s rows where
  // the caller can read a plan's rows itself (DirectRows, kv_types.h)
  // instead of asking for a gather, valid until the sequence is closed
  // through this client. Unimplemented for a node elsewhere (the default);
  // KvStore::GetDirectRows' or ShareRows' errors otherwise.
  virtual absl::StatusOr<DirectRows> GetDirectRows(SequenceId seq) {
    return absl::UnimplementedError(
        "only a node on this host, inproc: or shm:, shares its rows");
  }
  // Tells the node the caller read `plan`'s rows of `layer` itself, so that
  // its fetch statistics and eviction see the fetch (KvStore::NoteFetched);
  // the outcome comes from Wait(). `via`: an idle buffer of this client
  // that could have held the plan's rows; a data plane may carry the note
  // through it (shm; nothing is written into it), and it is busy until the
  // handle is waited, as after FetchAsync.
  virtual FetchHandle NoteFetchedAsync(SequenceId seq, int32_t layer,
                                       const FetchPlan& plan,
                                       FetchBuffer* via) {
    return FetchHandle(
        absl::UnimplementedError("no one-sided reads on this data plane"));
  }
  // Tells the node the caller used `plan`'s rows of `layer` from copies of
  // its own (a row cache), beside the layer's last fetch, so that its
  // statistics and eviction count them as that fetch's rows
  // (KvStore::NoteHeld); the outcome comes from Wait(). `via` as for
  // NoteFetchedAsync: the note travels as a fetch that moves no rows.
  virtual FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                                    const FetchPlan& plan, FetchBuffer* via) {
    return FetchHandle(absl::UnimplementedError(
        "this data plane takes no notes of rows the caller holds"));
  }
  // NoteFetchedAsync of the plan in which each KV head h read its first
  // head_offsets[h + 1] - head_offsets[h] positions in order (a whole
  // layer), without its indices (KvStore::NoteLeadingFetched).
  virtual FetchHandle NoteLeadingFetchedAsync(
      SequenceId seq, int32_t layer, absl::Span<const int32_t> head_offsets,
      FetchBuffer* via) {
    return FetchHandle(
        absl::UnimplementedError("no one-sided reads on this data plane"));
  }
  // NoteFetchedAsync + Wait.
  absl::Status NoteFetched(SequenceId seq, int32_t layer, const FetchPlan& plan,
                           FetchBuffer* via) {
    return NoteFetchedAsync(seq, layer, plan, via).Wait();
  }

  // Frees the sequence on the memory node.
  virtual absl::Status Close(SequenceId seq) = 0;

  virtual absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) = 0;
  virtual absl::StatusOr<StoreStats> GetStoreStats() = 0;
  // The present tokens of (layer, kv_head) of `seq`, by increasing
  // position, with their fetch statistics (KvStore::GetTokenStats), for
  // tests and tools that check what the node counted. Unimplemented where
  // the data plane does not report them (the default; inproc: and the
  // planes over gRPC control do).
  virtual absl::StatusOr<std::vector<TokenFetchStats>> GetTokenStats(
      SequenceId seq, int32_t layer, int32_t kv_head) {
    return absl::UnimplementedError(
        "this data plane does not report token statistics");
  }

  // The data plane, for logs: "inproc", "tcp", "shm", "rdma".
  virtual std::string data_plane() const = 0;
  // The node's address as the client was given it (tcp://HOST:PORT,
  // shm:unix:PATH, a tier's list, ...), for messages that name the node.
  virtual std::string address() const { return "inproc:"; }

  // OK while the memory node answers; for a remote node, the outcome of the
  // last heartbeat (Unavailable, DeadlineExceeded, Unauthenticated, ...)
  // once one fails, OK again once one succeeds. Never calls the node:
  // cheap enough to poll. In-process (the default here): always OK.
  virtual absl::Status Health() const { return absl::OkStatus(); }

  // The session on the memory node that this client's sequences belong to
  // (kv_store.h, "Ids and ownership"); 0: none (in-process, or before the
  // first sequence). A data plane beside a control client names it in each
  // fetch: the node serves a sequence's rows only to its owner.
  virtual SessionId session() const { return 0; }

  // A data plane beside this client's control path (shm) reports a fetch
  // the node left unanswered for `timeout`. A remote client then takes the
  // node as unresponsive, as when a call of its own times out: its calls
  // fail at once until the node answers a heartbeat (asked for at once).
  // Default (in-process): nothing.
  virtual void NoteUnanswered(absl::Duration timeout) {}
  // Unavailable, saying why, while the node is taken as unresponsive; OK
  // otherwise. Never calls the node.
  virtual absl::Status Unanswered() const { return absl::OkStatus(); }
};

// `status` naming the node it came from: "memory node ADDRESS: MESSAGE".
// Unchanged when OK, when it names a node already (a tier's) or for the
// in-process store.
absl::Status AtNode(absl::string_view address, const absl::Status& status);

// Forwards every call to another client. Data planes that reuse another
// client's control path derive from it and override only what they change
// (e.g. shm: NewFetchBuffer and FetchAsync over the gRPC client's control).
class KvClientWrapper : public KvClient {
 public:
  explicit KvClientWrapper(std::unique_ptr<KvClient> target)
      : target_(std::move(target)) {}

  absl::StatusOr<OpenedSequence> OpenSequence(
      const SequenceGeometry& geometry, const PrefixRequest& prefix) override {
    return target_->OpenSequence(geometry, prefix);
  }
  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override {
    return target_->Append(seq, block);
  }
  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) override {
    return target_->NewFetchBuffer(elements);
  }
  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    return target_->FetchAsync(seq, layer, plan, dest);
  }
  // Through the target, whose buffer `via` is (a plane that makes buffers
  // of its own overrides this too).
  FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                            const FetchPlan& plan, FetchBuffer* via) override {
    return target_->NoteHeldAsync(seq, layer, plan, via);
  }
  absl::Status Close(SequenceId seq) override { return target_->Close(seq); }
  absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) override {
    return target_->GetSequenceStats(seq);
  }
  absl::StatusOr<StoreStats> GetStoreStats() override {
    return target_->GetStoreStats();
  }
  absl::StatusOr<std::vector<TokenFetchStats>> GetTokenStats(
      SequenceId seq, int32_t layer, int32_t kv_head) override {
    return target_->GetTokenStats(seq, layer, kv_head);
  }
  std::string data_plane() const override { return target_->data_plane(); }
  std::string address() const override { return target_->address(); }
  absl::Status Health() const override { return target_->Health(); }
  SessionId session() const override { return target_->session(); }
  void NoteUnanswered(absl::Duration timeout) override {
    target_->NoteUnanswered(timeout);
  }
  absl::Status Unanswered() const override { return target_->Unanswered(); }

  KvClient* target() const { return target_.get(); }

 private:
  std::unique_ptr<KvClient> target_;
};

// Connects to the memory node at `address` (grammar above) and returns a
// client for it. InvalidArgument for an address no data plane claims;
// Unimplemented for a data plane not built yet; Unavailable when a remote
// server does not answer within options.connect_timeout. Defined in the
// :kv_client target, which links every data plane; data planes themselves
// depend only on :kv_client_interface.
absl::StatusOr<std::unique_ptr<KvClient>> ConnectKvClient(
    const std::string& address, const KvClientOptions& options = {});

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_CLIENT_KV_CLIENT_H_
