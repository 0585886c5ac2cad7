#include "kv_memory_service/store/kv_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/store/stored_sequence.h"
#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

#define EXPECT_CODE(expr, code_name)                                   \
  EXPECT_EQ((expr).code(), absl::StatusCode::code_name) << (expr)
#define EXPECT_OK_STATUS(expr)                   \
  do {                                           \
    const absl::Status s_ = (expr);              \
    EXPECT_TRUE(s_.ok()) << s_;                  \
  } while (0)
#define ASSERT_OK(expr)                 \
  do {                                  \
    const absl::Status s_ = (expr);     \
    ASSERT_TRUE(s_.ok()) << s_;         \
  } while (0)

SequenceGeometry Geo(int layers, int heads, int dim, int max_tokens) {
  return testdata::MakeGeometry(layers, heads, dim, max_tokens);
}

using Block = testdata::TestBlock;
Block MakeBlock(uint32_t salt, const SequenceGeometry& g, int first_layer,
                int n_layers, int first_pos, int n_tokens) {
  return testdata::MakeTestBlock(salt, g, first_layer, n_layers, first_pos,
                                 n_tokens);
}
std::vector<uint16_t> Expected(uint32_t salt, const SequenceGeometry& g,
                               int layer, const OwnedFetchPlan& plan) {
  return testdata::ExpectedRows(salt, g, layer, plan.view());
}

// Gathers every position of every head of every layer and compares.
void ExpectAllRows(KvStore& store, SequenceId id, uint32_t salt,
                   const SequenceGeometry& g, int length) {
  std::vector<int32_t> all(length);
  for (int i = 0; i < length; ++i) all[i] = i;
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(g.n_kv_heads, all);
  std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim));
  for (int l = 0; l < g.n_layers; ++l) {
    ASSERT_OK(store.Gather(id, l, plan.view(), absl::MakeSpan(dest)));
    ASSERT_EQ(dest, Expected(salt, g, l, plan)) << "layer " << l;
  }
}

TEST(KvTypesTest, ParsesEvictionPolicies) {
  EXPECT_EQ(*ParseEvictionPolicy("fifo"), EvictionPolicy::kFifo);
  EXPECT_EQ(*ParseEvictionPolicy("lru"), EvictionPolicy::kLru);
  EXPECT_EQ(*ParseEvictionPolicy("counter"), EvictionPolicy::kCounter);
  EXPECT_CODE(ParseEvictionPolicy("LRU").status(), kInvalidArgument);
  EXPECT_EQ(EvictionPolicyName(EvictionPolicy::kCounter), "counter");
}

TEST(KvTypesTest, ReservedBytesCountsKAndV) {
  EXPECT_EQ(ReservedBytes(Geo(2, 3, 64, 100)), 2 * 2 * 3 * 64 * 100 * 2);
}

TEST(KvStoreTest, RejectsBadGeometry) {
  KvStore store(KvStoreOptions{});
  EXPECT_CODE(store.Open(Geo(0, 1, 1, 1)).status(), kInvalidArgument);
  EXPECT_CODE(store.Open(Geo(1, 0, 1, 1)).status(), kInvalidArgument);
  EXPECT_CODE(store.Open(Geo(1, 1, -1, 1)).status(), kInvalidArgument);
  EXPECT_CODE(store.Open(Geo(1, 1, 1, 0)).status(), kInvalidArgument);
  EXPECT_CODE(store.Open(Geo(1 << 30, 1 << 30, 1 << 30, 1 << 30)).status(),
              kInvalidArgument);
  SequenceGeometry bad_dtype = Geo(1, 1, 1, 1);
  bad_dtype.dtype = static_cast<KvDType>(7);
  EXPECT_CODE(store.Open(bad_dtype).status(), kInvalidArgument);
  SequenceGeometry bf16 = Geo(1, 1, 1, 1);
  bf16.dtype = KvDType::kBFloat16;
  EXPECT_TRUE(store.Open(bf16).ok());
  EXPECT_EQ(store.GetStoreStats().open_sequences, 1);
}

// 2^20 layers x 2^10 KV heads x 1 token x dim 1 is
// only 4 GiB of rows but 2^30 (layer, head) bookkeeping entries; it used to
// throw out of Open (gRPC UNKNOWN) and leave its placeholder and its
// reservation behind. It is refused before anything is reserved.
TEST(KvStoreTest, AbsurdGeometryIsRefusedAndReservesNothing) {
  KvStoreOptions options;
  options.max_sequences = 4;
  options.capacity_bytes = int64_t{8} << 30;
  KvStore store(options);
  for (int i = 0; i < 8; ++i) {
    EXPECT_CODE(store.Open(Geo(1 << 20, 1 << 10, 1, 1)).status(),
                kInvalidArgument);
    EXPECT_CODE(store.Open(Geo(1 << 30, 1 << 10, 1, 1)).status(),
                kInvalidArgument);
  }
  StoreStats stats = store.GetStoreStats();
  EXPECT_EQ(stats.open_sequences, 0);
  EXPECT_EQ(stats.bytes_reserved, 0);
  // The largest bookkeeping allowed still opens.
  auto wide = store.Open(Geo(1 << 8, 1 << 8, 1, 1));
  ASSERT_TRUE(wide.ok()) << wide.status();
  ASSERT_OK(store.Close(*wide));
  EXPECT_CODE(store.Open(Geo((1 << 8) + 1, 1 << 8, 1, 1)).status(),
              kInvalidArgument);
  // A well-behaved client is served as before.
  const SequenceGeometry g = Geo(2, 2, 8, 16);
  auto id = store.Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  const Block block = MakeBlock(3, g, 0, 2, 0, 4);
  ASSERT_TRUE(store.Append(*id, block.block).ok());
  ExpectAllRows(store, *id, 3, g, 4);
  EXPECT_EQ(store.GetStoreStats().bytes_reserved, ReservedBytes(g));
}

TEST(KvStoreTest, LimitsSequencesAndBytes) {
  KvStoreOptions options;
  options.max_sequences = 2;
  options.capacity_bytes = 3 * ReservedBytes(Geo(1, 1, 8, 16));
  KvStore store(options);
  auto a = store.Open(Geo(1, 1, 8, 16));
  auto b = store.Open(Geo(1, 1, 8, 16));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_CODE(store.Open(Geo(1, 1, 8, 16)).status(), kResourceExhausted);
  ASSERT_OK(store.Close(*a));
  // One slot free, but three sequences' bytes do not fit beside b.
  EXPECT_CODE(store.Open(Geo(1, 1, 8, 48)).status(), kResourceExhausted);
  auto c = store.Open(Geo(1, 1, 8, 16));
  ASSERT_TRUE(c.ok());
  StoreStats stats = store.GetStoreStats();
  EXPECT_EQ(stats.open_sequences, 2);
  EXPECT_EQ(stats.bytes_reserved, 2 * ReservedBytes(Geo(1, 1, 8, 16)));
  EXPECT_EQ(stats.capacity_bytes, options.capacity_bytes);
}

TEST(KvStoreTest, GathersBitExactWithPerHeadPlans) {
  const SequenceGeometry g = Geo(3, 4, 24, 64);
  KvStore store(KvStoreOptions{});
  auto id = store.Open(g);
  ASSERT_TRUE(id.ok());
  // Prefill 40 tokens of all layers, then 10 decode steps of one token.
  Block prefill = MakeBlock(1, g, 0, g.n_layers, 0, 40);
  ASSERT_TRUE(store.Append(*id, prefill.block).ok());
  for (int t = 40; t < 50; ++t) {
    Block step = MakeBlock(1, g, 0, g.n_layers, t, 1);
    auto r = store.Append(*id, step.block);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->evicted, IsEmpty());
  }
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
    for (auto& positions : per_head) {
      const int count = rng() % 20;  // heads differ in count, may be 0
      for (int i = 0; i < count; ++i) positions.push_back(rng() % 50);
    }
    const OwnedFetchPlan plan = OwnedFetchPlan::PerHead(per_head);
    const int layer = rng() % g.n_layers;
    // A larger destination: the tail must stay untouched.
    std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim) + 5,
                               0xabcd);
    ASSERT_OK(store.Gather(*id, layer, plan.view(), absl::MakeSpan(dest)));
    std::vector<uint16_t> want = Expected(1, g, layer, plan);
    want.resize(want.size() + 5, 0xabcd);
    ASSERT_EQ(dest, want) << "trial " << trial;
  }
}

TEST(KvStoreTest, LayersAppendSeparately) {
  const SequenceGeometry g = Geo(3, 2, 8, 16);
  KvStore store(KvStoreOptions{});
  SequenceId id = *store.Open(g);
  // Layer by layer, as a prefill that streams each layer out when done.
  for (int l = 0; l < g.n_layers; ++l) {
    Block b = MakeBlock(5, g, l, 1, 0, 6);
    ASSERT_TRUE(store.Append(id, b.block).ok());
  }
  // Layers 1..2 only, then layer 0.
  Block tail = MakeBlock(5, g, 1, 2, 6, 1);
  ASSERT_TRUE(store.Append(id, tail.block).ok());
  SequenceStats stats = *store.GetSequenceStats(id);
  EXPECT_THAT(stats.layer_lengths, ElementsAre(6, 7, 7));
  OwnedFetchPlan beyond = OwnedFetchPlan::SameForAllHeads(2, {6});
  std::vector<uint16_t> dest(FetchElements(beyond.view(), g.head_dim));
  EXPECT_CODE(store.Gather(id, 0, beyond.view(), absl::MakeSpan(dest)),
              kOutOfRange);
  ASSERT_OK(store.Gather(id, 2, beyond.view(), absl::MakeSpan(dest)));
  EXPECT_EQ(dest, Expected(5, g, 2, beyond));
  Block head = MakeBlock(5, g, 0, 1, 6, 1);
  ASSERT_TRUE(store.Append(id, head.block).ok());
  ExpectAllRows(store, id, 5, g, 7);
}

// A sequence with known contents and one snapshot of everything observable,
// for checking that a failed call changed nothing.
struct Snapshot {
  SequenceStats seq;
  StoreStats store;
  std::vector<std::vector<TokenFetchStats>> tokens;  // [layer * heads + h]
};
Snapshot Take(KvStore& store, SequenceId id, const SequenceGeometry& g) {
  Snapshot s;
  s.seq = *store.GetSequenceStats(id);
  s.store = store.GetStoreStats();
  for (int l = 0; l < g.n_layers; ++l) {
    for (int h = 0; h < g.n_kv_heads; ++h) {
      s.tokens.push_back(*store.GetTokenStats(id, l, h));
    }
  }
  return s;
}
void ExpectSame(const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.seq.layer_lengths, b.seq.layer_lengths);
  EXPECT_EQ(a.seq.present_rows, b.seq.present_rows);
  EXPECT_EQ(a.seq.evicted_rows, b.seq.evicted_rows);
  EXPECT_EQ(a.seq.fetches, b.seq.fetches);
  EXPECT_EQ(a.seq.fetched_rows, b.seq.fetched_rows);
  EXPECT_EQ(a.store.appended_rows, b.store.appended_rows);
  EXPECT_EQ(a.store.fetches, b.store.fetches);
  ASSERT_EQ(a.tokens.size(), b.tokens.size());
  for (size_t i = 0; i < a.tokens.size(); ++i) {
    ASSERT_EQ(a.tokens[i].size(), b.tokens[i].size());
    for (size_t j = 0; j < a.tokens[i].size(); ++j) {
      EXPECT_EQ(a.tokens[i][j].position, b.tokens[i][j].position);
      EXPECT_EQ(a.tokens[i][j].fetch_count, b.tokens[i][j].fetch_count);
      EXPECT_EQ(a.tokens[i][j].last_fetch, b.tokens[i][j].last_fetch);
    }
  }
}

