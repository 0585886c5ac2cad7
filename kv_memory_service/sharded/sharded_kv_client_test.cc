// ShardedKvClient over in-process nodes: fetches and evictions equal those
// of one node bit for bit, each node holds exactly its heads, and a node's
// error comes back with its code and its address.
#include "kv_memory_service/sharded/sharded_kv_client.h"

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/client/prefix_keys.h"
#include "kv_memory_service/testing/fault_injection_client.h"
#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service {
namespace {

using ::testing::HasSubstr;
using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

// Every node reports Unavailable from Health().
class UnhealthyClient final : public KvClientWrapper {
 public:
  using KvClientWrapper::KvClientWrapper;
  absl::Status Health() const override {
    return absl::UnavailableError("no heartbeat answered");
  }
};

struct Tier {
  std::vector<std::shared_ptr<KvStore>> stores;
  std::vector<FaultInjectionKvClient*> faults;  // owned by `client`
  std::unique_ptr<KvClient> client;
};

// Node i's store made with per_node[i].
Tier MakeTierOf(const std::vector<KvStoreOptions>& per_node) {
  Tier tier;
  std::vector<MemoryNode> nodes;
  for (size_t i = 0; i < per_node.size(); ++i) {
    tier.stores.push_back(std::make_shared<KvStore>(per_node[i]));
    KvClientOptions options;
    options.inproc_store = tier.stores.back();
    auto child = ConnectKvClient("inproc:", options);
    EXPECT_TRUE(child.ok()) << child.status();
    auto fault = std::make_unique<FaultInjectionKvClient>(std::move(*child));
    tier.faults.push_back(fault.get());
    nodes.push_back(MemoryNode{absl::StrCat("node", i), std::move(fault)});
  }
  auto client = NewShardedKvClient(std::move(nodes));
  EXPECT_TRUE(client.ok()) << client.status();
  tier.client = std::move(*client);
  return tier;
}

Tier MakeTier(int n_nodes, KvStoreOptions store_options = {}) {
  return MakeTierOf(std::vector<KvStoreOptions>(n_nodes, store_options));
}

// Prefix reuse across the tier: every node attaches its heads' part of the
// blocks, and the sequence is cached as far as all of them hold.
TEST(ShardedPrefix, NodesAttachTheirHeadsAndAgreeOnTheCachedLength) {
  KvStoreOptions with_cache;
  with_cache.prefix_cache_bytes = 1 << 20;
  const SequenceGeometry g = MakeGeometry(2, 3, 8, 64);
  std::vector<int32_t> tokens(20);
  for (int i = 0; i < 20; ++i) tokens[i] = 5 * i + 2;
  PrefixRequest prefix;
  prefix.block_tokens = 8;
  prefix.keys = PrefixKeys("m", 8, tokens);
  auto publish = [&](KvClient& client) {
    auto a = client.OpenSequence(g, prefix);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->cached_tokens, 0);
    testdata::TestBlock rows = MakeTestBlock(3, g, 0, 2, 0, 20);
    const std::vector<std::string> meta = {"b0", "b1"};
    rows.block.prefix_meta = meta;
    ASSERT_TRUE(client.Append(a->id, rows.block).ok());
    ASSERT_TRUE(client.Close(a->id).ok());
  };
  {
    Tier tier = MakeTier(2, with_cache);
    publish(*tier.client);
    auto b = tier.client->OpenSequence(g, prefix);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->cached_tokens, 16);
    EXPECT_EQ(b->prefix_meta, (std::vector<std::string>{"b0", "b1"}));
    const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, {0, 9, 15});
    auto buffer = tier.client->NewFetchBuffer(FetchElements(plan.view(), 8));
    ASSERT_TRUE(buffer.ok());
    ASSERT_TRUE(tier.client->Fetch(b->id, 1, plan.view(), buffer->get()).ok());
    EXPECT_EQ(std::vector<uint16_t>((*buffer)->data(),
                                    (*buffer)->data() + (*buffer)->size()),
              ExpectedRows(3, g, 1, plan.view()));
    // Each node holds its heads' blocks only.
    for (const auto& store : tier.stores) {
      EXPECT_EQ(store->GetStoreStats().prefix_blocks, 2);
    }
    buffer->reset();
  }
  {
    // A node that shares nothing: the tier reuses nothing, every part of
    // the sequence starts at 0 and appends line up.
    KvStoreOptions none;
    Tier tier = MakeTierOf({with_cache, none});
    publish(*tier.client);
    auto b = tier.client->OpenSequence(g, prefix);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->cached_tokens, 0);
    EXPECT_TRUE(b->prefix_meta.empty());
    testdata::TestBlock rows = MakeTestBlock(4, g, 0, 2, 0, 20);
    ASSERT_TRUE(tier.client->Append(b->id, rows.block).ok());
    auto stats = tier.client->GetSequenceStats(b->id);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->layer_lengths, (std::vector<int32_t>{20, 20}));
    for (const auto& store : tier.stores) {
      EXPECT_EQ(store->GetStoreStats().open_sequences, 1);
    }
  }
}

