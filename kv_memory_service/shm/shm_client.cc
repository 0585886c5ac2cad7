#include "kv_memory_service/shm/shm_client.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/address.h"
#include "common/status.h"
#include "common/cuda_host_register.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service {
namespace {

using shm::SlotControl;

// How often a sleeping waiter checks that the server is still there.
constexpr absl::Duration kServerCheckInterval = absl::Milliseconds(10);
// Largest FetchBuffer: 64 Gi values (128 GiB).
constexpr size_t kMaxBufferElements = size_t{1} << 36;

// How long Wait polls before it sleeps on the futex: long enough to catch
// small and medium gathers (about 0.25 us per index at head_dim 64) without
// a wake-up, short enough that a waiter for a large one sleeps instead of
// competing with the server's thread for a CPU. Polling yields the CPU after
// the first few steps (shm::SpinStep); a sleeper is woken by the server.
int64_t SpinNanos(size_t n_indices) {
  return std::min<int64_t>(20'000 + 250 * static_cast<int64_t>(n_indices),
                           60'000);
}

// A sealed memfd of `bytes`: neither side can shrink it under the other's
// mapping.
absl::StatusOr<int> NewSealedMemfd(const char* name, size_t bytes) {
  const int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            "memfd_create", errno);
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    close(fd);
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            absl::StrCat("sizing a memfd of ", bytes, " bytes"),
                            err);
  }
  return fd;
}

absl::StatusOr<void*> MapShared(int fd, size_t offset, size_t bytes,
                                bool populate) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_SHARED | (populate ? MAP_POPULATE : 0), fd,
                 static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            absl::StrCat("mmap of ", bytes, " shared bytes"),
                            errno);
  }
  return p;
}

// Connects to the data-plane socket at `path` and reads the server's Hello;
// returns the socket, and the announced control address in `control`.
absl::StatusOr<int> OpenDataPlaneSocket(const std::string& path,
                                        absl::Duration timeout,
                                        std::string* control) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return shm::ErrnoStatus(absl::StatusCode::kInternal, "socket", errno);
  auto fail = [fd](absl::Status status) {
    close(fd);
    return status;
  };
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return fail(shm::ErrnoStatus(
        absl::StatusCode::kUnavailable,
        absl::StrCat("no KV memory server's shm data plane at ", path,
                     ": connect"),
        errno));
  }
  absl::Status status = shm::SetReceiveTimeout(fd, timeout);
  if (!status.ok()) return fail(status);
  absl::StatusOr<shm::SocketMessage> hello = shm::ReceiveMessage(fd, nullptr);
  if (!hello.ok()) return fail(hello.status());
  if (hello->type == shm::MessageType::kReply) {
    status = shm::StatusOfReply(*hello);  // refused, e.g. too many clients
    return fail(status.ok() ? absl::InternalError("shm: empty refusal") : status);
  }
  if (hello->type != shm::MessageType::kHello) {
    return fail(absl::InternalError("shm data plane: the server sent no Hello"));
  }
  *control = hello->text;
  return fd;
}

