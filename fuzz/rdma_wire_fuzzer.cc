// libFuzzer target: the RDMA data plane's wire (kv_memory_service/rdma/
// rdma_wire.h) as a peer would send it: the first byte picks a fetch
// request packet, a response packet, the queue-pair endpoint exchanged
// over gRPC, or an rdma:// address. A request that decodes is served as
// the RDMA server serves it (the plan gathered from a live KvStore into a
// buffer slot's worth of rows) and must re-encode to the same request; a
// response and an endpoint that decode must survive a round trip.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <string>
#include <vector>

#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/client/kv_types.h"
#include "kv_memory_service/rdma/rdma_wire.h"

namespace kvm = infinigen::kv_memory_service;
namespace rdma = infinigen::kv_memory_service::rdma;

namespace {

struct Store {
  kvm::KvStore store{kvm::KvStoreOptions{}};
  kvm::SequenceId sequence = 0;
  Store() {
    kvm::SequenceGeometry g;
    g.n_layers = 2;
    g.n_kv_heads = 2;
    g.head_dim = 4;
    g.max_tokens = 64;
    auto opened = store.Open(g);
    if (!opened.ok()) std::abort();
    sequence = *opened;
    std::vector<uint16_t> k(2 * 8 * 2 * 4, 1), v(k.size(), 2);
    kvm::AppendBlock b;
    b.first_layer = 0;
    b.n_layers = 2;
    b.n_tokens = 8;
    b.k = k;
    b.v = v;
    if (!store.Append(sequence, b).ok()) std::abort();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Store node;
  if (size == 0 || size > rdma::kMaxRequestBytes + 1) return 0;
  const uint8_t op = data[0] % 4;
  // Packets arrive in 4-byte aligned receive buffers.
  std::vector<uint32_t> aligned((size - 1 + 3) / 4 + 1);
  std::memcpy(aligned.data(), data + 1, size - 1);
  const auto packet =
      absl::MakeConstSpan(reinterpret_cast<const char*>(aligned.data()), size - 1);
  switch (op) {
    case 0: {
      auto request = rdma::DecodeFetchRequest(packet);
      if (!request.ok() || !request->plan_inline) return 0;
      kvm::FetchPlan plan;
      plan.indices = request->inline_plan.subspan(0, request->n_indices);
      plan.head_offsets = request->inline_plan.subspan(request->n_indices);
      // Low ids reach the open sequence.
      const kvm::SequenceId seq =
          request->sequence < 4 ? node.sequence : request->sequence;
      std::vector<uint16_t> rows(256);
      (void)node.store.Gather(seq, request->layer, plan, absl::MakeSpan(rows));
      std::vector<char> again(rdma::kMaxRequestBytes);
      const size_t n = rdma::EncodeFetchRequest(
          request->slot, request->sequence, request->session, request->layer,
          plan,
          absl::MakeSpan(again));
      if (n != packet.size()) std::abort();
      auto decoded = rdma::DecodeFetchRequest(absl::MakeConstSpan(again.data(), n));
      if (!decoded.ok() || decoded->slot != request->slot ||
          decoded->sequence != request->sequence ||
          decoded->session != request->session ||
          decoded->layer != request->layer ||
          decoded->n_indices != request->n_indices ||
          decoded->n_head_offsets != request->n_head_offsets ||
          !std::equal(decoded->inline_plan.begin(), decoded->inline_plan.end(),
                      request->inline_plan.begin(),
                      request->inline_plan.end())) {
        std::abort();
      }
      break;
    }
    case 1: {
      auto response = rdma::DecodeFetchResponse(packet);
      if (!response.ok()) return 0;
      std::vector<char> again(rdma::kResponseBytes);
      const size_t n = rdma::EncodeFetchResponse(
          response->slot, response->status, absl::MakeSpan(again));
      auto decoded =
          rdma::DecodeFetchResponse(absl::MakeConstSpan(again.data(), n));
      if (!decoded.ok() || decoded->slot != response->slot ||
          decoded->status.code() != response->status.code()) {
        std::abort();
      }
      break;
    }
    case 2: {
      infinigen::kv::RdmaEndpoint proto;
      if (!proto.ParseFromArray(packet.data(), static_cast<int>(packet.size()))) {
        return 0;
      }
      auto info = rdma::FromProto(proto);
      if (!info.ok()) return 0;
      infinigen::kv::RdmaEndpoint back;
      rdma::ToProto(*info, &back);
      auto again = rdma::FromProto(back);
      if (!again.ok() || again->qp_num != info->qp_num ||
          again->psn != info->psn || again->lid != info->lid ||
          again->gid != info->gid || again->mtu != info->mtu ||
          again->port != info->port) {
        std::abort();
      }
      break;
    }
    case 3:
      (void)rdma::ParseRdmaAddress(std::string(packet.data(), packet.size()));
      break;
  }
  return 0;
}
