// GatherRowsOnHost, the one-sided reader's address arithmetic, against the
// memory node's own gather (KvStore::Gather): over a stored layer laid out
// as the node lays it out ([kv_head][slot][row], a position's slot the
// position until a head evicts), the same plan gives the same bytes. The
// CUDA kernel is tested against GatherRowsOnHost (cuda/kernels_test.cc).
#include "gpu_worker/backend/gather_rows.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kv_memory_service/store/kv_store.h"

namespace infinigen::gpu_worker {
namespace {

using kv_memory_service::AppendBlock;
using kv_memory_service::KvStore;
using kv_memory_service::KvStoreOptions;
using kv_memory_service::OwnedFetchPlan;
using kv_memory_service::SequenceGeometry;

struct Stored {
  // [layer][head][slot][row]: what the node holds, as the reader sees it.
  std::vector<uint16_t> k, v;
};

// Appends `tokens` random tokens to a fresh sequence of `store` and returns
// the same rows in the node's layout.
Stored Fill(KvStore& store, kv_memory_service::SequenceId seq,
            const SequenceGeometry& g, int tokens, std::mt19937& rng) {
  const size_t row = g.head_dim;
  const size_t per_layer = static_cast<size_t>(tokens) * g.n_kv_heads * row;
  std::vector<uint16_t> k(g.n_layers * per_layer), v(k.size());
  std::uniform_int_distribution<int> value(0, 0xffff);
  for (auto& x : k) x = static_cast<uint16_t>(value(rng));
  for (auto& x : v) x = static_cast<uint16_t>(value(rng));
  AppendBlock block;
  block.n_layers = g.n_layers;
  block.n_tokens = tokens;
  block.k = k;
  block.v = v;
  EXPECT_TRUE(store.Append(seq, block).ok());
  Stored s;
  const size_t head_rows = static_cast<size_t>(g.max_tokens) * row;
  s.k.assign(static_cast<size_t>(g.n_layers) * g.n_kv_heads * head_rows, 0);
  s.v.assign(s.k.size(), 0);
  for (int l = 0; l < g.n_layers; ++l) {
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const size_t from = l * per_layer + (t * g.n_kv_heads + h) * row;
        const size_t to = (static_cast<size_t>(l) * g.n_kv_heads + h) *
                              head_rows + t * row;
        std::copy_n(k.begin() + from, row, s.k.begin() + to);
        std::copy_n(v.begin() + from, row, s.v.begin() + to);
      }
    }
  }
  return s;
}

// The reader's view of `layer` of the stored rows, writing to `out`; the
// plan (indices, head offsets, n_rows) is the caller's.
GatherRowsParams LayerOf(const Stored& s, const SequenceGeometry& g,
                         int layer, void* out) {
  const size_t head_rows = static_cast<size_t>(g.max_tokens) * g.head_dim;
  GatherRowsParams p;
  p.k_rows = s.k.data() + layer * g.n_kv_heads * head_rows;
  p.v_rows = s.v.data() + layer * g.n_kv_heads * head_rows;
  p.head_stride = g.max_tokens;
  p.n_heads = g.n_kv_heads;
  p.row_bytes = g.head_dim * 2;
  p.out = out;
  return p;
}

TEST(GatherRowsOnHost, MatchesTheNodesGather) {
  std::mt19937 rng(11);
  KvStore store(KvStoreOptions{});
  SequenceGeometry g;
  g.n_layers = 3;
  g.n_kv_heads = 4;
  g.head_dim = 36;  // an int4 row of head_dim 128: 72 bytes
  g.max_tokens = 300;
  auto seq = store.Open(g);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const int tokens = 257;
  const Stored s = Fill(store, *seq, g, tokens, rng);
  for (int trial = 0; trial < 20; ++trial) {
    // Random plans: sorted and unsorted, repeats, empty heads, the last row.
    OwnedFetchPlan plan;
    plan.head_offsets.push_back(0);
    std::uniform_int_distribution<int> count(0, 40), pos(0, tokens - 1);
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const int n = (trial + h) % 3 == 0 ? 0 : count(rng);
      for (int i = 0; i < n; ++i) plan.indices.push_back(pos(rng));
      if (n > 0 && trial % 2 == 0) plan.indices.back() = tokens - 1;
      plan.head_offsets.push_back(static_cast<int32_t>(plan.indices.size()));
    }
    if (plan.indices.empty()) continue;
    const int layer = trial % g.n_layers;
    std::vector<uint16_t> want(2 * plan.indices.size() * g.head_dim);
    ASSERT_TRUE(store.Gather(*seq, layer, plan.view(), absl::MakeSpan(want))
                    .ok());
    std::vector<uint16_t> got(want.size(), 0xdead);
    GatherRowsParams p = LayerOf(s, g, layer, got.data());
    p.indices = plan.indices.data();
    p.head_offsets = plan.head_offsets.data();
    p.n_rows = static_cast<long>(plan.indices.size());
    GatherRowsOnHost(p);
    ASSERT_EQ(got, want) << "trial " << trial;
  }
}

// A leading plan (no indices: each head's first rows) reads what the node
// gathers for the plan of those positions, including every row a head
// holds and a single row.
TEST(GatherRowsOnHost, LeadingPlansReadEachHeadsFirstRows) {
  std::mt19937 rng(12);
  KvStore store(KvStoreOptions{});
  SequenceGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 3;
  g.head_dim = 64;
  g.max_tokens = 90;
  auto seq = store.Open(g);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const Stored s = Fill(store, *seq, g, 90, rng);
  for (int per_head : {1, 37, 90}) {
    for (int layer = 0; layer < g.n_layers; ++layer) {
      std::vector<std::vector<int32_t>> positions(g.n_kv_heads);
      for (auto& head : positions) {
        for (int t = 0; t < per_head; ++t) head.push_back(t);
      }
      const OwnedFetchPlan plan = OwnedFetchPlan::PerHead(positions);
      std::vector<uint16_t> want(2 * plan.indices.size() * g.head_dim);
      ASSERT_TRUE(
          store.Gather(*seq, layer, plan.view(), absl::MakeSpan(want)).ok());
      std::vector<uint16_t> got(want.size(), 0xdead);
      GatherRowsParams p = LayerOf(s, g, layer, got.data());
      p.n_rows = static_cast<long>(plan.indices.size());  // no indices
      GatherRowsOnHost(p);
      ASSERT_EQ(got, want) << per_head << " rows a head, layer " << layer;
    }
  }
}

TEST(GatherRowHead, EmptyHeadsOwnNoRow) {
  // Heads 0 and 2 are empty; head 3 holds the last rows.
  const int32_t offsets[] = {0, 0, 3, 3, 5};
  EXPECT_EQ(GatherRowHead(offsets, 4, 0), 1);
  EXPECT_EQ(GatherRowHead(offsets, 4, 2), 1);
  EXPECT_EQ(GatherRowHead(offsets, 4, 3), 3);
  EXPECT_EQ(GatherRowHead(offsets, 4, 4), 3);
  const int32_t one[] = {0, 7};
  EXPECT_EQ(GatherRowHead(one, 1, 6), 0);
}

}  // namespace
}  // namespace infinigen::gpu_worker
