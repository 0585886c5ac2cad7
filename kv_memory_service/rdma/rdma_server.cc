#include "kv_memory_service/rdma/rdma_server.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "kv_memory_service/control/proto_convert.h"
#include "kv_memory_service/rdma/queue_pair.h"
#include "kv_memory_service/rdma/rdma_device.h"
#include "kv_memory_service/rdma/rdma_wire.h"
#include "proto/kv_rdma.grpc.pb.h"

namespace infinigen::kv_memory_service {
namespace {

using rdma::AlignedMemory;
using rdma::MemoryRegion;
using rdma::WorkKind;

constexpr absl::Duration kIdleWait = absl::Milliseconds(50);
// A WRITE, READ or SEND that has not completed by then means the client is
// gone (RC retries take well under this).
constexpr absl::Duration kCompletionTimeout = absl::Seconds(10);
constexpr uint64_t kMaxBufferBytes = uint64_t{1} << 30;

// One client's queue pair, registered memory and serving thread.
class Connection {
 public:
  Connection(rdma::RdmaDevice* device, std::shared_ptr<KvStore> store,
             absl::Duration spin, RequestMetrics* metrics)
      : device_(device),
        store_(std::move(store)),
        spin_(spin),
        metrics_(metrics) {}

  ~Connection() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    if (qp_ != nullptr) qp_->Fail();
  }

  // Creates the QP, posts the request receives and connects to `client`.
  absl::Status Setup(const rdma::EndpointInfo& client, uint32_t max_slots) {
    max_slots_ = max_slots;
    IG_ASSIGN_OR_RETURN(cq_, rdma::CompletionQueue::Create(device_->context(),
                                                           4 * max_slots + 16));
    IG_ASSIGN_OR_RETURN(qp_, rdma::RcQueuePair::Create(*device_, *cq_, 8,
                                                       max_slots + 4));
    IG_RETURN_IF_ERROR(qp_->Init());
    const size_t recv_bytes = max_slots * rdma::kMaxRequestBytes;
    IG_ASSIGN_OR_RETURN(requests_, rdma::AllocateAligned(recv_bytes));
    IG_ASSIGN_OR_RETURN(requests_mr_,
                        MemoryRegion::Register(device_->pd(), requests_.get(),
                                               recv_bytes, IBV_ACCESS_LOCAL_WRITE));
    IG_ASSIGN_OR_RETURN(response_, rdma::AllocateAligned(rdma::kResponseBytes));
    IG_ASSIGN_OR_RETURN(response_mr_, MemoryRegion::Register(
                                          device_->pd(), response_.get(),
                                          rdma::kResponseBytes, 0));
    for (uint32_t i = 0; i < max_slots; ++i) IG_RETURN_IF_ERROR(PostRequestRecv(i));
    IG_RETURN_IF_ERROR(qp_->ConnectTo(client));
    {
      absl::MutexLock lock(&mu_);
      buffers_.resize(max_slots);
    }
    thread_ = std::thread([this] {
      Run();
      done_.store(true);
    });
    return absl::OkStatus();
  }

  const rdma::EndpointInfo& local() const { return qp_->local(); }
  bool done() const { return done_.load(); }

