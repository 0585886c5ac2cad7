#include "kv_memory_service/rdma/rdma_client.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kv_memory_service/control/proto_convert.h"
#include "kv_memory_service/rdma/queue_pair.h"
#include "kv_memory_service/rdma/rdma_device.h"
#include "kv_memory_service/rdma/rdma_wire.h"
#include "common/cuda_host_register.h"
#include "proto/kv_rdma.grpc.pb.h"

namespace infinigen::kv_memory_service {
namespace {

using rdma::AlignedMemory;
using rdma::MemoryRegion;
using rdma::WorkKind;

// One RDMA message carries the whole fetch: keep it far below the 2 GiB
// most adapters allow.
constexpr size_t kMaxBufferElements = size_t{1} << 29;
constexpr absl::Duration kSleepSlice = absl::Milliseconds(10);
constexpr absl::Duration kChannelCheckInterval = absl::Milliseconds(100);

int64_t SpinNanos(size_t n_indices) {
  return std::min<int64_t>(30'000 + 250 * static_cast<int64_t>(n_indices),
                           2'000'000);
}

void AddAuth(grpc::ClientContext* ctx, const KvClientOptions& options,
             absl::Duration timeout) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!options.auth_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options.auth_token);
  }
}

// One fetch slot's progress, written by whichever thread polls the CQ.
struct SlotProgress {
  std::atomic<bool> request_sent{true};
  std::atomic<bool> response_in{true};
  absl::Status result;  // written before response_in = true
};

class RdmaKvClient;

class RdmaFetchBuffer final : public FetchBuffer {
 public:
  struct Memory {
    AlignedMemory data;  // [elements] uint16
    size_t elements = 0;
    AlignedMemory plan;  // [plan_capacity] int32, for plans sent by READ
    size_t plan_capacity = 0;
    std::unique_ptr<MemoryRegion> data_mr, plan_mr;
  };

  RdmaFetchBuffer(RdmaKvClient* client, uint32_t slot, Memory memory,
                  bool pinned)
      : FetchBuffer(client, reinterpret_cast<uint16_t*>(memory.data.get()),
                    memory.elements),
        client_(client),
        slot_(slot),
        memory_(std::move(memory)),
        pinned_(pinned) {}
  ~RdmaFetchBuffer() override;

  // Sends the fetch of a claimed buffer (FetchBuffer::Claim began it).
  // A fetch of `plan`, or with `held` a note of its rows held (nothing
  // written into the buffer).
  FetchHandle Start(SequenceId seq, int32_t layer, const FetchPlan& plan,
                    absl::Time deadline, bool held = false);

 protected:
  absl::Status WaitForFetch() override;

 private:
  RdmaKvClient* const client_;
  const uint32_t slot_;
  Memory memory_;
  const bool pinned_;
  bool published_ = false;
  absl::Time deadline_;
  int64_t spin_ns_ = 0;
};

class RdmaKvClient final : public KvClientWrapper {
 public:
  struct Parts {
    std::unique_ptr<rdma::RdmaDevice> device;
    std::unique_ptr<rdma::CompletionQueue> cq;
    AlignedMemory send_memory;  // [kMaxSlots][kMaxRequestBytes]
    std::unique_ptr<MemoryRegion> send_mr;
    AlignedMemory recv_memory;  // [kMaxSlots][kResponseBytes]
    std::unique_ptr<MemoryRegion> recv_mr;
    std::unique_ptr<rdma::RcQueuePair> qp;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<kv::KvRdma::Stub> stub;
    uint64_t connection_id = 0;
    size_t max_request_bytes = rdma::kMaxRequestBytes;
  };

  RdmaKvClient(std::unique_ptr<KvClient> control, const KvClientOptions& options,
               Parts parts)
      : KvClientWrapper(std::move(control)),
        options_(options),
        p_(std::move(parts)),
        slot_used_(rdma::kMaxSlots, false) {}