// One setup request on `socket` and its reply; rings the doorbell so that a
// sleeping server thread reads it.
// `reply` and `reply_fd` (may be null) get the reply's fields and the
// descriptor it carried (-1: none; the caller closes it).
absl::Status Exchange(int socket, shm::RegionHeader* header,
                      const shm::SocketMessage& message, int fd,
                      shm::SocketMessage* reply = nullptr,
                      int* reply_fd = nullptr) {
  IG_RETURN_IF_ERROR(shm::SendMessage(socket, message, fd));
  header->control_seq.fetch_add(1);
  header->doorbell.fetch_add(1);
  if (header->server_waiting.load() != 0) shm::FutexWakeAll(&header->doorbell);
  IG_ASSIGN_OR_RETURN(shm::SocketMessage got,
                      shm::ReceiveMessage(socket, reply_fd));
  if (reply != nullptr) *reply = got;
  return shm::StatusOfReply(got);
}

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

  ShmFetchBuffer(ShmKvClient* client, uint32_t slot, SlotControl* control,
                 Memory memory, bool pinned)
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
  // Ends the fetch the server did not finish: `why` unless the server
  // finished it meanwhile (then its outcome).
  absl::Status GiveUp(absl::Status why);

  ShmKvClient* const client_;
  const uint32_t slot_;
  SlotControl* const control_;
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

  ~ShmKvClient() override {
    close(socket_);  // the server drops the connection and unmaps the slots
    close(region_fd_);
    munmap(region_, shm::ControlRegionBytes(shm::kMaxSlots));
    absl::MutexLock lock(&rows_mu_);
    for (auto& [seq, rows] : rows_) UnmapRows(rows);
  }

  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) override;

  // A new sequence is where a generation starts: if the server closed the
  // data plane since the last fetch (it restarted), reconnect now, so that
  // the generation's first fetch does not fail on the old connection.
  absl::StatusOr<OpenedSequence> OpenSequence(
      const SequenceGeometry& geometry, const PrefixRequest& prefix) override {
    IG_ASSIGN_OR_RETURN(const OpenedSequence opened,
                        KvClientWrapper::OpenSequence(geometry, prefix));
    ServerGone();
    absl::Status connected = EnsureConnected();
    if (!connected.ok()) {
      KvClientWrapper::Close(opened.id).IgnoreError();
      return connected;
    }
    return opened;
  }

  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    // A node that left a fetch unanswered gets none until it answers a
    // heartbeat again.
    if (absl::Status down = Unanswered(); !down.ok()) return FetchHandle(down);
    auto buffer = FetchBuffer::Claim<ShmFetchBuffer>(this, dest);
    if (!buffer.ok()) return FetchHandle(buffer.status());
    return (*buffer)->Start(seq, layer, plan,
                            absl::Now() + options_.fetch_timeout);
  }

  // One-sided reads: the node's K and V memfds of `seq`, mapped read-only
  // (MapRows), until Close.
  absl::StatusOr<DirectRows> GetDirectRows(SequenceId seq) override {
    {
      absl::MutexLock lock(&rows_mu_);
      auto it = rows_.find(seq);
      if (it != rows_.end()) return it->second.rows;
    }
    MappedRows mapped;
    for (uint32_t part : {0u, 1u}) {
      shm::SocketMessage request;
      request.type = shm::MessageType::kMapRows;
      request.slot = part;
      request.sequence = seq;
      request.session = session();
      shm::SocketMessage reply;
      int fd = -1;
      absl::Status status = Call(request, -1, &reply, &fd);
      if (status.ok() && fd < 0) {
        status = absl::InternalError("shm data plane: MapRows carried no fd");
      }
      size_t bytes = 0;
      struct stat st {};
      if (status.ok() && fstat(fd, &st) != 0) {
        status = shm::ErrnoStatus(absl::StatusCode::kInternal, "fstat", errno);
      }
      if (status.ok()) {
        bytes = static_cast<size_t>(st.st_size);
        const size_t layer_bytes = reply.elements * sizeof(uint16_t);
        if (reply.elements == 0 || reply.max_slots == 0 ||
            bytes < layer_bytes || bytes % layer_bytes != 0) {
          status = absl::InternalError(absl::StrCat(
              "shm data plane: MapRows gave ", bytes, " bytes for layers of ",
              layer_bytes));
        }
      }
      void* p = MAP_FAILED;
      if (status.ok()) {
        p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
          status = shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                                    "mmap of the node's rows", errno);
        }
      }
      if (fd >= 0) close(fd);
      if (!status.ok()) {
        UnmapRows(mapped);
        return status;
      }
      (part == 0 ? mapped.k : mapped.v) = p;
      (part == 0 ? mapped.k_bytes : mapped.v_bytes) = bytes;
      mapped.rows.layer_values = reply.elements;
      mapped.rows.max_tokens = static_cast<int32_t>(reply.max_slots);
    }
    mapped.rows.k = static_cast<const uint16_t*>(mapped.k);
    mapped.rows.v = static_cast<const uint16_t*>(mapped.v);
    absl::MutexLock lock(&rows_mu_);
    auto [it, fresh] = rows_.emplace(seq, mapped);
    if (!fresh) UnmapRows(mapped);  // mapped twice at once: keep the first
    return it->second.rows;
  }

  // The plan goes through `via`'s slot with kNoteOnly: the server records
  // the fetch and writes nothing.
  FetchHandle NoteFetchedAsync(SequenceId seq, int32_t layer,
                               const FetchPlan& plan,
                               FetchBuffer* via) override {
    if (absl::Status down = Unanswered(); !down.ok()) return FetchHandle(down);
    auto buffer = FetchBuffer::Claim<ShmFetchBuffer>(this, via);
    if (!buffer.ok()) return FetchHandle(buffer.status());
    return (*buffer)->Start(seq, layer, plan,
                            absl::Now() + options_.fetch_timeout,
                            shm::kNoteOnly);
  }
  // Head offsets alone, with kNoteOnly | kLeading.
  FetchHandle NoteLeadingFetchedAsync(SequenceId seq, int32_t layer,
                                      absl::Span<const int32_t> head_offsets,
                                      FetchBuffer* via) override {
    if (absl::Status down = Unanswered(); !down.ok()) return FetchHandle(down);
    auto buffer = FetchBuffer::Claim<ShmFetchBuffer>(this, via);
    if (!buffer.ok()) return FetchHandle(buffer.status());
    FetchPlan plan;
    plan.head_offsets = head_offsets;
    return (*buffer)->Start(seq, layer, plan,
                            absl::Now() + options_.fetch_timeout,
                            shm::kNoteOnly | shm::kLeading);
  }

  // Unmaps the sequence's rows (GetDirectRows) whatever the node answers.
  // The rows are unmapped first: the node frees them at the close instead
  // of counting them as pinned until this client lets go.
  absl::Status Close(SequenceId seq) override {
    {
      absl::MutexLock lock(&rows_mu_);
      auto it = rows_.find(seq);
      if (it != rows_.end()) {
        UnmapRows(it->second);
        rows_.erase(it);
      }
    }
    return KvClientWrapper::Close(seq);
  }

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
  // Unmaps the slot on the server and frees its index for reuse.
  void ReleaseSlot(uint32_t slot) {
    // A node taken as unresponsive would not answer: closing the socket
    // (the client's end) unmaps its slots there all the same.
    if (health_.load() == kHealthy && Unanswered().ok()) {
      shm::SocketMessage unmap;
      unmap.type = shm::MessageType::kUnmapSlot;
      unmap.slot = slot;
      Call(unmap, -1).IgnoreError();
    }
    absl::MutexLock lock(&slots_mu_);
    if (slots_[slot].fd >= 0) close(slots_[slot].fd);
    slots_[slot] = Slot();
  }

 private:
  enum Health : int { kHealthy = 0, kServerGone = 1, kAbandoned = 2 };

  struct Slot {
    bool used = false;
    int fd = -1;  // the buffer's memfd, once mapped
    size_t elements = 0;
  };

  // A sequence's rows mapped for one-sided reads.
  struct MappedRows {
    void* k = nullptr;
    void* v = nullptr;
    size_t k_bytes = 0;
    size_t v_bytes = 0;
    DirectRows rows;
  };
  static void UnmapRows(const MappedRows& m) {
    if (m.k != nullptr) munmap(m.k, m.k_bytes);
    if (m.v != nullptr) munmap(m.v, m.v_bytes);
  }

  void MarkGone() {
    int healthy = kHealthy;
    health_.compare_exchange_strong(healthy, kServerGone);
  }

  // One setup request and its reply. The server closing the socket makes
  // the client reconnect on next use; no reply in time (a hung server) or a
  // garbled one leaves the reply stream out of step for good.
  absl::Status Call(const shm::SocketMessage& message, int fd,
                    shm::SocketMessage* reply = nullptr,
                    int* reply_fd = nullptr) ABSL_LOCKS_EXCLUDED(socket_mu_) {
    absl::MutexLock lock(&socket_mu_);
    IG_RETURN_IF_ERROR(EnsureConnectedLocked());
    absl::Status status =
        Exchange(socket_, header_, message, fd, reply, reply_fd);
    if (absl::IsUnavailable(status)) {
      MarkGone();
    } else if (absl::IsDeadlineExceeded(status) ||
               (absl::IsInvalidArgument(status) &&
                absl::StrContains(status.message(), "malformed"))) {
      Abandon();
    }
    return status;
  }

  absl::Status Reconnect() ABSL_LOCKS_EXCLUDED(socket_mu_) {
    absl::MutexLock lock(&socket_mu_);
    return EnsureConnectedLocked();
  }

  absl::Status EnsureConnectedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(socket_mu_);

  absl::StatusOr<uint32_t> AllocateSlot() {
    absl::MutexLock lock(&slots_mu_);
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].used) {
        slots_[i].used = true;
        return i;
      }
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "a shm client holds at most ", shm::kMaxSlots, " fetch buffers"));
  }

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
};