  absl::Status RegisterBuffer(const kv::RdmaRegisterBufferRequest& req) {
    if (req.data_bytes() == 0 || req.data_bytes() > kMaxBufferBytes ||
        req.data_bytes() % 2 != 0 || req.plan_bytes() > kMaxBufferBytes ||
        req.plan_bytes() % 4 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RDMA buffer of ", req.data_bytes(), " data bytes and ",
          req.plan_bytes(), " plan bytes is out of range"));
    }
    absl::MutexLock lock(&mu_);
    if (req.slot() >= buffers_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("RDMA buffer slot ", req.slot(), " out of range"));
    }
    // Staging and plan scratch grow to the largest buffer, here at setup,
    // never on the fetch path.
    if (req.data_bytes() > staging_bytes_) {
      staging_mr_.reset();
      IG_ASSIGN_OR_RETURN(staging_, rdma::AllocateAligned(req.data_bytes()));
      IG_ASSIGN_OR_RETURN(staging_mr_, MemoryRegion::Register(
                                           device_->pd(), staging_.get(),
                                           req.data_bytes(), IBV_ACCESS_LOCAL_WRITE));
      staging_bytes_ = req.data_bytes();
    }
    if (req.plan_bytes() > scratch_bytes_) {
      scratch_mr_.reset();
      IG_ASSIGN_OR_RETURN(scratch_, rdma::AllocateAligned(req.plan_bytes()));
      IG_ASSIGN_OR_RETURN(scratch_mr_, MemoryRegion::Register(
                                           device_->pd(), scratch_.get(),
                                           req.plan_bytes(), IBV_ACCESS_LOCAL_WRITE));
      scratch_bytes_ = req.plan_bytes();
    }
    RemoteBuffer& b = buffers_[req.slot()];
    b.valid = true;
    b.data_addr = req.data_addr();
    b.data_rkey = req.data_rkey();
    b.data_bytes = req.data_bytes();
    b.plan_addr = req.plan_addr();
    b.plan_rkey = req.plan_rkey();
    b.plan_bytes = req.plan_bytes();
    return absl::OkStatus();
  }

 private:
  struct RemoteBuffer {
    bool valid = false;
    uint64_t data_addr = 0;
    uint32_t data_rkey = 0;
    uint64_t data_bytes = 0;
    uint64_t plan_addr = 0;
    uint32_t plan_rkey = 0;
    uint64_t plan_bytes = 0;
  };

  absl::Status PostRequestRecv(uint32_t i) {
    return qp_->PostRecv(rdma::MakeWorkId(WorkKind::kRequestRecv, i),
                         requests_.get() + i * rdma::kMaxRequestBytes,
                         rdma::kMaxRequestBytes, requests_mr_->lkey());
  }

  void Run() {
    int64_t last_work = absl::GetCurrentTimeNanos();
    const int64_t spin_ns = absl::ToInt64Nanoseconds(spin_);
    while (!stop_.load(std::memory_order_relaxed)) {
      ibv_wc wc;
      if (!pending_.empty()) {
        wc = pending_.front();
        pending_.pop_front();
      } else {
        absl::StatusOr<int> n = cq_->Poll(absl::MakeSpan(&wc, 1));
        if (!n.ok()) {
          IG_LOG(WARNING) << "RDMA connection: " << n.status();
          return;
        }
        if (*n == 0) {
          if (absl::GetCurrentTimeNanos() - last_work > spin_ns) {
            absl::Status waited = cq_->WaitForEvent(kIdleWait);
            if (!waited.ok()) {
              IG_LOG(WARNING) << "RDMA connection: " << waited;
              return;
            }
          }
          continue;
        }
      }
      if (wc.status != IBV_WC_SUCCESS) {
        IG_LOG(INFO) << "RDMA connection QP " << qp_->local().qp_num
                     << " ends: " << ibv_wc_status_str(wc.status);
        return;
      }
      if (rdma::WorkKindOf(wc.wr_id) == WorkKind::kRequestRecv) {
        absl::Status served = Serve(wc);
        if (!served.ok()) {
          IG_LOG(WARNING) << "RDMA connection QP " << qp_->local().qp_num
                          << " ends: " << served;
          return;
        }
      }
      last_work = absl::GetCurrentTimeNanos();
    }
  }

  // Waits for the completion of the one `kind` operation in flight; request
  // receives that complete meanwhile are kept for Run.
  absl::Status AwaitCompletion(WorkKind kind) {
    const absl::Time deadline = absl::Now() + kCompletionTimeout;
    while (!stop_.load(std::memory_order_relaxed)) {
      ibv_wc wc[8];
      IG_ASSIGN_OR_RETURN(const int n, cq_->Poll(absl::MakeSpan(wc)));
      bool found = false;
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          return absl::UnavailableError(absl::StrCat(
              "completion error ", ibv_wc_status_str(wc[i].status)));
        }
        const WorkKind k = rdma::WorkKindOf(wc[i].wr_id);
        if (k == WorkKind::kRequestRecv) {
          pending_.push_back(wc[i]);
        } else if (k == kind) {
          found = true;
        }
      }
      if (found) return absl::OkStatus();
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError("the client did not acknowledge");
      }
    }
    return absl::CancelledError("shutting down");
  }

  // Serves one request. Errors of the request go to the client in the
  // response; an error returned here ends the connection.
  absl::Status Serve(const ibv_wc& wc) {
    const uint32_t index = rdma::WorkSlotOf(wc.wr_id);
    const char* packet = requests_.get() + index * rdma::kMaxRequestBytes;
    IG_ASSIGN_OR_RETURN(
        const rdma::FetchRequest request,
        rdma::DecodeFetchRequest(absl::MakeConstSpan(packet, wc.byte_len)));
    absl::MutexLock lock(&mu_);
    const absl::Time start = absl::Now();
    absl::Status status;
    RemoteBuffer b;
    size_t rows_bytes = 0;
    if (request.slot >= buffers_.size() || !buffers_[request.slot].valid) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "RDMA fetch into unregistered buffer slot ", request.slot));
    } else if (absl::Status owner =
                   store_->CheckOwner(request.sequence, request.session);
               !owner.ok()) {
      status = std::move(owner);  // another session's (or no) sequence
    } else {
      b = buffers_[request.slot];
      const size_t count =
          static_cast<size_t>(request.n_indices) + request.n_head_offsets;
      const int32_t* plan_values = request.inline_plan.data();
      if (!request.plan_inline) {
        if (count * sizeof(int32_t) > b.plan_bytes ||
            count * sizeof(int32_t) > scratch_bytes_) {
          status = absl::InvalidArgumentError(absl::StrCat(
              "a plan of ", count, " values does not fit the buffer's plan area"));
        } else if (count > 0) {
          IG_RETURN_IF_ERROR(qp_->PostRead(
              rdma::MakeWorkId(WorkKind::kPlanRead, request.slot), scratch_.get(),
              static_cast<uint32_t>(count * sizeof(int32_t)), scratch_mr_->lkey(),
              b.plan_addr, b.plan_rkey));
          IG_RETURN_IF_ERROR(AwaitCompletion(WorkKind::kPlanRead));
        }
        plan_values = reinterpret_cast<const int32_t*>(scratch_.get());
      }
      if (status.ok()) {
        FetchPlan plan;
        plan.indices = absl::MakeConstSpan(plan_values, request.n_indices);
        plan.head_offsets = absl::MakeConstSpan(plan_values + request.n_indices,
                                                request.n_head_offsets);
        if (request.held) {
          status = store_->NoteHeld(request.sequence, request.layer, plan);
        } else {
          status = store_->Gather(
              request.sequence, request.layer, plan,
              absl::MakeSpan(reinterpret_cast<uint16_t*>(staging_.get()),
                             b.data_bytes / sizeof(uint16_t)));
        }
        if (status.ok() && !request.held) {
          absl::StatusOr<SequenceGeometry> g = store_->Geometry(request.sequence);
          if (g.ok()) {
            rows_bytes = FetchElements(plan, g->head_dim) * sizeof(uint16_t);
          } else {
            status = g.status();  // closed since the gather
          }
        }
      }
    }
    if (metrics_ != nullptr && !(request.held && status.ok())) {
      metrics_->Record(Plane::kRdma, RequestOp::kFetch, absl::Now() - start,
                       static_cast<int64_t>(rows_bytes), status);
    }
    const size_t response_bytes = rdma::EncodeFetchResponse(
        request.slot, status, absl::MakeSpan(response_.get(), rdma::kResponseBytes));
    IG_RETURN_IF_ERROR(qp_->PostWriteThenSend(
        rdma::MakeWorkId(WorkKind::kResponseSend, request.slot), staging_.get(),
        static_cast<uint32_t>(rows_bytes),
        staging_mr_ != nullptr ? staging_mr_->lkey() : 0, b.data_addr,
        b.data_rkey, response_.get(), static_cast<uint32_t>(response_bytes),
        response_mr_->lkey()));
    IG_RETURN_IF_ERROR(AwaitCompletion(WorkKind::kResponseSend));
    return PostRequestRecv(index);
  }

  rdma::RdmaDevice* const device_;
  const std::shared_ptr<KvStore> store_;
  const absl::Duration spin_;
  RequestMetrics* const metrics_;  // not owned; null: none
  uint32_t max_slots_ = 0;

  std::unique_ptr<rdma::CompletionQueue> cq_;
  AlignedMemory requests_;  // [max_slots][kMaxRequestBytes]: receives
  std::unique_ptr<MemoryRegion> requests_mr_;
  AlignedMemory response_;  // [kResponseBytes]: the response being sent
  std::unique_ptr<MemoryRegion> response_mr_;
  std::unique_ptr<rdma::RcQueuePair> qp_;
  std::deque<ibv_wc> pending_;  // request receives not served yet (Run only)

  std::atomic<bool> stop_{false};
  std::atomic<bool> done_{false};
  std::thread thread_;

  absl::Mutex mu_;  // held while serving one request
  std::vector<RemoteBuffer> buffers_ ABSL_GUARDED_BY(mu_);
  AlignedMemory staging_ ABSL_GUARDED_BY(mu_);  // gathered rows
  std::unique_ptr<MemoryRegion> staging_mr_ ABSL_GUARDED_BY(mu_);
  uint64_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  AlignedMemory scratch_ ABSL_GUARDED_BY(mu_);  // plans read from the client
  std::unique_ptr<MemoryRegion> scratch_mr_ ABSL_GUARDED_BY(mu_);
  uint64_t scratch_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

