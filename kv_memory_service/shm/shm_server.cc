#include "kv_memory_service/shm/shm_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/address.h"
#include "common/log.h"
#include "common/status.h"
#include "kv_memory_service/shm/shm_append.h"
#include "kv_memory_service/shm/shm_protocol.h"
#include "kv_memory_service/shm/shm_socket_lock.h"

namespace infinigen::kv_memory_service {
namespace {

using shm::SlotControl;

constexpr absl::Duration kIdleCheck = absl::Milliseconds(50);
constexpr absl::Duration kAttachTimeout = absl::Seconds(10);
// Connections in their handshake at once (ShmServer::AcceptLoop).
constexpr int kMaxHandshakes = 64;

// Maps [offset, offset + bytes) of a client's memfd. The client must have
// sealed it against shrinking: a file truncated under our mapping would
// make the gather fault.
// Never pre-populated: pages the client never touched cost the server
// nothing.
absl::StatusOr<void*> MapClientMemory(int fd, size_t offset, size_t bytes) {
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "shm data plane: the client's memory is not a memfd sealed against "
        "shrinking");
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return shm::ErrnoStatus(absl::StatusCode::kInternal, "fstat", errno);
  }
  if (static_cast<uint64_t>(st.st_size) < offset + bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm data plane: the client's memfd holds ", st.st_size,
        " bytes; its layout needs ", offset + bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_SHARED, fd,
                 static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    return shm::ErrnoStatus(absl::StatusCode::kResourceExhausted,
                            "mmap of a shm slot", errno);
  }
  return p;
}

}  // namespace

// One client: its socket, its control region and slots, and the thread that
// serves them. Everything but stop_ is touched only by that thread (and by
// the destructor after the join).
class ShmServer::Connection {
 public:
  Connection(ShmServer* server, int socket) : server_(server), socket_(socket) {}

  ~Connection() {
    Stop();
    if (thread_.joinable()) thread_.join();
    for (uint32_t i = 0; i < slots_.size(); ++i) UnmapSlot(i);
    if (region_ != nullptr) munmap(region_, region_bytes_);
    close(socket_);
  }

  void Start() {
    thread_ = std::thread([this] {
      Run();
      done_.store(true);
    });
  }

  // Makes Run return soon. The client sees its socket close only when the
  // destructor closes it, after the thread has ended: a client may trust a
  // closed socket to mean that nothing writes into its memory any more.
  void Stop() {
    stop_.store(true);
    shm::RegionHeader* header = header_.load();
    if (header != nullptr) {
      header->doorbell.fetch_add(1);
      shm::FutexWakeAll(&header->doorbell);
    } else {
      shutdown(socket_, SHUT_RD);  // not attached yet: end the Attach wait
    }
  }

  bool done() const { return done_.load(); }
  // Past its handshake: authenticated, its control region mapped.
  bool attached() const { return header_.load() != nullptr; }

 private:
  struct MappedSlot {
    uint16_t* data = nullptr;  // [elements], the FetchBuffer's values
    size_t elements = 0;
    size_t data_bytes = 0;
    int32_t* plan = nullptr;  // [plan_capacity]: indices, then head offsets
    size_t plan_capacity = 0;
    size_t plan_bytes = 0;
  };