  ~RdmaKvClient() override {
    if (Health().ok()) {
      grpc::ClientContext ctx;
      AddAuth(&ctx, options_, absl::Seconds(1));
      kv::RdmaDisconnectRequest req;
      req.set_connection_id(p_.connection_id);
      kv::RdmaDisconnectResponse resp;
      p_.stub->Disconnect(&ctx, req, &resp);
    }
    p_.qp->Fail();
  }

  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) override;

  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    auto buffer = FetchBuffer::Claim<RdmaFetchBuffer>(this, dest);
    if (!buffer.ok()) return FetchHandle(buffer.status());
    return (*buffer)->Start(seq, layer, plan,
                            absl::Now() + options_.fetch_timeout);
  }

  // On the queue pair, as a fetch whose response comes without rows.
  FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                            const FetchPlan& plan, FetchBuffer* via) override {
    auto buffer = FetchBuffer::Claim<RdmaFetchBuffer>(this, via);
    if (!buffer.ok()) return FetchHandle(buffer.status());
    return (*buffer)->Start(seq, layer, plan,
                            absl::Now() + options_.fetch_timeout,
                            /*held=*/true);
  }

  std::string data_plane() const override { return "rdma"; }

  // For RdmaFetchBuffer.

  absl::Status Health() const {
    if (healthy_.load(std::memory_order_acquire)) return absl::OkStatus();
    absl::MutexLock lock(&failure_mu_);
    return failure_;
  }

  absl::Span<char> RequestArea(uint32_t slot) {
    return absl::MakeSpan(p_.send_memory.get() + slot * rdma::kMaxRequestBytes,
                          p_.max_request_bytes);
  }

  absl::Status PostRequest(uint32_t slot, size_t bytes) {
    SlotProgress& s = progress_[slot];
    s.result = absl::OkStatus();
    s.request_sent.store(false);
    s.response_in.store(false);
    return p_.qp->PostSend(rdma::MakeWorkId(WorkKind::kRequestSend, slot),
                           RequestArea(slot).data(),
                           static_cast<uint32_t>(bytes), p_.send_mr->lkey());
  }

  // Until the slot's response is in and its request's send completed (its
  // buffer may be reused only then), the connection fails, or `deadline`.
  absl::Status AwaitSlot(uint32_t slot, absl::Time deadline, int64_t spin_ns);

  void ReleaseSlot(uint32_t slot) {
    absl::MutexLock lock(&slots_mu_);
    slot_used_[slot] = false;
  }

 private:
  // Moves the queue pair to ERR (the server can no longer write into our
  // memory) and makes every wait fail with `why`.
  void Fail(absl::Status why) {
    {
      absl::MutexLock lock(&failure_mu_);
      if (!healthy_.load()) return;
      failure_ = why;
      healthy_.store(false, std::memory_order_release);
    }
    IG_LOG(WARNING) << "RDMA data plane: " << why;
    p_.qp->Fail();
  }

  // Drains the completion queue; true if anything completed.
  bool Poll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(cq_mu_);

  absl::StatusOr<uint32_t> AllocateSlot() {
    absl::MutexLock lock(&slots_mu_);
    for (uint32_t i = 0; i < slot_used_.size(); ++i) {
      if (!slot_used_[i]) {
        slot_used_[i] = true;
        return i;
      }
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "an RDMA client holds at most ", rdma::kMaxSlots, " fetch buffers"));
  }

  const KvClientOptions options_;
  Parts p_;
  SlotProgress progress_[rdma::kMaxSlots];

  absl::Mutex cq_mu_;  // one poller at a time
  std::atomic<int64_t> next_channel_check_ns_{0};

  std::atomic<bool> healthy_{true};
  mutable absl::Mutex failure_mu_;
  absl::Status failure_ ABSL_GUARDED_BY(failure_mu_);

  absl::Mutex slots_mu_;
  std::vector<bool> slot_used_ ABSL_GUARDED_BY(slots_mu_);
};