absl::Status ShmKvClient::EnsureConnectedLocked() {
  const int health = health_.load(std::memory_order_acquire);
  if (health == kHealthy) return absl::OkStatus();
  if (health == kAbandoned) {
    // The server, alive but hung, may still write into our slots.
    return absl::UnavailableError(
        "the shm data plane was abandoned after the server stopped answering "
        "in time; make a new client");
  }
  // kServerGone: the server closed its end, which it does only once its
  // connection thread has ended (or the process has), so nothing of the old
  // connection writes into our memory any more.
  std::string control;
  absl::StatusOr<int> fresh =
      OpenDataPlaneSocket(path_, options_.connect_timeout, &control);
  if (!fresh.ok()) {
    return absl::UnavailableError(absl::StrCat(
        GoneStatus().message(), "; reconnecting failed: ", fresh.status().message()));
  }
  const int s = *fresh;
  // Nothing of the old connection is in flight (its waiters fail on the
  // generation): start the region afresh for the new server.
  header_->doorbell.store(0);
  header_->server_waiting.store(0);
  header_->control_seq.store(0);
  for (uint32_t i = 0; i < shm::kMaxSlots; ++i) {
    shm::SlotAt(region_, i)->state.store(shm::kIdle);
    shm::SlotAt(region_, i)->client_waiting.store(0);
  }
  generation_.fetch_add(1, std::memory_order_acq_rel);
  absl::Status status = shm::SetReceiveTimeout(s, options_.rpc_timeout);
  shm::SocketMessage attach;
  attach.type = shm::MessageType::kAttach;
  attach.max_slots = shm::kMaxSlots;
  attach.text = options_.auth_token;
  if (status.ok()) status = Exchange(s, header_, attach, region_fd_);
  if (status.ok()) {
    absl::MutexLock lock(&slots_mu_);
    for (uint32_t i = 0; i < slots_.size() && status.ok(); ++i) {
      if (slots_[i].fd < 0) continue;
      shm::SocketMessage map;
      map.type = shm::MessageType::kMapSlot;
      map.slot = i;
      map.elements = slots_[i].elements;
      status = Exchange(s, header_, map, slots_[i].fd);
    }
  }
  if (!status.ok() || dup2(s, socket_) < 0) {
    close(s);
    return absl::UnavailableError(absl::StrCat(
        GoneStatus().message(), "; reconnecting failed: ",
        status.ok() ? "dup2" : status.message()));
  }
  close(s);
  health_.store(kHealthy, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<FetchBuffer>> ShmKvClient::NewFetchBuffer(
    size_t elements) {
  if (elements == 0) {
    return absl::InvalidArgumentError("a fetch buffer needs at least 1 value");
  }
  if (elements > kMaxBufferElements) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a shm fetch buffer holds at most ", kMaxBufferElements,
                     " values; asked for ", elements));
  }
  IG_RETURN_IF_ERROR(EnsureConnected());
  IG_ASSIGN_OR_RETURN(const uint32_t slot, AllocateSlot());

  ShmFetchBuffer::Memory m;
  m.elements = elements;
  m.data_bytes = shm::SlotDataBytes(elements);
  m.plan_capacity = shm::SlotPlanCapacity(elements);
  m.plan_bytes = shm::SlotPlanBytes(elements);
  int fd = -1;
  auto undo = [&](absl::Status status) {
    if (m.data != nullptr) munmap(m.data, m.data_bytes);
    if (m.plan != nullptr) munmap(m.plan, m.plan_bytes);
    if (fd >= 0) close(fd);
    absl::MutexLock lock(&slots_mu_);
    slots_[slot] = Slot();
    return status;
  };
  absl::StatusOr<int> memfd =
      NewSealedMemfd("infinigen-kv-shm-slot", m.data_bytes + m.plan_bytes);
  if (!memfd.ok()) return undo(memfd.status());
  fd = *memfd;
  // The data pages are faulted in now, on both sides, not on the first
  // fetch; the plan area only as far as plans reach.
  absl::StatusOr<void*> data = MapShared(fd, 0, m.data_bytes, true);
  if (!data.ok()) return undo(data.status());
  m.data = static_cast<uint16_t*>(*data);
  absl::StatusOr<void*> plan = MapShared(fd, m.data_bytes, m.plan_bytes, false);
  if (!plan.ok()) return undo(plan.status());
  m.plan = static_cast<int32_t*>(*plan);

  SlotControl* control = shm::SlotAt(region_, slot);
  control->state.store(shm::kIdle);
  control->client_waiting.store(0);
  shm::SocketMessage map;
  map.type = shm::MessageType::kMapSlot;
  map.slot = slot;
  map.elements = elements;
  absl::Status mapped = Call(map, fd);
  if (!mapped.ok()) return undo(mapped);
  SlotMapped(slot, fd, elements);
  const bool pinned = CudaHostRegister(m.data, m.data_bytes);
  return std::unique_ptr<FetchBuffer>(
      new ShmFetchBuffer(this, slot, control, m, pinned));
}