  void Run() {
    absl::Status attached = Attach();
    if (!attached.ok()) {
      // A handshake dropped for a newer one (admission) is no news.
      if (!stop_.load()) {
        IG_LOG(WARNING) << "shm data plane: a client failed to attach: "
                        << attached;
      }
      return;
    }
    const int flags = fcntl(socket_, F_GETFL);
    fcntl(socket_, F_SETFL, flags | O_NONBLOCK);

    shm::RegionHeader* header = header_.load();
    const int64_t spin_ns = absl::ToInt64Nanoseconds(server_->options_.spin);
    int64_t last_work = absl::GetCurrentTimeNanos();
    uint32_t steps = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      bool worked = ServePending();
      const uint32_t control = header->control_seq.load(std::memory_order_acquire);
      if (control != seen_control_) {
        seen_control_ = control;
        if (!HandleMessages()) break;
        worked = true;
      }
      const int64_t now = absl::GetCurrentTimeNanos();
      if (worked) {
        last_work = now;
        steps = 0;
        continue;
      }
      if (now - last_work < spin_ns) {
        shm::SpinStep(steps);
        continue;
      }
      // Sleep. Announce it before the last look, so that a client that
      // publishes after the look sees server_waiting and wakes us.
      header->server_waiting.store(1);
      const uint32_t bell = header->doorbell.load();
      if (AnyRequested() || header->control_seq.load() != seen_control_ ||
          stop_.load()) {
        header->server_waiting.store(0);
        continue;
      }
      shm::FutexWait(&header->doorbell, bell, kIdleCheck);
      header->server_waiting.store(0);
      if (header->doorbell.load() == bell) {
        // Timed out: is the client still there?
        if (shm::PeerClosed(socket_) || !HandleMessages()) break;
      }
      last_work = absl::GetCurrentTimeNanos();
      steps = 0;
    }
  }

  absl::Status Attach() {
    shm::SocketMessage hello;
    hello.type = shm::MessageType::kHello;
    hello.max_slots = shm::kMaxSlots;
    hello.text = server_->options_.control_address;
    IG_RETURN_IF_ERROR(shm::SendMessage(socket_, hello));
    IG_RETURN_IF_ERROR(shm::SetReceiveTimeout(socket_, kAttachTimeout));
    int fd = -1;
    IG_ASSIGN_OR_RETURN(shm::SocketMessage attach,
                        shm::ReceiveMessage(socket_, &fd));
    absl::Status status = MapRegion(attach, fd);
    if (fd >= 0) close(fd);
    Count(status);
    shm::SendMessage(socket_, shm::ReplyFor(status)).IgnoreError();
    return status;
  }

  absl::Status MapRegion(const shm::SocketMessage& attach, int fd) {
    if (attach.type != shm::MessageType::kAttach) {
      return absl::InvalidArgumentError("shm data plane: expected Attach");
    }
    // The Attach carries the bare token.
    const std::string bearer = "Bearer " + attach.text;
    const absl::string_view presented(bearer);
    if (!server_->options_.credentials.Authenticate(&presented).ok()) {
      return absl::UnauthenticatedError(
          "shm data plane: missing or wrong auth token");
    }
    if (attach.max_slots == 0 || attach.max_slots > shm::kMaxSlots) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm data plane: max_slots ", attach.max_slots, " not in [1, ",
          shm::kMaxSlots, "]"));
    }
    if (fd < 0) {
      return absl::InvalidArgumentError(
          "shm data plane: Attach carries no control region");
    }
    const size_t bytes = shm::ControlRegionBytes(attach.max_slots);
    IG_ASSIGN_OR_RETURN(void* region, MapClientMemory(fd, 0, bytes));
    auto* header = static_cast<shm::RegionHeader*>(region);
    if (header->magic != shm::kRegionMagic ||
        header->version != shm::kProtocolVersion ||
        header->max_slots != attach.max_slots) {
      munmap(region, bytes);
      return absl::InvalidArgumentError(
          "shm data plane: the control region's header does not match");
    }
    region_ = region;
    region_bytes_ = bytes;
    slots_.resize(attach.max_slots);
    seen_control_ = header->control_seq.load();
    header_.store(header);
    return absl::OkStatus();
  }

  // Answers every queued socket message. False when the client is gone.
  bool HandleMessages() {
    while (true) {
      int fd = -1;
      absl::StatusOr<shm::SocketMessage> message =
          shm::ReceiveMessage(socket_, &fd);
      if (absl::IsDeadlineExceeded(message.status())) return true;  // drained
      if (absl::IsUnavailable(message.status())) return false;
      absl::Status status = message.status();
      shm::SocketMessage rows_reply;  // MapRows' fields
      int reply_fd = -1;
      if (status.ok()) {
        switch (message->type) {
          case shm::MessageType::kMapSlot:
            status = MapSlot(*message, fd);
            break;
          case shm::MessageType::kMapRows:
            status = MapRows(*message, &rows_reply, &reply_fd);
            break;
          case shm::MessageType::kUnmapSlot:
            status = message->slot < slots_.size()
                         ? absl::OkStatus()
                         : absl::InvalidArgumentError("slot out of range");
            if (status.ok()) UnmapSlot(message->slot);
            break;
          default:
            status = absl::InvalidArgumentError(absl::StrCat(
                "shm data plane: unexpected message type ",
                static_cast<uint32_t>(message->type)));
        }
      }
      if (fd >= 0) close(fd);
      Count(status);
      shm::SocketMessage reply = shm::ReplyFor(status);
      reply.elements = rows_reply.elements;
      reply.max_slots = rows_reply.max_slots;
      const bool sent = shm::SendMessage(socket_, reply, reply_fd).ok();
      if (reply_fd >= 0) close(reply_fd);
      if (!sent) return false;
    }
  }

  // One-sided reads: a read-only descriptor of the K (slot 0) or V (slot 1)
  // rows of a sequence the caller's session owns (KvStore::ShareRows).
  absl::Status MapRows(const shm::SocketMessage& message,
                       shm::SocketMessage* reply, int* fd) {
    if (message.slot > 1) {
      return absl::InvalidArgumentError(
          "shm data plane: MapRows names K (0) or V (1)");
    }
    IG_ASSIGN_OR_RETURN(
        KvStore::SharedRows rows,
        server_->store_->ShareRows(message.sequence, message.session));
    *fd = message.slot == 0 ? rows.k_fd : rows.v_fd;
    close(message.slot == 0 ? rows.v_fd : rows.k_fd);
    reply->elements = rows.layer_values;
    reply->max_slots = static_cast<uint32_t>(rows.max_tokens);
    return absl::OkStatus();
  }

  absl::Status MapSlot(const shm::SocketMessage& message, int fd) {
    if (message.slot >= slots_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm data plane: slot ", message.slot, " out of range"));
    }
    if (fd < 0) {
      return absl::InvalidArgumentError("shm data plane: MapSlot carries no fd");
    }
    const size_t elements = message.elements;
    if (elements == 0 || elements > (size_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm data plane: bad slot size of ", elements, " values"));
    }
    UnmapSlot(message.slot);
    MappedSlot slot;
    slot.elements = elements;
    slot.data_bytes = shm::SlotDataBytes(elements);
    slot.plan_capacity = shm::SlotPlanCapacity(elements);
    slot.plan_bytes = shm::SlotPlanBytes(elements);
    const int64_t bytes = static_cast<int64_t>(slot.data_bytes + slot.plan_bytes);
    const ShmServerOptions& options = server_->options_;
    if (bytes > options.max_client_slot_bytes - client_slot_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "shm data plane: a slot of ", bytes, " bytes would pass the limit of ",
          options.max_client_slot_bytes, " bytes of slots per client (",
          client_slot_bytes_, " mapped)"));
    }
    if (server_->slot_bytes_.fetch_add(bytes) + bytes >
        options.max_total_slot_bytes) {
      server_->slot_bytes_.fetch_sub(bytes);
      return absl::ResourceExhaustedError(absl::StrCat(
          "shm data plane: a slot of ", bytes, " bytes would pass the limit of ",
          options.max_total_slot_bytes, " bytes of slots of all clients"));
    }
    absl::StatusOr<void*> data = MapClientMemory(fd, 0, slot.data_bytes);
    absl::StatusOr<void*> plan =
        data.ok() ? MapClientMemory(fd, slot.data_bytes, slot.plan_bytes)
                  : data.status();
    if (!plan.ok()) {
      if (data.ok()) munmap(*data, slot.data_bytes);
      server_->slot_bytes_.fetch_sub(bytes);
      return plan.status();
    }
    client_slot_bytes_ += bytes;
    slot.data = static_cast<uint16_t*>(*data);
    slot.plan = static_cast<int32_t*>(*plan);
    if (slot.plan_capacity > scratch_capacity_) {
      // new[] of a large array is untouched memory until a plan uses it.
      scratch_.reset(new int32_t[slot.plan_capacity]);
      scratch_capacity_ = slot.plan_capacity;
    }
    slots_[message.slot] = slot;
    slot_limit_ = std::max<uint32_t>(slot_limit_, message.slot + 1);
    return absl::OkStatus();
  }

  void UnmapSlot(uint32_t i) {
    MappedSlot& slot = slots_[i];
    if (slot.data == nullptr) return;
    munmap(slot.data, slot.data_bytes);
    munmap(slot.plan, slot.plan_bytes);
    const int64_t bytes = static_cast<int64_t>(slot.data_bytes + slot.plan_bytes);
    client_slot_bytes_ -= bytes;
    server_->slot_bytes_.fetch_sub(bytes);
    slot = MappedSlot();
  }

  bool AnyRequested() {
    for (uint32_t i = 0; i < slot_limit_; ++i) {
      if (shm::SlotAt(region_, i)->state.load(std::memory_order_relaxed) ==
          shm::kRequested) {
        return true;
      }
    }
    return false;
  }

  // Serves every slot found requested, starting after the last one served
  // so that no client thread starves the others. True if any was.
  bool ServePending() {
    bool served = false;
    for (uint32_t k = 0; k < slot_limit_; ++k) {
      const uint32_t i = (next_slot_ + k) % slot_limit_;
      SlotControl* control = shm::SlotAt(region_, i);
      if (control->state.load(std::memory_order_relaxed) != shm::kRequested) {
        continue;
      }
      uint32_t expected = shm::kRequested;
      if (!control->state.compare_exchange_strong(expected, shm::kServing)) {
        continue;  // cancelled by the client at its deadline
      }
      Serve(i, control);
      next_slot_ = i + 1;
      served = true;
    }
    return served;
  }

  // A refusal (not OK) is counted.
  void Count(const absl::Status& status) {
    if (server_->options_.metrics != nullptr) {
      server_->options_.metrics->Rejected(Plane::kShm, status);
    }
  }

  void Serve(uint32_t i, SlotControl* control) {
    const MappedSlot& slot = slots_[i];
    // Read every field once: the client shares this memory.
    const uint32_t n_indices = control->n_indices;
    const uint32_t n_offsets = control->n_head_offsets;
    const int32_t layer = control->layer;
    const SequenceId sequence = control->sequence;
    const SessionId session = control->session;
    const uint32_t flags = control->flags;
    const bool note_only = (flags & shm::kNoteOnly) != 0;
    const uint64_t append_values = control->append_values;
    const uint64_t append_meta_bytes = control->append_meta_bytes;
    absl::Status status;
    if (slot.data != nullptr && (flags & shm::kAppend) != 0) {
      AppendFields append;
      append.sequence = sequence;
      append.session = session;
      append.first_layer = layer;
      append.n_layers = n_offsets;
      append.n_tokens = n_indices;
      append.values = append_values;
      const absl::Time start = absl::Now();
      status = shm::ServeAppend(*server_->store_, append, append_meta_bytes,
                                slot.data,
                                slot.elements, slot.plan, slot.plan_capacity,
                                &control->result_count);
      if (RequestMetrics* metrics = server_->options_.metrics;
          metrics != nullptr && status.ok()) {
        metrics->Served(Plane::kShm, RequestOp::kAppend, absl::Now() - start,
                        static_cast<int64_t>(2 * append_values *
                                             sizeof(uint16_t)));
      }
    } else if (slot.data == nullptr) {
      status = absl::FailedPreconditionError(
          absl::StrCat("shm data plane: slot ", i, " is not mapped"));
    } else if (static_cast<size_t>(n_indices) + n_offsets > slot.plan_capacity) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "shm data plane: a plan of ", n_indices, " indices and ", n_offsets,
          " head offsets does not fit the slot"));
    } else {
      // Copy the plan out of shared memory so that the store validates and
      // uses the same values.
      std::memcpy(scratch_.get(), slot.plan,
                  (static_cast<size_t>(n_indices) + n_offsets) * sizeof(int32_t));
      FetchPlan plan;
      plan.indices = absl::MakeConstSpan(scratch_.get(), n_indices);
      plan.head_offsets =
          absl::MakeConstSpan(scratch_.get() + n_indices, n_offsets);
      const absl::Time start = absl::Now();
      status = server_->store_->CheckOwner(sequence, session);
      if (status.ok() && note_only &&
          (flags & shm::kLeading) != 0) {
        // A whole layer read in place: head offsets alone.
        status = n_indices == 0
                     ? server_->store_->NoteLeadingFetched(sequence, layer,
                                                           plan.head_offsets)
                     : absl::InvalidArgumentError(absl::StrCat(
                           "shm data plane: a leading note carries no "
                           "indices, got ",
                           n_indices));
      } else if (status.ok() && note_only && (flags & shm::kHeld) != 0) {
        // The client holds the rows (its row cache).
        status = server_->store_->NoteHeld(sequence, layer, plan);
      } else if (status.ok() && note_only) {
        // The client read the rows itself (MapRows): the node records it.
        status = server_->store_->NoteFetched(sequence, layer, plan);
      } else if (status.ok()) {
        status = server_->store_->Gather(
            sequence, layer, plan, absl::MakeSpan(slot.data, slot.elements));
      }
      RequestMetrics* metrics = server_->options_.metrics;
      if (metrics != nullptr && status.ok() && !note_only) {
        const absl::Duration elapsed = absl::Now() - start;
        absl::StatusOr<SequenceGeometry> g = server_->store_->Geometry(sequence);
        metrics->Served(Plane::kShm, RequestOp::kFetch, elapsed,
                        g.ok() ? static_cast<int64_t>(
                                     FetchElements(plan, g->head_dim) *
                                     sizeof(uint16_t))
                               : 0);
      }
    }
    Count(status);
    control->status_code = static_cast<int32_t>(status.code());
    const size_t len = std::min(status.message().size(), shm::kStatusMessageBytes);
    // An OK status's message may be a null view: memcpy's source must not.
    if (len > 0) std::memcpy(control->message, status.message().data(), len);
    control->message_bytes = static_cast<uint32_t>(len);
    control->state.store(shm::kDone);
    if (control->client_waiting.load() != 0) shm::FutexWakeAll(&control->state);
  }

  ShmServer* const server_;
  const int socket_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> done_{false};
  std::thread thread_;

  std::atomic<shm::RegionHeader*> header_{nullptr};
  void* region_ = nullptr;
  size_t region_bytes_ = 0;
  std::vector<MappedSlot> slots_;
  uint32_t slot_limit_ = 0;  // 1 + the highest slot ever mapped
  uint32_t next_slot_ = 0;
  uint32_t seen_control_ = 0;
  int64_t client_slot_bytes_ = 0;  // of the slots mapped now
  std::unique_ptr<int32_t[]> scratch_;  // the plan being served
  size_t scratch_capacity_ = 0;
};