class BadInputTest : public ::testing::Test {
 protected:
  BadInputTest() : store_(Options()) {
    id_ = *store_.Open(g_);
    Block b = MakeBlock(9, g_, 0, g_.n_layers, 0, 6);
    EXPECT_TRUE(store_.Append(id_, b.block).ok());
    // Fetch something so the counters are not all zero.
    OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {1, 3});
    std::vector<uint16_t> dest(FetchElements(plan.view(), g_.head_dim));
    EXPECT_TRUE(store_.Gather(id_, 1, plan.view(), absl::MakeSpan(dest)).ok());
    before_ = Take(store_, id_, g_);
  }
  static KvStoreOptions Options() {
    KvStoreOptions o;
    o.max_append_tokens = 100;
    o.max_fetch_indices = 50;
    o.eviction = EvictionPolicy::kFifo;
    return o;
  }
  void TearDown() override {
    ExpectSame(before_, Take(store_, id_, g_));
    ExpectAllRows(store_, id_, 9, g_, 6);
  }
  absl::Status Gather(int layer, const OwnedFetchPlan& plan, size_t slack = 0) {
    std::vector<uint16_t> dest(FetchElements(plan.view(), g_.head_dim) + slack);
    return store_.Gather(id_, layer, plan.view(), absl::MakeSpan(dest));
  }

  const SequenceGeometry g_ = Geo(3, 2, 8, 16);
  KvStore store_;
  SequenceId id_;
  Snapshot before_;
};

TEST_F(BadInputTest, AppendToUnknownSequenceIsNotFound) {
  Block b = MakeBlock(9, g_, 0, 1, 6, 1);
  EXPECT_CODE(store_.Append(id_ + 1, b.block).status(), kNotFound);
}

TEST_F(BadInputTest, AppendOutsideLayersIsInvalid) {
  Block b = MakeBlock(9, g_, 2, 2, 6, 1);  // layers 2..3 of 3
  EXPECT_CODE(store_.Append(id_, b.block).status(), kInvalidArgument);
  b.block.first_layer = -1;
  EXPECT_CODE(store_.Append(id_, b.block).status(), kInvalidArgument);
  b.block.first_layer = 0;
  b.block.n_layers = 0;
  EXPECT_CODE(store_.Append(id_, b.block).status(), kInvalidArgument);
}

TEST_F(BadInputTest, AppendWithWrongRowSizeIsInvalid) {
  Block b = MakeBlock(9, g_, 0, 1, 6, 2);
  AppendBlock short_k = b.block;
  short_k.k = short_k.k.subspan(1);
  EXPECT_CODE(store_.Append(id_, short_k).status(), kInvalidArgument);
  AppendBlock short_v = b.block;
  short_v.v = short_v.v.subspan(0, short_v.v.size() - 8);
  EXPECT_CODE(store_.Append(id_, short_v).status(), kInvalidArgument);
  AppendBlock more_tokens = b.block;
  more_tokens.n_tokens = 3;
  EXPECT_CODE(store_.Append(id_, more_tokens).status(), kInvalidArgument);
  AppendBlock no_tokens = b.block;
  no_tokens.n_tokens = 0;
  EXPECT_CODE(store_.Append(id_, no_tokens).status(), kInvalidArgument);
}

TEST_F(BadInputTest, OversizedAppendIsResourceExhausted) {
  Block b = MakeBlock(9, g_, 0, 1, 6, 101);
  EXPECT_CODE(store_.Append(id_, b.block).status(), kResourceExhausted);
}

// An append whose caller's deadline has come, or
// that its caller cancelled, writes nothing (TearDown checks every row).
TEST_F(BadInputTest, AppendPastItsDeadlineOrCancelledWritesNothing) {
  Block b = MakeBlock(9, g_, 0, 3, 6, 2);
  AppendBlock late = b.block;
  late.deadline = absl::Now() - absl::Milliseconds(1);
  EXPECT_CODE(store_.Append(id_, late).status(), kDeadlineExceeded);
  AppendBlock cancelled = b.block;
  cancelled.cancelled = [] { return true; };
  EXPECT_CODE(store_.Append(id_, cancelled).status(), kCancelled);
}

// An append queued behind a slow one on the same sequence is judged when
// its turn comes: its deadline passed while it waited, so it writes
// nothing, and the sequence takes the next append as usual.
TEST(KvStoreTest, AnAppendWhoseDeadlinePassesWhileQueuedWritesNothing) {
  KvStore store{KvStoreOptions{}};
  const SequenceGeometry g = Geo(1, 1, 4, 64);
  const SequenceId id = *store.Open(g);
  absl::Notification holding, release;
  Block first = MakeBlock(3, g, 0, 1, 0, 4);
  // The cancellation check runs with the sequence held: it stands for a
  // long append.
  first.block.cancelled = [&] {
    holding.Notify();
    release.WaitForNotification();
    return false;
  };
  std::thread slow([&] { EXPECT_TRUE(store.Append(id, first.block).ok()); });
  holding.WaitForNotification();
  Block queued = MakeBlock(3, g, 0, 1, 4, 4);
  queued.block.deadline = absl::Now() + absl::Milliseconds(50);
  absl::Status status;
  std::thread waiter([&] { status = store.Append(id, queued.block).status(); });
  absl::SleepFor(absl::Milliseconds(300));
  release.Notify();
  slow.join();
  waiter.join();
  EXPECT_CODE(status, kDeadlineExceeded);
  auto stats = store.GetSequenceStats(id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->layer_lengths[0], 4);  // the first append's tokens only
  queued.block.deadline = absl::InfiniteFuture();
  EXPECT_TRUE(store.Append(id, queued.block).ok());
  ExpectAllRows(store, id, 3, g, 8);
}

TEST_F(BadInputTest, GatherFromUnknownSequenceIsNotFound) {
  OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {0});
  std::vector<uint16_t> dest(FetchElements(plan.view(), g_.head_dim));
  EXPECT_CODE(store_.Gather(id_ ^ 0x100000000ULL, 0, plan.view(),
                            absl::MakeSpan(dest)),
              kNotFound);
}

TEST_F(BadInputTest, GatherOutsideLayersIsInvalid) {
  OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {0});
  EXPECT_CODE(Gather(3, plan), kInvalidArgument);
  EXPECT_CODE(Gather(-1, plan), kInvalidArgument);
}

TEST_F(BadInputTest, PlanForWrongHeadCountIsInvalid) {
  EXPECT_CODE(Gather(0, OwnedFetchPlan::SameForAllHeads(3, {0})),
              kInvalidArgument);
  EXPECT_CODE(Gather(0, OwnedFetchPlan::SameForAllHeads(1, {0})),
              kInvalidArgument);
  EXPECT_CODE(Gather(0, OwnedFetchPlan{}), kInvalidArgument);
}

TEST_F(BadInputTest, MalformedOffsetsAreInvalid) {
  OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{0, 1}, {2}});
  plan.head_offsets = {1, 2, 3};  // does not start at 0
  EXPECT_CODE(Gather(0, plan), kInvalidArgument);
  plan.head_offsets = {0, 3, 2};  // decreasing
  EXPECT_CODE(Gather(0, plan), kInvalidArgument);
  plan.head_offsets = {0, 1, 2};  // does not cover the indices
  EXPECT_CODE(Gather(0, plan), kInvalidArgument);
}

TEST_F(BadInputTest, NegativePositionIsInvalid) {
  EXPECT_CODE(Gather(0, OwnedFetchPlan::PerHead({{0, -1}, {2}})),
              kInvalidArgument);
}

TEST_F(BadInputTest, PositionBeyondLengthIsOutOfRange) {
  // The good head 0 comes first: nothing may be counted for it either.
  EXPECT_CODE(Gather(2, OwnedFetchPlan::PerHead({{0, 5}, {6}})), kOutOfRange);
}

TEST_F(BadInputTest, SmallDestinationIsInvalid) {
  OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {0, 1});
  std::vector<uint16_t> dest(FetchElements(plan.view(), g_.head_dim) - 1);
  EXPECT_CODE(store_.Gather(id_, 0, plan.view(), absl::MakeSpan(dest)),
              kInvalidArgument);
}

TEST_F(BadInputTest, OversizedPlanIsResourceExhausted) {
  std::vector<int32_t> many(26, 0);
  EXPECT_CODE(Gather(0, OwnedFetchPlan::SameForAllHeads(2, many)),
              kResourceExhausted);
}

TEST_F(BadInputTest, TokenStatsOutsideGeometryIsInvalid) {
  EXPECT_CODE(store_.GetTokenStats(id_, 3, 0).status(), kInvalidArgument);
  EXPECT_CODE(store_.GetTokenStats(id_, 0, 2).status(), kInvalidArgument);
  EXPECT_CODE(store_.GetTokenStats(id_ + 7, 0, 0).status(), kNotFound);
}

TEST(KvStoreTest, ClosedSequenceIsNotFound) {
  KvStore store(KvStoreOptions{});
  const SequenceGeometry g = Geo(1, 1, 4, 4);
  SequenceId id = *store.Open(g);
  ASSERT_OK(store.Close(id));
  EXPECT_CODE(store.Close(id), kNotFound);
  Block b = MakeBlock(1, g, 0, 1, 0, 1);
  EXPECT_CODE(store.Append(id, b.block).status(), kNotFound);
  EXPECT_CODE(store.GetSequenceStats(id).status(), kNotFound);
  EXPECT_EQ(store.GetStoreStats().bytes_reserved, 0);
}

TEST(KvStoreTest, IdsOfAnotherStoreAreNotFound) {
  KvStore a(KvStoreOptions{}), b(KvStoreOptions{});
  SequenceId ia = *a.Open(Geo(1, 1, 4, 4));
  SequenceId ib = *b.Open(Geo(1, 1, 4, 4));
  EXPECT_NE(ia, ib);
  EXPECT_CODE(b.GetSequenceStats(ia).status(), kNotFound);
}

