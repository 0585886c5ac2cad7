#include "kv_memory_service/sharded/sharded_kv_client.h"

#include <netdb.h>
#include <sys/socket.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/address.h"
#include "common/status.h"

namespace infinigen::kv_memory_service {
namespace {

// A sequence's ids on every node (0 where the node holds no head).
struct Shards {
  SequenceGeometry geometry;
  std::vector<SequenceId> node_ids;
};

class ShardedKvClient;

// The composite destination: its own memory (data()) plus one child buffer
// per node holding heads; Wait copies each node's rows into place.
class ShardedFetchBuffer final : public FetchBuffer {
 public:
  ShardedFetchBuffer(const void* owner, std::unique_ptr<uint16_t[]> storage,
                     size_t size, const std::vector<MemoryNode>* nodes,
                     std::vector<std::unique_ptr<FetchBuffer>> children)
      : FetchBuffer(owner, storage.get(), size),
        storage_(std::move(storage)),
        nodes_(nodes),
        children_(std::move(children)),
        handles_(children_.size()),
        offsets_(children_.size()),
        row_begin_(children_.size(), 0),
        n_rows_(children_.size(), 0) {}

  ~ShardedFetchBuffer() override {
    // Children first wait (via their handles) before they are destroyed.
    for (auto& h : handles_) h.Wait().IgnoreError();
  }

  // Starts every node's part of `plan` (validated by the caller): its
  // fetch, or with `held` its note of the rows the caller holds
  // (NoteHeldAsync, through the node's child buffer; nothing is copied).
  FetchHandle Start(const Shards& shards, int32_t layer,
                    const FetchPlan& plan, bool held = false) {
    absl::Status begun = BeginFetch();
    if (!begun.ok()) return FetchHandle(std::move(begun));
    held_ = held;
    const int n = static_cast<int>(children_.size());
    const int32_t heads = shards.geometry.n_kv_heads;
    head_dim_ = shards.geometry.head_dim;
    total_rows_ = plan.indices.size();
    for (int node = 0; node < n; ++node) {
      const HeadRange r = NodeHeads(node, n, heads);
      n_rows_[node] = 0;
      if (r.begin == r.end) {
        handles_[node] = FetchHandle();  // drops an earlier fetch's status
        continue;
      }
      const int32_t first = plan.head_offsets[r.begin];
      std::vector<int32_t>& off = offsets_[node];
      off.resize(r.end - r.begin + 1);  // allocates on the first fetch only
      for (int32_t h = r.begin; h <= r.end; ++h) {
        off[h - r.begin] = plan.head_offsets[h] - first;
      }
      row_begin_[node] = first;
      n_rows_[node] = plan.head_offsets[r.end] - first;
      FetchPlan part{plan.indices.subspan(first, n_rows_[node]), off};
      KvClient& child = *(*nodes_)[node].client;
      handles_[node] =
          held ? child.NoteHeldAsync(shards.node_ids[node], layer, part,
                                     children_[node].get())
               : child.FetchAsync(shards.node_ids[node], layer, part,
                                  children_[node].get());
    }
    return FetchHandle(static_cast<FetchBuffer*>(this));
  }

 protected:
  absl::Status WaitForFetch() override {
    absl::Status result;
    for (size_t node = 0; node < handles_.size(); ++node) {
      absl::Status s = handles_[node].Wait();
      if (!s.ok() && result.ok()) result = AtNode((*nodes_)[node].address, s);
    }
    if (result.ok() && !held_) {
      for (size_t node = 0; node < handles_.size(); ++node) {
        const size_t n = n_rows_[node];
        if (n == 0) continue;
        const uint16_t* src = children_[node]->data();
        const size_t row = static_cast<size_t>(head_dim_);
        std::memcpy(data() + row_begin_[node] * row, src,
                    n * row * sizeof(uint16_t));
        std::memcpy(data() + (total_rows_ + row_begin_[node]) * row,
                    src + n * row, n * row * sizeof(uint16_t));
      }
    }
    CompleteFetch(std::move(result));
    return TakeResult();
  }

