// The shm client's parts (shm_client.h), private to //kv_memory_service/shm:
// the setup socket and shared memory (shm_client_socket.cc), ShmKvClient,
// the client and its connection (shm_client.cc, shm_direct_rows.cc), and
// ShmFetchBuffer, one fetch buffer's slot and its waits
// (shm_fetch_buffer.cc).
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_CLIENT_INTERNAL_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_CLIENT_INTERNAL_H_

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service::shm_client_internal {

// Largest FetchBuffer: 64 Gi values (128 GiB).
inline constexpr size_t kMaxBufferElements = size_t{1} << 36;

// A sealed memfd of `bytes`: neither side can shrink it under the other's
// mapping.
absl::StatusOr<int> NewSealedMemfd(const char* name, size_t bytes);

absl::StatusOr<void*> MapShared(int fd, size_t offset, size_t bytes,
                                bool populate);

// Connects to the data-plane socket at `path` and reads the server's Hello;
// returns the socket, and the announced control address in `control`.
absl::StatusOr<int> OpenDataPlaneSocket(const std::string& path,
                                        absl::Duration timeout,
                                        std::string* control);

// One setup request on `socket` and its reply; rings the doorbell so that a
// sleeping server thread reads it.
// `reply` and `reply_fd` (may be null) get the reply's fields and the
// descriptor it carried (-1: none; the caller closes it).
absl::Status Exchange(int socket, shm::RegionHeader* header,
                      const shm::SocketMessage& message, int fd,
                      shm::SocketMessage* reply = nullptr,
                      int* reply_fd = nullptr);

class ShmKvClient;

class ShmFetchBuffer final : public FetchBuffer {
 public:
  struct Memory {
    uint16_t* data = nullptr;  // [elements]
    size_t elements = 0;
    size_t data_bytes = 0;
    int32_t* plan = nullptr;  // [plan_capacity]
    size_t plan_capacity = 0;
    size_t plan_bytes = 0;
  };

  ShmFetchBuffer(ShmKvClient* client, uint32_t slot,
                 shm::SlotControl* control, Memory memory, bool pinned)
      : FetchBuffer(client, memory.data, memory.elements),
        client_(client),
        slot_(slot),
        control_(control),
        memory_(memory),
        pinned_(pinned) {}
  ~ShmFetchBuffer() override;

  // Sends the fetch of a claimed buffer (FetchBuffer::Claim began it).
  // flags: SlotControl::flags (shm::kNoteOnly: a note, no rows).
  FetchHandle Start(SequenceId seq, int32_t layer, const FetchPlan& plan,
                    absl::Time deadline, uint32_t flags = 0);
  // Sends the append of `block`, whose K then V values and then
  // `meta_bytes` of its annotations (EncodePrefixMeta) the caller wrote
  // into data() (shm::kAppend), on a claimed buffer; after its Wait,
  // Evicted reads what the server evicted.
  FetchHandle StartAppend(SequenceId seq, const AppendBlock& block,
                          size_t meta_bytes, absl::Time deadline);
  // The evicted tokens of the append just waited for: InternalError when
  // the server's count does not fit the plan area.
  absl::StatusOr<std::vector<EvictedToken>> Evicted() const;

 protected:
  absl::Status WaitForFetch() override {
    if (published_) {
      published_ = false;
      CompleteFetch(AwaitServer());
    }
    return TakeResult();
  }

 private:
  absl::Status AwaitServer();
  absl::Status TakeServerStatus();
  // Hands the request written into the slot to the server (kRequested,
  // the doorbell); its Wait spins `spin_ns`, then sleeps until `deadline`.
  FetchHandle Publish(absl::Time deadline, int64_t spin_ns);
  // Ends the fetch the server did not finish: `why` unless the server
  // finished it meanwhile (then its outcome).
  absl::Status GiveUp(absl::Status why);

  ShmKvClient* const client_;
  const uint32_t slot_;
  shm::SlotControl* const control_;
  const Memory memory_;
  bool pinned_;
  // The fetch in flight; touched by Start and then by its Wait.
  bool published_ = false;
  bool abandoned_ = false;  // the server may still write the old pages
  uint32_t generation_ = 0;  // the connection the fetch was sent on
  absl::Time deadline_;
  int64_t spin_ns_ = 0;
};

class ShmKvClient final : public KvClientWrapper {
 public:
  ShmKvClient(std::unique_ptr<KvClient> control, const KvClientOptions& options,
              std::string path, int socket, int region_fd, void* region)
      : KvClientWrapper(std::move(control)),
        options_(options),
        path_(std::move(path)),
        socket_(socket),
        region_fd_(region_fd),
        region_(region),
        header_(static_cast<shm::RegionHeader*>(region)),
        slots_(shm::kMaxSlots) {}

  ~ShmKvClient() override;

  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) override {
    return NewSlotBuffer(elements, options_.rpc_timeout);
  }

  // A new sequence is where a generation starts: if the server closed the
  // data plane since the last fetch (it restarted), reconnect now, so that
  // the generation's first fetch does not fail on the old connection.
  absl::StatusOr<OpenedSequence> OpenSequence(
      const SequenceGeometry& geometry, const PrefixRequest& prefix) override;

  // The rows, and the block's prefix annotations, through a slot of the
  // data plane (shm::kAppend): written once into shared memory and
  // appended by the server from there. A block whose K and V differ in
  // size, or one for which no slot can be had goes through the control
  // client (gRPC), as does every append while the data plane is down.
  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override;

  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override;

  // One-sided reads: the node's K and V memfds of `seq`, mapped read-only
  // (MapRows) and registered with CUDA where a device answers, until Close.
  // Memfds the client still keeps mapped from a closed sequence (the node
  // reuses a session's spare rows) are taken as they are: neither mapped
  // nor registered again.
  absl::StatusOr<DirectRows> GetDirectRows(SequenceId seq) override;

  // The plan goes through `via`'s slot with kNoteOnly: the server records
  // the fetch and writes nothing.
  FetchHandle NoteFetchedAsync(SequenceId seq, int32_t layer,
                               const FetchPlan& plan,
                               FetchBuffer* via) override;
  // The plan goes through `via`'s slot with kNoteOnly | kHeld.
  FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                            const FetchPlan& plan, FetchBuffer* via) override;
  // A note of `plan` through `via`'s slot with `flags` (kNoteOnly and
  // what kind).
  FetchHandle Note(SequenceId seq, int32_t layer, const FetchPlan& plan,
                   FetchBuffer* via, uint32_t flags);
  // Head offsets alone, with kNoteOnly | kLeading.
  FetchHandle NoteLeadingFetchedAsync(SequenceId seq, int32_t layer,
                                      absl::Span<const int32_t> head_offsets,
                                      FetchBuffer* via) override;

  // Closes the sequence whatever the node answers. Its rows
  // (GetDirectRows) stay mapped among the last options.shm_kept_rows
  // closed ones, for the node to open the session's next sequence in; the
  // oldest beyond them are unmapped first, so that the node frees them at
  // the close instead of counting them as pinned until this client lets go.
  absl::Status Close(SequenceId seq) override;

  std::string data_plane() const override { return "shm"; }
  std::string address() const override { return "shm:unix:" + path_; }
  absl::Duration fetch_timeout() const { return options_.fetch_timeout; }

  // For ShmFetchBuffer.

  // Tells a sleeping server thread that there is work.
  void Ring() {
    header_->doorbell.fetch_add(1);
    if (header_->server_waiting.load() != 0) {
      shm::FutexWakeAll(&header_->doorbell);
    }
  }

  // OK while the data plane works; after the server went away, tries once to
  // reconnect to a server at the same path (a restarted one), re-sending
  // every live buffer. Unavailable when that fails or after Abandon.
  absl::Status EnsureConnected() {
    if (health_.load(std::memory_order_acquire) == kHealthy) return absl::OkStatus();
    return Reconnect();
  }
  // Counts connections: a fetch sent on an earlier one has failed.
  uint32_t generation() const {
    return generation_.load(std::memory_order_acquire);
  }
  // True (and the client disconnected from now on) if the server is gone.
  bool ServerGone() {
    if (!shm::PeerClosed(socket_)) return false;
    MarkGone();
    return true;
  }
  absl::Status GoneStatus() const {
    return absl::UnavailableError(
        "the KV memory server closed the shm data plane (did it exit?)");
  }
  void Abandon() { health_.store(kAbandoned, std::memory_order_release); }

  // Records the buffer's memfd (kept to re-send on reconnecting).
  void SlotMapped(uint32_t slot, int fd, size_t elements) {
    absl::MutexLock lock(&slots_mu_);
    slots_[slot].fd = fd;
    slots_[slot].elements = elements;
  }
  // Unmaps the slot on the server (waiting up to the fetch timeout) and
  // frees its index for reuse.
  void ReleaseSlot(uint32_t slot);

 private:
  // A new slot of `elements` values, mapped by the server within `timeout`.
  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewSlotBuffer(
      size_t elements, absl::Duration timeout);
  enum Health : int { kHealthy = 0, kServerGone = 1, kAbandoned = 2 };

  struct Slot {
    bool used = false;
    int fd = -1;  // the buffer's memfd, once mapped
    size_t elements = 0;
  };

  // A memfd of the node's rows, mapped read-only: its inode names it.
  struct MappedFile {
    void* data = nullptr;
    size_t bytes = 0;
    dev_t dev = 0;
    ino_t ino = 0;
    bool registered = false;  // with CUDA
  };
  // A sequence's rows mapped for one-sided reads.
  struct MappedRows {
    MappedFile k;
    MappedFile v;
    DirectRows rows;
  };
  static void Unmap(const MappedFile& f);
  static void UnmapRows(const MappedRows& m);
  // `fd` (of `bytes`, its inode in `st`) mapped: a kept mapping of the same
  // file, taken out of kept_, or a new one, registered with CUDA.
  absl::StatusOr<MappedFile> MapFile(int fd, const struct stat& st);
  // GetDirectRows' requests to the node and mappings, once.
  absl::StatusOr<MappedRows> MapRows(SequenceId seq);

  void MarkGone() {
    int healthy = kHealthy;
    health_.compare_exchange_strong(healthy, kServerGone);
  }

  // One setup request and its reply, waited for up to options.rpc_timeout.
  // The server closing the socket makes the client reconnect on next use;
  // no reply in time (a hung server) or a garbled one leaves the reply
  // stream out of step for good.
  absl::Status Call(const shm::SocketMessage& message, int fd,
                    shm::SocketMessage* reply = nullptr,
                    int* reply_fd = nullptr) ABSL_LOCKS_EXCLUDED(socket_mu_) {
    return CallWithin(options_.rpc_timeout, message, fd, reply, reply_fd);
  }
  // A request a generation waits on (a slot for an append, a sequence's
  // rows), waited for up to `timeout` (the fetch timeout, or less): no
  // reply by then takes the node as unresponsive, as a fetch's timeout
  // does, so that the control calls after it fail at once too.
  absl::Status CallWithin(absl::Duration timeout,
                          const shm::SocketMessage& message, int fd,
                          shm::SocketMessage* reply = nullptr,
                          int* reply_fd = nullptr)
      ABSL_LOCKS_EXCLUDED(socket_mu_);

  absl::Status Reconnect() ABSL_LOCKS_EXCLUDED(socket_mu_) {
    absl::MutexLock lock(&socket_mu_);
    return EnsureConnectedLocked();
  }

  absl::Status EnsureConnectedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(socket_mu_);
  
  absl::StatusOr<uint32_t> AllocateSlot();

  const KvClientOptions options_;
  const std::string path_;  // the server's data-plane socket
  // The socket's descriptor number never changes: a reconnect dup2()s the
  // new connection onto it, so that waiters polling it need no lock.
  const int socket_;
  const int region_fd_;  // kept to attach again after a reconnect
  void* const region_;
  shm::RegionHeader* const header_;
  std::atomic<int> health_{kHealthy};
  std::atomic<uint32_t> generation_{0};

  absl::Mutex socket_mu_;  // one request/reply on the socket at a time

  absl::Mutex slots_mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(slots_mu_);

  absl::Mutex rows_mu_;
  absl::flat_hash_map<SequenceId, MappedRows> rows_ ABSL_GUARDED_BY(rows_mu_);
  // Closed sequences' K and V mappings (Close), the newest last.
  std::vector<MappedFile> kept_ ABSL_GUARDED_BY(rows_mu_);

  // Appends through the data plane, one at a time, in a slot that grows to
  // the largest block.
  absl::Mutex append_mu_;
  std::unique_ptr<FetchBuffer> append_buffer_ ABSL_GUARDED_BY(append_mu_);
};

}  // namespace infinigen::kv_memory_service::shm_client_internal

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHM_SHM_CLIENT_INTERNAL_H_