// Ids were sequential (B opened after A got A + 1), so
// any client could reach another's sequence by counting.
TEST(KvStoreTest, IdsCannotBeGuessedFromOtherIds) {
  KvStore store(KvStoreOptions{});
  std::vector<SequenceId> ids;
  for (int i = 0; i < 64; ++i) ids.push_back(*store.Open(Geo(1, 1, 4, 4)));
  int same_high_half = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    for (SequenceId guess : {ids[i] + 1, ids[i] - 1, ids[i] + 2}) {
      if (std::find(ids.begin(), ids.end(), guess) != ids.end()) {
        ADD_FAILURE() << "id " << guess << " is a neighbour of " << ids[i];
      }
      EXPECT_CODE(store.GetSequenceStats(guess).status(), kNotFound);
      EXPECT_CODE(store.Close(guess), kNotFound);
    }
    if (i > 0 && (ids[i] >> 32) == (ids[i - 1] >> 32)) ++same_high_half;
  }
  // 64 random bits each: no shared prefix, no counter in the low half.
  EXPECT_LT(same_high_half, 2);
  SessionId s1 = *store.OpenSession(), s2 = *store.OpenSession();
  EXPECT_NE(s2, s1 + 1);
  EXPECT_CODE(store.RenewSession(s2 + 1), kNotFound);
}

// A sequence opened in a session answers only to
// that session, as if it did not exist.
TEST(KvStoreTest, ASessionsSequenceAnswersOnlyToItsSession) {
  KvStore store(KvStoreOptions{});
  const SessionId mine = *store.OpenSession(), theirs = *store.OpenSession();
  const SequenceId owned = *store.Open(Geo(1, 1, 4, 4), mine);
  const SequenceId shared = *store.Open(Geo(1, 1, 4, 4));
  EXPECT_OK_STATUS(store.CheckOwner(owned, mine));
  EXPECT_CODE(store.CheckOwner(owned, theirs), kNotFound);
  EXPECT_CODE(store.CheckOwner(owned, 0), kNotFound);
  EXPECT_OK_STATUS(store.CheckOwner(shared, theirs));
  EXPECT_OK_STATUS(store.CheckOwner(shared, 0));
  EXPECT_CODE(store.CheckOwner(owned + 1, mine), kNotFound);
  // What a fetch reads first: the geometry, for the owner only.
  auto g = store.Geometry(owned, mine);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->head_dim, 4);
  EXPECT_CODE(store.Geometry(owned, theirs).status(), kNotFound);
  EXPECT_CODE(store.Geometry(owned, 0).status(), kNotFound);
  EXPECT_TRUE(store.Geometry(shared, theirs).ok());
  ASSERT_OK(store.Close(owned));
  EXPECT_CODE(store.CheckOwner(owned, mine), kNotFound);
  EXPECT_CODE(store.Geometry(owned, mine).status(), kNotFound);
}

// Picking an LRU victim scanned the whole head, so an
// append that evicts 2^16 tokens from a full 2^16-token head took 2^32
// steps (seconds). Now each eviction is O(log capacity).
TEST(EvictionTest, EvictingFromALargeHeadIsFast) {
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kCounter,
                                EvictionPolicy::kFifo}) {
    KvStoreOptions options;
    options.eviction = policy;
    KvStore store(options);
    constexpr int kTokens = 1 << 16;
    const SequenceGeometry g = Geo(1, 1, 1, kTokens);
    SequenceId id = *store.Open(g);
    Block fill = MakeBlock(1, g, 0, 1, 0, kTokens);
    ASSERT_TRUE(store.Append(id, fill.block).ok());
    // Fetch a few so LRU and counter have something to rank.
    OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {1, 5, 9, 100});
    std::vector<uint16_t> dest(FetchElements(plan.view(), 1));
    ASSERT_OK(store.Gather(id, 0, plan.view(), absl::MakeSpan(dest)));
    const absl::Time start = absl::Now();
    Block more = MakeBlock(1, g, 0, 1, kTokens, kTokens);
    absl::StatusOr<AppendResult> r = store.Append(id, more.block);
    const absl::Duration took = absl::Now() - start;
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->evicted.size(), static_cast<size_t>(kTokens));
    EXPECT_LT(took, absl::Seconds(2)) << EvictionPolicyName(policy);
  }
}

// ---- Eviction ------------------------------------------------------------

// One (layer, head) of a sequence with the store's rules restated plainly:
// the reference the store is checked against.
class PoolModel {
 public:
  PoolModel(EvictionPolicy policy, int capacity)
      : policy_(policy), capacity_(capacity) {}

  // Returns the evicted position or -1.
  int Append() {
    const int p = length_++;
    int victim = -1;
    if (static_cast<int>(tokens_.size()) == capacity_) {
      if (policy_ != EvictionPolicy::kFifo) {
        for (const auto& [pos, t] : tokens_) {  // increasing position
          if (pos >= p / 2) break;
          if (victim < 0 || Better(t, tokens_[victim])) victim = pos;
        }
      }
      if (victim < 0) victim = tokens_.begin()->first;
      tokens_.erase(victim);
    }
    tokens_[p] = Token{};
    return victim;
  }
  void Fetch(const std::vector<int>& positions, uint64_t clock) {
    for (int pos : positions) {
      ++tokens_.at(pos).count;
      tokens_.at(pos).last = clock;
    }
  }
  std::vector<int> Present() const {
    std::vector<int> out;
    for (const auto& [pos, t] : tokens_) out.push_back(pos);
    return out;
  }

 private:
  struct Token {
    int64_t count = 0;
    uint64_t last = 0;
  };
  bool Better(const Token& a, const Token& b) const {
    return policy_ == EvictionPolicy::kLru ? a.last < b.last
                                           : a.count < b.count;
  }
  EvictionPolicy policy_;
  int capacity_;
  int length_ = 0;
  std::map<int, Token> tokens_;
};

struct Pool {
  explicit Pool(EvictionPolicy policy, SequenceGeometry g)
      : g(g), store([&] {
          KvStoreOptions o;
          o.eviction = policy;
          return o;
        }()) {
    id = *store.Open(g);
  }
  // Appends one token to every layer; returns the evictions.
  std::vector<EvictedToken> Step() {
    Block b = MakeBlock(3, g, 0, g.n_layers, length++, 1);
    auto r = store.Append(id, b.block);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->evicted : std::vector<EvictedToken>{};
  }
  void Fetch(int layer, const std::vector<std::vector<int32_t>>& per_head) {
    OwnedFetchPlan plan = OwnedFetchPlan::PerHead(per_head);
    std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim));
    absl::Status s = store.Gather(id, layer, plan.view(), absl::MakeSpan(dest));
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(dest, Expected(3, g, layer, plan));
  }
  std::vector<int> Present(int layer, int head) {
    std::vector<int> out;
    const std::vector<TokenFetchStats> stats =
        *store.GetTokenStats(id, layer, head);
    for (const auto& t : stats) {
      out.push_back(t.position);
    }
    return out;
  }
  SequenceGeometry g;
  KvStore store;
  SequenceId id;
  int length = 0;
};

// One token appended to every (layer, head) model; the evictions in the
// order the store reports them.
std::vector<EvictedToken> AppendToModels(const SequenceGeometry& g,
                                         std::vector<PoolModel>& models) {
  std::vector<EvictedToken> evicted;
  for (int l = 0; l < g.n_layers; ++l) {
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const int victim = models[l * g.n_kv_heads + h].Append();
      if (victim >= 0) evicted.push_back({l, h, victim});
    }
  }
  return evicted;
}

void ExpectPresentAsInModels(Pool& pool, std::vector<PoolModel>& models) {
  for (int l = 0; l < pool.g.n_layers; ++l) {
    for (int h = 0; h < pool.g.n_kv_heads; ++h) {
      EXPECT_EQ(pool.Present(l, h),
                models[l * pool.g.n_kv_heads + h].Present());
    }
  }
}

TEST(EvictionTest, FifoEvictsTheOldest) {
  Pool pool(EvictionPolicy::kFifo, Geo(1, 2, 4, 4));
  for (int i = 0; i < 4; ++i) EXPECT_THAT(pool.Step(), IsEmpty());
  pool.Fetch(0, {{0, 0, 0}, {0}});  // fetches do not matter to FIFO
  EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 0},
                                       EvictedToken{0, 1, 0}));
  EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 1},
                                       EvictedToken{0, 1, 1}));
  EXPECT_THAT(pool.Present(0, 0), ElementsAre(2, 3, 4, 5));
  OwnedFetchPlan evicted = OwnedFetchPlan::PerHead({{2}, {1}});
  std::vector<uint16_t> dest(FetchElements(evicted.view(), 4));
  EXPECT_CODE(pool.store.Gather(pool.id, 0, evicted.view(), absl::MakeSpan(dest)),
              kFailedPrecondition);
  // Rows in reused slots are the new tokens' rows.
  pool.Fetch(0, {{5, 4, 3, 2}, {2, 5}});
}

TEST(EvictionTest, LruEvictsTheLeastRecentlyFetchedOfTheOlderHalf) {
  Pool pool(EvictionPolicy::kLru, Geo(1, 2, 4, 6));
  for (int i = 0; i < 6; ++i) pool.Step();
  // Clock 1: head 0 fetches 0, 1; head 1 fetches 2.
  pool.Fetch(0, {{0, 1}, {2}});
  // Clock 2: head 0 fetches 0 and 5; head 1 fetches 0 and 1.
  pool.Fetch(0, {{0, 5}, {0, 1}});
  // Appending position 6: candidates are positions < 3.
  // Head 0: last fetches 0->2, 1->1, 2->never: evict 2.
  // Head 1: 0->2, 1->2, 2->1: evict 2.
  EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 2},
                                       EvictedToken{0, 1, 2}));
  // Appending 7: candidates < 3 are {0, 1}. Head 0: 1 is older (clock 1).
  // Head 1: 0 and 1 tie at clock 2: the smaller position, 0.
  EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 1},
                                       EvictedToken{0, 1, 0}));
  // Position 5 was fetched but is not in the older half: never a victim.
  EXPECT_THAT(pool.Present(0, 0), ElementsAre(0, 3, 4, 5, 6, 7));
  EXPECT_THAT(pool.Present(0, 1), ElementsAre(1, 3, 4, 5, 6, 7));
}

TEST(EvictionTest, CounterEvictsTheLeastFetchedOfTheOlderHalf) {
  Pool pool(EvictionPolicy::kCounter, Geo(2, 1, 4, 6));
  for (int i = 0; i < 6; ++i) pool.Step();
  pool.Fetch(0, {{0, 0, 0, 1, 2, 2}});  // counts 0:3 1:1 2:2
  pool.Fetch(0, {{1, 5, 5, 5}});        // counts 0:3 1:2 2:2 5:3
  pool.Fetch(1, {{2}});                 // layer 1 keeps its own counts
  // Position 6, candidates < 3: layer 0 ties 1 and 2 at 2 fetches -> 1.
  // Layer 1: 0 and 1 never fetched -> 0.
  EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 1},
                                       EvictedToken{1, 0, 0}));
  // Position 7: layer 0 has {0: 3, 2: 2} -> 2. Layer 1 {1: 0, 2: 1} -> 1.
  EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 2},
                                       EvictedToken{1, 0, 1}));
  // Position 8, candidates < 4: layer 0 {0: 3, 3: 0} -> 3; layer 1
  // {2: 1, 3: 0} -> 3.
  EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 3},
                                       EvictedToken{1, 0, 3}));
}

