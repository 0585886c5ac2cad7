// Prefix reuse in the memory node: the hash-chain keys, the shared block
// cache, and a store whose sequences attach and publish blocks.
#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/store/prefix_cache.h"
#include "kv_memory_service/client/prefix_keys.h"
#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service {
namespace {

using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

std::vector<int32_t> Tokens(int n, int salt = 0) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7 + salt) % 1000;
  return t;
}

TEST(PrefixKeysTest, ChainCoversIdentityBlockSizeAndEveryEarlierToken) {
  const std::vector<int32_t> tokens = Tokens(70);
  const std::vector<PrefixKey> keys = PrefixKeys("model-a|fp16", 16, tokens);
  ASSERT_EQ(keys.size(), 4u);  // 64 of 70 tokens: the partial block has none
  EXPECT_EQ(keys, PrefixKeys("model-a|fp16", 16, tokens));
  for (size_t i = 0; i < keys.size(); ++i) {
    for (size_t j = 0; j < i; ++j) EXPECT_NE(keys[i], keys[j]);
  }
  // Another model (or row format): every key differs, so nothing matches.
  const std::vector<PrefixKey> other = PrefixKeys("model-b|fp16", 16, tokens);
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_NE(other[i], keys[i]);
  // Another block size: no key in common.
  const std::vector<PrefixKey> eights = PrefixKeys("model-a|fp16", 8, tokens);
  for (const PrefixKey& k : eights) {
    for (const PrefixKey& m : keys) EXPECT_NE(k, m);
  }
  // One token changed in block 2: blocks 0 and 1 still match, 2 and 3 not.
  std::vector<int32_t> changed = tokens;
  changed[40] += 1;
  const std::vector<PrefixKey> c = PrefixKeys("model-a|fp16", 16, changed);
  EXPECT_EQ(c[0], keys[0]);
  EXPECT_EQ(c[1], keys[1]);
  EXPECT_NE(c[2], keys[2]);
  EXPECT_NE(c[3], keys[3]);
  EXPECT_TRUE(PrefixKeys("model-a|fp16", 0, tokens).empty());
}

class PrefixStoreTest : public ::testing::Test {
 protected:
  static constexpr int kLayers = 3, kHeads = 2, kDim = 8, kBlock = 4;

  PrefixStoreTest() {
    KvStoreOptions o;
    o.prefix_cache_bytes = 1 << 20;
    store_ = std::make_unique<KvStore>(o);
  }

  // Opens a sequence over `tokens` (keys of `identity`), appends salt's rows
  // for the positions it did not attach, layer by layer as a prefill does,
  // and returns it.
  OpenedSequence Prefill(uint32_t salt, const std::string& identity,
                         const std::vector<int32_t>& tokens,
                         int max_tokens = 64) {
    const SequenceGeometry g = MakeGeometry(kLayers, kHeads, kDim, max_tokens);
    PrefixRequest p;
    p.block_tokens = kBlock;
    p.keys = PrefixKeys(identity, kBlock, tokens);
    auto opened = store_->Open(g, 0, p);
    EXPECT_TRUE(opened.ok()) << opened.status();
    const int n = static_cast<int>(tokens.size()) - opened->cached_tokens;
    for (int l = 0; l < kLayers && n > 0; ++l) {
      auto b = MakeTestBlock(salt, g, l, 1, opened->cached_tokens, n);
      EXPECT_TRUE(store_->Append(opened->id, b.block).ok());
    }
    return *opened;
  }

  // The rows of positions [first, first + n) of every layer equal salt's.
  void ExpectRows(SequenceId seq, uint32_t salt, int first, int n) {
    const SequenceGeometry g = MakeGeometry(kLayers, kHeads, kDim, 64);
    std::vector<int32_t> pos;
    for (int i = first; i < first + n; ++i) pos.push_back(i);
    const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(kHeads, pos);
    for (int l = 0; l < kLayers; ++l) {
      std::vector<uint16_t> got(FetchElements(plan.view(), kDim));
      ASSERT_TRUE(store_->Gather(seq, l, plan.view(), absl::MakeSpan(got)).ok());
      EXPECT_EQ(got, ExpectedRows(salt, g, l, plan.view())) << "layer " << l;
    }
  }

  std::unique_ptr<KvStore> store_;
};