 private:
  std::unique_ptr<uint16_t[]> storage_;
  const std::vector<MemoryNode>* const nodes_;
  // One per node, whether or not the node holds heads of a given sequence.
  std::vector<std::unique_ptr<FetchBuffer>> children_;
  // State of the fetch in flight (one at a time, per FetchBuffer).
  std::vector<FetchHandle> handles_;
  std::vector<std::vector<int32_t>> offsets_;
  std::vector<size_t> row_begin_;
  std::vector<size_t> n_rows_;
  size_t total_rows_ = 0;
  int32_t head_dim_ = 0;
  bool held_ = false;  // the operation in flight is a note
};

class ShardedKvClient final : public KvClient {
 public:
  explicit ShardedKvClient(std::vector<MemoryNode> nodes)
      : nodes_(std::move(nodes)) {}

  ~ShardedKvClient() override = default;

  // Every node opens its heads' part with the same prefix keys and
  // attaches what it holds. The parts must agree on the cached prefix:
  // when they do not, every part is reopened asking for the least of
  // them (and, should a node have dropped blocks meanwhile, for none).
  absl::StatusOr<OpenedSequence> OpenSequence(
      const SequenceGeometry& geometry, const PrefixRequest& prefix) override {
    IG_RETURN_IF_ERROR(ValidateGeometry(geometry));
    const int n = static_cast<int>(nodes_.size());
    PrefixRequest want = prefix;
    for (int attempt = 0;; ++attempt) {
      auto shards = std::make_shared<Shards>();
      shards->geometry = geometry;
      shards->node_ids.assign(nodes_.size(), 0);
      SequenceId id = 0;
      int32_t least = -1, most = -1;
      std::vector<std::string> meta;
      for (int node = 0; node < n; ++node) {
        const HeadRange r = NodeHeads(node, n, geometry.n_kv_heads);
        if (r.begin == r.end) continue;
        SequenceGeometry part = geometry;
        part.n_kv_heads = r.end - r.begin;
        auto opened = nodes_[node].client->OpenSequence(part, want);
        if (!opened.ok()) {
          CloseOnNodes(*shards);
          return AtNode(nodes_[node].address, opened.status());
        }
        shards->node_ids[node] = opened->id;
        if (id == 0) {
          id = opened->id;
          meta = std::move(opened->prefix_meta);
        }
        least = least < 0 ? opened->cached_tokens
                          : std::min(least, opened->cached_tokens);
        most = std::max(most, opened->cached_tokens);
      }
      if (least == most || want.keys.empty()) {
        absl::MutexLock lock(&mu_);
        sequences_[id] = std::move(shards);
        meta.resize(std::max(least, 0) /
                    std::max(want.block_tokens, int32_t{1}));
        return OpenedSequence{id, std::max(least, 0), std::move(meta)};
      }
      CloseOnNodes(*shards);
      want.keys.resize(attempt == 0 ? least / want.block_tokens : 0);
    }
  }

  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override {
    IG_ASSIGN_OR_RETURN(std::shared_ptr<const Shards> shards, Find(seq));
    const SequenceGeometry& g = shards->geometry;
    if (block.n_layers <= 0 || block.n_tokens <= 0 || block.first_layer < 0 ||
        block.first_layer + block.n_layers > g.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "append of layers [", block.first_layer, ", ",
          block.first_layer + block.n_layers, ") and ", block.n_tokens,
          " tokens does not fit ", g.n_layers, " layers"));
    }
    const size_t rows = static_cast<size_t>(block.n_layers) * block.n_tokens;
    const size_t want = rows * g.n_kv_heads * g.head_dim;
    if (block.k.size() != want || block.v.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "append block has ", block.k.size(), " K and ", block.v.size(),
          " V values, want ", want));
    }
    static thread_local std::vector<uint16_t> k_part, v_part;
    AppendResult result;
    const int n = static_cast<int>(nodes_.size());
    for (int node = 0; node < n; ++node) {
      const HeadRange r = NodeHeads(node, n, g.n_kv_heads);
      if (r.begin == r.end) continue;
      AppendBlock part = block;
      if (r.end - r.begin != g.n_kv_heads) {
        const size_t width = static_cast<size_t>(r.end - r.begin) * g.head_dim;
        k_part.resize(rows * width);
        v_part.resize(rows * width);
        const size_t stride = static_cast<size_t>(g.n_kv_heads) * g.head_dim;
        const size_t skip = static_cast<size_t>(r.begin) * g.head_dim;
        for (size_t i = 0; i < rows; ++i) {
          std::memcpy(&k_part[i * width], &block.k[i * stride + skip],
                      width * sizeof(uint16_t));
          std::memcpy(&v_part[i * width], &block.v[i * stride + skip],
                      width * sizeof(uint16_t));
        }
        part.k = absl::MakeConstSpan(k_part.data(), rows * width);
        part.v = absl::MakeConstSpan(v_part.data(), rows * width);
      }
      auto appended = nodes_[node].client->Append(shards->node_ids[node], part);
      if (!appended.ok()) return AtNode(nodes_[node].address, appended.status());
      for (EvictedToken t : appended->evicted) {
        t.kv_head += r.begin;
        result.evicted.push_back(t);
      }
    }
    std::stable_sort(result.evicted.begin(), result.evicted.end(),
                     [](const EvictedToken& a, const EvictedToken& b) {
                       return a.layer < b.layer;
                     });
    return result;
  }

  absl::StatusOr<std::unique_ptr<FetchBuffer>> NewFetchBuffer(
      size_t elements) override {
    if (elements == 0) {
      return absl::InvalidArgumentError("a fetch buffer of 0 elements");
    }
    std::vector<std::unique_ptr<FetchBuffer>> children;
    for (const MemoryNode& node : nodes_) {
      auto child = node.client->NewFetchBuffer(elements);
      if (!child.ok()) return AtNode(node.address, child.status());
      children.push_back(std::move(*child));
    }
    std::unique_ptr<uint16_t[]> storage(new uint16_t[elements]());
    return std::unique_ptr<FetchBuffer>(new ShardedFetchBuffer(
        this, std::move(storage), elements, &nodes_, std::move(children)));
  }

  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    return Start(seq, layer, plan, dest, /*held=*/false);
  }

  // Each node's part, as FetchAsync splits it, noted to the node.
  FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                            const FetchPlan& plan, FetchBuffer* via) override {
    return Start(seq, layer, plan, via, /*held=*/true);
  }

  absl::Status Close(SequenceId seq) override {
    std::shared_ptr<const Shards> shards;
    {
      absl::MutexLock lock(&mu_);
      auto it = sequences_.find(seq);
      if (it == sequences_.end()) return UnknownSequence(seq);
      shards = std::move(it->second);
      sequences_.erase(it);
    }
    return CloseOnNodes(*shards);
  }

  absl::StatusOr<SequenceStats> GetSequenceStats(SequenceId seq) override {
    IG_ASSIGN_OR_RETURN(std::shared_ptr<const Shards> shards, Find(seq));
    SequenceStats total;
    total.id = seq;
    total.geometry = shards->geometry;
    bool first = true;
    for (size_t node = 0; node < nodes_.size(); ++node) {
      if (shards->node_ids[node] == 0) continue;
      auto s = nodes_[node].client->GetSequenceStats(shards->node_ids[node]);
      if (!s.ok()) return AtNode(nodes_[node].address, s.status());
      if (first) {
        total.layer_lengths = s->layer_lengths;
        total.fetches = s->fetches;  // every node serves every fetch
        first = false;
      }
      total.present_rows += s->present_rows;
      total.evicted_rows += s->evicted_rows;
      total.bytes_reserved += s->bytes_reserved;
      total.fetched_rows += s->fetched_rows;
    }
    return total;
  }

  // Summed over the nodes: a sequence counts once on every node holding it.
  absl::StatusOr<StoreStats> GetStoreStats() override {
    StoreStats total;
    for (size_t node = 0; node < nodes_.size(); ++node) {
      auto s = nodes_[node].client->GetStoreStats();
      if (!s.ok()) return AtNode(nodes_[node].address, s.status());
      if (node == 0) {
        total.eviction = s->eviction;
        total.lease_timeout_ms = s->lease_timeout_ms;
      }
      total.open_sequences += s->open_sequences;
      total.max_sequences += s->max_sequences;
      total.bytes_reserved += s->bytes_reserved;
      total.capacity_bytes += s->capacity_bytes;
      total.appended_rows += s->appended_rows;
      total.evicted_rows += s->evicted_rows;
      total.fetches += s->fetches;
      total.fetched_rows += s->fetched_rows;
      total.open_sessions += s->open_sessions;
      total.expired_sessions += s->expired_sessions;
      total.expired_sequences += s->expired_sequences;
    }
    return total;
  }

  std::string data_plane() const override {
    return absl::StrCat(nodes_[0].client->data_plane(), " x", nodes_.size());
  }
  std::string address() const override {
    return absl::StrJoin(nodes_, ",", [](std::string* out, const MemoryNode& n) {
      out->append(n.address);
    });
  }

  absl::Status Health() const override {
    for (const MemoryNode& node : nodes_) {
      absl::Status s = node.client->Health();
      if (!s.ok()) return AtNode(node.address, s);
    }
    return absl::OkStatus();
  }


 private:
  // FetchAsync's checks, then each node's part of `plan` started through
  // `buffer`: a fetch, or with `held` a note of rows the caller holds
  // (which needs no room in the buffer).
  FetchHandle Start(SequenceId seq, int32_t layer, const FetchPlan& plan,
                    FetchBuffer* buffer, bool held) {
    if (buffer == nullptr || buffer->owner() != this) {
      return FetchHandle(absl::InvalidArgumentError(
          "the fetch buffer was not made by this client"));
    }
    auto shards = Find(seq);
    if (!shards.ok()) return FetchHandle(shards.status());
    const SequenceGeometry& g = (*shards)->geometry;
    if (layer < 0 || layer >= g.n_layers) {
      return FetchHandle(absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, " out of range [0, ", g.n_layers, ")")));
    }
    absl::Status shape = ValidatePlanShape(plan, g.n_kv_heads);
    if (!shape.ok()) return FetchHandle(std::move(shape));
    if (!held && FetchElements(plan, g.head_dim) > buffer->size()) {
      return FetchHandle(absl::InvalidArgumentError(absl::StrCat(
          "the plan needs ", FetchElements(plan, g.head_dim),
          " values, the buffer holds ", buffer->size())));
    }
    return static_cast<ShardedFetchBuffer*>(buffer)->Start(**shards, layer,
                                                           plan, held);
  }
  static absl::Status UnknownSequence(SequenceId seq) {
    return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  }

  absl::StatusOr<std::shared_ptr<const Shards>> Find(SequenceId seq) const {
    absl::MutexLock lock(&mu_);
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) return UnknownSequence(seq);
    return it->second;
  }

  // Closes the sequence on every node that holds part of it; the first
  // error, with its node.
  absl::Status CloseOnNodes(const Shards& shards) {
    absl::Status result;
    for (size_t node = 0; node < nodes_.size(); ++node) {
      if (shards.node_ids[node] == 0) continue;
      absl::Status s = nodes_[node].client->Close(shards.node_ids[node]);
      if (!s.ok() && result.ok()) result = AtNode(nodes_[node].address, s);
    }
    return result;
  }

  const std::vector<MemoryNode> nodes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SequenceId, std::shared_ptr<const Shards>> sequences_
      ABSL_GUARDED_BY(mu_);
};