TEST(EvictionTest, FallsBackToFifoWhenTheOlderHalfIsGone) {
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kCounter}) {
    Pool pool(policy, Geo(1, 1, 4, 3));
    for (int i = 0; i < 3; ++i) pool.Step();
    // p = 3: candidates < 1 -> 0.
    EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 0}));
    // p = 4: candidates < 2 -> 1.
    EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 1}));
    // p = 5: candidates < 2: none present -> the oldest present, 2.
    EXPECT_THAT(pool.Step(), ElementsAre(EvictedToken{0, 0, 2}));
    EXPECT_THAT(pool.Present(0, 0), ElementsAre(3, 4, 5));
  }
}

TEST(EvictionTest, MatchesTheReferenceOnRandomWorkloads) {
  for (EvictionPolicy policy : {EvictionPolicy::kFifo, EvictionPolicy::kLru,
                                EvictionPolicy::kCounter}) {
    const SequenceGeometry g = Geo(2, 3, 4, 10);
    Pool pool(policy, g);
    std::vector<PoolModel> models(g.n_layers * g.n_kv_heads,
                                  PoolModel(policy, g.max_tokens));
    std::mt19937 rng(11 + static_cast<int>(policy));
    uint64_t clock = 0;
    for (int step = 0; step < 300; ++step) {
      ASSERT_EQ(pool.Step(), AppendToModels(g, models))
          << EvictionPolicyName(policy) << " step " << step;
      // A few fetches of random present tokens per step, skewed to favour
      // some tokens so that the policies differ.
      for (int f = 0; f < 2; ++f) {
        const int layer = rng() % g.n_layers;
        ++clock;
        std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
        for (int h = 0; h < g.n_kv_heads; ++h) {
          PoolModel& m = models[layer * g.n_kv_heads + h];
          std::vector<int> present = m.Present();
          const int k = rng() % 4;
          std::vector<int> chosen;
          for (int i = 0; i < k; ++i) {
            const int r = std::min<int>(rng() % present.size(),
                                        rng() % present.size());
            chosen.push_back(present[r]);
          }
          m.Fetch(chosen, clock);
          per_head[h].assign(chosen.begin(), chosen.end());
        }
        pool.Fetch(layer, per_head);
      }
    }
    ExpectPresentAsInModels(pool, models);
    SequenceStats stats = *pool.store.GetSequenceStats(pool.id);
    EXPECT_EQ(stats.present_rows, g.n_layers * g.n_kv_heads * g.max_tokens);
    EXPECT_EQ(stats.evicted_rows,
              g.n_layers * g.n_kv_heads * (300 - g.max_tokens));
  }
}

TEST(KvStoreTest, CountsFetches) {
  const SequenceGeometry g = Geo(1, 2, 4, 8);
  KvStore store(KvStoreOptions{});
  SequenceId id = *store.Open(g);
  Block b = MakeBlock(1, g, 0, 1, 0, 4);
  ASSERT_TRUE(store.Append(id, b.block).ok());
  OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{1, 1, 3}, {}});
  std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim));
  ASSERT_OK(store.Gather(id, 0, plan.view(), absl::MakeSpan(dest)));
  ASSERT_OK(store.Gather(id, 0, plan.view(), absl::MakeSpan(dest)));
  std::vector<TokenFetchStats> head0 = *store.GetTokenStats(id, 0, 0);
  ASSERT_EQ(head0.size(), 4u);
  EXPECT_EQ(head0[0].fetch_count, 0);
  EXPECT_EQ(head0[0].last_fetch, 0u);
  EXPECT_EQ(head0[1].fetch_count, 4);
  EXPECT_EQ(head0[1].last_fetch, 2u);
  EXPECT_EQ(head0[3].fetch_count, 2);
  const std::vector<TokenFetchStats> head1 = *store.GetTokenStats(id, 0, 1);
  for (const auto& t : head1) {
    EXPECT_EQ(t.fetch_count, 0);
  }
  SequenceStats s = *store.GetSequenceStats(id);
  EXPECT_EQ(s.fetches, 2);
  EXPECT_EQ(s.fetched_rows, 6);
  EXPECT_EQ(s.present_rows, 8);
  EXPECT_EQ(s.bytes_reserved, ReservedBytes(g));
  StoreStats t = store.GetStoreStats();
  EXPECT_EQ(t.appended_rows, 8);
  EXPECT_EQ(t.fetches, 2);
  EXPECT_EQ(t.fetched_rows, 6);
}

// Plans made of runs of consecutive positions (copied as one block where
// the rows lie side by side) and single rows, under every policy, before
// and after the heads start evicting (FIFO's slots wrap around, LRU's and
// the counter's positions move between the ring and the older map): every
// gather returns the right rows, and the victims stay the reference's.
TEST(KvStoreTest, RunsAndScatteredRowsGatherRightWhileHeadsEvict) {
  for (EvictionPolicy policy : {EvictionPolicy::kFifo, EvictionPolicy::kLru,
                                EvictionPolicy::kCounter}) {
    SCOPED_TRACE(EvictionPolicyName(policy));
    const SequenceGeometry g = Geo(2, 3, 8, 16);
    Pool pool(policy, g);
    std::vector<PoolModel> models(g.n_layers * g.n_kv_heads,
                                  PoolModel(policy, g.max_tokens));
    std::mt19937 rng(5 + static_cast<int>(policy));
    uint64_t clock = 0;
    for (int step = 0; step < 120; ++step) {
      ASSERT_EQ(pool.Step(), AppendToModels(g, models)) << "step " << step;
      const int layer = step % g.n_layers;
      ++clock;
      std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
      for (int h = 0; h < g.n_kv_heads; ++h) {
        PoolModel& m = models[layer * g.n_kv_heads + h];
        const std::vector<int> present = m.Present();
        std::vector<int32_t>& chosen = per_head[h];
        // A run of present positions from a random start (consecutive where
        // nothing between was evicted), then a few scattered ones, repeats
        // allowed, and sometimes the whole head in order.
        if (rng() % 5 == 0) {
          chosen.assign(present.begin(), present.end());
        } else {
          const size_t start = rng() % present.size();
          const size_t len = 1 + rng() % 8;
          for (size_t i = start; i < present.size() && i < start + len; ++i) {
            chosen.push_back(present[i]);
          }
          for (int i = 0; i < 3; ++i) {
            chosen.push_back(present[rng() % present.size()]);
          }
        }
        m.Fetch(std::vector<int>(chosen.begin(), chosen.end()), clock);
      }
      pool.Fetch(layer, per_head);
    }
    ExpectPresentAsInModels(pool, models);
  }
}

// A gather above the split threshold is shared by the pool's threads, each
// a range of the plan's rows across head boundaries: the rows are the same
// as one thread's, and an error in any range fails the whole gather with
// the first bad index's error, counting nothing.
TEST(KvStoreTest, LargeGathersSplitAcrossThreadsAreBitExact) {
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    KvStoreOptions options;
    options.gather_threads = threads;
    KvStore store(options);
    const SequenceGeometry g = Geo(1, 4, 64, 8192);
    const SequenceId id = *store.Open(g);
    for (int t = 0; t < 8192; t += 2048) {
      Block b = MakeBlock(9, g, 0, 1, t, 2048);
      ASSERT_TRUE(store.Append(id, b.block).ok());
    }
    std::mt19937 rng(3);
    std::vector<std::vector<int32_t>> per_head(4);
    for (int p = 0; p < 8192; ++p) per_head[1].push_back(p);  // all, in order
    for (int i = 0; i < 3000; ++i) per_head[2].push_back(rng() % 8192);
    for (int p = 8191; p >= 0; p -= 3) per_head[3].push_back(p);  // reversed
    // Head 0 selects nothing.
    OwnedFetchPlan plan = OwnedFetchPlan::PerHead(per_head);
    std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim));
    ASSERT_GT(dest.size() * 2, size_t{1} << 21);  // well above the split
    ASSERT_OK(store.Gather(id, 0, plan.view(), absl::MakeSpan(dest)));
    EXPECT_EQ(dest, Expected(9, g, 0, plan));
    EXPECT_EQ(store.GetSequenceStats(id)->fetched_rows,
              static_cast<int64_t>(plan.indices.size()));

    // The last task's range names a position past the end, an earlier one
    // a negative position: the earlier error is the answer.
    plan.indices.back() = 9000;
    EXPECT_CODE(store.Gather(id, 0, plan.view(), absl::MakeSpan(dest)),
                kOutOfRange);
    plan.indices[plan.head_offsets[2] + 5] = -1;
    EXPECT_CODE(store.Gather(id, 0, plan.view(), absl::MakeSpan(dest)),
                kInvalidArgument);
    const SequenceStats stats = *store.GetSequenceStats(id);
    EXPECT_EQ(stats.fetches, 1);
    EXPECT_EQ(stats.fetched_rows, static_cast<int64_t>(plan.indices.size()));
  }
}

// A prefill's large append is copied by the pool's threads, a range of KV
// heads each (five heads over three threads: uneven ranges), in blocks of
// several layers and continuing a layer already started: every row lands
// where one thread puts it, and a small append after it too.
TEST(KvStoreTest, LargeAppendsSplitAcrossThreadsAreBitExact) {
  const SequenceGeometry g = Geo(2, 5, 64, 9000);
  const size_t block_bytes = 2 * size_t{4096} * g.n_kv_heads * g.head_dim * 2;
  ASSERT_GT(block_bytes, StoredSequence::kAppendSplitBytes);
  for (int threads : {1, 3}) {
    SCOPED_TRACE(threads);
    KvStoreOptions options;
    options.gather_threads = threads;
    KvStore store(options);
    const SequenceId id = *store.Open(g);
    Block head = MakeBlock(5, g, 0, 2, 0, 100);
    ASSERT_OK(store.Append(id, head.block).status());
    Block big = MakeBlock(5, g, 0, 2, 100, 4096);
    ASSERT_OK(store.Append(id, big.block).status());
    Block one = MakeBlock(5, g, 0, 2, 4196, 1);
    ASSERT_OK(store.Append(id, one.block).status());
    ExpectAllRows(store, id, 5, g, 4197);
    EXPECT_EQ(store.GetSequenceStats(id)->present_rows,
              int64_t{2} * g.n_kv_heads * 4197);
  }
}