ShmFetchBuffer::~ShmFetchBuffer() {
  if (pinned_) CudaHostUnregister(memory_.data);
  // An abandoned slot stays taken: the server may still be writing it.
  if (!abandoned_) client_->ReleaseSlot(slot_);
  munmap(memory_.data, memory_.data_bytes);
  munmap(memory_.plan, memory_.plan_bytes);
}

FetchHandle ShmFetchBuffer::Start(SequenceId seq, int32_t layer,
                                  const FetchPlan& plan, absl::Time deadline,
                                  uint32_t flags) {
  absl::Status connected = client_->EnsureConnected();
  if (!connected.ok()) {
    CompleteFetch(std::move(connected));
    return FetchHandle(this);
  }
  const size_t n = plan.indices.size();
  const size_t m = plan.head_offsets.size();
  if (n + m > memory_.plan_capacity) {
    CompleteFetch(absl::InvalidArgumentError(absl::StrCat(
        "a plan of ", n, " indices and ", m, " head offsets does not fit a ",
        "shm fetch buffer of ", memory_.elements, " values")));
    return FetchHandle(this);
  }
  // An empty span's data() may be null, which memcpy must not see.
  if (n > 0) std::memcpy(memory_.plan, plan.indices.data(), n * sizeof(int32_t));
  if (m > 0) {
    std::memcpy(memory_.plan + n, plan.head_offsets.data(), m * sizeof(int32_t));
  }
  control_->layer = layer;
  control_->sequence = seq;
  control_->session = client_->session();
  control_->n_indices = static_cast<uint32_t>(n);
  control_->n_head_offsets = static_cast<uint32_t>(m);
  control_->flags = flags;
  generation_ = client_->generation();
  control_->state.store(shm::kRequested, std::memory_order_release);
  client_->Ring();
  published_ = true;
  deadline_ = deadline;
  spin_ns_ = SpinNanos(n);
  return FetchHandle(this);
}