// "dns+tcp://NAME:PORT[?query]" -> every address of NAME, sorted.
absl::StatusOr<std::vector<std::string>> ResolveDnsAddress(
    const std::string& address) {
  absl::string_view rest = absl::string_view(address).substr(4);  // "dns+"
  std::string scheme;
  for (const char* s : {"tcp://", "rdma://"}) {
    if (absl::StartsWith(rest, s)) scheme = s;
  }
  if (scheme.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", address, "': dns+ takes tcp://NAME:PORT or rdma://NAME:PORT"));
  }
  rest.remove_prefix(scheme.size());
  absl::string_view query;
  if (size_t q = rest.find('?'); q != absl::string_view::npos) {
    query = rest.substr(q);
    rest = rest.substr(0, q);
  }
  absl::StatusOr<HostPort> name_port = ParseDialHostPort(rest);
  if (!name_port.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "': want NAME:PORT after ", scheme));
  }
  const std::string& name = name_port->host;
  const int port = name_port->port;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(name.c_str(), nullptr, &hints, &found); rc != 0) {
    return absl::NotFoundError(absl::StrCat("'", address, "': cannot resolve ",
                                            name, ": ", gai_strerror(rc)));
  }
  std::set<std::string> ips;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr,
                buf, sizeof(buf));
      ips.insert(buf);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6,
                &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf,
                sizeof(buf));
      ips.insert(absl::StrCat("[", buf, "]"));
    }
  }
  freeaddrinfo(found);
  std::vector<std::string> out;
  for (const std::string& ip : ips) {
    out.push_back(absl::StrCat(scheme, ip, ":", port, query));
  }
  if (out.empty()) {
    return absl::NotFoundError(
        absl::StrCat("'", address, "': ", name, " has no addresses"));
  }
  return out;
}

}  // namespace

