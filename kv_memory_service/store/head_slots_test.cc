// HeadSlots' leading fetches (NoteLeadingFetches: a whole head read in
// place, counted once) against a reference that counts every slot, mixed
// with per-row fetches and appends, across fold periods: the slots keep
// their base in 32 bits and every fold_period leading fetches all of them
// are folded in, so a small period exercises what 2^31 fetches would. And
// a run of positions placed at once against each placed alone.
#include "kv_memory_service/store/head_slots.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace infinigen::kv_memory_service {
namespace {

TEST(HeadSlots, LeadingFetchesCountAsEverySlotsFetch) {
  for (const int64_t period : {int64_t{2}, int64_t{4}, int64_t{1} << 31}) {
    SCOPED_TRACE(period);
    HeadSlots head(EvictionPolicy::kLru, /*max_tokens=*/1000, period);
    std::vector<int64_t> count;    // the reference, per position
    std::vector<uint64_t> last;
    std::mt19937 rng(static_cast<uint32_t>(period));
    uint64_t clock = 0;
    std::vector<int32_t> dirty;
    for (int round = 0; round < 300; ++round) {
      const int length = static_cast<int>(count.size());
      switch (rng() % 3) {
        case 0: {  // an append
          int32_t victim;
          EXPECT_EQ(head.Place(length, &victim), length);
          EXPECT_EQ(victim, -1);
          count.push_back(0);
          last.push_back(0);
          break;
        }
        case 1: {  // a whole head read, maybe before the last appends
          const int n = length - static_cast<int>(rng() % 3);
          ++clock;
          head.NoteLeadingFetches(n, length, clock, dirty);
          for (int p = 0; p < n; ++p) {
            ++count[p];
            last[p] = clock;
          }
          break;
        }
        default: {  // some rows by index
          if (length == 0) break;
          ++clock;
          std::vector<int32_t> positions;
          for (int i = 0; i < 3; ++i) positions.push_back(rng() % length);
          head.NoteFetches(positions.data(),
                           static_cast<int32_t>(positions.size()), length,
                           clock, dirty);
          for (int32_t p : positions) {
            ++count[p];
            last[p] = clock;
          }
        }
      }
      for (size_t p = 0; p < count.size(); ++p) {
        ASSERT_EQ(head.FetchCount(static_cast<int32_t>(p)), count[p])
            << "round " << round << " position " << p;
        ASSERT_EQ(head.LastFetch(static_cast<int32_t>(p)), last[p])
            << "round " << round << " position " << p;
      }
    }
    EXPECT_TRUE(dirty.empty());  // no candidates before the head evicts
  }
}

// A run of positions placed at once (PlaceRun: a prefill's append) leaves
// the head as placing them one at a time does: the same slots, the same
// counts and clocks under later fetches, and, once the head is full, the
// same victims in the same order under every eviction policy.
TEST(HeadSlots, PlacingARunIsPlacingEachPosition) {
  for (const EvictionPolicy policy :
       {EvictionPolicy::kFifo, EvictionPolicy::kLru,
        EvictionPolicy::kCounter}) {
    SCOPED_TRACE(EvictionPolicyName(policy));
    constexpr int32_t kMax = 64;
    HeadSlots runs(policy, kMax), each(policy, kMax);
    std::mt19937 rng(static_cast<uint32_t>(policy) + 1);
    uint64_t clock = 0;
    std::vector<int32_t> dirty_runs, dirty_each;
    int32_t length = 0;
    auto fetch = [&] {
      ++clock;
      if (rng() % 2 == 0) {
        runs.NoteLeadingFetches(length, length, clock, dirty_runs);
        each.NoteLeadingFetches(length, length, clock, dirty_each);
        return;
      }
      // Four present positions, in order, as a plan names them.
      std::vector<int32_t> positions;
      while (positions.size() < 4) {
        const int32_t pos = static_cast<int32_t>(rng() % length);
        ASSERT_EQ(runs.SlotOf(pos, length), each.SlotOf(pos, length));
        if (runs.SlotOf(pos, length) >= 0) positions.push_back(pos);
      }
      std::sort(positions.begin(), positions.end());
      positions.erase(std::unique(positions.begin(), positions.end()),
                      positions.end());
      const int32_t n = static_cast<int32_t>(positions.size());
      runs.NoteFetches(positions.data(), n, length, clock, dirty_runs);
      each.NoteFetches(positions.data(), n, length, clock, dirty_each);
    };
    // Runs of 1 to 12 positions while they fit, fetches between them.
    while (true) {
      const int32_t n = 1 + static_cast<int32_t>(rng() % 12);
      if (length + n > kMax) break;
      EXPECT_EQ(runs.PlaceRun(length, n), length);
      for (int32_t p = length; p < length + n; ++p) {
        int32_t victim;
        EXPECT_EQ(each.Place(p, &victim), p);
        EXPECT_EQ(victim, -1);
      }
      length += n;
      ASSERT_NO_FATAL_FAILURE(fetch());
    }
    // Then one position at a time past the head's room: both evict alike.
    for (int step = 0; step < 3 * kMax; ++step) {
      int32_t victim_runs, victim_each;
      const int32_t slot = runs.Place(length, &victim_runs);
      EXPECT_EQ(slot, each.Place(length, &victim_each)) << step;
      EXPECT_EQ(victim_runs, victim_each) << step;
      if (length >= kMax) EXPECT_GE(victim_runs, 0) << step;
      ++length;
      ASSERT_NO_FATAL_FAILURE(fetch());
      EXPECT_EQ(dirty_runs, dirty_each) << step;
    }
    for (int32_t pos = 0; pos < length; ++pos) {
      const int32_t slot = runs.SlotOf(pos, length);
      ASSERT_EQ(slot, each.SlotOf(pos, length)) << pos;
      if (slot < 0) continue;
      EXPECT_EQ(runs.FetchCount(slot), each.FetchCount(slot)) << pos;
      EXPECT_EQ(runs.LastFetch(slot), each.LastFetch(slot)) << pos;
    }
  }
}

}  // namespace
}  // namespace infinigen::kv_memory_service