bool RdmaKvClient::Poll() {
  ibv_wc wc[16];
  absl::StatusOr<int> n = p_.cq->Poll(absl::MakeSpan(wc));
  if (!n.ok()) {
    Fail(absl::UnavailableError(n.status().message()));
    return true;
  }
  for (int i = 0; i < *n; ++i) {
    const WorkKind kind = rdma::WorkKindOf(wc[i].wr_id);
    const uint32_t index = rdma::WorkSlotOf(wc[i].wr_id);
    if (wc[i].status != IBV_WC_SUCCESS) {
      if (Health().ok()) {
        Fail(absl::UnavailableError(absl::StrCat(
            "RDMA completion error (", ibv_wc_status_str(wc[i].status),
            "): the KV memory server is gone or unreachable")));
      }
      continue;
    }
    if (kind == WorkKind::kRequestSend && index < rdma::kMaxSlots) {
      progress_[index].request_sent.store(true, std::memory_order_release);
    } else if (kind == WorkKind::kResponseRecv && index < rdma::kMaxSlots) {
      char* packet = p_.recv_memory.get() + index * rdma::kResponseBytes;
      absl::StatusOr<rdma::FetchResponse> response =
          rdma::DecodeFetchResponse(absl::MakeConstSpan(packet, wc[i].byte_len));
      if (!response.ok() || response->slot >= rdma::kMaxSlots) {
        Fail(absl::InternalError(absl::StrCat(
            "RDMA data plane: bad response from the server: ",
            response.ok() ? "slot out of range" : response.status().message())));
        continue;
      }
      SlotProgress& s = progress_[response->slot];
      s.result = std::move(response->status);
      s.response_in.store(true, std::memory_order_release);
      absl::Status reposted = p_.qp->PostRecv(wc[i].wr_id, packet,
                                              rdma::kResponseBytes,
                                              p_.recv_mr->lkey());
      if (!reposted.ok()) Fail(absl::UnavailableError(reposted.message()));
    }
  }
  return *n > 0;
}