// Fetches are logged and applied to the statistics later: when the log
// outgrows its bound, before statistics are read and before an append
// that evicts. Every fetch counts once, with its own clock tick, and LRU
// picks its victim from the statistics as they would be had each fetch
// been counted at once.
TEST(KvStoreTest, LoggedFetchesCountInOrder) {
  KvStoreOptions options;
  options.eviction = EvictionPolicy::kLru;
  KvStore store(options);
  const SequenceGeometry g = Geo(1, 1, 2, 100);
  const SequenceId id = *store.Open(g);
  Block b = MakeBlock(4, g, 0, 1, 0, 100);
  ASSERT_TRUE(store.Append(id, b.block).ok());
  std::vector<int32_t> early;
  for (int p = 0; p < 50; ++p) early.push_back(p);
  const OwnedFetchPlan many = OwnedFetchPlan::SameForAllHeads(1, early);
  std::vector<uint16_t> dest(FetchElements(many.view(), g.head_dim));
  // 3,000 x 50 logged positions: more than the log holds before applying.
  for (int i = 0; i < 3000; ++i) {
    ASSERT_OK(store.Gather(id, 0, many.view(), absl::MakeSpan(dest)));
  }
  // Position 7 fetched last: of the older half (< 50), 7 is the most
  // recent, and 0 the least (tied with the rest at clock 3000, smallest).
  const OwnedFetchPlan seven = OwnedFetchPlan::SameForAllHeads(1, {7});
  ASSERT_OK(store.Gather(id, 0, seven.view(), absl::MakeSpan(dest)));
  const std::vector<TokenFetchStats> stats = *store.GetTokenStats(id, 0, 0);
  ASSERT_EQ(stats.size(), 100u);
  EXPECT_EQ(stats[0].fetch_count, 3000);
  EXPECT_EQ(stats[0].last_fetch, 3000u);
  EXPECT_EQ(stats[7].fetch_count, 3001);
  EXPECT_EQ(stats[7].last_fetch, 3001u);
  EXPECT_EQ(stats[60].fetch_count, 0);
  // Fetch 0 again (clock 3002): the victim is now 1.
  const OwnedFetchPlan zero = OwnedFetchPlan::SameForAllHeads(1, {0});
  ASSERT_OK(store.Gather(id, 0, zero.view(), absl::MakeSpan(dest)));
  Block next = MakeBlock(4, g, 0, 1, 100, 1);
  absl::StatusOr<AppendResult> r = store.Append(id, next.block);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->evicted, ElementsAre(EvictedToken{0, 0, 1}));
  EXPECT_EQ(store.GetSequenceStats(id)->fetches, 3002);
}

// ---- Concurrency -----------------------------------------------------------

TEST(KvStoreConcurrencyTest, ManyThreadsOnManySequences) {
  KvStoreOptions options;
  options.eviction = EvictionPolicy::kLru;
  KvStore store(options);
  const SequenceGeometry g = Geo(4, 3, 16, 48);
  constexpr int kThreads = 8;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int round = 0; round < 3; ++round) {
        const uint32_t salt = 100 + t * 10 + round;
        auto id = store.Open(g);
        if (!id.ok()) {
          ++failures;
          return;
        }
        int length = 0;
        // Below capacity so every position stays fetchable.
        while (length < 40) {
          const int n = 1 + rng() % 5;
          Block b = MakeBlock(salt, g, 0, g.n_layers, length, n);
          if (!store.Append(*id, b.block).ok()) ++failures;
          length += n;
          for (int f = 0; f < 4; ++f) {
            std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
            for (auto& p : per_head) {
              for (int i = 0, k = rng() % 8; i < k; ++i) {
                p.push_back(rng() % length);
              }
            }
            OwnedFetchPlan plan = OwnedFetchPlan::PerHead(per_head);
            const int layer = rng() % g.n_layers;
            std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim));
            if (!store.Gather(*id, layer, plan.view(), absl::MakeSpan(dest))
                     .ok() ||
                dest != Expected(salt, g, layer, plan)) {
              ++failures;
            }
          }
        }
        if (!store.Close(*id).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store.GetStoreStats().open_sequences, 0);
  EXPECT_EQ(store.GetStoreStats().bytes_reserved, 0);
}

TEST(KvStoreConcurrencyTest, ReadersAndAWriterShareASequence) {
  KvStore store(KvStoreOptions{});
  const SequenceGeometry g = Geo(2, 2, 8, 4096);
  SequenceId id = *store.Open(g);
  Block first = MakeBlock(42, g, 0, g.n_layers, 0, 16);
  ASSERT_TRUE(store.Append(id, first.block).ok());
  std::atomic<int> length{16};
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 4; ++r) {
    readers.emplace_back([&, r] {
      std::mt19937 rng(r);
      while (!done.load()) {
        const int n = length.load();
        std::vector<int32_t> positions;
        for (int i = 0; i < 8; ++i) positions.push_back(rng() % n);
        OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, positions);
        std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim));
        const int layer = rng() % 2;
        if (!store.Gather(id, layer, plan.view(), absl::MakeSpan(dest)).ok() ||
            dest != Expected(42, g, layer, plan)) {
          ++failures;
        }
      }
    });
  }
  for (int t = 16; t < 400; ++t) {
    Block b = MakeBlock(42, g, 0, g.n_layers, t, 1);
    ASSERT_TRUE(store.Append(id, b.block).ok());
    length.store(t + 1);
  }
  done.store(true);
  for (auto& th : readers) th.join();
  EXPECT_EQ(failures.load(), 0);
  // Closing while nobody uses it, then gathers see NotFound.
  ASSERT_OK(store.Close(id));
}

// A clock the test moves by hand.
class FakeClock {
 public:
  absl::Time Now() const {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  std::function<absl::Time()> AsFunction() {
    return [this] { return Now(); };
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000000);
};

KvStoreOptions LeaseOptions(FakeClock& clock, absl::Duration lease) {
  KvStoreOptions o;
  o.lease_timeout = lease;
  o.clock = clock.AsFunction();
  return o;
}

TEST(LeaseTest, ExpiredSessionsSequencesAreClosedAndTheirBytesFreed) {
  FakeClock clock;
  KvStoreOptions o = LeaseOptions(clock, absl::Seconds(10));
  const SequenceGeometry g = Geo(2, 2, 8, 16);
  o.capacity_bytes = 3 * ReservedBytes(g);
  KvStore store(o);
  auto dead = store.OpenSession();
  auto live = store.OpenSession();
  ASSERT_TRUE(dead.ok() && live.ok());
  ASSERT_NE(*dead, *live);
  auto a = store.Open(g, *dead);
  auto b = store.Open(g, *dead);
  auto c = store.Open(g, *live);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  // Full: a fourth sequence does not fit.
  EXPECT_CODE(store.Open(g, *live).status(), kResourceExhausted);

  // `live` keeps renewing; `dead` stops.
  for (int i = 0; i < 4; ++i) {
    clock.Advance(absl::Seconds(4));
    ASSERT_OK(store.RenewSession(*live));
    std::vector<ExpiredSession> none = store.ExpireSessions();
    if (i < 2) {
      EXPECT_THAT(none, IsEmpty()) << "at " << 4 * (i + 1) << " s";
    }
  }
  // 16 s without a renewal: gone (the sweep after 12 s took it).
  EXPECT_EQ(store.GetStoreStats().open_sequences, 1);
  EXPECT_EQ(store.GetStoreStats().bytes_reserved, ReservedBytes(g));
  EXPECT_EQ(store.GetStoreStats().expired_sessions, 1);
  EXPECT_EQ(store.GetStoreStats().expired_sequences, 2);
  EXPECT_EQ(store.GetStoreStats().open_sessions, 1);
  EXPECT_EQ(store.GetStoreStats().lease_timeout_ms, 10000);
  Block blk = MakeBlock(1, g, 0, 2, 0, 1);
  EXPECT_CODE(store.Append(*a, blk.block).status(), kNotFound);
  EXPECT_CODE(store.Close(*b), kNotFound);
  EXPECT_CODE(store.RenewSession(*dead), kNotFound);
  EXPECT_CODE(store.Open(g, *dead).status(), kNotFound);
  // The live session's sequence is untouched and the capacity is back.
  ASSERT_OK(store.Append(*c, blk.block).status());
  EXPECT_TRUE(store.Open(g, *live).ok());
  EXPECT_TRUE(store.Open(g, *live).ok());
}

TEST(LeaseTest, ExpireSessionsReportsWhatItClosed) {
  FakeClock clock;
  KvStore store(LeaseOptions(clock, absl::Seconds(3)));
  const SequenceGeometry g = Geo(1, 1, 8, 8);
  auto session = store.OpenSession();
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(store.Open(g, *session).ok());
  ASSERT_TRUE(store.Open(g, *session).ok());
  auto closed = store.Open(g, *session);
  ASSERT_TRUE(closed.ok());
  ASSERT_OK(store.Close(*closed));  // closed by its client: not counted
  clock.Advance(absl::Seconds(3));
  EXPECT_THAT(store.ExpireSessions(), IsEmpty());  // exactly the lease: alive
  clock.Advance(absl::Milliseconds(1));
  std::vector<ExpiredSession> expired = store.ExpireSessions();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].session, *session);
  EXPECT_EQ(expired[0].sequences, 2);
  EXPECT_EQ(expired[0].bytes_freed, 2 * ReservedBytes(g));
  EXPECT_EQ(expired[0].idle, absl::Seconds(3) + absl::Milliseconds(1));
  EXPECT_THAT(store.ExpireSessions(), IsEmpty());
  EXPECT_EQ(store.GetStoreStats().open_sequences, 0);
  EXPECT_EQ(store.GetStoreStats().bytes_reserved, 0);
}

TEST(LeaseTest, ALateRenewalFindsTheSessionGoneEvenBeforeTheSweep) {
  FakeClock clock;
  KvStore store(LeaseOptions(clock, absl::Seconds(2)));
  const SequenceGeometry g = Geo(1, 1, 8, 8);
  auto session = store.OpenSession();
  ASSERT_TRUE(session.ok());
  auto seq = store.Open(g, *session);
  ASSERT_TRUE(seq.ok());
  clock.Advance(absl::Seconds(5));
  EXPECT_CODE(store.RenewSession(*session), kNotFound);
  EXPECT_CODE(store.Geometry(*seq).status(), kNotFound);
  EXPECT_EQ(store.GetStoreStats().expired_sequences, 1);
  EXPECT_THAT(store.ExpireSessions(), IsEmpty());
}

TEST(LeaseTest, SequencesWithoutASessionAndStoresWithoutLeasesNeverExpire) {
  FakeClock clock;
  KvStore leased(LeaseOptions(clock, absl::Seconds(1)));
  KvStore unleased(LeaseOptions(clock, absl::ZeroDuration()));
  const SequenceGeometry g = Geo(1, 1, 8, 8);
  auto free_seq = leased.Open(g);
  auto session = unleased.OpenSession();
  ASSERT_TRUE(free_seq.ok() && session.ok());
  auto owned = unleased.Open(g, *session);
  ASSERT_TRUE(owned.ok());
  clock.Advance(absl::Hours(1));
  EXPECT_THAT(leased.ExpireSessions(), IsEmpty());
  EXPECT_THAT(unleased.ExpireSessions(), IsEmpty());
  EXPECT_TRUE(leased.Geometry(*free_seq).ok());
  EXPECT_TRUE(unleased.Geometry(*owned).ok());
  EXPECT_OK_STATUS(unleased.RenewSession(*session));
}