class RdmaServer::Impl final : public kv::KvRdma::Service {
 public:
  Impl(std::shared_ptr<KvStore> store, const RdmaServerOptions& options,
       std::unique_ptr<rdma::RdmaDevice> device)
      : store_(std::move(store)),
        options_(options),
        credentials_(options.credentials),
        device_(std::move(device)) {}

  ~Impl() override {
    absl::flat_hash_map<uint64_t, std::unique_ptr<Connection>> connections;
    {
      absl::MutexLock lock(&mu_);
      connections.swap(connections_);
    }
    connections.clear();  // joins; the queue pairs go to ERR
  }

  std::string Describe() const { return device_->Describe(); }

  grpc::Status Connect(grpc::ServerContext* ctx,
                       const kv::RdmaConnectRequest* req,
                       kv::RdmaConnectResponse* resp) override {
    return ToGrpcStatus(DoConnect(*ctx, *req, resp));
  }

  grpc::Status RegisterBuffer(grpc::ServerContext* ctx,
                              const kv::RdmaRegisterBufferRequest* req,
                              kv::RdmaRegisterBufferResponse*) override {
    absl::Status status = Authorize(*ctx);
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      auto it = connections_.find(req->connection_id());
      status = it == connections_.end() || it->second->done()
                   ? absl::NotFoundError(absl::StrCat(
                         "no RDMA connection ", req->connection_id()))
                   : it->second->RegisterBuffer(*req);
    }
    return ToGrpcStatus(status);
  }

  grpc::Status Disconnect(grpc::ServerContext* ctx,
                          const kv::RdmaDisconnectRequest* req,
                          kv::RdmaDisconnectResponse*) override {
    absl::Status status = Authorize(*ctx);
    std::unique_ptr<Connection> ended;
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      auto it = connections_.find(req->connection_id());
      if (it == connections_.end()) {
        status = absl::NotFoundError(
            absl::StrCat("no RDMA connection ", req->connection_id()));
      } else {
        ended = std::move(it->second);
        connections_.erase(it);
      }
    }
    ended.reset();  // outside the lock: joins the thread
    return ToGrpcStatus(status);
  }

 private:
  absl::Status Authorize(const grpc::ServerContext& ctx) const {
    const auto& md = ctx.client_metadata();
    auto it = md.find("authorization");
    if (it == md.end()) return credentials_.Authenticate(nullptr).status();
    const absl::string_view presented(it->second.data(), it->second.size());
    return credentials_.Authenticate(&presented).status();
  }

  absl::Status DoConnect(const grpc::ServerContext& ctx,
                         const kv::RdmaConnectRequest& req,
                         kv::RdmaConnectResponse* resp) {
    IG_RETURN_IF_ERROR(Authorize(ctx));
    IG_ASSIGN_OR_RETURN(const rdma::EndpointInfo client, rdma::FromProto(req.client()));
    if (req.max_slots() == 0 || req.max_slots() > rdma::kMaxSlots) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_slots ", req.max_slots(), " not in [1, ", rdma::kMaxSlots, "]"));
    }
    std::vector<std::unique_ptr<Connection>> finished;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (it->second->done()) {
          finished.push_back(std::move(it->second));
          connections_.erase(it++);
        } else {
          ++it;
        }
      }
      if (static_cast<int>(connections_.size()) >= options_.max_connections) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the RDMA data plane already serves its limit of ",
            options_.max_connections, " clients"));
      }
    }
    finished.clear();
    auto connection = std::make_unique<Connection>(device_.get(), store_,
                                                   options_.spin,
                                                   options_.metrics);
    IG_RETURN_IF_ERROR(connection->Setup(client, req.max_slots()));
    rdma::ToProto(connection->local(), resp->mutable_server());
    resp->set_max_request_bytes(rdma::kMaxRequestBytes);
    absl::MutexLock lock(&mu_);
    const uint64_t id = next_id_++;
    resp->set_connection_id(id);
    connections_[id] = std::move(connection);
    return absl::OkStatus();
  }

  const std::shared_ptr<KvStore> store_;
  const RdmaServerOptions options_;
  const Credentials credentials_;
  const std::unique_ptr<rdma::RdmaDevice> device_;

  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connection>> connections_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

absl::StatusOr<std::unique_ptr<RdmaServer>> RdmaServer::Start(
    std::shared_ptr<KvStore> store, const RdmaServerOptions& options) {
  if (store == nullptr) return absl::InvalidArgumentError("no store");
  rdma::RdmaDeviceOptions device_options;
  device_options.device = options.device;
  device_options.port = options.port;
  device_options.gid_index = options.gid_index;
  IG_ASSIGN_OR_RETURN(std::unique_ptr<rdma::RdmaDevice> device,
                      rdma::RdmaDevice::Open(device_options));
  IG_LOG(INFO) << "RDMA data plane on " << device->Describe();
  return std::unique_ptr<RdmaServer>(new RdmaServer(
      std::make_unique<Impl>(std::move(store), options, std::move(device))));
}

RdmaServer::RdmaServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RdmaServer::~RdmaServer() = default;

grpc::Service* RdmaServer::service() { return impl_.get(); }
std::string RdmaServer::Describe() const { return impl_->Describe(); }

}  // namespace infinigen::kv_memory_service
