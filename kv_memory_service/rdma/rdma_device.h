// The RDMA device context: an opened ibverbs device with its protection
// domain and the port and GID the data plane uses, plus RAII owners of
// memory regions and completion queues.
//
// RdmaDevice::Open is where a machine without RDMA says so: Unavailable with
// a message that starts "no RDMA device: " and says what was looked for.
// Every other ibverbs failure becomes a Status naming the call and the
// source line (VerbsError).
//
// Thread-safety: ibverbs objects may be used from several threads; these
// wrappers add no state of their own after construction.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_DEVICE_H_
#define INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_DEVICE_H_

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv_memory_service/rdma/rdma_wire.h"

namespace infinigen::kv_memory_service::rdma {

// "<call> failed at <file>:<line>: <strerror(err)>", code Internal (or
// Unavailable for errors that mean the device went away).
absl::Status VerbsError(absl::string_view call, int err, const char* file,
                        int line);
#define IG_VERBS_ERROR(call, err) \
  ::infinigen::kv_memory_service::rdma::VerbsError(call, err, __FILE__, __LINE__)

struct RdmaDeviceOptions {
  // ibverbs device name (e.g. "mlx5_0"); empty = the first device that has
  // an active port.
  std::string device;
  // Port number; 0 = the device's first active port.
  int port = 0;
  // GID table index; -1 = on Ethernet (RoCE) the first RoCE v2 GID holding
  // an IPv4-mapped address, else the first non-zero one; on InfiniBand 0.
  int gid_index = -1;
};

class RdmaDevice {
 public:
  static absl::StatusOr<std::unique_ptr<RdmaDevice>> Open(
      const RdmaDeviceOptions& options);
  ~RdmaDevice();
  RdmaDevice(const RdmaDevice&) = delete;
  RdmaDevice& operator=(const RdmaDevice&) = delete;

  ibv_context* context() const { return context_; }
  ibv_pd* pd() const { return pd_; }
  const std::string& name() const { return name_; }
  uint8_t port() const { return port_; }

  // This device's side of a queue pair with the given number and first PSN.
  EndpointInfo Endpoint(uint32_t qp_num, uint32_t psn) const;
  // For logs: "mlx5_0 port 1 (RoCE, gid 3 ..., mtu 4096)".
  std::string Describe() const;

 private:
  RdmaDevice() = default;

  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  std::string name_;
  uint8_t port_ = 0;
  uint16_t lid_ = 0;
  ibv_mtu mtu_ = IBV_MTU_1024;
  bool ethernet_ = false;
  int gid_index_ = 0;
  std::array<uint8_t, 16> gid_{};
};

// A registered memory region; deregistered on destruction.
class MemoryRegion {
 public:
  // access: IBV_ACCESS_* flags. The memory must outlive the region.
  static absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(
      ibv_pd* pd, void* addr, size_t length, int access);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  void* addr() const { return mr_->addr; }
  size_t length() const { return mr_->length; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }

 private:
  explicit MemoryRegion(ibv_mr* mr) : mr_(mr) {}
  ibv_mr* const mr_;
};

// A completion queue with a completion channel, so that a poller can sleep.
class CompletionQueue {
 public:
  static absl::StatusOr<std::unique_ptr<CompletionQueue>> Create(
      ibv_context* context, int entries);
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;

  ibv_cq* cq() const { return cq_; }
  // Up to out.size() completions; their count, or an error.
  absl::StatusOr<int> Poll(absl::Span<ibv_wc> out);
  // Arms the queue and sleeps until a completion event or `timeout`. The
  // caller polls again afterwards (completions may have come before the
  // arming).
  absl::Status WaitForEvent(absl::Duration timeout);

 private:
  CompletionQueue(ibv_comp_channel* channel, ibv_cq* cq)
      : channel_(channel), cq_(cq) {}
  ibv_comp_channel* const channel_;
  ibv_cq* const cq_;
  unsigned unacked_events_ = 0;
};

// Aligned host memory that is freed on destruction (for registration).
struct AlignedFree {
  void operator()(void* p) const;
};
using AlignedMemory = std::unique_ptr<char, AlignedFree>;
// `bytes` rounded up to pages, page-aligned; ResourceExhausted on failure.
absl::StatusOr<AlignedMemory> AllocateAligned(size_t bytes);

}  // namespace infinigen::kv_memory_service::rdma

#endif  // INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_DEVICE_H_