TEST(LeaseTest, ClosingASessionClosesItsSequencesWithoutCountingAnExpiry) {
  FakeClock clock;
  KvStore store(LeaseOptions(clock, absl::Seconds(5)));
  const SequenceGeometry g = Geo(1, 1, 8, 8);
  auto session = store.OpenSession();
  auto other = store.OpenSession();
  ASSERT_TRUE(session.ok() && other.ok());
  auto a = store.Open(g, *session);
  auto b = store.Open(g, *session);
  auto kept = store.Open(g, *other);
  ASSERT_TRUE(a.ok() && b.ok() && kept.ok());
  ASSERT_OK(store.Close(*b));
  ASSERT_OK(store.CloseSession(*session));
  EXPECT_CODE(store.Geometry(*a).status(), kNotFound);
  EXPECT_TRUE(store.Geometry(*kept).ok());
  StoreStats stats = store.GetStoreStats();
  EXPECT_EQ(stats.open_sequences, 1);
  EXPECT_EQ(stats.open_sessions, 1);
  EXPECT_EQ(stats.bytes_reserved, ReservedBytes(g));
  EXPECT_EQ(stats.expired_sessions, 0);
  EXPECT_CODE(store.CloseSession(*session), kNotFound);
  EXPECT_CODE(store.RenewSession(*session), kNotFound);
  // A session past its lease expires (and is counted) rather than closes.
  clock.Advance(absl::Seconds(6));
  EXPECT_CODE(store.CloseSession(*other), kNotFound);
  stats = store.GetStoreStats();
  EXPECT_EQ(stats.expired_sessions, 1);
  EXPECT_EQ(stats.expired_sequences, 1);
  EXPECT_EQ(stats.open_sequences, 0);
}

TEST(LeaseTest, UnknownSessionsAndTheSessionLimit) {
  FakeClock clock;
  KvStoreOptions o = LeaseOptions(clock, absl::Seconds(1));
  o.max_sessions = 2;
  KvStore store(o);
  const SequenceGeometry g = Geo(1, 1, 8, 8);
  EXPECT_CODE(store.RenewSession(12345), kNotFound);
  EXPECT_CODE(store.Open(g, 12345).status(), kNotFound);
  EXPECT_EQ(store.GetStoreStats().open_sequences, 0);
  ASSERT_TRUE(store.OpenSession().ok());
  ASSERT_TRUE(store.OpenSession().ok());
  EXPECT_CODE(store.OpenSession().status(), kResourceExhausted);
  // Expired sessions make room.
  clock.Advance(absl::Seconds(2));
  EXPECT_EQ(store.ExpireSessions().size(), 2u);
  EXPECT_TRUE(store.OpenSession().ok());
}

TEST(LeaseTest, ConcurrentOpensRenewalsAndExpiriesKeepTheAccountsStraight) {
  FakeClock clock;
  KvStore store(LeaseOptions(clock, absl::Seconds(1)));
  const SequenceGeometry g = Geo(1, 1, 8, 8);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      while (!stop.load()) {
        auto session = store.OpenSession();
        if (!session.ok()) continue;
        for (int i = 0; i < 4; ++i) {
          auto seq = store.Open(g, *session);
          if (seq.ok() && i % 2 == 0) store.Close(*seq).IgnoreError();
          store.RenewSession(*session).IgnoreError();
        }
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < 200; ++i) {
      clock.Advance(absl::Milliseconds(300));
      store.ExpireSessions();
    }
    stop.store(true);
  });
  for (std::thread& t : threads) t.join();
  clock.Advance(absl::Seconds(2));
  store.ExpireSessions();
  const StoreStats stats = store.GetStoreStats();
  EXPECT_EQ(stats.open_sequences, 0);
  EXPECT_EQ(stats.open_sessions, 0);
  EXPECT_EQ(stats.bytes_reserved, 0);
  EXPECT_GT(stats.expired_sequences, 0);
}

}  // namespace
}  // namespace infinigen::kv_memory_service

namespace infinigen::kv_memory_service {
namespace {

// One-sided reads: GetDirectRows shows the rows where Gather finds them
// ([layer][kv_head][slot][head_dim], a position at its own slot), and a
// fetch noted with NoteFetched leaves the store exactly as the same
// gather does (statistics, token counts); bad plans change nothing.
TEST(KvStoreDirectRows, ReadInPlaceAndNotedLikeAGather) {
  const SequenceGeometry g = Geo(3, 2, 8, 20);
  KvStore gathered(KvStoreOptions{}), noted(KvStoreOptions{});
  auto a = gathered.Open(g);
  auto b = noted.Open(g);
  ASSERT_OK(a.status());
  ASSERT_OK(b.status());
  Block block = MakeBlock(5, g, 0, 3, 0, 12);
  ASSERT_TRUE(gathered.Append(*a, block.block).ok());
  ASSERT_TRUE(noted.Append(*b, block.block).ok());

  auto rows = noted.GetDirectRows(*b);
  ASSERT_OK(rows.status());
  EXPECT_EQ(rows->max_tokens, 20);
  EXPECT_EQ(rows->layer_values, size_t{2} * 20 * 8);
  for (int l = 0; l < 3; ++l) {
    for (int h = 0; h < 2; ++h) {
      for (int pos = 0; pos < 12; ++pos) {
        for (int d = 0; d < 8; ++d) {
          const size_t at = l * rows->layer_values + (h * 20 + pos) * 8 + d;
          ASSERT_EQ(rows->k[at], testdata::RowValue(5, l, h, pos, d, 0));
          ASSERT_EQ(rows->v[at], testdata::RowValue(5, l, h, pos, d, 1));
        }
      }
    }
  }

  const OwnedFetchPlan plans[] = {
      OwnedFetchPlan::SameForAllHeads(2, {3, 0, 7, 7}),
      OwnedFetchPlan::SameForAllHeads(2, {11}),
      OwnedFetchPlan{{1, 2, 5}, {0, 0, 3}},  // head 0 reads nothing
  };
  for (int l = 0; l < 3; ++l) {
    for (const OwnedFetchPlan& plan : plans) {
      std::vector<uint16_t> dest(FetchElements(plan.view(), g.head_dim));
      ASSERT_OK(gathered.Gather(*a, l, plan.view(), absl::MakeSpan(dest)));
      ASSERT_OK(noted.NoteFetched(*b, l, plan.view()));
    }
  }
  ExpectSame(Take(gathered, *a, g), Take(noted, *b, g));

  // Bad plans are refused and change nothing.
  const Snapshot before = Take(noted, *b, g);
  EXPECT_CODE(noted.NoteFetched(*b, 0, OwnedFetchPlan::SameForAllHeads(2, {12})
                                           .view()),
              kOutOfRange);
  EXPECT_CODE(noted.NoteFetched(*b, 0, OwnedFetchPlan::SameForAllHeads(2, {-1})
                                           .view()),
              kInvalidArgument);
  EXPECT_CODE(noted.NoteFetched(*b, 3, plans[0].view()), kInvalidArgument);
  EXPECT_CODE(noted.NoteFetched(*b, 0, OwnedFetchPlan{{1}, {0, 1}}.view()),
              kInvalidArgument);  // one head's offsets for two heads
  ExpectSame(before, Take(noted, *b, g));

  // Once a head evicts, positions leave their slots: not readable in place.
  Block more = MakeBlock(5, g, 0, 3, 12, 10);
  ASSERT_TRUE(noted.Append(*b, more.block).ok());
  EXPECT_CODE(noted.NoteFetched(*b, 0, OwnedFetchPlan::SameForAllHeads(2, {21})
                                           .view()),
              kFailedPrecondition);

  ASSERT_OK(noted.Close(*b));
  EXPECT_CODE(noted.GetDirectRows(*b).status(), kNotFound);
  EXPECT_CODE(noted.NoteFetched(*b, 0, plans[0].view()), kNotFound);
}

// A reader that fetches only the rows it does not hold and notes the rest
// (NoteHeld) leaves the store exactly as fetching every row does: the same
// statistics, token counts and clocks, and once the heads evict (LRU and
// counter rank by those) the same victims, with each layer's note arriving
// after the next layer's gather. A note names positions evicted since
// without error and counts only the present ones; bad plans are refused
// and change nothing.
TEST(KvStoreDirectRows, HeldNotesLeaveTheStoreAsFetchingEveryRow) {
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kCounter}) {
    SCOPED_TRACE(EvictionPolicyName(policy));
    const SequenceGeometry g = Geo(3, 2, 4, 12);
    KvStoreOptions o;
    o.eviction = policy;
    KvStore every(o), held(o);
    auto a = every.Open(g);
    auto b = held.Open(g);
    ASSERT_OK(a.status());
    ASSERT_OK(b.status());
    int length = 0;
    long evictions = 0;
    auto append = [&](int n) {
      Block block = MakeBlock(9, g, 0, g.n_layers, length, n);
      auto ra = every.Append(*a, block.block);
      auto rb = held.Append(*b, block.block);
      ASSERT_OK(ra.status());
      ASSERT_OK(rb.status());
      EXPECT_EQ(ra->evicted, rb->evicted) << "appending " << length;
      evictions += static_cast<long>(ra->evicted.size());
      length += n;
    };
    append(10);
    std::mt19937 rng(11);
    const OwnedFetchPlan some = OwnedFetchPlan::PerHead({{1}, {2}});
    for (int step = 0; step < 40; ++step) {
      std::vector<OwnedFetchPlan> all, misses, hits;
      for (int l = 0; l < g.n_layers; ++l) {
        std::vector<std::vector<int32_t>> a_rows(2), m_rows(2), h_rows(2);
        for (int h = 0; h < g.n_kv_heads; ++h) {
          auto present = every.GetTokenStats(*a, l, h);
          ASSERT_OK(present.status());
          for (int i = 0, k = static_cast<int>(rng() % 6); i < k; ++i) {
            const int32_t pos = (*present)[rng() % present->size()].position;
            a_rows[h].push_back(pos);
            (rng() % 2 ? h_rows : m_rows)[h].push_back(pos);
          }
        }
        all.push_back(OwnedFetchPlan::PerHead(a_rows));
        misses.push_back(OwnedFetchPlan::PerHead(m_rows));
        hits.push_back(OwnedFetchPlan::PerHead(h_rows));
      }
      for (int l = 0; l < g.n_layers; ++l) {
        std::vector<uint16_t> dest(FetchElements(all[l].view(), g.head_dim));
        ASSERT_OK(every.Gather(*a, l, all[l].view(), absl::MakeSpan(dest)));
        ASSERT_OK(held.Gather(*b, l, misses[l].view(), absl::MakeSpan(dest)));
        if (l > 0) ASSERT_OK(held.NoteHeld(*b, l - 1, hits[l - 1].view()));
      }
      ASSERT_OK(held.NoteHeld(*b, g.n_layers - 1, hits.back().view()));
      append(1);
    }
    EXPECT_GT(evictions, 0);
    ExpectSame(Take(every, *a, g), Take(held, *b, g));

    // Position 0 is long gone: a note of it counts its present row alone.
    auto head0 = held.GetTokenStats(*b, 0, 0);
    ASSERT_OK(head0.status());
    ASSERT_NE(head0->front().position, 0);
    const int32_t kept = head0->back().position;
    const int64_t rows_before = held.GetStoreStats().fetched_rows;
    ASSERT_OK(held.NoteHeld(
        *b, 0, OwnedFetchPlan::PerHead({{0, kept}, {}}).view()));
    EXPECT_EQ(held.GetStoreStats().fetched_rows, rows_before + 1);
    EXPECT_EQ(held.GetTokenStats(*b, 0, 0)->back().fetch_count,
              head0->back().fetch_count + 1);

    const Snapshot before = Take(held, *b, g);
    EXPECT_CODE(held.NoteHeld(*b, 0,
                              OwnedFetchPlan::PerHead({{length}, {}}).view()),
                kOutOfRange);
    EXPECT_CODE(
        held.NoteHeld(*b, 0, OwnedFetchPlan::PerHead({{-1}, {}}).view()),
        kInvalidArgument);
    EXPECT_CODE(held.NoteHeld(*b, 3, some.view()), kInvalidArgument);
    EXPECT_CODE(held.NoteHeld(*b, 0, OwnedFetchPlan{{1}, {0, 1}}.view()),
                kInvalidArgument);
    ExpectSame(before, Take(held, *b, g));
    ASSERT_OK(held.Close(*b));
    EXPECT_CODE(held.NoteHeld(*b, 0, some.view()), kNotFound);
  }
}

