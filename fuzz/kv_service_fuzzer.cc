// libFuzzer target: the memory node's gRPC handlers (KvMemoryService) and
// the proto conversions under them, called as gRPC would call them with a
// request a peer sent: the first byte picks the method, the rest is the
// serialized request. One sequence stays open for appends and fetches to
// reach; sequences the input opens are closed again so that the store's
// table does not fill. A handler must never answer UNKNOWN (an exception
// crossing the RPC boundary), and a fetch it answers OK carries exactly the
// plan's rows.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "grpcpp/server_context.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/client/kv_types.h"
#include "kv_memory_service/server/kv_service.h"

namespace kvm = infinigen::kv_memory_service;
namespace kv = infinigen::kv;

namespace {

struct Node {
  std::shared_ptr<kvm::KvStore> store;
  std::unique_ptr<kvm::KvMemoryService> service;
  uint64_t sequence = 0;

  Node() {
    kvm::KvStoreOptions o;
    o.capacity_bytes = 64 << 20;
    o.max_sequences = 64;
    o.prefix_cache_bytes = 8 << 20;
    store = std::make_shared<kvm::KvStore>(o);
    // 4 MiB responses: big enough for any row the open sequence holds.
    service =
        std::make_unique<kvm::KvMemoryService>(store, kvm::Credentials(), 4 << 20,
                                              0, false);
    kvm::SequenceGeometry g;
    g.n_layers = 2;
    g.n_kv_heads = 2;
    g.head_dim = 4;
    g.max_tokens = 64;
    auto opened = store->Open(g);
    if (!opened.ok()) std::abort();
    sequence = *opened;
    std::vector<uint16_t> k(2 * 8 * 2 * 4, 1), v(k.size(), 2);
    kvm::AppendBlock b;
    b.first_layer = 0;
    b.n_layers = 2;
    b.n_tokens = 8;
    b.k = k;
    b.v = v;
    if (!store->Append(sequence, b).ok()) std::abort();
  }
};

void Check(const grpc::Status& s) {
  if (s.error_code() == grpc::StatusCode::UNKNOWN) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Node node;
  if (size == 0) return 0;
  const uint8_t op = data[0] % 5;
  const void* body = data + 1;
  const int n = static_cast<int>(size - 1);
  grpc::ServerContext ctx;
  kvm::KvMemoryService& s = *node.service;
  switch (op) {
    case 0: {
      kv::OpenSequenceRequest req;
      if (!req.ParseFromArray(body, n)) return 0;
      kv::OpenSequenceResponse resp;
      grpc::Status st = s.OpenSequence(&ctx, &req, &resp);
      Check(st);
      if (st.ok()) {
        kv::CloseSequenceRequest close;
        close.set_sequence_id(resp.sequence_id());
        kv::CloseSequenceResponse closed;
        grpc::ServerContext ctx2;
        if (!s.CloseSequence(&ctx2, &close, &closed).ok()) std::abort();
      }
      break;
    }
    case 1: {
      kv::AppendRequest req;
      if (!req.ParseFromArray(body, n)) return 0;
      // Low ids reach the open sequence; it never closes.
      if (req.sequence_id() < 4) req.set_sequence_id(node.sequence);
      kv::AppendResponse resp;
      Check(s.Append(&ctx, &req, &resp));
      break;
    }
    case 2: {
      kv::FetchRequest req;
      if (!req.ParseFromArray(body, n)) return 0;
      if (req.sequence_id() < 4) req.set_sequence_id(node.sequence);
      kv::FetchResponse resp;
      grpc::Status st = s.Fetch(&ctx, &req, &resp);
      Check(st);
      if (st.ok()) {
        auto g = node.store->Geometry(req.sequence_id());
        if (!g.ok()) std::abort();
        // A note of held rows answers with none.
        const size_t want =
            req.held() ? 0
                       : 2 * static_cast<size_t>(req.plan().indices_size()) *
                             g->head_dim * sizeof(uint16_t);
        if (resp.rows().size() != want) std::abort();
      }
      break;
    }
    case 3: {
      kv::CloseSequenceRequest req;
      if (!req.ParseFromArray(body, n)) return 0;
      if (req.sequence_id() == node.sequence) return 0;
      kv::CloseSequenceResponse resp;
      Check(s.CloseSequence(&ctx, &req, &resp));
      break;
    }
    case 4: {
      kv::GetStatsRequest req;
      if (!req.ParseFromArray(body, n)) return 0;
      if (req.sequence_id() > 0 && req.sequence_id() < 4) {
        req.set_sequence_id(node.sequence);
      }
      kv::GetStatsResponse resp;
      Check(s.GetStats(&ctx, &req, &resp));
      break;
    }
  }
  return 0;
}