absl::Status ShmFetchBuffer::AwaitServer() {
  const int64_t spin_until = absl::GetCurrentTimeNanos() + spin_ns_;
  uint32_t state;
  uint32_t steps = 0;
  while ((state = control_->state.load(std::memory_order_acquire)) !=
         shm::kDone) {
    if (absl::GetCurrentTimeNanos() >= spin_until) break;
    shm::SpinStep(steps);
  }
  while (state != shm::kDone) {
    if (client_->generation() != generation_) {
      return client_->GoneStatus();  // reconnected since: this one is lost
    }
    const absl::Time now = absl::Now();
    if (now >= deadline_) {
      // The node is taken as unresponsive: the fetches after this one, and
      // those in flight on other buffers, fail at once.
      client_->NoteUnanswered(client_->fetch_timeout());
      return GiveUp(absl::DeadlineExceededError(absl::StrCat(
          "no answer to a shm fetch within ",
          absl::FormatDuration(client_->fetch_timeout()))));
    }
    if (absl::Status down = client_->Unanswered(); !down.ok()) {
      return GiveUp(down);  // another fetch of this client timed out
    }
    // Announce the sleep before the last look, so that the server, which
    // stores kDone and then reads client_waiting, cannot miss us.
    control_->client_waiting.store(1);
    state = control_->state.load();
    if (state == shm::kDone) break;
    shm::FutexWait(&control_->state, state,
                   std::min(kServerCheckInterval, deadline_ - now));
    state = control_->state.load(std::memory_order_acquire);
    if (state != shm::kDone && client_->ServerGone()) {
      control_->client_waiting.store(0);
      return client_->GoneStatus();
    }
  }
  control_->client_waiting.store(0, std::memory_order_relaxed);
  return TakeServerStatus();
}