TEST(NodeHeads, EveryHeadOnExactlyOneNodeInOrder) {
  for (int n = 1; n <= 5; ++n) {
    for (int h = 1; h <= 9; ++h) {
      int32_t next = 0;
      for (int node = 0; node < n; ++node) {
        const HeadRange r = NodeHeads(node, n, h);
        EXPECT_EQ(r.begin, next) << n << " nodes, " << h << " heads";
        EXPECT_GE(r.end, r.begin);
        // Balanced: shares differ by at most one head.
        EXPECT_LE(r.end - r.begin, (h + n - 1) / n);
        next = r.end;
      }
      EXPECT_EQ(next, h);
    }
  }
}

class ShardedKvClientTest : public ::testing::TestWithParam<int> {};

TEST_P(ShardedKvClientTest, FetchesEqualOneNodesAndEachNodeHoldsItsHeads) {
  const int n_nodes = GetParam();
  Tier tier = MakeTier(n_nodes);
  const SequenceGeometry g = MakeGeometry(3, 4, 8, 256);
  auto id = tier.client->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  // Prefill layer by layer, then decode steps of every layer at once.
  for (int l = 0; l < g.n_layers; ++l) {
    testdata::TestBlock b = MakeTestBlock(7, g, l, 1, 0, 40);
    ASSERT_TRUE(tier.client->Append(*id, b.block).ok());
  }
  for (int t = 40; t < 45; ++t) {
    testdata::TestBlock b = MakeTestBlock(7, g, 0, g.n_layers, t, 1);
    auto r = tier.client->Append(*id, b.block);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->evicted.empty());
  }
  for (int node = 0; node < n_nodes; ++node) {
    const HeadRange r = NodeHeads(node, n_nodes, g.n_kv_heads);
    const StoreStats s = tier.stores[node]->GetStoreStats();
    EXPECT_EQ(s.appended_rows, int64_t{45} * g.n_layers * (r.end - r.begin))
        << "node " << node;
    EXPECT_EQ(s.open_sequences, r.begin == r.end ? 0 : 1);
  }
  auto stats = tier.client->GetSequenceStats(*id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->present_rows, int64_t{45} * g.n_layers * g.n_kv_heads);
  EXPECT_EQ(stats->layer_lengths, std::vector<int32_t>(g.n_layers, 45));

  // Two buffers, two layers in flight, as the worker fetches.
  std::vector<std::unique_ptr<FetchBuffer>> buffers;
  for (int i = 0; i < 2; ++i) {
    auto b = tier.client->NewFetchBuffer(2 * 4 * 45 * 8);
    ASSERT_TRUE(b.ok()) << b.status();
    buffers.push_back(std::move(*b));
  }
  const uint16_t* fixed[2] = {buffers[0]->data(), buffers[1]->data()};
  std::mt19937 rng(5);
  for (int round = 0; round < 10; ++round) {
    std::vector<OwnedFetchPlan> plans;
    for (int l = 0; l < g.n_layers; ++l) {
      // Heads select different tokens and counts; sometimes none.
      std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
      for (auto& p : per_head) {
        for (int i = 0, k = rng() % 30; i < k; ++i) p.push_back(rng() % 45);
      }
      plans.push_back(OwnedFetchPlan::PerHead(per_head));
    }
    FetchHandle in_flight =
        tier.client->FetchAsync(*id, 0, plans[0].view(), buffers[0].get());
    for (int l = 0; l < g.n_layers; ++l) {
      FetchHandle next;
      if (l + 1 < g.n_layers) {
        next = tier.client->FetchAsync(*id, l + 1, plans[l + 1].view(),
                                       buffers[(l + 1) % 2].get());
      }
      ASSERT_TRUE(in_flight.Wait().ok()) << "round " << round << " layer " << l;
      const std::vector<uint16_t> want = ExpectedRows(7, g, l, plans[l].view());
      const FetchBuffer& buf = *buffers[l % 2];
      ASSERT_EQ(buf.data(), fixed[l % 2]);
      ASSERT_EQ(std::vector<uint16_t>(buf.data(), buf.data() + want.size()),
                want)
          << "round " << round << " layer " << l;
      in_flight = std::move(next);
    }
  }
  ASSERT_TRUE(tier.client->Close(*id).ok());
  for (int node = 0; node < n_nodes; ++node) {
    EXPECT_EQ(tier.stores[node]->GetStoreStats().open_sequences, 0);
  }
  EXPECT_EQ(tier.client->Close(*id).code(), absl::StatusCode::kNotFound);
}

