#include "kv_memory_service/rdma/rdma_device.h"

#include <errno.h>
#include <poll.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace infinigen::kv_memory_service::rdma {
namespace {

constexpr size_t kPage = 4096;

int MtuBytes(ibv_mtu mtu) { return 128 << static_cast<int>(mtu); }

bool IsIpv4Mapped(const uint8_t* gid) {
  static const uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(gid, kPrefix, sizeof(kPrefix)) == 0;
}

bool IsZero(const uint8_t* gid) {
  for (int i = 0; i < 16; ++i) {
    if (gid[i] != 0) return false;
  }
  return true;
}

}  // namespace

absl::Status VerbsError(absl::string_view call, int err, const char* file,
                        int line) {
  const char* base = std::strrchr(file, '/');
  const absl::StatusCode code = err == ENODEV || err == EIO
                                    ? absl::StatusCode::kUnavailable
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(call, " failed at ",
                                         base != nullptr ? base + 1 : file, ":",
                                         line, ": ", std::strerror(err)));
}

void AlignedFree::operator()(void* p) const { std::free(p); }

absl::StatusOr<AlignedMemory> AllocateAligned(size_t bytes) {
  const size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  void* p = std::aligned_alloc(kPage, rounded == 0 ? kPage : rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", rounded, " bytes for RDMA"));
  }
  return AlignedMemory(static_cast<char*>(p));
}

absl::StatusOr<std::unique_ptr<RdmaDevice>> RdmaDevice::Open(
    const RdmaDeviceOptions& options) {
  errno = 0;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    const int err = errno;
    return absl::UnavailableError(absl::StrCat(
        "no RDMA device: ibv_get_device_list failed (",
        std::strerror(err),
        err == ENOSYS ? "; this kernel has no RDMA support, e.g. no "
                        "/sys/class/infiniband"
                      : "",
        ")"));
  }
  struct ListFree {
    ibv_device** l;
    ~ListFree() { ibv_free_device_list(l); }
  } free_list{list};
  if (n == 0) {
    return absl::UnavailableError(
        "no RDMA device: ibv_get_device_list found none (no InfiniBand, RoCE "
        "or iWARP adapter, and no soft-RoCE link: see "
        "kv_memory_service/rdma/README.md)");
  }

  std::vector<std::string> tried;
  for (int i = 0; i < n; ++i) {
    const std::string name = ibv_get_device_name(list[i]);
    if (!options.device.empty() && name != options.device) continue;
    ibv_context* context = ibv_open_device(list[i]);
    if (context == nullptr) {
      tried.push_back(absl::StrCat(name, " (cannot open: ", std::strerror(errno), ")"));
      continue;
    }
    ibv_device_attr device_attr;
    if (ibv_query_device(context, &device_attr) != 0) {
      tried.push_back(absl::StrCat(name, " (ibv_query_device failed)"));
      ibv_close_device(context);
      continue;
    }
    for (int port = 1; port <= device_attr.phys_port_cnt; ++port) {
      if (options.port != 0 && port != options.port) continue;
      ibv_port_attr port_attr;
      if (ibv_query_port(context, static_cast<uint8_t>(port), &port_attr) != 0 ||
          port_attr.state != IBV_PORT_ACTIVE) {
        tried.push_back(absl::StrCat(name, " port ", port, " (not active)"));
        continue;
      }
      std::unique_ptr<RdmaDevice> device(new RdmaDevice);
      device->name_ = name;
      device->port_ = static_cast<uint8_t>(port);
      device->lid_ = port_attr.lid;
      device->mtu_ = port_attr.active_mtu;
      device->ethernet_ = port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
      // Pick the GID.
      int gid_index = options.gid_index;
      if (gid_index < 0 && device->ethernet_) {
        int fallback = -1;
        for (int g = 0; g < port_attr.gid_tbl_len; ++g) {
          ibv_gid_entry entry;
          if (ibv_query_gid_ex(context, port, g, &entry, 0) != 0) continue;
          if (IsZero(entry.gid.raw)) continue;
          if (fallback < 0) fallback = g;
          if (entry.gid_type == IBV_GID_TYPE_ROCE_V2 && IsIpv4Mapped(entry.gid.raw)) {
            gid_index = g;
            break;
          }
        }
        if (gid_index < 0) gid_index = fallback;
      }
      if (gid_index < 0) gid_index = 0;
      ibv_gid gid;
      if (ibv_query_gid(context, static_cast<uint8_t>(port), gid_index, &gid) != 0) {
        tried.push_back(absl::StrCat(name, " port ", port, " (no GID ", gid_index, ")"));
        continue;
      }
      if (device->ethernet_ && IsZero(gid.raw)) {
        tried.push_back(absl::StrCat(name, " port ", port,
                                     " (RoCE port with no usable GID: is an IP "
                                     "address set on its netdev?)"));
        continue;
      }
      device->gid_index_ = gid_index;
      std::memcpy(device->gid_.data(), gid.raw, 16);
      device->pd_ = ibv_alloc_pd(context);
      if (device->pd_ == nullptr) {
        const int err = errno;
        ibv_close_device(context);
        return IG_VERBS_ERROR("ibv_alloc_pd", err);
      }
      device->context_ = context;
      return device;
    }
    ibv_close_device(context);
  }
  if (!options.device.empty() && tried.empty()) {
    std::vector<std::string> names;
    for (int i = 0; i < n; ++i) names.push_back(ibv_get_device_name(list[i]));
    return absl::UnavailableError(absl::StrCat(
        "no RDMA device: no device named '", options.device, "' (there are: ",
        absl::StrJoin(names, ", "), ")"));
  }
  return absl::UnavailableError(absl::StrCat(
      "no RDMA device: no usable port among ", absl::StrJoin(tried, "; ")));
}

