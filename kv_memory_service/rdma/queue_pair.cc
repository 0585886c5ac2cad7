#include "kv_memory_service/rdma/queue_pair.h"

#include <errno.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace infinigen::kv_memory_service::rdma {

QpTransition InitTransition(uint8_t port) {
  QpTransition t;
  std::memset(&t.attr, 0, sizeof(t.attr));
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = port;
  t.attr.qp_access_flags =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return t;
}

QpTransition RtrTransition(const EndpointInfo& local, const EndpointInfo& remote,
                           const RcPathOptions& options) {
  QpTransition t;
  std::memset(&t.attr, 0, sizeof(t.attr));
  t.attr.qp_state = IBV_QPS_RTR;
  t.attr.path_mtu = static_cast<ibv_mtu>(std::min(local.mtu, remote.mtu));
  t.attr.dest_qp_num = remote.qp_num;
  t.attr.rq_psn = remote.psn;
  t.attr.max_dest_rd_atomic = options.max_rd_atomic;
  t.attr.min_rnr_timer = options.min_rnr_timer;
  t.attr.ah_attr.dlid = remote.lid;
  t.attr.ah_attr.sl = options.service_level;
  t.attr.ah_attr.src_path_bits = 0;
  t.attr.ah_attr.port_num = static_cast<uint8_t>(local.port);
  if (remote.has_gid()) {
    t.attr.ah_attr.is_global = 1;
    std::memcpy(t.attr.ah_attr.grh.dgid.raw, remote.gid.data(), 16);
    t.attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(local.gid_index);
    t.attr.ah_attr.grh.hop_limit = options.hop_limit;
    t.attr.ah_attr.grh.traffic_class = options.traffic_class;
    t.attr.ah_attr.grh.flow_label = 0;
  }
  t.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  return t;
}

QpTransition RtsTransition(const EndpointInfo& local,
                           const RcPathOptions& options) {
  QpTransition t;
  std::memset(&t.attr, 0, sizeof(t.attr));
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.sq_psn = local.psn;
  t.attr.timeout = options.timeout;
  t.attr.retry_cnt = options.retry_cnt;
  t.attr.rnr_retry = options.rnr_retry;
  t.attr.max_rd_atomic = options.max_rd_atomic;
  t.mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
           IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
}

uint32_t RandomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

absl::StatusOr<std::unique_ptr<RcQueuePair>> RcQueuePair::Create(
    const RdmaDevice& device, const CompletionQueue& cq, uint32_t max_send_wr,
    uint32_t max_recv_wr) {
  ibv_qp_init_attr init;
  std::memset(&init, 0, sizeof(init));
  init.send_cq = cq.cq();
  init.recv_cq = cq.cq();
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;
  init.cap.max_send_wr = max_send_wr;
  init.cap.max_recv_wr = max_recv_wr;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(device.pd(), &init);
  if (qp == nullptr) return IG_VERBS_ERROR("ibv_create_qp(RC)", errno);
  return std::unique_ptr<RcQueuePair>(
      new RcQueuePair(qp, device.Endpoint(qp->qp_num, RandomPsn())));
}

RcQueuePair::~RcQueuePair() { ibv_destroy_qp(qp_); }

absl::Status RcQueuePair::Modify(const QpTransition& t, const char* what) {
  QpTransition copy = t;
  const int err = ibv_modify_qp(qp_, &copy.attr, copy.mask);
  if (err != 0) return IG_VERBS_ERROR(absl::StrCat("ibv_modify_qp(", what, ")"), err);
  return absl::OkStatus();
}

absl::Status RcQueuePair::Init() {
  return Modify(InitTransition(static_cast<uint8_t>(local_.port)), "INIT");
}

absl::Status RcQueuePair::ConnectTo(const EndpointInfo& remote,
                                    const RcPathOptions& options) {
  absl::Status s = Modify(RtrTransition(local_, remote, options), "RTR");
  if (!s.ok()) return s;
  return Modify(RtsTransition(local_, options), "RTS");
}

void RcQueuePair::Fail() {
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(qp_, &attr, IBV_QP_STATE);
}

absl::Status RcQueuePair::PostRecv(uint64_t wr_id, void* addr, uint32_t length,
                                   uint32_t lkey) {
  ibv_sge sge{reinterpret_cast<uint64_t>(addr), length, lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int err = ibv_post_recv(qp_, &wr, &bad);
  if (err != 0) return IG_VERBS_ERROR("ibv_post_recv", err);
  return absl::OkStatus();
}

absl::Status RcQueuePair::PostSend(uint64_t wr_id, const void* addr,
                                   uint32_t length, uint32_t lkey) {
  ibv_sge sge{reinterpret_cast<uint64_t>(addr), length, lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  const int err = ibv_post_send(qp_, &wr, &bad);
  if (err != 0) return IG_VERBS_ERROR("ibv_post_send(SEND)", err);
  return absl::OkStatus();
}

absl::Status RcQueuePair::PostRead(uint64_t wr_id, void* addr, uint32_t length,
                                   uint32_t lkey, uint64_t remote_addr,
                                   uint32_t rkey) {
  ibv_sge sge{reinterpret_cast<uint64_t>(addr), length, lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  const int err = ibv_post_send(qp_, &wr, &bad);
  if (err != 0) return IG_VERBS_ERROR("ibv_post_send(RDMA_READ)", err);
  return absl::OkStatus();
}

absl::Status RcQueuePair::PostWriteThenSend(
    uint64_t wr_id, const void* rows, uint32_t rows_length, uint32_t rows_lkey,
    uint64_t remote_addr, uint32_t rkey, const void* response,
    uint32_t response_length, uint32_t response_lkey) {
  ibv_sge write_sge{reinterpret_cast<uint64_t>(rows), rows_length, rows_lkey};
  ibv_sge send_sge{reinterpret_cast<uint64_t>(response), response_length,
                   response_lkey};
  ibv_send_wr send{};
  send.wr_id = wr_id;
  send.sg_list = &send_sge;
  send.num_sge = 1;
  send.opcode = IBV_WR_SEND;
  send.send_flags = IBV_SEND_SIGNALED;
  ibv_send_wr write{};
  write.wr_id = MakeWorkId(WorkKind::kRowsWrite, WorkSlotOf(wr_id));
  write.sg_list = &write_sge;
  write.num_sge = 1;
  write.opcode = IBV_WR_RDMA_WRITE;
  write.wr.rdma.remote_addr = remote_addr;
  write.wr.rdma.rkey = rkey;
  write.next = &send;
  ibv_send_wr* bad = nullptr;
  const int err = ibv_post_send(qp_, rows_length > 0 ? &write : &send, &bad);
  if (err != 0) return IG_VERBS_ERROR("ibv_post_send(RDMA_WRITE + SEND)", err);
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service::rdma