absl::Status ShmFetchBuffer::TakeServerStatus() {
  const auto code = static_cast<absl::StatusCode>(control_->status_code);
  absl::Status status;
  if (code != absl::StatusCode::kOk) {
    const size_t len =
        std::min<size_t>(control_->message_bytes, shm::kStatusMessageBytes);
    status = absl::Status(code, absl::string_view(control_->message, len));
  }
  control_->state.store(shm::kIdle, std::memory_order_relaxed);
  return status;
}

absl::Status ShmFetchBuffer::GiveUp(absl::Status why) {
  uint32_t expected = shm::kRequested;
  if (control_->state.compare_exchange_strong(expected, shm::kCancelled)) {
    // The server never started it and now never will.
    return why;
  }
  if (expected == shm::kDone) return TakeServerStatus();
  if (expected != shm::kServing) return why;
  // The server is writing into the slot right now and may go on after we
  // return: swap the buffer's pages for private ones at the same address,
  // so that the caller's memory stays valid and the server's late writes
  // land where nobody looks.
  if (pinned_) {
    CudaHostUnregister(memory_.data);
    pinned_ = false;
  }
  mmap(memory_.data, memory_.data_bytes, PROT_READ | PROT_WRITE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  abandoned_ = true;
  client_->Abandon();
  return why;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvClient>> ConnectShmKvClient(
    const std::string& address, const KvClientOptions& options,
    const ControlConnector& connect_control) {
  if (!absl::StartsWith(address, "shm:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a shm address: '", address, "'"));
  }
  absl::StatusOr<std::string> path = ParseUnixPath(address.substr(4));
  if (!path.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad shm address '", address, "' (want shm:unix:PATH): ",
        path.status().message()));
  }
  std::string control_address;
  IG_ASSIGN_OR_RETURN(
      const int socket_fd,
      OpenDataPlaneSocket(*path, options.connect_timeout, &control_address));
  // Owns the socket and the region until the client does.
  struct Pending {
    int socket = -1;
    int region_fd = -1;
    void* region = nullptr;
    ~Pending() {
      if (region != nullptr) {
        munmap(region, shm::ControlRegionBytes(shm::kMaxSlots));
      }
      if (region_fd >= 0) close(region_fd);
      if (socket >= 0) close(socket);
    }
  } pending;
  pending.socket = socket_fd;

  const size_t region_bytes = shm::ControlRegionBytes(shm::kMaxSlots);
  IG_ASSIGN_OR_RETURN(pending.region_fd,
                      NewSealedMemfd("infinigen-kv-shm-control", region_bytes));
  IG_ASSIGN_OR_RETURN(pending.region,
                      MapShared(pending.region_fd, 0, region_bytes, true));
  auto* header = new (pending.region) shm::RegionHeader();
  header->magic = shm::kRegionMagic;
  header->version = shm::kProtocolVersion;
  header->max_slots = shm::kMaxSlots;

  IG_RETURN_IF_ERROR(shm::SetReceiveTimeout(socket_fd, options.rpc_timeout));
  shm::SocketMessage attach;
  attach.type = shm::MessageType::kAttach;
  attach.max_slots = shm::kMaxSlots;
  attach.text = options.auth_token;
  IG_RETURN_IF_ERROR(Exchange(socket_fd, header, attach, pending.region_fd));

  if (control_address.empty() || absl::StartsWith(control_address, "shm:")) {
    return absl::InternalError(absl::StrCat(
        "shm data plane: the server announced no usable control address ('",
        control_address, "')"));
  }
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvClient> control,
                      connect_control(control_address, options));
  auto client = std::make_unique<ShmKvClient>(
      std::move(control), options, *path, socket_fd, pending.region_fd,
      pending.region);
  pending.socket = -1;
  pending.region_fd = -1;
  pending.region = nullptr;
  return client;
}

}  // namespace infinigen::kv_memory_service
