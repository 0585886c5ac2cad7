// What the RDMA data plane's two sides exchange, as plain values with their
// encodings. No ibverbs here: this is what can be tested on a machine with
// no RDMA device.
//
// Handshake (gRPC, proto/kv_rdma.proto): each side's queue-pair endpoint
// (EndpointInfo <-> RdmaEndpoint), then one RegisterBuffer per FetchBuffer
// (the remote address and rkey the server writes rows to).
//
// Per fetch, on the RC queue pair, no gRPC:
//   client SEND   FetchRequest packet: header + the plan inline when it fits
//                 kMaxRequestBytes, else only the header (the server RDMA
//                 READs the plan from the buffer's registered plan area)
//   server WRITE  the gathered rows, staging -> the buffer's data (on success)
//   server SEND   FetchResponse packet: slot, status code, message
// A note (the request's `held` flag: the client holds the plan's rows) gets
// the response alone: the server counts them as rows of the layer's last
// fetch (KvStore::NoteHeld) and writes no rows.
// RC delivers the WRITE before the SEND that follows it on the same queue
// pair, so the rows are in place when the client sees the response.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_WIRE_H_
#define INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv_memory_service/client/kv_types.h"
#include "proto/kv_rdma.pb.h"

namespace infinigen::kv_memory_service::rdma {

// Most fetches in flight per connection (FetchBuffers of one client).
constexpr uint32_t kMaxSlots = 64;
// Size of each request receive the server posts.
constexpr size_t kMaxRequestBytes = 4096;
// Size of each response receive the client posts.
constexpr size_t kResponseBytes = 512;

// One side of an RC queue pair (see RdmaEndpoint in kv_rdma.proto).
struct EndpointInfo {
  uint32_t qp_num = 0;  // 24 bits
  uint32_t psn = 0;     // 24 bits
  uint16_t lid = 0;
  std::array<uint8_t, 16> gid{};
  uint32_t gid_index = 0;
  uint32_t mtu = 0;  // enum ibv_mtu: 1 (256 B) .. 5 (4096 B)
  uint32_t port = 1;

  bool has_gid() const;
};

void ToProto(const EndpointInfo& info, infinigen::kv::RdmaEndpoint* proto);
// InvalidArgument naming the field when out of range (a 24-bit number over
// 24 bits, a gid not of 16 bytes, an unknown MTU).
absl::StatusOr<EndpointInfo> FromProto(const infinigen::kv::RdmaEndpoint& proto);

// "fe80:0000:...:" form, for logs.
std::string GidToString(const std::array<uint8_t, 16>& gid);

// A fetch as the server receives it. `plan` points into the packet when
// inline, else is empty and the plan (n_indices, then n_head_offsets
// int32s) must be read from the buffer's plan area.
struct FetchRequest {
  uint32_t slot = 0;
  SequenceId sequence = 0;
  SessionId session = 0;  // the caller's: the node serves only the owner
  int32_t layer = 0;
  uint32_t n_indices = 0;
  uint32_t n_head_offsets = 0;
  bool plan_inline = false;
  bool held = false;  // a note of rows the client holds: no rows written
  absl::Span<const int32_t> inline_plan;  // indices then head offsets
};

// Bytes a request packet for a plan of this size takes when inline.
size_t InlineRequestBytes(size_t n_indices, size_t n_head_offsets);

// Writes the request packet for `plan` into `out` (at least
// kMaxRequestBytes), inline when it fits; returns the bytes to send. The
// caller writes a non-inline plan into the plan area itself. `held`: a
// note of rows the caller holds instead of a fetch.
size_t EncodeFetchRequest(uint32_t slot, SequenceId sequence,
                          SessionId session, int32_t layer,
                          const FetchPlan& plan, absl::Span<char> out,
                          bool held = false);
// InvalidArgument for a packet that is short, has a bad magic, or whose
// lengths do not match. `packet` must be 4-byte aligned and outlive the
// result (the inline plan points into it).
absl::StatusOr<FetchRequest> DecodeFetchRequest(absl::Span<const char> packet);

// Writes the response for `slot` into `out` (kResponseBytes), the message
// cut to fit; returns the bytes to send.
size_t EncodeFetchResponse(uint32_t slot, const absl::Status& status,
                           absl::Span<char> out);
struct FetchResponse {
  uint32_t slot = 0;
  absl::Status status;
};
absl::StatusOr<FetchResponse> DecodeFetchResponse(absl::Span<const char> packet);

// wr_id of the work requests: which kind and which slot.
enum class WorkKind : uint32_t {
  kRequestSend = 1,
  kResponseRecv = 2,
  kRequestRecv = 3,
  kPlanRead = 4,
  kRowsWrite = 5,
  kResponseSend = 6,
};
inline uint64_t MakeWorkId(WorkKind kind, uint32_t slot) {
  return (static_cast<uint64_t>(kind) << 32) | slot;
}
inline WorkKind WorkKindOf(uint64_t wr_id) {
  return static_cast<WorkKind>(wr_id >> 32);
}
inline uint32_t WorkSlotOf(uint64_t wr_id) {
  return static_cast<uint32_t>(wr_id);
}

// The parts of rdma://HOST:PORT[?device=NAME&port=N&gid_index=N].
struct RdmaAddress {
  std::string host_port;   // HOST:PORT, also the gRPC control endpoint
  std::string device;      // empty: the first device with an active port
  int port = 0;            // 0: the device's first active port
  int gid_index = -1;      // -1: chosen from the port's GID table
};
absl::StatusOr<RdmaAddress> ParseRdmaAddress(const std::string& address);

}  // namespace infinigen::kv_memory_service::rdma

#endif  // INFINIGEN_KV_MEMORY_SERVICE_RDMA_RDMA_WIRE_H_