absl::Status RdmaKvClient::AwaitSlot(uint32_t slot, absl::Time deadline,
                                     int64_t spin_ns) {
  SlotProgress& s = progress_[slot];
  const int64_t spin_until = absl::GetCurrentTimeNanos() + spin_ns;
  while (true) {
    if (s.response_in.load(std::memory_order_acquire) &&
        s.request_sent.load(std::memory_order_acquire)) {
      return std::move(s.result);
    }
    IG_RETURN_IF_ERROR(Health());
    const int64_t now_ns = absl::GetCurrentTimeNanos();
    if (cq_mu_.TryLock()) {
      if (!Poll() && now_ns >= spin_until) {
        const absl::Duration left =
            deadline - absl::FromUnixNanos(now_ns);
        absl::Status waited =
            p_.cq->WaitForEvent(std::min(kSleepSlice, std::max(left, absl::ZeroDuration())));
        if (!waited.ok()) Fail(absl::UnavailableError(waited.message()));
        Poll();
      }
      cq_mu_.Unlock();
    } else if (now_ns >= spin_until) {
      // Another thread polls (and may sleep); wait for it to hand over.
      cq_mu_.Lock();
      cq_mu_.Unlock();
    } else {
      sched_yield();
    }
    if (s.response_in.load(std::memory_order_acquire) &&
        s.request_sent.load(std::memory_order_acquire)) {
      continue;  // done: take the result above
    }
    if (absl::Now() >= deadline) {
      Fail(absl::UnavailableError(
          "the RDMA data plane was abandoned after a fetch timed out; "
          "reconnect"));
      return absl::DeadlineExceededError(
          "an RDMA fetch did not finish within the fetch timeout");
    }
    // A server that died after taking our request sends nothing more: ask
    // the gRPC channel now and then.
    int64_t next = next_channel_check_ns_.load(std::memory_order_relaxed);
    if (now_ns >= next &&
        next_channel_check_ns_.compare_exchange_strong(
            next, now_ns + absl::ToInt64Nanoseconds(kChannelCheckInterval))) {
      const grpc_connectivity_state state = p_.channel->GetState(true);
      if (state == GRPC_CHANNEL_TRANSIENT_FAILURE ||
          state == GRPC_CHANNEL_SHUTDOWN) {
        Fail(absl::UnavailableError(
            "the KV memory server's control channel failed during an RDMA "
            "fetch (is the server gone?)"));
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<FetchBuffer>> RdmaKvClient::NewFetchBuffer(
    size_t elements) {
  if (elements == 0) {
    return absl::InvalidArgumentError("a fetch buffer needs at least 1 value");
  }
  if (elements > kMaxBufferElements) {
    return absl::ResourceExhaustedError(
        absl::StrCat("an RDMA fetch buffer holds at most ", kMaxBufferElements,
                     " values; asked for ", elements));
  }
  IG_RETURN_IF_ERROR(Health());
  IG_ASSIGN_OR_RETURN(const uint32_t slot, AllocateSlot());
  auto undo = [&](absl::Status status) {
    ReleaseSlot(slot);
    return status;
  };
  RdmaFetchBuffer::Memory m;
  m.elements = elements;
  m.plan_capacity = elements / 2 + 4097;
  const size_t data_bytes = elements * sizeof(uint16_t);
  const size_t plan_bytes = m.plan_capacity * sizeof(int32_t);
  absl::StatusOr<AlignedMemory> data = rdma::AllocateAligned(data_bytes);
  if (!data.ok()) return undo(data.status());
  m.data = *std::move(data);
  absl::StatusOr<AlignedMemory> plan = rdma::AllocateAligned(plan_bytes);
  if (!plan.ok()) return undo(plan.status());
  m.plan = *std::move(plan);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> data_mr =
      MemoryRegion::Register(p_.device->pd(), m.data.get(), data_bytes,
                             IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!data_mr.ok()) return undo(data_mr.status());
  m.data_mr = *std::move(data_mr);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> plan_mr =
      MemoryRegion::Register(p_.device->pd(), m.plan.get(), plan_bytes,
                             IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!plan_mr.ok()) return undo(plan_mr.status());
  m.plan_mr = *std::move(plan_mr);

  grpc::ClientContext ctx;
  AddAuth(&ctx, options_, options_.rpc_timeout);
  kv::RdmaRegisterBufferRequest req;
  req.set_connection_id(p_.connection_id);
  req.set_slot(slot);
  req.set_data_addr(reinterpret_cast<uint64_t>(m.data.get()));
  req.set_data_rkey(m.data_mr->rkey());
  req.set_data_bytes(data_bytes);
  req.set_plan_addr(reinterpret_cast<uint64_t>(m.plan.get()));
  req.set_plan_rkey(m.plan_mr->rkey());
  req.set_plan_bytes(plan_bytes);
  kv::RdmaRegisterBufferResponse resp;
  absl::Status registered = FromGrpcStatus(p_.stub->RegisterBuffer(&ctx, req, &resp));
  if (!registered.ok()) return undo(registered);
  const bool pinned = CudaHostRegister(m.data.get(), data_bytes);
  return std::unique_ptr<FetchBuffer>(
      new RdmaFetchBuffer(this, slot, std::move(m), pinned));
}

RdmaFetchBuffer::~RdmaFetchBuffer() {
  if (pinned_) CudaHostUnregister(memory_.data.get());
  client_->ReleaseSlot(slot_);
}

FetchHandle RdmaFetchBuffer::Start(SequenceId seq, int32_t layer,
                                   const FetchPlan& plan, absl::Time deadline,
                                   bool held) {
  absl::Status status = client_->Health();
  const size_t n = plan.indices.size(), m = plan.head_offsets.size();
  if (status.ok() && n + m > memory_.plan_capacity) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "a plan of ", n, " indices and ", m, " head offsets does not fit an ",
        "RDMA fetch buffer of ", memory_.elements, " values"));
  }
  if (status.ok()) {
    absl::Span<char> packet = client_->RequestArea(slot_);
    const size_t bytes = rdma::EncodeFetchRequest(slot_, seq, client_->session(),
                                                 layer, plan, packet, held);
    if (bytes < rdma::InlineRequestBytes(n, m)) {
      // Too large to send inline: the server reads it from the plan area.
      auto* area = reinterpret_cast<int32_t*>(memory_.plan.get());
      std::memcpy(area, plan.indices.data(), n * sizeof(int32_t));
      std::memcpy(area + n, plan.head_offsets.data(), m * sizeof(int32_t));
    }
    status = client_->PostRequest(slot_, bytes);
  }
  if (!status.ok()) {
    CompleteFetch(std::move(status));
    return FetchHandle(this);
  }
  published_ = true;
  deadline_ = deadline;
  spin_ns_ = SpinNanos(n);
  return FetchHandle(this);
}

absl::Status RdmaFetchBuffer::WaitForFetch() {
  if (published_) {
    published_ = false;
    CompleteFetch(client_->AwaitSlot(slot_, deadline_, spin_ns_));
  }
  return TakeResult();
}

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return args;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvClient>> ConnectRdmaKvClient(
    const std::string& address, const KvClientOptions& options,
    const RdmaControlConnector& connect_control) {
  IG_ASSIGN_OR_RETURN(const rdma::RdmaAddress parsed,
                      rdma::ParseRdmaAddress(address));
  rdma::RdmaDeviceOptions device_options;
  device_options.device = parsed.device;
  device_options.port = parsed.port;
  device_options.gid_index = parsed.gid_index;
  RdmaKvClient::Parts p;
  // The device first: no RDMA device here is the answer on most machines.
  IG_ASSIGN_OR_RETURN(p.device, rdma::RdmaDevice::Open(device_options));
  constexpr uint32_t kQueueDepth = 2 * rdma::kMaxSlots;
  IG_ASSIGN_OR_RETURN(p.cq, rdma::CompletionQueue::Create(p.device->context(),
                                                          2 * kQueueDepth));
  IG_ASSIGN_OR_RETURN(p.send_memory,
                      rdma::AllocateAligned(rdma::kMaxSlots * rdma::kMaxRequestBytes));
  IG_ASSIGN_OR_RETURN(
      p.send_mr, MemoryRegion::Register(p.device->pd(), p.send_memory.get(),
                                        rdma::kMaxSlots * rdma::kMaxRequestBytes,
                                        IBV_ACCESS_LOCAL_WRITE));
  IG_ASSIGN_OR_RETURN(p.recv_memory,
                      rdma::AllocateAligned(rdma::kMaxSlots * rdma::kResponseBytes));
  IG_ASSIGN_OR_RETURN(
      p.recv_mr, MemoryRegion::Register(p.device->pd(), p.recv_memory.get(),
                                        rdma::kMaxSlots * rdma::kResponseBytes,
                                        IBV_ACCESS_LOCAL_WRITE));
  IG_ASSIGN_OR_RETURN(p.qp, rdma::RcQueuePair::Create(*p.device, *p.cq,
                                                      kQueueDepth, kQueueDepth));
  IG_RETURN_IF_ERROR(p.qp->Init());
  for (uint32_t i = 0; i < rdma::kMaxSlots; ++i) {
    IG_RETURN_IF_ERROR(p.qp->PostRecv(
        rdma::MakeWorkId(WorkKind::kResponseRecv, i),
        p.recv_memory.get() + i * rdma::kResponseBytes, rdma::kResponseBytes,
        p.recv_mr->lkey()));
  }

  p.channel = grpc::CreateCustomChannel(
      parsed.host_port, grpc::InsecureChannelCredentials(), ChannelArgs());
  if (!p.channel->WaitForConnected(
          absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "cannot connect to the KV memory server at ", parsed.host_port,
        " within ", absl::FormatDuration(options.connect_timeout)));
  }
  p.stub = kv::KvRdma::NewStub(p.channel);
  grpc::ClientContext ctx;
  AddAuth(&ctx, options, options.rpc_timeout);
  kv::RdmaConnectRequest req;
  rdma::ToProto(p.qp->local(), req.mutable_client());
  req.set_max_slots(rdma::kMaxSlots);
  kv::RdmaConnectResponse resp;
  absl::Status connected = FromGrpcStatus(p.stub->Connect(&ctx, req, &resp));
  if (absl::IsUnimplemented(connected)) {
    return absl::UnavailableError(absl::StrCat(
        "the KV memory server at ", parsed.host_port,
        " does not serve the RDMA data plane (start it with --rdma_device)"));
  }
  IG_RETURN_IF_ERROR(connected);
  IG_ASSIGN_OR_RETURN(const rdma::EndpointInfo server,
                      rdma::FromProto(resp.server()));
  IG_RETURN_IF_ERROR(p.qp->ConnectTo(server));
  p.connection_id = resp.connection_id();
  p.max_request_bytes =
      std::clamp<size_t>(resp.max_request_bytes(), 64, rdma::kMaxRequestBytes);
  IG_LOG(INFO) << "RDMA data plane: " << p.device->Describe() << " QP "
               << p.qp->local().qp_num << " -> " << parsed.host_port << " QP "
               << server.qp_num;

  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvClient> control,
                      connect_control("tcp://" + parsed.host_port, options));
  return std::unique_ptr<KvClient>(
      new RdmaKvClient(std::move(control), options, std::move(p)));
}

}  // namespace infinigen::kv_memory_service
