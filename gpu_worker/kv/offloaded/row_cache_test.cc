#include "gpu_worker/kv/offloaded/row_cache.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace infinigen::gpu_worker::offloaded {
namespace {

using kv_memory_service::OwnedFetchPlan;

constexpr int kLayers = 2, kHeads = 2, kTokens = 16, kWidth = 3;

// The stored K value of (layer, head, position, column); V's is K's plus
// 5000.
uint16_t KValue(int layer, int g, int p, int col) {
  return static_cast<uint16_t>(1000 * layer + 100 * g + 4 * p + col);
}

// What the node's gather writes for `misses`: K rows of every head in
// plan order, then V rows.
std::vector<uint16_t> Gather(int layer, const OwnedFetchPlan& misses) {
  const size_t n = misses.indices.size();
  std::vector<uint16_t> out(2 * n * kWidth);
  for (int g = 0; g < kHeads; ++g) {
    for (int i = misses.head_offsets[g]; i < misses.head_offsets[g + 1];
         ++i) {
      for (int c = 0; c < kWidth; ++c) {
        const uint16_t k = KValue(layer, g, misses.indices[i], c);
        out[i * kWidth + c] = k;
        out[(n + i) * kWidth + c] = k + 5000;
      }
    }
  }
  return out;
}

// Splits `plan`, fills the misses as the node would and checks that every
// planned row reads back as the true K and V in plan order; returns hits.
long Step(RowCache& cache, int layer, const OwnedFetchPlan& plan,
          int cached_tokens, std::vector<uint16_t>& fetched) {
  absl::StatusOr<RowCache::Counts> counts =
      cache.Split(layer, plan.view(), cached_tokens);
  EXPECT_TRUE(counts.ok()) << counts.status();
  if (!counts.ok()) return -1;
  fetched = Gather(layer, cache.misses(layer));
  cache.Fill(layer, fetched.data());
  for (int g = 0; g < kHeads; ++g) {
    const RowCache::HeadRows h = cache.Head(layer, g, fetched.data());
    for (int t = plan.head_offsets[g]; t < plan.head_offsets[g + 1]; ++t) {
      const int local = t - plan.head_offsets[g];
      const int row = h.indices != nullptr ? h.indices[local] : local;
      for (int c = 0; c < kWidth; ++c) {
        EXPECT_EQ(h.k[row * kWidth + c], KValue(layer, g, plan.indices[t], c))
            << "layer " << layer << " head " << g << " plan row " << t;
        EXPECT_EQ(h.v[row * kWidth + c],
                  KValue(layer, g, plan.indices[t], c) + 5000);
      }
    }
  }
  return counts->hits;
}

TEST(RowCacheTest, FetchesOnlyTheRowsItDoesNotHold) {
  RowCache cache(kLayers, kHeads, kTokens, kWidth, 0.5);
  std::vector<uint16_t> fetched;
  const OwnedFetchPlan first = OwnedFetchPlan::PerHead({{0, 3, 5}, {1, 2}});
  EXPECT_EQ(Step(cache, 1, first, 16, fetched), 0);
  EXPECT_EQ(cache.misses(1).indices, first.indices);
  EXPECT_TRUE(cache.hits(1).indices.empty());

  // The next step keeps 3 and 5 of head 0 and 2 of head 1: only 7, 9 and
  // 4 move, and the rows read are in the new plan's order.
  const OwnedFetchPlan second = OwnedFetchPlan::PerHead({{5, 7, 3}, {9, 2, 4}});
  EXPECT_EQ(Step(cache, 1, second, 16, fetched), 3);
  EXPECT_EQ(cache.misses(1).indices, (std::vector<int32_t>{7, 9, 4}));
  EXPECT_EQ(cache.misses(1).head_offsets, (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(cache.hits(1).indices, (std::vector<int32_t>{5, 3, 2}));
  EXPECT_EQ(cache.hits(1).head_offsets, (std::vector<int32_t>{0, 2, 3}));
  // Layers are apart: layer 0 holds nothing.
  EXPECT_EQ(Step(cache, 0, second, 16, fetched), 0);
  EXPECT_EQ(cache.bytes(), (4 + 4 + 3 + 3) * 2 * kWidth * 2);
}

TEST(RowCacheTest, EvictsTheLeastRecentlySelectedNeverTheStepsOwn) {
  // A quarter of 2 heads x 16 tokens: 8 rows, which the first step fills.
  RowCache cache(1, kHeads, kTokens, kWidth, 0.25);
  std::vector<uint16_t> fetched;
  const std::vector<int32_t> h1 = {4, 5, 6, 7};  // head 1: always these
  auto plan = [&](std::vector<int32_t> h0) {
    return OwnedFetchPlan::PerHead({h0, h1});
  };
  EXPECT_EQ(Step(cache, 0, plan({0, 1, 2, 3}), 16, fetched), 0);
  EXPECT_EQ(Step(cache, 0, plan({2, 0}), 16, fetched), 2 + 4);
  // Full: head 0's least recent are 1, then 3; 8 takes 1's slot.
  EXPECT_EQ(Step(cache, 0, plan({8, 2}), 16, fetched), 1 + 4);
  EXPECT_EQ(Step(cache, 0, plan({3, 0, 2, 8}), 16, fetched), 4 + 4);
  // Three new rows take the slots of rows this step did not select, and
  // 2, selected again, stays.
  EXPECT_EQ(Step(cache, 0, plan({9, 2, 10, 11}), 16, fetched), 1 + 4);
  EXPECT_EQ(Step(cache, 0, plan({11, 10, 9, 2}), 16, fetched), 4 + 4);
  EXPECT_EQ(cache.bytes(), 8 * 2 * kWidth * 2);
}

// Slot arrays held elsewhere (a device's): SlotsOf says where each miss
// goes and where each planned row lies, a skipped head's among the
// misses; moving the misses there and reading by those slots gives the
// true rows, as the host cache's own arrays do.
TEST(RowCacheTest, SlotsOfPlaceRowsInArraysHeldElsewhere) {
  RowCache cache(1, kHeads, kTokens, kWidth, 0.25, RowCacheReplacement::kRecency,
                 /*hold_rows=*/false);
  EXPECT_EQ(cache.max_rows(), 8);
  std::vector<uint16_t> slot_k(cache.max_rows() * kWidth),
      slot_v(slot_k.size());
  long hits = 0;
  for (const OwnedFetchPlan& plan :
       {OwnedFetchPlan::PerHead({{0, 1, 2}, {4, 5}}),
        OwnedFetchPlan::PerHead({{2, 0, 9}, {5, 6}}),
        // Head 1 asks for more than its slots and the bound's rest: it
        // skips the cache and reads from the fetch.
        OwnedFetchPlan::PerHead({{9, 2}, {7, 8, 10, 11, 12, 13}}),
        OwnedFetchPlan::PerHead({{0, 9, 2}, {5, 6}})}) {
    auto counts = cache.Split(0, plan.view(), 16);
    ASSERT_TRUE(counts.ok()) << counts.status();
    hits += counts->hits;
    const OwnedFetchPlan& misses = cache.misses(0);
    const std::vector<uint16_t> fetched = Gather(0, misses);
    std::vector<int32_t> plan_slots(plan.indices.size()),
        miss_slots(misses.indices.size());
    cache.SlotsOf(0, plan_slots.data(), miss_slots.data());
    const size_t n = misses.indices.size();
    for (size_t i = 0; i < n; ++i) {
      if (miss_slots[i] < 0) continue;
      ASSERT_LT(miss_slots[i], cache.max_rows());
      std::copy_n(&fetched[i * kWidth], kWidth, &slot_k[miss_slots[i] * kWidth]);
      std::copy_n(&fetched[(n + i) * kWidth], kWidth,
                  &slot_v[miss_slots[i] * kWidth]);
    }
    for (int g = 0; g < kHeads; ++g) {
      for (int t = plan.head_offsets[g]; t < plan.head_offsets[g + 1]; ++t) {
        const int32_t s = plan_slots[t];
        const uint16_t* k = s >= 0 ? &slot_k[s * kWidth]
                                   : &fetched[(-1 - s) * kWidth];
        const uint16_t* v = s >= 0 ? &slot_v[s * kWidth]
                                   : &fetched[(n + (-1 - s)) * kWidth];
        for (int c = 0; c < kWidth; ++c) {
          EXPECT_EQ(k[c], KValue(0, g, plan.indices[t], c)) << t;
          EXPECT_EQ(v[c], KValue(0, g, plan.indices[t], c) + 5000) << t;
        }
      }
    }
  }
  // Step 2 held 0, 2 and 5; step 3 held 9 and 2 (head 1 skipped); step 4
  // held 0, 9, 2, 5 and 6.
  EXPECT_EQ(hits, 3 + 2 + 5);
}

TEST(RowCacheTest, ByFrequencyEvictsTheLeastOftenSelected) {
  // Head 0 selects 1 three times, then 0, 2 and 3 once more each, so that
  // 1 is the least recently selected and the most often. A new row takes
  // 1's slot by recency, 0's by frequency (the least recent of the rows
  // selected twice); the rows the step selected stay either way.
  for (const RowCacheReplacement r :
       {RowCacheReplacement::kRecency, RowCacheReplacement::kFrequency}) {
    const bool frequency = r == RowCacheReplacement::kFrequency;
    RowCache cache(1, kHeads, kTokens, kWidth, 0.25, r);
    std::vector<uint16_t> fetched;
    auto plan = [&](std::vector<int32_t> h0) {
      return OwnedFetchPlan::PerHead({h0, {4, 5, 6, 7}});
    };
    EXPECT_EQ(Step(cache, 0, plan({0, 1, 2, 3}), 16, fetched), 0);
    EXPECT_EQ(Step(cache, 0, plan({1}), 16, fetched), 1 + 4);
    EXPECT_EQ(Step(cache, 0, plan({1}), 16, fetched), 1 + 4);
    EXPECT_EQ(Step(cache, 0, plan({0, 2, 3}), 16, fetched), 3 + 4);
    EXPECT_EQ(Step(cache, 0, plan({9, 2}), 16, fetched), 1 + 4);
    EXPECT_EQ(Step(cache, 0, plan({1}), 16, fetched), (frequency ? 1 : 0) + 4)
        << (frequency ? "frequency" : "recency");
    EXPECT_EQ(Step(cache, 0, plan({9, 2, 3}), 16, fetched), 3 + 4);
  }
  EXPECT_EQ(RowCache::Bytes(kLayers, kHeads, kTokens, kWidth, 0.25,
                            RowCacheReplacement::kFrequency),
            RowCache::Bytes(kLayers, kHeads, kTokens, kWidth, 0.25) + 16 * 4);
}

TEST(RowCacheTest, AHeadWhoseMissesDoNotFitIsReadFromTheFetch) {
  RowCache cache(1, kHeads, kTokens, kWidth, 0.25);
  std::vector<uint16_t> fetched;
  // 8 cached tokens: 4 rows in all. Head 0 takes 3; head 1's two do not
  // fit in the one left: fetched, and read from the fetch.
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{4, 1, 6}, {2, 3}});
  EXPECT_EQ(Step(cache, 0, plan, 8, fetched), 0);
  EXPECT_NE(cache.Head(0, 0, fetched.data()).indices, nullptr);
  EXPECT_EQ(cache.Head(0, 1, fetched.data()).indices, nullptr);
  EXPECT_EQ(Step(cache, 0, plan, 8, fetched), 3);
  EXPECT_EQ(cache.misses(0).indices, (std::vector<int32_t>{2, 3}));
  // With more cached tokens the bound grows, and head 1 is cached too.
  EXPECT_EQ(Step(cache, 0, plan, 16, fetched), 3);
  EXPECT_EQ(Step(cache, 0, plan, 16, fetched), 5);
  EXPECT_TRUE(cache.misses(0).indices.empty());
}

TEST(RowCacheTest, TheBoundIsSharedByEveryLayerAndHead) {
  // Half of 4 layers x 2 heads x 16 tokens: 64 rows. Layers that select
  // every row hold them while the bound lasts; the next layer's do not fit.
  RowCache cache(4, kHeads, kTokens, kWidth, 0.5);
  std::vector<int32_t> every(kTokens);
  for (int p = 0; p < kTokens; ++p) every[p] = p;
  const OwnedFetchPlan whole = OwnedFetchPlan::PerHead({every, every});
  std::vector<uint16_t> fetched;
  for (int layer : {0, 1}) {
    EXPECT_EQ(Step(cache, layer, whole, kTokens, fetched), 0);
    EXPECT_EQ(Step(cache, layer, whole, kTokens, fetched), 2 * kTokens);
  }
  EXPECT_EQ(Step(cache, 2, whole, kTokens, fetched), 0);
  EXPECT_EQ(cache.Head(2, 0, fetched.data()).indices, nullptr);
  EXPECT_EQ(cache.Head(2, 1, fetched.data()).indices, nullptr);
  EXPECT_EQ(cache.bytes(), 64 * 2 * kWidth * 2);
}

TEST(RowCacheTest, APositionPlannedTwiceIsFetchedOnce) {
  RowCache cache(1, kHeads, kTokens, kWidth, 0.5);
  std::vector<uint16_t> fetched;
  Step(cache, 0, OwnedFetchPlan::PerHead({{5, 5, 6}, {}}), 16, fetched);
  EXPECT_EQ(cache.misses(0).indices, (std::vector<int32_t>{5, 6}));
}

TEST(RowCacheTest, RefusesAPositionOutsideTheSequence) {
  RowCache cache(1, kHeads, kTokens, kWidth, 0.5);
  std::vector<uint16_t> fetched;
  Step(cache, 0, OwnedFetchPlan::PerHead({{1}, {2}}), 16, fetched);
  for (int32_t bad : {-1, kTokens}) {
    absl::StatusOr<RowCache::Counts> split = cache.Split(
        0, OwnedFetchPlan::PerHead({{1}, {bad}}).view(), kTokens);
    ASSERT_FALSE(split.ok());
    EXPECT_EQ(split.status().code(), absl::StatusCode::kInternal);
    EXPECT_NE(split.status().message().find(std::to_string(bad)),
              std::string::npos);
  }
  // Unchanged: the last good split still reads.
  EXPECT_EQ(Step(cache, 0, OwnedFetchPlan::PerHead({{1}, {2}}), 16, fetched),
            2);
}

TEST(RowCacheTest, CountsTheRowsThePreviousStepSelectedToo) {
  RowCache cache(1, kHeads, kTokens, kWidth, 0.25);
  auto repeats = [&](const OwnedFetchPlan& plan) {
    absl::StatusOr<RowCache::Counts> c = cache.Split(0, plan.view(), 16);
    EXPECT_TRUE(c.ok());
    return c.ok() ? c->repeats : -1;
  };
  EXPECT_EQ(repeats(OwnedFetchPlan::PerHead({{1, 2}, {3}})), 0);
  // 2 and 3 again; 1 was not selected at the last step, whatever the
  // cache holds.
  EXPECT_EQ(repeats(OwnedFetchPlan::PerHead({{2, 4, 5, 6, 7}, {3}})), 2);
  EXPECT_EQ(repeats(OwnedFetchPlan::PerHead({{1, 4}, {9}})), 1);
}

TEST(RowCacheTest, BytesCountTheBoundsRowsAndTheMaps) {
  // A quarter of 2 layers x 2 heads x 16 tokens: 16 rows of K and V; per
  // position of each (layer, head) two maps, per row three.
  EXPECT_EQ(RowCache::Bytes(kLayers, kHeads, kTokens, kWidth, 0.25),
            16 * 2 * kWidth * 2 + (kLayers * kHeads * 2 * kTokens + 3 * 16) * 4);
}

TEST(RowCacheTest, FractionWithinIsTheLargestThatFits) {
  const int64_t maps = kLayers * kHeads * 2 * kTokens * 4;
  const int64_t per_row = 2 * kWidth * 2 + 3 * 4;
  // Room for the maps and 10 rows (of 64), and a little to spare.
  const double f = RowCache::FractionWithin(maps + 10 * per_row + 5, kLayers,
                                            kHeads, kTokens, kWidth);
  EXPECT_DOUBLE_EQ(f, 10.0 / 64);
  EXPECT_LE(RowCache::Bytes(kLayers, kHeads, kTokens, kWidth, f),
            maps + 10 * per_row + 5);
  EXPECT_GT(RowCache::Bytes(kLayers, kHeads, kTokens, kWidth, 11.0 / 64),
            maps + 10 * per_row + 5);
  // Not even the maps and a row: none.
  EXPECT_EQ(RowCache::FractionWithin(maps, kLayers, kHeads, kTokens, kWidth),
            0.0);
  EXPECT_EQ(RowCache::FractionWithin(-1, kLayers, kHeads, kTokens, kWidth),
            0.0);
}

}  // namespace
}  // namespace infinigen::gpu_worker::offloaded
