// The endpoint: a reliable-connected queue pair and its state machine.
//
//   RESET --Init()--> INIT --ConnectTo(remote)--> RTR --> RTS
//
// Handshake (over gRPC, KvRdma.Connect in proto/kv_rdma.proto):
//   1. the client creates its QP, moves it to INIT and posts its receives;
//   2. it sends its EndpointInfo (QPN, first PSN, LID, GID, MTU, port);
//   3. the server creates its QP, INIT, posts receives, moves it to RTR and
//      RTS against the client's endpoint, and answers with its own;
//   4. the client moves its QP to RTR and RTS against the server's.
// Receives are posted in INIT, before the peer can send. Either side moves
// its QP to ERR (Fail) to stop the peer writing into its memory at once.
//
// The transitions' parameters are built by plain functions (InitTransition,
// RtrTransition, RtsTransition), unit-tested without a device.
//
// Thread-safety: posting and Fail may be called from several threads
// (ibverbs serializes them); Init and ConnectTo once, from one thread.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_RDMA_QUEUE_PAIR_H_
#define INFINIGEN_KV_MEMORY_SERVICE_RDMA_QUEUE_PAIR_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kv_memory_service/rdma/rdma_device.h"
#include "kv_memory_service/rdma/rdma_wire.h"

namespace infinigen::kv_memory_service::rdma {

// Reliability and path settings of RTR and RTS.
struct RcPathOptions {
  uint8_t timeout = 14;        // local ACK timeout 4.096 us * 2^14 = 67 ms
  uint8_t retry_cnt = 7;       // transport retries before IBV_WC_RETRY_EXC_ERR
  uint8_t rnr_retry = 7;       // 7 = retry forever on receiver-not-ready
  uint8_t min_rnr_timer = 12;  // 0.64 ms
  uint8_t max_rd_atomic = 4;   // RDMA READs in flight (server reads plans)
  uint8_t service_level = 0;
  uint8_t hop_limit = 64;
  uint8_t traffic_class = 0;
};

struct QpTransition {
  ibv_qp_attr attr;
  int mask = 0;
};

// RESET -> INIT on `port`, allowing remote writes and reads.
QpTransition InitTransition(uint8_t port);
// INIT -> RTR against `remote`: path MTU = the smaller of the two; global
// routing (GRH) when the remote has a GID, which RoCE always needs.
QpTransition RtrTransition(const EndpointInfo& local, const EndpointInfo& remote,
                           const RcPathOptions& options);
// RTR -> RTS, sending from local.psn.
QpTransition RtsTransition(const EndpointInfo& local,
                           const RcPathOptions& options);

// A random 24-bit first packet sequence number.
uint32_t RandomPsn();

class RcQueuePair {
 public:
  // Both queues complete into `cq`.
  static absl::StatusOr<std::unique_ptr<RcQueuePair>> Create(
      const RdmaDevice& device, const CompletionQueue& cq,
      uint32_t max_send_wr, uint32_t max_recv_wr);
  ~RcQueuePair();
  RcQueuePair(const RcQueuePair&) = delete;
  RcQueuePair& operator=(const RcQueuePair&) = delete;

  const EndpointInfo& local() const { return local_; }

  absl::Status Init();
  absl::Status ConnectTo(const EndpointInfo& remote,
                         const RcPathOptions& options = {});
  // Moves to ERR: outstanding work completes with a flush error, and the
  // peer's writes are refused from now on.
  void Fail();

  absl::Status PostRecv(uint64_t wr_id, void* addr, uint32_t length,
                        uint32_t lkey);
  absl::Status PostSend(uint64_t wr_id, const void* addr, uint32_t length,
                        uint32_t lkey);
  // One RDMA READ of [remote, +length) into local memory.
  absl::Status PostRead(uint64_t wr_id, void* addr, uint32_t length,
                        uint32_t lkey, uint64_t remote_addr, uint32_t rkey);
  // An unsignaled RDMA WRITE of the rows, then a signaled SEND of the
  // response, in one post: the SEND's completion means both are done.
  // length 0 skips the WRITE.
  absl::Status PostWriteThenSend(uint64_t wr_id, const void* rows,
                                 uint32_t rows_length, uint32_t rows_lkey,
                                 uint64_t remote_addr, uint32_t rkey,
                                 const void* response, uint32_t response_length,
                                 uint32_t response_lkey);

 private:
  RcQueuePair(ibv_qp* qp, EndpointInfo local) : qp_(qp), local_(local) {}
  absl::Status Modify(const QpTransition& t, const char* what);

  ibv_qp* const qp_;
  const EndpointInfo local_;
};

}  // namespace infinigen::kv_memory_service::rdma

#endif  // INFINIGEN_KV_MEMORY_SERVICE_RDMA_QUEUE_PAIR_H_