absl::StatusOr<std::unique_ptr<ShmServer>> ShmServer::Start(
    std::shared_ptr<KvStore> store, ShmServerOptions options) {
  if (store == nullptr) return absl::InvalidArgumentError("no store");
  absl::StatusOr<std::string> path_or =
      ParseUnixPath(options.listen_address);
  if (!path_or.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm data plane listen address: ", path_or.status().message()));
  }
  std::string path = *std::move(path_or);
  IG_ASSIGN_OR_RETURN(const int lock_fd, shm::LockSocketPath(path));
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    close(lock_fd);
    return shm::ErrnoStatus(absl::StatusCode::kInternal, "socket", errno);
  }
  struct stat st;
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    // Left by a server that did not exit cleanly: a live one would hold the
    // lock.
    unlink(path.c_str());
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    shm::UnlockSocketPath(path, lock_fd);
    return shm::ErrnoStatus(absl::StatusCode::kUnavailable,
                            absl::StrCat("bind ", path), err);
  }
  if (listen(fd, 128) != 0) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    shm::UnlockSocketPath(path, lock_fd);
    return shm::ErrnoStatus(absl::StatusCode::kInternal, "listen", err);
  }
  const int stop_fd = eventfd(0, EFD_CLOEXEC);
  if (stop_fd < 0) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    shm::UnlockSocketPath(path, lock_fd);
    return shm::ErrnoStatus(absl::StatusCode::kInternal, "eventfd", err);
  }
  std::unique_ptr<ShmServer> server(new ShmServer(std::move(store),
                                                  std::move(options),
                                                  std::move(path), fd, stop_fd,
                                                  lock_fd));
  server->accept_thread_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  IG_LOG(INFO) << "shm data plane listening on " << server->client_address()
               << " (control at " << server->options_.control_address << ")";
  return server;
}