HeadRange NodeHeads(int node, int n_nodes, int32_t n_kv_heads) {
  HeadRange r;
  r.begin = static_cast<int32_t>(static_cast<int64_t>(node) * n_kv_heads /
                                 n_nodes);
  r.end = static_cast<int32_t>(static_cast<int64_t>(node + 1) * n_kv_heads /
                               n_nodes);
  return r;
}

absl::StatusOr<std::unique_ptr<KvClient>> NewShardedKvClient(
    std::vector<MemoryNode> nodes) {
  if (nodes.empty()) {
    return absl::InvalidArgumentError("a memory tier needs at least one node");
  }
  for (const MemoryNode& node : nodes) {
    if (node.client == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory node ", node.address, " has no client"));
    }
  }
  return std::unique_ptr<KvClient>(new ShardedKvClient(std::move(nodes)));
}

bool IsMemoryTierAddress(const std::string& address) {
  return absl::StrContains(address, ',') || absl::StartsWith(address, "dns+");
}

namespace {

// One memory node of a tier address, and the host it was named by: NAME
// for the addresses dns+tcp://NAME:PORT resolved to, empty otherwise.
struct TierNode {
  std::string address;
  std::string dns_name;
};

absl::StatusOr<std::vector<TierNode>> ExpandTier(const std::string& address) {
  std::vector<TierNode> out;
  for (absl::string_view part : absl::StrSplit(address, ',')) {
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", address, "': empty memory node address"));
    }
    if (absl::StartsWith(part, "dns+")) {
      IG_ASSIGN_OR_RETURN(std::vector<std::string> resolved,
                          ResolveDnsAddress(std::string(part)));
      absl::string_view name = part.substr(part.find("://") + 3);
      name = name.substr(0, name.find('?'));
      name = name.substr(0, name.rfind(':'));
      for (std::string& a : resolved) {
        out.push_back(TierNode{std::move(a), std::string(name)});
      }
    } else {
      out.push_back(TierNode{std::string(part), ""});
    }
  }
  std::set<std::string> seen;
  for (const TierNode& n : out) {
    if (!seen.insert(n.address).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", address, "': memory node ", n.address, " is listed twice"));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandMemoryTierAddress(
    const std::string& address) {
  IG_ASSIGN_OR_RETURN(std::vector<TierNode> nodes, ExpandTier(address));
  std::vector<std::string> out;
  for (TierNode& n : nodes) out.push_back(std::move(n.address));
  return out;
}

absl::StatusOr<std::unique_ptr<KvClient>> ConnectMemoryTier(
    const std::string& address, const KvClientOptions& options,
    const ConnectNodeFn& connect_node) {
  IG_ASSIGN_OR_RETURN(std::vector<TierNode> tier, ExpandTier(address));
  // Under TLS, a node found through DNS is checked against the name it was
  // found by (its certificate names the Service, not the pod's IP), unless
  // the caller names one.
  auto node_options = [&options](const TierNode& n) {
    KvClientOptions o = options;
    if (!o.tls_ca_pem.empty() && o.tls_server_name.empty()) {
      o.tls_server_name = n.dns_name;
    }
    return o;
  };
  if (tier.size() == 1) {
    return connect_node(tier[0].address, node_options(tier[0]));
  }
  std::vector<MemoryNode> nodes;
  for (const TierNode& n : tier) {
    auto client = connect_node(n.address, node_options(n));
    if (!client.ok()) return AtNode(n.address, client.status());
    nodes.push_back(MemoryNode{n.address, std::move(*client)});
  }
  return NewShardedKvClient(std::move(nodes));
}

}  // namespace infinigen::kv_memory_service
