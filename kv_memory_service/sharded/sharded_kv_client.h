// ShardedKvClient: one worker's KV cache spread over several memory nodes
// (a memory tier), behind the same KvClient interface as one node.
//
// Placement: by KV head. Node k of N holds, for every sequence and every
// layer, the K and V rows of the KV heads [k * H / N, (k + 1) * H / N)
// (H = the sequence's n_kv_heads), in its own sequence with that many heads.
// Why by head and not by layer: the worker fetches one layer at a time (two
// in flight), so with layers on different nodes a fetch would still be served
// by one node and at most two nodes would work at once. By head, every fetch
// is split over all nodes, which gather and send their share in parallel: a
// fetch completes when the slowest node does, and the bandwidth of N nodes
// (and N NICs) adds up on every fetch. The placement is a pure function of
// (node index, N, H): nothing to look up, no coordinator. The cost: N is
// useful only up to H (SmolLM2-135M has H = 3: a fourth node holds nothing);
// nodes that get no head hold nothing and are not asked anything.
//
// Sequence ids: the composite id is the id the first node holding heads
// gave; the client maps it to every node's own id. Each node keeps its own
// session and lease with its child client.
//
// Appends are split by head: the rows of each node's heads are copied into a
// per-thread staging buffer (grows to the largest block, then allocates no
// more) and sent to the nodes one after the other. An Append that fails on
// one node leaves the nodes with different lengths: the caller should close
// the sequence (the worker fails it). Evicted tokens come back with their
// global head; within a layer they are grouped by node.
//
// Fetches: the composite FetchBuffer owns one child buffer per node (each as
// large as the composite, since one head may select every index) and its own
// memory at a fixed address. FetchAsync starts every node's fetch of its
// heads at once; Wait() waits for all of them (each bounded by the child's
// fetch timeout) and copies each node's K and V rows into place (a note of
// rows the caller holds, NoteHeldAsync, goes to each node the same way and
// copies nothing): one memcpy
// of the fetched bytes per fetch (about 10 GB/s per core: small beside a TCP
// transfer, but it gives up the zero-copy of shm and RDMA: a memory tier
// there should fetch into disjoint views of one registered region instead).
//
// Errors: any node's error is returned with its code and the node's address
// in the message ("memory node tcp://a:7070: ..."). A node that stops
// answering fails every sequence of this client (every sequence has rows on
// every node) within the child's fetch or rpc timeout.
//
// Thread-safety: as KvClient: every method from any thread; a FetchBuffer
// carries one fetch at a time.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_SHARDED_SHARDED_KV_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_SHARDED_SHARDED_KV_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::kv_memory_service {

// One memory node: its address (for error messages) and a client for it.
struct MemoryNode {
  std::string address;
  std::unique_ptr<KvClient> client;
};

// The KV heads [begin, end) node `node` of `n_nodes` holds when sequences
// have `n_kv_heads` heads. Empty (begin == end) when n_nodes > n_kv_heads
// for some nodes.
struct HeadRange {
  int32_t begin = 0;
  int32_t end = 0;
};
HeadRange NodeHeads(int node, int n_nodes, int32_t n_kv_heads);

// A client over `nodes` (at least one). InvalidArgument for none.
absl::StatusOr<std::unique_ptr<KvClient>> NewShardedKvClient(
    std::vector<MemoryNode> nodes);

// True if `address` names several nodes: a comma-separated list, or a
// "dns+" name.
bool IsMemoryTierAddress(const std::string& address);

// The node addresses of a --kv_service value, in placement order:
//   A,B,...              each a single-node address (tcp://, unix:, shm:,
//                        rdma://), in the order given
//   dns+tcp://NAME:PORT  every address NAME resolves to (A and AAAA
//   dns+rdma://NAME:PORT[?...]  records, e.g. a headless Service's pods),
//                        sorted, as tcp://IP:PORT (rdma://IP:PORT?...)
// InvalidArgument for an empty element, a repeated address, or a malformed
// dns+ address; NotFound when NAME does not resolve. A single address comes
// back as itself.
absl::StatusOr<std::vector<std::string>> ExpandMemoryTierAddress(
    const std::string& address);

// Connects to every node of `address` with `connect_node` (a single-node
// ConnectKvClient) and returns a ShardedKvClient over them; a single node
// is returned unwrapped. A node that does not connect fails the whole call
// with its address in the message. Under TLS (options.tls_ca_pem) without
// options.tls_server_name, the nodes dns+tcp://NAME:PORT resolved to are
// connected with tls_server_name NAME: their certificates name the DNS
// name, not each pod's IP.
using ConnectNodeFn = std::function<absl::StatusOr<std::unique_ptr<KvClient>>(
    const std::string& address, const KvClientOptions& options)>;
absl::StatusOr<std::unique_ptr<KvClient>> ConnectMemoryTier(
    const std::string& address, const KvClientOptions& options,
    const ConnectNodeFn& connect_node);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_SHARDED_SHARDED_KV_CLIENT_H_