TEST_F(PrefixStoreTest, SecondSequenceAttachesTheFirstOnesBlocks) {
  const std::vector<int32_t> tokens = Tokens(18);  // 4 blocks of 4 + 2
  const OpenedSequence a = Prefill(/*salt=*/1, "m", tokens);
  EXPECT_EQ(a.cached_tokens, 0);
  EXPECT_EQ(store_->GetStoreStats().prefix_blocks, 4);
  ASSERT_TRUE(store_->Close(a.id).ok());
  // Blocks outlive their publisher.
  const OpenedSequence b = Prefill(/*salt=*/2, "m", tokens);
  EXPECT_EQ(b.cached_tokens, 16);
  auto stats = store_->GetSequenceStats(b.id);
  ASSERT_TRUE(stats.ok());
  for (int32_t len : stats->layer_lengths) EXPECT_EQ(len, 18);
  EXPECT_EQ(stats->present_rows, int64_t{18} * kLayers * kHeads);
  ExpectRows(b.id, /*salt=*/1, 0, 16);  // A's rows, bit for bit
  ExpectRows(b.id, /*salt=*/2, 16, 2);  // B's own
  const StoreStats s = store_->GetStoreStats();
  EXPECT_EQ(s.prefix_hit_tokens, 16);
  EXPECT_EQ(s.prefix_bytes, int64_t{4} * 2 * kLayers * kHeads * kBlock * kDim * 2);
}

TEST_F(PrefixStoreTest, AnnotationsTravelWithTheirBlocks) {
  const std::vector<int32_t> tokens = Tokens(12);  // 3 blocks
  const SequenceGeometry g = MakeGeometry(kLayers, kHeads, kDim, 64);
  PrefixRequest p;
  p.block_tokens = kBlock;
  p.keys = PrefixKeys("m", kBlock, tokens);
  auto a = store_->Open(g, 0, p);
  ASSERT_TRUE(a.ok());
  // Layer by layer; the annotations come with the last layer's rows, the
  // first block's on its own.
  for (int l = 0; l < kLayers; ++l) {
    auto b = MakeTestBlock(1, g, l, 1, 0, 12);
    std::vector<std::string> meta;
    if (l == kLayers - 1) {
      meta = {"one", "two"};
      b.block.prefix_meta_first_block = 1;
      b.block.prefix_meta = meta;
      auto early = MakeTestBlock(1, g, l, 1, 0, 12);
      const std::vector<std::string> zero = {"zero"};
      early.block.prefix_meta = zero;
      early.block.n_tokens = 0;  // invalid: nothing of it is kept
      EXPECT_FALSE(store_->Append(a->id, early.block).ok());
    }
    ASSERT_TRUE(store_->Append(a->id, b.block).ok());
  }
  auto c = store_->Open(g, 0, p);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->cached_tokens, 12);
  EXPECT_EQ(c->prefix_meta, (std::vector<std::string>{"", "one", "two"}));
  // An oversized annotation is refused and changes nothing.
  auto d = store_->Open(g, 0, PrefixRequest());
  auto rows = MakeTestBlock(1, g, 0, kLayers, 0, 4);
  const std::vector<std::string> big = {std::string(kMaxPrefixMetaBytes + 1, 'x')};
  rows.block.prefix_meta = big;
  EXPECT_EQ(store_->Append(d->id, rows.block).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto stats = store_->GetSequenceStats(d->id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->present_rows, 0);
}

// Annotations waiting for their blocks are bounded by the rows the
// sequence holds: none larger than twice its block's rows, none kept for
// a block whose rows are not in, so a sequence with many prefix keys cannot
// park unbounded memory on the node.
TEST_F(PrefixStoreTest, WaitingAnnotationsAreBoundedByTheRowsHeld) {
  const SequenceGeometry g = MakeGeometry(kLayers, kHeads, kDim, 64);
  const size_t block_bytes =
      size_t{2} * kLayers * kHeads * kBlock * kDim * sizeof(uint16_t);
  const std::vector<int32_t> tokens = Tokens(64);  // 16 blocks of keys
  PrefixRequest p;
  p.block_tokens = kBlock;
  p.keys = PrefixKeys("bounded", kBlock, tokens);
  auto a = store_->Open(g, 0, p);
  ASSERT_TRUE(a.ok());
  auto rows = MakeTestBlock(1, g, 0, kLayers, 0, 4);  // block 0's rows only
  // Larger than a block's rows: refused, nothing appended.
  const std::vector<std::string> big = {std::string(2 * block_bytes + 1, 'x')};
  rows.block.prefix_meta = big;
  const absl::Status refused = store_->Append(a->id, rows.block).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("exceeds twice its block's"));
  EXPECT_EQ(store_->GetSequenceStats(a->id)->present_rows, 0);
  // Annotations for all 16 blocks with only block 0's rows in: only block
  // 0's is kept.
  std::vector<std::string> all;
  for (int i = 0; i < 16; ++i) all.push_back(std::string(block_bytes, 'a' + i));
  rows.block.prefix_meta = all;
  ASSERT_TRUE(store_->Append(a->id, rows.block).ok());
  auto rest = MakeTestBlock(1, g, 0, kLayers, 4, 60);
  ASSERT_TRUE(store_->Append(a->id, rest.block).ok());  // no annotations
  auto b = store_->Open(g, 0, p);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 64);
  ASSERT_FALSE(b->prefix_meta.empty());
  EXPECT_EQ(b->prefix_meta[0], all[0]);
  for (size_t i = 1; i < b->prefix_meta.size(); ++i) {
    EXPECT_EQ(b->prefix_meta[i], "") << i;
  }
}

