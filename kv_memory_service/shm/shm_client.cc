// ConnectShmKvClient (shm_client.h) and ShmKvClient
// (shm_client_internal.h): the connection to the server and its
// reconnection, the fetch buffers' slots, and the fetches sent through them.
#include "kv_memory_service/shm/shm_client.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/address.h"
#include "common/cuda_host_register.h"
#include "common/status.h"
#include "kv_memory_service/shm/shm_client_internal.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service::shm_client_internal {

ShmKvClient::~ShmKvClient() {
  {
    absl::MutexLock lock(&append_mu_);
    append_buffer_.reset();  // its slot goes while the connection is up
  }
  close(socket_);  // the server drops the connection and unmaps the slots
  close(region_fd_);
  munmap(region_, shm::ControlRegionBytes(shm::kMaxSlots));
  absl::MutexLock lock(&rows_mu_);
  for (auto& [seq, rows] : rows_) UnmapRows(rows);
  for (const MappedFile& f : kept_) Unmap(f);
}

absl::StatusOr<OpenedSequence> ShmKvClient::OpenSequence(
    const SequenceGeometry& geometry, const PrefixRequest& prefix) {
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

absl::StatusOr<AppendResult> ShmKvClient::Append(SequenceId seq,
                                                 const AppendBlock& block) {
  const size_t values = block.k.size();
  const std::string meta = EncodePrefixMeta(block);
  // K, V, then the annotations, in the slot's 2-byte values.
  const size_t need = 2 * values + (meta.size() + 1) / 2;
  if (values == 0 || block.v.size() != values ||
      values > kMaxBufferElements / 2 || need > kMaxBufferElements ||
      health_.load(std::memory_order_acquire) != kHealthy ||
      !Unanswered().ok()) {
    return KvClientWrapper::Append(seq, block);
  }
  const absl::Time deadline =
      std::min(block.deadline, absl::Now() + options_.fetch_timeout);
  absl::MutexLock lock(&append_mu_);
  if (append_buffer_ == nullptr || append_buffer_->size() < need) {
    append_buffer_.reset();
    // Room for a few more tokens than asked: a prefill's chunks differ a
    // little in length. The generation waits on this slot as on the append
    // itself: a node that does not map it by the deadline is unresponsive.
    absl::StatusOr<std::unique_ptr<FetchBuffer>> buffer = NewSlotBuffer(
        std::min(need + values / 8, kMaxBufferElements),
        std::max(std::min(options_.fetch_timeout, block.deadline - absl::Now()),
                 absl::Milliseconds(1)));
    if (absl::IsResourceExhausted(buffer.status())) {
      return KvClientWrapper::Append(seq, block);  // no slot to be had
    }
    if (!buffer.ok()) return buffer.status();
    append_buffer_ = *std::move(buffer);
  }
  uint16_t* data = append_buffer_->data();
  std::memcpy(data, block.k.data(), values * sizeof(uint16_t));
  std::memcpy(data + values, block.v.data(), values * sizeof(uint16_t));
  std::memcpy(data + 2 * values, meta.data(), meta.size());
  auto buffer = FetchBuffer::Claim<ShmFetchBuffer>(this, append_buffer_.get());
  if (!buffer.ok()) return buffer.status();
  IG_RETURN_IF_ERROR(
      (*buffer)->StartAppend(seq, block, meta.size(), deadline).Wait());
  AppendResult result;
  IG_ASSIGN_OR_RETURN(result.evicted, (*buffer)->Evicted());
  return result;
}

FetchHandle ShmKvClient::FetchAsync(SequenceId seq, int32_t layer,
                                    const FetchPlan& plan, FetchBuffer* dest) {
  // A node that left a fetch unanswered gets none until it answers a
  // heartbeat again.
  if (absl::Status down = Unanswered(); !down.ok()) return FetchHandle(down);
  auto buffer = FetchBuffer::Claim<ShmFetchBuffer>(this, dest);
  if (!buffer.ok()) return FetchHandle(buffer.status());
  return (*buffer)->Start(seq, layer, plan,
                          absl::Now() + options_.fetch_timeout);
}

FetchHandle ShmKvClient::Note(SequenceId seq, int32_t layer,
                              const FetchPlan& plan, FetchBuffer* via,
                              uint32_t flags) {
  if (absl::Status down = Unanswered(); !down.ok()) return FetchHandle(down);
  auto buffer = FetchBuffer::Claim<ShmFetchBuffer>(this, via);
  if (!buffer.ok()) return FetchHandle(buffer.status());
  return (*buffer)->Start(seq, layer, plan,
                          absl::Now() + options_.fetch_timeout, flags);
}

FetchHandle ShmKvClient::NoteFetchedAsync(SequenceId seq, int32_t layer,
                                          const FetchPlan& plan,
                                          FetchBuffer* via) {
  return Note(seq, layer, plan, via, shm::kNoteOnly);
}

FetchHandle ShmKvClient::NoteHeldAsync(SequenceId seq, int32_t layer,
                                       const FetchPlan& plan,
                                       FetchBuffer* via) {
  return Note(seq, layer, plan, via, shm::kNoteOnly | shm::kHeld);
}

FetchHandle ShmKvClient::NoteLeadingFetchedAsync(
    SequenceId seq, int32_t layer, absl::Span<const int32_t> head_offsets,
    FetchBuffer* via) {
  if (absl::Status down = Unanswered(); !down.ok()) return FetchHandle(down);
  auto buffer = FetchBuffer::Claim<ShmFetchBuffer>(this, via);
  if (!buffer.ok()) return FetchHandle(buffer.status());
  FetchPlan plan;
  plan.head_offsets = head_offsets;
  return (*buffer)->Start(seq, layer, plan,
                          absl::Now() + options_.fetch_timeout,
                          shm::kNoteOnly | shm::kLeading);
}

void ShmKvClient::ReleaseSlot(uint32_t slot) {
  // A node taken as unresponsive would not answer: closing the socket
  // (the client's end) unmaps its slots there all the same.
  if (health_.load() == kHealthy && Unanswered().ok()) {
    shm::SocketMessage unmap;
    unmap.type = shm::MessageType::kUnmapSlot;
    unmap.slot = slot;
    CallWithin(options_.fetch_timeout, unmap, -1).IgnoreError();
  }
  absl::MutexLock lock(&slots_mu_);
  if (slots_[slot].fd >= 0) close(slots_[slot].fd);
  slots_[slot] = Slot();
}

absl::Status ShmKvClient::CallWithin(absl::Duration timeout,
                                     const shm::SocketMessage& message, int fd,
                                     shm::SocketMessage* reply,
                                     int* reply_fd) {
  absl::Status status;
  {
    absl::MutexLock lock(&socket_mu_);
    IG_RETURN_IF_ERROR(EnsureConnectedLocked());
    // The socket waits rpc_timeout unless told otherwise for this call.
    const bool own_timeout = timeout != options_.rpc_timeout;
    if (own_timeout) {
      IG_RETURN_IF_ERROR(shm::SetReceiveTimeout(socket_, timeout));
    }
    status = Exchange(socket_, header_, message, fd, reply, reply_fd);
    if (own_timeout) {
      shm::SetReceiveTimeout(socket_, options_.rpc_timeout).IgnoreError();
    }
    if (absl::IsUnavailable(status)) {
      MarkGone();
      status = absl::UnavailableError(
          absl::StrCat(GoneStatus().message(), " (", status.message(), ")"));
    } else if (absl::IsDeadlineExceeded(status) ||
               (absl::IsInvalidArgument(status) &&
                absl::StrContains(status.message(), "malformed"))) {
      Abandon();
    }
  }
  if (absl::IsDeadlineExceeded(status)) {
    if (timeout <= options_.fetch_timeout) NoteUnanswered(timeout);
    status = absl::DeadlineExceededError(
        absl::StrCat("no answer on the shm data plane socket within ",
                     absl::FormatDuration(timeout)));
  }
  return status;
}

absl::StatusOr<uint32_t> ShmKvClient::AllocateSlot() {
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

absl::StatusOr<std::unique_ptr<FetchBuffer>> ShmKvClient::NewSlotBuffer(
    size_t elements, absl::Duration timeout) {
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

  shm::SlotControl* control = shm::SlotAt(region_, slot);
  control->state.store(shm::kIdle);
  control->client_waiting.store(0);
  shm::SocketMessage map;
  map.type = shm::MessageType::kMapSlot;
  map.slot = slot;
  map.elements = elements;
  absl::Status mapped = CallWithin(timeout, map, fd);
  if (!mapped.ok()) return undo(mapped);
  SlotMapped(slot, fd, elements);
  const bool pinned = CudaHostRegister(m.data, m.data_bytes);
  return std::unique_ptr<FetchBuffer>(
      new ShmFetchBuffer(this, slot, control, m, pinned));
}

}  // namespace infinigen::kv_memory_service::shm_client_internal

namespace infinigen::kv_memory_service {

using shm_client_internal::Exchange;
using shm_client_internal::MapShared;
using shm_client_internal::NewSealedMemfd;
using shm_client_internal::OpenDataPlaneSocket;
using shm_client_internal::ShmKvClient;

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