// A whole layer read in place and noted by its head counts alone
// (NoteLeadingFetched) leaves the store as the note of the same positions
// does: statistics, token counts and clocks, whether the note arrives
// before or after later appends, mixed with per-row notes, and the
// victims once the heads evict (LRU and counter rank by those counts).
// Bad notes are refused and change nothing.
TEST(KvStoreDirectRows, LeadingNotesCountAsTheirPlans) {
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kCounter}) {
    SCOPED_TRACE(EvictionPolicyName(policy));
    const SequenceGeometry g = Geo(2, 2, 8, 24);
    KvStoreOptions options;
    options.eviction = policy;
    KvStore rows(options), leading(options);
    auto a = rows.Open(g);
    auto b = leading.Open(g);
    ASSERT_OK(a.status());
    ASSERT_OK(b.status());
    int length = 0;
    auto append = [&](int n) {
      Block block = MakeBlock(3, g, 0, g.n_layers, length, n);
      ASSERT_TRUE(rows.Append(*a, block.block).ok());
      ASSERT_TRUE(leading.Append(*b, block.block).ok());
      length += n;
    };
    // Head h read its first counts[h] positions.
    auto note = [&](int layer, std::vector<int32_t> counts) {
      std::vector<std::vector<int32_t>> per_head;
      std::vector<int32_t> offsets = {0};
      for (int32_t c : counts) {
        per_head.emplace_back();
        for (int32_t p = 0; p < c; ++p) per_head.back().push_back(p);
        offsets.push_back(offsets.back() + c);
      }
      ASSERT_OK(rows.NoteFetched(*a, layer,
                                 OwnedFetchPlan::PerHead(per_head).view()));
      ASSERT_OK(leading.NoteLeadingFetched(*b, layer, offsets));
    };
    auto both = [&](int layer, const OwnedFetchPlan& plan) {
      ASSERT_OK(rows.NoteFetched(*a, layer, plan.view()));
      ASSERT_OK(leading.NoteFetched(*b, layer, plan.view()));
    };
    append(10);
    note(0, {10, 10});
    note(1, {10, 4});  // head 1 read fewer
    both(0, OwnedFetchPlan::SameForAllHeads(2, {9, 2}));
    append(1);
    note(0, {10, 10});  // planned before the append: the new row unread
    append(2);
    note(0, {13, 13});
    note(1, {0, 13});
    both(1, OwnedFetchPlan::SameForAllHeads(2, {12, 0, 5}));
    note(0, {11, 13});
    ExpectSame(Take(rows, *a, g), Take(leading, *b, g));

    const Snapshot before = Take(leading, *b, g);
    const std::vector<int32_t> past = {0, 14, 28};  // length 13
    EXPECT_CODE(leading.NoteLeadingFetched(*b, 0, past), kOutOfRange);
    EXPECT_CODE(leading.NoteLeadingFetched(*b, 0, {0, 5, 3}),
                kInvalidArgument);  // decreasing
    EXPECT_CODE(leading.NoteLeadingFetched(*b, 0, {1, 5, 9}),
                kInvalidArgument);
    EXPECT_CODE(leading.NoteLeadingFetched(*b, 0, {0, 5}), kInvalidArgument);
    EXPECT_CODE(leading.NoteLeadingFetched(*b, 2, {0, 5, 10}),
                kInvalidArgument);  // no layer 2
    ExpectSame(before, Take(leading, *b, g));

    // Past max_tokens the heads evict by the counts: the same victims.
    append(11);  // full, not yet evicting
    note(1, {24, 24});
    both(0, OwnedFetchPlan::SameForAllHeads(2, {20, 23}));
    note(0, {24, 17});
    append(6);
    ExpectSame(Take(rows, *a, g), Take(leading, *b, g));
    // An evicting head's slots no longer hold their positions.
    EXPECT_CODE(leading.NoteLeadingFetched(*b, 0, {0, 5, 10}),
                kFailedPrecondition);
    ASSERT_OK(leading.Close(*b));
    EXPECT_CODE(leading.NoteLeadingFetched(*b, 0, {0, 5, 10}), kNotFound);
  }
}

// One-sided reads from another process: ShareRows hands the owner
// read-only descriptors of the memfds holding its rows (GetDirectRows'
// layout; a writable mapping through them is refused), nobody else; at
// most max_shared_sequences sequences at once, the rest in private memory.
TEST(KvStoreDirectRows, SharedRowsAreTheOwnersAndReadOnly) {
  const SequenceGeometry g = Geo(2, 2, 8, 16);
  KvStoreOptions options;
  options.max_shared_sequences = 1;
  KvStore store(options);
  auto alice = store.OpenSession();
  auto bob = store.OpenSession();
  ASSERT_OK(alice.status());
  ASSERT_OK(bob.status());
  auto a = store.Open(g, *alice);
  ASSERT_OK(a.status());
  Block block = MakeBlock(9, g, 0, 2, 0, 10);
  ASSERT_TRUE(store.Append(*a, block.block).ok());

  EXPECT_CODE(store.ShareRows(*a, *bob).status(), kNotFound);
  auto shared = store.ShareRows(*a, *alice);
  ASSERT_OK(shared.status());
  EXPECT_EQ(shared->layer_values, size_t{2} * 16 * 8);
  EXPECT_EQ(shared->max_tokens, 16);
  const size_t bytes = 2 * shared->layer_values * sizeof(uint16_t);
  for (int fd : {shared->k_fd, shared->v_fd}) {
    EXPECT_EQ(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0),
              MAP_FAILED);
    EXPECT_EQ(errno, EACCES);
  }
  void* k = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, shared->k_fd, 0);
  void* v = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, shared->v_fd, 0);
  ASSERT_NE(k, MAP_FAILED);
  ASSERT_NE(v, MAP_FAILED);
  close(shared->k_fd);
  close(shared->v_fd);
  const auto* kr = static_cast<const uint16_t*>(k);
  const auto* vr = static_cast<const uint16_t*>(v);
  // Rows appended after the mapping show through it.
  Block more = MakeBlock(9, g, 0, 2, 10, 3);
  ASSERT_TRUE(store.Append(*a, more.block).ok());
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      for (int pos = 0; pos < 13; ++pos) {
        for (int d = 0; d < 8; ++d) {
          const size_t at = l * shared->layer_values + (h * 16 + pos) * 8 + d;
          ASSERT_EQ(kr[at], testdata::RowValue(9, l, h, pos, d, 0));
          ASSERT_EQ(vr[at], testdata::RowValue(9, l, h, pos, d, 1));
        }
      }
    }
  }
  // One shared sequence at a time: the next is private until one closes.
  auto b = store.Open(g, *alice);
  ASSERT_OK(b.status());
  EXPECT_CODE(store.ShareRows(*b, *alice).status(), kFailedPrecondition);
  ASSERT_OK(store.Close(*a));
  ASSERT_OK(store.Close(*b));
  // The mapping outlives the sequence on the node (the reader unmaps).
  EXPECT_EQ(kr[0], testdata::RowValue(9, 0, 0, 0, 0, 0));
  munmap(k, bytes);
  munmap(v, bytes);
  auto c = store.Open(g, *alice);
  ASSERT_OK(c.status());
  auto again = store.ShareRows(*c, *alice);
  ASSERT_OK(again.status());
  close(again->k_fd);
  close(again->v_fd);
  // Without max_shared_sequences nothing is shared.
  KvStore private_store(KvStoreOptions{});
  auto d = private_store.Open(g);
  ASSERT_OK(d.status());
  EXPECT_CODE(private_store.ShareRows(*d, 0).status(), kFailedPrecondition);
}

// The store's stats once at most `sequences` closed sequences stay pinned:
// the kernel reports a freed inode a jiffy or so after its last holder
// lets go.
StoreStats UntilUnpinned(KvStore& store, int64_t sequences = 0) {
  StoreStats st = store.GetStoreStats();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (st.pinned_sequences > sequences && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    st = store.GetStoreStats();
  }
  return st;
}

// A shared descriptor reopened writable through /proc (a memfd's inode is
// mode 0777) can neither write, resize nor punch holes in the node's rows:
// they are sealed before any descriptor leaves the store.
TEST(KvStoreDirectRows, SharedRowsCannotBeChangedThroughAReopenedDescriptor) {
  const SequenceGeometry g = Geo(1, 1, 8, 16);
  KvStoreOptions options;
  options.max_shared_sequences = 1;
  KvStore store(options);
  auto a = store.Open(g);
  ASSERT_OK(a.status());
  Block block = MakeBlock(3, g, 0, 1, 0, 4);
  ASSERT_TRUE(store.Append(*a, block.block).ok());
  auto shared = store.ShareRows(*a, 0);
  ASSERT_OK(shared.status());
  const int writable =
      open(absl::StrCat("/proc/self/fd/", shared->k_fd).c_str(), O_RDWR);
  ASSERT_GE(writable, 0) << "a memfd may be reopened writable: " << errno;
  const uint16_t junk[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(pwrite(writable, junk, sizeof(junk), 0), -1);
  EXPECT_EQ(ftruncate(writable, 0), -1);
  EXPECT_EQ(ftruncate(writable, 1 << 20), -1);
  EXPECT_EQ(fallocate(writable, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                      4096),
            -1);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, writable,
                 0),
            MAP_FAILED);
  EXPECT_EQ(fcntl(writable, F_ADD_SEALS, F_SEAL_WRITE), -1);
  close(writable);
  // The node still writes its own rows, and reads them back unchanged.
  Block more = MakeBlock(3, g, 0, 1, 4, 2);
  ASSERT_TRUE(store.Append(*a, more.block).ok());
  ExpectAllRows(store, *a, 3, g, 6);
  close(shared->k_fd);
  close(shared->v_fd);
}