TEST_F(PrefixStoreTest, AnotherModelOrOtherTokensMiss) {
  const std::vector<int32_t> tokens = Tokens(16);
  Prefill(1, "model-a", tokens);
  EXPECT_EQ(Prefill(2, "model-b", tokens).cached_tokens, 0);
  std::vector<int32_t> other = tokens;
  other[5] += 1;  // block 1 differs: only block 0 matches
  EXPECT_EQ(Prefill(3, "model-a", other).cached_tokens, 4);
  // Same keys, another row format (head_dim): a miss, never foreign rows.
  PrefixRequest p;
  p.block_tokens = kBlock;
  p.keys = PrefixKeys("model-a", kBlock, tokens);
  auto opened = store_->Open(MakeGeometry(kLayers, kHeads, 2 * kDim, 64), 0, p);
  ASSERT_TRUE(opened.ok());
  EXPECT_EQ(opened->cached_tokens, 0);
}

TEST_F(PrefixStoreTest, AppendsAfterTheAttachedPrefixAndEvictsSharedRowsAsOwn) {
  const std::vector<int32_t> tokens = Tokens(8);
  Prefill(1, "m", tokens);
  // max_tokens 8: B attaches 8, then each append evicts (LRU falls back to
  // FIFO here) a shared row and the slot takes its own row.
  const OpenedSequence b = Prefill(2, "m", tokens, /*max_tokens=*/8);
  ASSERT_EQ(b.cached_tokens, 8);
  const SequenceGeometry g = MakeGeometry(kLayers, kHeads, kDim, 8);
  auto step = MakeTestBlock(2, g, 0, kLayers, 8, 2);
  auto appended = store_->Append(b.id, step.block);
  ASSERT_TRUE(appended.ok());
  EXPECT_EQ(appended->evicted.size(), size_t{2} * kLayers * kHeads);
  ExpectRows(b.id, 2, 8, 2);
  ExpectRows(b.id, 1, 2, 6);
  // The publisher's blocks are intact for the next sequence.
  const OpenedSequence c = Prefill(3, "m", tokens);
  EXPECT_EQ(c.cached_tokens, 8);
  ExpectRows(c.id, 1, 0, 8);
}

TEST_F(PrefixStoreTest, ABlockWithAnEvictedRowIsNotPublished) {
  // max_tokens 8, 12 tokens appended layer by layer: positions 0..3 of
  // every layer are evicted before the last layer completes block 0.
  KvStoreOptions o;
  o.prefix_cache_bytes = 1 << 20;
  o.eviction = EvictionPolicy::kFifo;
  store_ = std::make_unique<KvStore>(o);
  const std::vector<int32_t> tokens = Tokens(12);
  Prefill(1, "m", tokens, /*max_tokens=*/8);
  EXPECT_EQ(store_->GetStoreStats().prefix_blocks, 0);
}

TEST_F(PrefixStoreTest, EvictionKeepsBlocksInUseAndCountsThemOnce) {
  const int64_t block_bytes = int64_t{2} * kLayers * kHeads * kBlock * kDim * 2;
  KvStoreOptions o;
  o.prefix_cache_bytes = 2 * block_bytes;  // room for two blocks
  store_ = std::make_unique<KvStore>(o);
  const std::vector<int32_t> first = Tokens(8, 0);
  const OpenedSequence a = Prefill(1, "m", first);
  ASSERT_TRUE(store_->Close(a.id).ok());
  // Three sequences use both blocks: still two blocks' bytes.
  std::vector<OpenedSequence> users;
  for (int i = 0; i < 3; ++i) users.push_back(Prefill(10 + i, "m", first));
  for (const OpenedSequence& u : users) EXPECT_EQ(u.cached_tokens, 8);
  EXPECT_EQ(store_->GetStoreStats().prefix_bytes, 2 * block_bytes);
  // A new prefix finds no unused block to evict: its blocks are not kept.
  const std::vector<int32_t> second = Tokens(8, 500);
  const OpenedSequence d = Prefill(2, "m", second);
  StoreStats s = store_->GetStoreStats();
  EXPECT_EQ(s.prefix_blocks, 2);
  EXPECT_EQ(s.prefix_evicted_blocks, 0);
  ExpectRows(users[0].id, 1, 0, 8);
  // Once nobody uses them, the old blocks make room for new ones.
  for (const OpenedSequence& u : users) ASSERT_TRUE(store_->Close(u.id).ok());
  ASSERT_TRUE(store_->Close(d.id).ok());
  const OpenedSequence e = Prefill(3, "m", second);
  EXPECT_EQ(e.cached_tokens, 0);
  s = store_->GetStoreStats();
  EXPECT_EQ(s.prefix_blocks, 2);
  EXPECT_EQ(s.prefix_evicted_blocks, 2);
  EXPECT_EQ(Prefill(4, "m", second).cached_tokens, 8);
  EXPECT_EQ(Prefill(5, "m", first).cached_tokens, 0);
}