// A note of held rows reaches each node with its heads' part, as a fetch
// would, and writes nothing into the buffer: every node counts its rows.
TEST_P(ShardedKvClientTest, NotesOfHeldRowsReachEachNodesHeads) {
  const int n_nodes = GetParam();
  Tier tier = MakeTier(n_nodes);
  const SequenceGeometry g = MakeGeometry(2, 4, 8, 64);
  auto id = tier.client->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(tier.client->Append(*id, MakeTestBlock(3, g, 0, 2, 0, 20).block)
                  .ok());
  auto buffer = tier.client->NewFetchBuffer(2 * 4 * 20 * 8);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::fill((*buffer)->data(), (*buffer)->data() + (*buffer)->size(),
            uint16_t{0x5a5a});
  const OwnedFetchPlan plan =
      OwnedFetchPlan::PerHead({{1, 2}, {3}, {}, {4, 5, 6}});
  ASSERT_TRUE(
      tier.client->NoteHeldAsync(*id, 1, plan.view(), buffer->get()).Wait().ok());
  EXPECT_TRUE(std::all_of((*buffer)->data(),
                          (*buffer)->data() + (*buffer)->size(),
                          [](uint16_t v) { return v == 0x5a5a; }));
  int64_t rows = 0;
  for (int node = 0; node < n_nodes; ++node) {
    const HeadRange r = NodeHeads(node, n_nodes, g.n_kv_heads);
    const int64_t want = plan.head_offsets[r.end] - plan.head_offsets[r.begin];
    EXPECT_EQ(tier.stores[node]->GetStoreStats().fetched_rows, want)
        << "node " << node;
    rows += want;
  }
  EXPECT_EQ(rows, 6);
  EXPECT_EQ(tier.client
                ->NoteHeldAsync(*id, 1,
                                OwnedFetchPlan::PerHead({{40}, {}, {}, {}})
                                    .view(),
                                buffer->get())
                .Wait()
                .code(),
            absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(tier.client->FetchAsync(*id, 1, plan.view(), buffer->get())
                  .Wait()
                  .ok());
  const std::vector<uint16_t> want = ExpectedRows(3, g, 1, plan.view());
  EXPECT_EQ(std::vector<uint16_t>((*buffer)->data(),
                                  (*buffer)->data() + want.size()),
            want);
}

TEST_P(ShardedKvClientTest, EvictionsAreThoseOfOneNodeWithGlobalHeads) {
  const int n_nodes = GetParam();
  Tier tier = MakeTier(n_nodes);
  Tier one = MakeTier(1);
  const SequenceGeometry g = MakeGeometry(2, 4, 8, 6);
  auto id = tier.client->Open(g);
  auto one_id = one.client->Open(g);
  ASSERT_TRUE(id.ok() && one_id.ok());
  auto key = [](const EvictedToken& t) {
    return std::make_tuple(t.layer, t.position, t.kv_head);
  };
  auto sorted = [&](std::vector<EvictedToken> v) {
    std::sort(v.begin(), v.end(), [&](const auto& a, const auto& b) {
      return key(a) < key(b);
    });
    return v;
  };
  int evictions = 0;
  for (int t = 0; t < 10; ++t) {
    testdata::TestBlock b = MakeTestBlock(3, g, 0, g.n_layers, t, 1);
    auto got = tier.client->Append(*id, b.block);
    auto want = one.client->Append(*one_id, b.block);
    ASSERT_TRUE(got.ok() && want.ok());
    EXPECT_EQ(sorted(got->evicted), sorted(want->evicted)) << "token " << t;
    evictions += got->evicted.size();
  }
  EXPECT_EQ(evictions, 4 * g.n_layers * g.n_kv_heads);
}

TEST_P(ShardedKvClientTest, ANodesFetchErrorNamesTheNode) {
  const int n_nodes = GetParam();
  Tier tier = MakeTier(n_nodes);
  const SequenceGeometry g = MakeGeometry(2, 4, 8, 64);
  auto id = tier.client->Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock b = MakeTestBlock(1, g, 0, g.n_layers, 0, 10);
  ASSERT_TRUE(tier.client->Append(*id, b.block).ok());
  auto buf = tier.client->NewFetchBuffer(2 * 4 * 10 * 8);
  ASSERT_TRUE(buf.ok());
  const std::vector<int32_t> positions = {0, 3, 9};
  OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(4, positions);
  const int bad = n_nodes - 1;
  tier.faults[bad]->FailFetches(absl::UnavailableError("connection reset"));
  absl::Status s = tier.client->Fetch(*id, 1, plan.view(), buf->get());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("memory node node", bad, ": ")));
  EXPECT_THAT(std::string(s.message()), HasSubstr("connection reset"));
  // The buffer is free again and the next fetch succeeds.
  tier.faults[bad]->ClearFaults();
  ASSERT_TRUE(tier.client->Fetch(*id, 1, plan.view(), buf->get()).ok());
  const std::vector<uint16_t> want = ExpectedRows(1, g, 1, plan.view());
  EXPECT_EQ(std::vector<uint16_t>((*buf)->data(), (*buf)->data() + want.size()),
            want);
  // Appends likewise.
  tier.faults[bad]->FailAppends(absl::DeadlineExceededError("slow"));
  testdata::TestBlock next = MakeTestBlock(1, g, 0, g.n_layers, 10, 1);
  auto appended = tier.client->Append(*id, next.block);
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(appended.status().message()),
              HasSubstr(absl::StrCat("memory node node", bad, ": ")));
}

