// HeadSlots' leading fetches (NoteLeadingFetches: a whole head read in
// place, counted once) against a reference that counts every slot, mixed
// with per-row fetches and appends, across fold periods: the slots keep
// their base in 32 bits and every fold_period leading fetches all of them
// are folded in, so a small period exercises what 2^31 fetches would.
#include "kv_memory_service/head_slots.h"

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

}  // namespace
}  // namespace infinigen::kv_memory_service