// A prompt longer than the cache holds publishes its leading blocks, as
// many as fit: a later prompt attaches those (publishing every block would
// leave the cache holding the prompt's last blocks, which no prompt can
// attach without the first).
TEST_F(PrefixStoreTest, ALongPromptPublishesTheLeadingBlocksThatFit) {
  const int64_t block_bytes = int64_t{2} * kLayers * kHeads * kBlock * kDim * 2;
  KvStoreOptions o;
  o.prefix_cache_bytes = 3 * block_bytes;
  store_ = std::make_unique<KvStore>(o);
  const std::vector<int32_t> tokens = Tokens(40);  // 10 blocks
  const OpenedSequence a = Prefill(/*salt=*/1, "m", tokens);
  StoreStats s = store_->GetStoreStats();
  EXPECT_EQ(s.prefix_blocks, 3);
  EXPECT_EQ(s.prefix_evicted_blocks, 0);
  ASSERT_TRUE(store_->Close(a.id).ok());
  const OpenedSequence b = Prefill(/*salt=*/2, "m", tokens);
  EXPECT_EQ(b.cached_tokens, 3 * kBlock);
  ExpectRows(b.id, /*salt=*/1, 0, 3 * kBlock);
  ExpectRows(b.id, /*salt=*/2, 3 * kBlock, 40 - 3 * kBlock);
  // B publishes nothing more: its attached blocks fill the cache.
  EXPECT_EQ(store_->GetStoreStats().prefix_blocks, 3);
}

TEST_F(PrefixStoreTest, BadBlockSizeOpensNothing) {
  PrefixRequest p;
  p.block_tokens = 0;
  p.keys = {PrefixKey{1, 2}};
  auto opened = store_->Open(MakeGeometry(kLayers, kHeads, kDim, 64), 0, p);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->GetStoreStats().open_sequences, 0);
}

TEST_F(PrefixStoreTest, WithoutACacheNothingIsSharedOrAttached) {
  store_ = std::make_unique<KvStore>(KvStoreOptions());
  const std::vector<int32_t> tokens = Tokens(8);
  Prefill(1, "m", tokens);
  EXPECT_EQ(Prefill(2, "m", tokens).cached_tokens, 0);
  EXPECT_EQ(store_->GetStoreStats().prefix_blocks, 0);
}

TEST_F(PrefixStoreTest, ManyClientsAttachAndCloseConcurrently) {
  const std::vector<int32_t> tokens = Tokens(16);
  ASSERT_TRUE(store_->Close(Prefill(1, "m", tokens).id).ok());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 40; ++i) {
        // Half the clients share the common prefix, half publish their own
        // (evicting unused blocks of others as the cache fills).
        const bool common = (t % 2) == 0;
        const std::vector<int32_t> mine =
            common ? tokens : Tokens(16, 1000 + t * 100 + i);
        const OpenedSequence s = Prefill(common ? 2 : 100 + t, "m", mine);
        if (common && s.cached_tokens != 16) ++failures;
        const SequenceGeometry g = MakeGeometry(kLayers, kHeads, kDim, 64);
        const OwnedFetchPlan plan =
            OwnedFetchPlan::SameForAllHeads(kHeads, {0, 5, 15});
        std::vector<uint16_t> got(FetchElements(plan.view(), kDim));
        if (!store_->Gather(s.id, 2, plan.view(), absl::MakeSpan(got)).ok() ||
            (common && got != ExpectedRows(1, g, 2, plan.view()))) {
          ++failures;
        }
        if (!store_->Close(s.id).ok()) ++failures;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  const StoreStats s = store_->GetStoreStats();
  EXPECT_EQ(s.open_sequences, 0);
  EXPECT_LE(s.prefix_bytes, s.prefix_capacity_bytes);
}

}  // namespace
}  // namespace infinigen::kv_memory_service