RdmaDevice::~RdmaDevice() {
  if (pd_ != nullptr) ibv_dealloc_pd(pd_);
  if (context_ != nullptr) ibv_close_device(context_);
}

EndpointInfo RdmaDevice::Endpoint(uint32_t qp_num, uint32_t psn) const {
  EndpointInfo info;
  info.qp_num = qp_num;
  info.psn = psn;
  info.lid = lid_;
  info.gid = gid_;
  info.gid_index = static_cast<uint32_t>(gid_index_);
  info.mtu = static_cast<uint32_t>(mtu_);
  info.port = port_;
  return info;
}

std::string RdmaDevice::Describe() const {
  return absl::StrCat(name_, " port ", port_, " (",
                      ethernet_ ? "RoCE" : "InfiniBand", ", lid ", lid_,
                      ", gid ", gid_index_, " ", GidToString(gid_), ", mtu ",
                      MtuBytes(mtu_), ")");
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> MemoryRegion::Register(
    ibv_pd* pd, void* addr, size_t length, int access) {
  ibv_mr* mr = ibv_reg_mr(pd, addr, length, access);
  if (mr == nullptr) {
    const int err = errno;
    return IG_VERBS_ERROR(absl::StrCat("ibv_reg_mr of ", length, " bytes"), err);
  }
  return std::unique_ptr<MemoryRegion>(new MemoryRegion(mr));
}

MemoryRegion::~MemoryRegion() { ibv_dereg_mr(mr_); }

absl::StatusOr<std::unique_ptr<CompletionQueue>> CompletionQueue::Create(
    ibv_context* context, int entries) {
  ibv_comp_channel* channel = ibv_create_comp_channel(context);
  if (channel == nullptr) {
    return IG_VERBS_ERROR("ibv_create_comp_channel", errno);
  }
  ibv_cq* cq = ibv_create_cq(context, entries, nullptr, channel, 0);
  if (cq == nullptr) {
    const int err = errno;
    ibv_destroy_comp_channel(channel);
    return IG_VERBS_ERROR("ibv_create_cq", err);
  }
  return std::unique_ptr<CompletionQueue>(new CompletionQueue(channel, cq));
}

CompletionQueue::~CompletionQueue() {
  if (unacked_events_ > 0) ibv_ack_cq_events(cq_, unacked_events_);
  ibv_destroy_cq(cq_);
  ibv_destroy_comp_channel(channel_);
}

absl::StatusOr<int> CompletionQueue::Poll(absl::Span<ibv_wc> out) {
  const int n = ibv_poll_cq(cq_, static_cast<int>(out.size()), out.data());
  if (n < 0) return IG_VERBS_ERROR("ibv_poll_cq", EIO);
  return n;
}

absl::Status CompletionQueue::WaitForEvent(absl::Duration timeout) {
  if (ibv_req_notify_cq(cq_, 0) != 0) {
    return IG_VERBS_ERROR("ibv_req_notify_cq", errno);
  }
  pollfd p{channel_->fd, POLLIN, 0};
  const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
  const int ready = poll(&p, 1, ms < 1 ? 1 : ms);
  if (ready <= 0) return absl::OkStatus();  // timeout (or EINTR): poll again
  ibv_cq* cq = nullptr;
  void* context = nullptr;
  if (ibv_get_cq_event(channel_, &cq, &context) != 0) {
    return IG_VERBS_ERROR("ibv_get_cq_event", errno);
  }
  // Acknowledging is a lock on the CQ; batch it.
  if (++unacked_events_ >= 64) {
    ibv_ack_cq_events(cq_, unacked_events_);
    unacked_events_ = 0;
  }
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service::rdma