ShmServer::ShmServer(std::shared_ptr<KvStore> store, ShmServerOptions options,
                     std::string path, int listen_fd, int stop_fd,
                     int lock_fd)
    : store_(std::move(store)),
      options_(std::move(options)),
      path_(std::move(path)),
      listen_fd_(listen_fd),
      stop_fd_(stop_fd),
      lock_fd_(lock_fd) {}

ShmServer::~ShmServer() {
  stopping_.store(true);
  const uint64_t one = 1;
  if (write(stop_fd_, &one, sizeof(one)) < 0) {
    IG_LOG(WARNING) << "shm data plane: cannot signal the accept loop";
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  std::list<std::unique_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    connections.swap(connections_);
  }
  for (auto& c : connections) c->Stop();
  connections.clear();  // joins
  close(listen_fd_);
  close(stop_fd_);
  unlink(path_.c_str());
  shm::UnlockSocketPath(path_, lock_fd_);
}

std::string ShmServer::client_address() const {
  return absl::StrCat("shm:unix:", path_);
}

int ShmServer::active_connections() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& c : connections_) n += c->done() ? 0 : 1;
  return n;
}

void ShmServer::ReapFinished() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    it = (*it)->done() ? connections_.erase(it) : std::next(it);
  }
}

void ShmServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    // The timeout only paces the reaping of finished connections.
    const int n = poll(fds, 2, 1000);
    if (n < 0 && errno != EINTR) {
      IG_LOG(ERROR) << "shm data plane: poll: " << std::strerror(errno);
      return;
    }
    if (stopping_.load() || (fds[1].revents & POLLIN) != 0) return;
    // Out of descriptors, the pending peer is shed and the loop backs off
    // (acceptor.h) instead of polling a readable socket at full speed.
    const int socket = n > 0 && (fds[0].revents & POLLIN) != 0
                           ? acceptor_.Accept(listen_fd_, SOCK_CLOEXEC)
                           : -1;
    absl::MutexLock lock(&mu_);
    ReapFinished();
    if (socket < 0) continue;
    // Admission: attached clients up to max_connections; those still in
    // their handshake (not yet authenticated, perhaps silent) apart, at
    // most kMaxHandshakes, the oldest dropped for a newer one. A peer
    // without the token, or one that says nothing, never holds a place a
    // client with the token needs, and is dropped at the handshake timeout
    // anyway.
    int attached = 0, handshaking = 0;
    Connection* oldest_handshake = nullptr;
    for (const auto& c : connections_) {
      if (c->done()) continue;
      if (c->attached()) {
        ++attached;
      } else {
        ++handshaking;
        if (oldest_handshake == nullptr) oldest_handshake = c.get();
      }
    }
    if (handshaking >= kMaxHandshakes && oldest_handshake != nullptr) {
      oldest_handshake->Stop();  // its Attach fails now; reaped when done
      ++dropped_handshakes_;
    }
    if (attached >= options_.max_connections) {
      shm::SendMessage(socket, shm::ReplyFor(absl::ResourceExhaustedError(
                                   absl::StrCat("the shm data plane already "
                                                "serves its limit of ",
                                                options_.max_connections,
                                                " clients"))))
          .IgnoreError();
      close(socket);
      continue;
    }
    connections_.push_back(std::make_unique<Connection>(this, socket));
    connections_.back()->Start();
  }
}

}  // namespace infinigen::kv_memory_service