// Rows a reader still maps after their sequence's close stay committed:
// the store counts them as pinned against capacity_bytes until the reader
// lets go, and caps the closed sequences one session may keep pinned.
TEST(KvStoreDirectRows, RowsHeldAfterCloseArePinnedUntilReleased) {
  const SequenceGeometry g = Geo(1, 1, 256, 1024);  // 1 MiB of rows
  const int64_t reserved = ReservedBytes(g);
  KvStoreOptions options;
  options.max_shared_sequences = 8;
  options.max_pinned_sequences = 1;
  options.spare_rows_per_session = 0;  // each close lets the rows go
  options.capacity_bytes = reserved + reserved / 2;
  KvStore store(options);
  auto session = store.OpenSession();
  ASSERT_OK(session.status());
  auto a = store.Open(g, *session);
  ASSERT_OK(a.status());
  Block block = MakeBlock(5, g, 0, 1, 0, 1024);
  ASSERT_TRUE(store.Append(*a, block.block).ok());
  auto shared = store.ShareRows(*a, *session);
  ASSERT_OK(shared.status());
  const size_t bytes = reserved / 2;
  void* k = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, shared->k_fd, 0);
  ASSERT_NE(k, MAP_FAILED);
  close(shared->k_fd);  // the mapping alone holds K; V's descriptor is kept
  EXPECT_EQ(store.GetStoreStats().pinned_bytes, 0);  // open: reserved
  ASSERT_OK(store.Close(*a));

  StoreStats st = store.GetStoreStats();
  EXPECT_EQ(st.bytes_reserved, 0);
  EXPECT_EQ(st.pinned_sequences, 1);
  EXPECT_GE(st.pinned_bytes, reserved);  // both halves, every page written
  // The pinned bytes leave no room for another sequence of the size.
  absl::StatusOr<SequenceId> refused = store.Open(g, *session);
  EXPECT_CODE(refused.status(), kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              testing::HasSubstr("still held by the clients"));

  // V let go: K's mapping still pins its half.
  close(shared->v_fd);
  st = store.GetStoreStats();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (st.pinned_bytes >= reserved && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    st = store.GetStoreStats();
  }
  EXPECT_EQ(st.pinned_sequences, 1);
  EXPECT_GE(st.pinned_bytes, reserved / 2);
  EXPECT_LT(st.pinned_bytes, reserved);
  // A small sequence fits beside it, but the session keeps its limit of
  // one pinned sequence: its rows are not shared.
  auto small = store.Open(Geo(1, 1, 8, 16), *session);
  ASSERT_OK(small.status());
  absl::StatusOr<KvStore::SharedRows> over = store.ShareRows(*small, *session);
  EXPECT_CODE(over.status(), kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()),
              testing::HasSubstr("--shm_max_pinned_sequences=1"));

  munmap(k, bytes);
  st = UntilUnpinned(store);
  EXPECT_EQ(st.pinned_bytes, 0);
  EXPECT_EQ(st.pinned_sequences, 0);
  auto shared_small = store.ShareRows(*small, *session);
  ASSERT_OK(shared_small.status());
  close(shared_small->k_fd);
  close(shared_small->v_fd);
  ASSERT_OK(store.Close(*small));
  // Released before its close, the small sequence pins nothing.
  EXPECT_EQ(UntilUnpinned(store).pinned_bytes, 0);
  ASSERT_OK(store.Open(g, *session).status());
}

// A session that expires with its rows still mapped leaves them pinned:
// the expiry says so, and the bytes stay counted until released.
TEST(KvStoreDirectRows, AnExpiredSessionsMappedRowsStayPinned) {
  const SequenceGeometry g = Geo(1, 1, 64, 64);
  absl::Time now = absl::UnixEpoch();
  KvStoreOptions options;
  options.max_shared_sequences = 4;
  options.lease_timeout = absl::Seconds(1);
  options.clock = [&now] { return now; };
  KvStore store(options);
  auto session = store.OpenSession();
  ASSERT_OK(session.status());
  auto a = store.Open(g, *session);
  ASSERT_OK(a.status());
  Block block = MakeBlock(6, g, 0, 1, 0, 64);
  ASSERT_TRUE(store.Append(*a, block.block).ok());
  auto shared = store.ShareRows(*a, *session);
  ASSERT_OK(shared.status());
  now += absl::Seconds(2);
  std::vector<ExpiredSession> expired = store.ExpireSessions();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].sequences, 1);
  EXPECT_EQ(expired[0].shared, 1);
  EXPECT_GT(store.GetStoreStats().pinned_bytes, 0);
  close(shared->k_fd);
  close(shared->v_fd);
  const StoreStats st = UntilUnpinned(store);
  EXPECT_EQ(st.pinned_bytes, 0);
  EXPECT_EQ(st.pinned_sequences, 0);
}

// The inode of a shared descriptor, which is then closed.
ino_t InodeOf(int fd) {
  struct stat st {};
  EXPECT_EQ(fstat(fd, &st), 0);
  close(fd);
  return st.st_ino;
}

// A session's closed shared sequence stays as its spare: the session's
// next sequence of the same size opens in the same memfds (a client that
// kept them mapped maps nothing again), reads its own rows there, and the
// spare counts against capacity meanwhile. Another session's sequence, one
// of another size, and a sequence whose rows were never shared take fresh
// rows; the session's end lets its spare go.
TEST(KvStoreSpareRows, ASessionsNextSequenceOpensInItsClosedSequencesRows) {
  const SequenceGeometry g = Geo(2, 2, 8, 16);
  KvStoreOptions options;
  options.max_shared_sequences = 8;
  KvStore store(options);
  auto alice = store.OpenSession();
  auto bob = store.OpenSession();
  ASSERT_OK(alice.status());
  ASSERT_OK(bob.status());
  auto a = store.Open(g, *alice);
  ASSERT_OK(a.status());
  Block block = MakeBlock(11, g, 0, 2, 0, 16);
  ASSERT_TRUE(store.Append(*a, block.block).ok());
  auto shared = store.ShareRows(*a, *alice);
  ASSERT_OK(shared.status());
  const ino_t a_k = InodeOf(shared->k_fd);
  const ino_t a_v = InodeOf(shared->v_fd);
  ASSERT_OK(store.Close(*a));
  StoreStats st = store.GetStoreStats();
  EXPECT_EQ(st.spare_sequences, 1);
  EXPECT_EQ(st.spare_bytes, ReservedBytes(g));
  EXPECT_EQ(st.bytes_reserved, 0);
  EXPECT_EQ(st.pinned_sequences, 0);

  // Bob's sequence of the same size does not land in alice's rows.
  auto other = store.Open(g, *bob);
  ASSERT_OK(other.status());
  auto other_shared = store.ShareRows(*other, *bob);
  ASSERT_OK(other_shared.status());
  EXPECT_NE(InodeOf(other_shared->k_fd), a_k);
  close(other_shared->v_fd);
  EXPECT_EQ(store.GetStoreStats().spare_sequences, 1);

  // Alice's does, and reads its own rows: fewer of them, another salt.
  auto b = store.Open(g, *alice);
  ASSERT_OK(b.status());
  st = store.GetStoreStats();
  EXPECT_EQ(st.spare_sequences, 0);
  EXPECT_EQ(st.reused_row_sequences, 1);
  EXPECT_EQ(st.bytes_reserved, 2 * ReservedBytes(g));
  auto b_shared = store.ShareRows(*b, *alice);
  ASSERT_OK(b_shared.status());
  EXPECT_EQ(InodeOf(b_shared->k_fd), a_k);
  EXPECT_EQ(InodeOf(b_shared->v_fd), a_v);
  Block b_rows = MakeBlock(12, g, 0, 2, 0, 5);
  ASSERT_TRUE(store.Append(*b, b_rows.block).ok());
  ExpectAllRows(store, *b, 12, g, 5);
  // Past its own length, the old rows there are not its to read.
  std::vector<uint16_t> dest(64);
  EXPECT_CODE(store.Gather(*b, 0,
                           OwnedFetchPlan::SameForAllHeads(2, {5}).view(),
                           absl::MakeSpan(dest)),
              kOutOfRange);

  // Another size, or rows never shared: fresh rows, no spare taken.
  ASSERT_OK(store.Close(*b));
  auto small = store.Open(Geo(1, 1, 8, 16), *alice);
  ASSERT_OK(small.status());
  EXPECT_EQ(store.GetStoreStats().reused_row_sequences, 1);
  EXPECT_EQ(store.GetStoreStats().spare_sequences, 1);
  auto c = store.Open(g, *alice);  // takes b's rows
  ASSERT_OK(c.status());
  auto fresh = store.Open(g, *alice);  // no spare left: fresh rows
  ASSERT_OK(fresh.status());
  ASSERT_OK(store.Close(*fresh));  // never shared: nothing kept
  st = store.GetStoreStats();
  EXPECT_EQ(st.reused_row_sequences, 2);
  EXPECT_EQ(st.spare_sequences, 0);
  // b's rows were given out: c's close keeps them again, without a share.
  ASSERT_OK(store.Close(*c));
  EXPECT_EQ(store.GetStoreStats().spare_sequences, 1);

  // The session's end lets its spare go.
  ASSERT_OK(store.CloseSession(*alice));
  st = UntilUnpinned(store);
  EXPECT_EQ(st.spare_sequences, 0);
  EXPECT_EQ(st.spare_bytes, 0);
  EXPECT_EQ(st.pinned_sequences, 0);
}

// Spares give way: an Open that needs their room lets the oldest go, and
// at most spare_rows_per_session stay per session (0: none).
TEST(KvStoreSpareRows, SparesGiveWayToOpensThatNeedTheRoom) {
  const SequenceGeometry g = Geo(1, 1, 64, 256);
  const int64_t reserved = ReservedBytes(g);
  for (const int per_session : {1, 0}) {
    SCOPED_TRACE(per_session);
    KvStoreOptions options;
    options.max_shared_sequences = 8;
    options.spare_rows_per_session = per_session;
    options.capacity_bytes = 2 * reserved;
    KvStore store(options);
    auto alice = store.OpenSession();
    auto bob = store.OpenSession();
    ASSERT_OK(alice.status());
    ASSERT_OK(bob.status());
    std::vector<SequenceId> shared_and_closed;
    for (int i = 0; i < 2; ++i) {
      auto a = store.Open(g, *alice);
      ASSERT_OK(a.status());
      auto shared = store.ShareRows(*a, *alice);
      ASSERT_OK(shared.status());
      close(shared->k_fd);
      close(shared->v_fd);
      shared_and_closed.push_back(*a);
    }
    for (SequenceId a : shared_and_closed) ASSERT_OK(store.Close(a));
    EXPECT_EQ(store.GetStoreStats().spare_sequences, per_session);
    EXPECT_EQ(store.GetStoreStats().spare_bytes, per_session * reserved);
    // Bob needs the whole capacity: alice's spare goes.
    auto b1 = store.Open(g, *bob);
    auto b2 = store.Open(g, *bob);
    ASSERT_OK(b1.status());
    ASSERT_OK(b2.status());
    const StoreStats st = UntilUnpinned(store);
    EXPECT_EQ(st.spare_sequences, 0);
    EXPECT_EQ(st.bytes_reserved, 2 * reserved);
    EXPECT_EQ(st.pinned_bytes, 0);
    EXPECT_CODE(store.Open(g, *alice).status(), kResourceExhausted);
  }
}

}  // namespace
}  // namespace infinigen::kv_memory_service