INSTANTIATE_TEST_SUITE_P(Nodes, ShardedKvClientTest,
                         ::testing::Values(1, 2, 3, 4, 5));

TEST(ShardedKvClient, RejectsBadInput) {
  Tier tier = MakeTier(2);
  Tier other = MakeTier(2);
  const SequenceGeometry g = MakeGeometry(2, 4, 8, 64);
  auto id = tier.client->Open(g);
  ASSERT_TRUE(id.ok());
  auto buf = tier.client->NewFetchBuffer(64);
  auto other_buf = other.client->NewFetchBuffer(64);
  ASSERT_TRUE(buf.ok() && other_buf.ok());
  OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(4, {0});
  EXPECT_EQ(tier.client->Fetch(*id, 0, plan.view(), other_buf->get()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.client->Fetch(*id + 1, 0, plan.view(), buf->get()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(tier.client->Fetch(*id, 2, plan.view(), buf->get()).code(),
            absl::StatusCode::kInvalidArgument);
  OwnedFetchPlan three_heads = OwnedFetchPlan::SameForAllHeads(3, {0});
  EXPECT_EQ(tier.client->Fetch(*id, 0, three_heads.view(), buf->get()).code(),
            absl::StatusCode::kInvalidArgument);
  OwnedFetchPlan too_big = OwnedFetchPlan::SameForAllHeads(4, {0, 0, 0});
  EXPECT_EQ(tier.client->Fetch(*id, 0, too_big.view(), buf->get()).code(),
            absl::StatusCode::kInvalidArgument);
  // A position never appended: the node's own error, with the node.
  absl::Status s = tier.client->Fetch(*id, 0, plan.view(), buf->get());
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("memory node node"));
  testdata::TestBlock wrong = MakeTestBlock(1, MakeGeometry(2, 3, 8, 64), 0, 2,
                                            0, 1);
  EXPECT_EQ(tier.client->Append(*id, wrong.block).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tier.client->NewFetchBuffer(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NewShardedKvClient({}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShardedKvClient, HealthIsUnhealthyWhenAnyNodeIs) {
  std::vector<MemoryNode> nodes;
  nodes.push_back(MemoryNode{"a", *ConnectKvClient("inproc:")});
  nodes.push_back(MemoryNode{
      "b", std::make_unique<UnhealthyClient>(*ConnectKvClient("inproc:"))});
  auto client = NewShardedKvClient(std::move(nodes));
  ASSERT_TRUE(client.ok());
  const absl::Status h = (*client)->Health();
  EXPECT_EQ(h.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(h.message()), HasSubstr("memory node b: "));
  EXPECT_EQ((*client)->data_plane(), "inproc x2");
  Tier healthy = MakeTier(3);
  EXPECT_TRUE(healthy.client->Health().ok());
}

TEST(ExpandMemoryTierAddress, ListsAndDnsNames) {
  EXPECT_FALSE(IsMemoryTierAddress("tcp://a:1"));
  EXPECT_TRUE(IsMemoryTierAddress("tcp://a:1,tcp://b:1"));
  EXPECT_TRUE(IsMemoryTierAddress("dns+tcp://kv:7070"));
  auto list = ExpandMemoryTierAddress("tcp://a:1,shm:unix:/s,rdma://c:2");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(*list, (std::vector<std::string>{"tcp://a:1", "shm:unix:/s",
                                             "rdma://c:2"}));
  EXPECT_EQ(ExpandMemoryTierAddress("tcp://a:1,tcp://a:1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandMemoryTierAddress("tcp://a:1,").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandMemoryTierAddress("dns+unix:/x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandMemoryTierAddress("dns+tcp://localhost").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandMemoryTierAddress("dns+tcp://no-such-host.invalid:1")
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  auto local = ExpandMemoryTierAddress("dns+tcp://localhost:7070");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_THAT(*local, ::testing::Contains("tcp://127.0.0.1:7070"));
  auto rdma = ExpandMemoryTierAddress("dns+rdma://localhost:7070?device=mlx5_0");
  ASSERT_TRUE(rdma.ok()) << rdma.status();
  EXPECT_THAT(*rdma, ::testing::Contains("rdma://127.0.0.1:7070?device=mlx5_0"));
}

TEST(ConnectKvClient, ATierNodeThatDoesNotAnswerIsNamed) {
  KvClientOptions options;
  options.connect_timeout = absl::Milliseconds(300);
  // Port 1 on loopback: nothing listens.
  auto client = ConnectKvClient("inproc:,tcp://127.0.0.1:1", options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(client.status().message()),
              HasSubstr("memory node tcp://127.0.0.1:1: "));
  auto tier = ConnectKvClient("inproc:", options);
  ASSERT_TRUE(tier.ok());
  EXPECT_EQ((*tier)->data_plane(), "inproc");
}

}  // namespace
}  // namespace infinigen::kv_memory_service
