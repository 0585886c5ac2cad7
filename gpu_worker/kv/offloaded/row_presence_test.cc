#include "gpu_worker/kv/offloaded/row_presence.h"

#include <vector>

#include "gtest/gtest.h"

namespace infinigen::gpu_worker::offloaded {
namespace {

using kv_memory_service::EvictedToken;

TEST(RowPresenceTest, AppendedRowsArePresentInEveryHead) {
  RowPresence presence(/*n_layers=*/3, /*n_kv_heads=*/2, /*max_seq=*/8);
  EXPECT_EQ(presence.total(), 0);
  EXPECT_TRUE(presence.Whole(0, 0));
  presence.Mark(/*first_layer=*/0, /*n_layers=*/3, /*first=*/0, /*n=*/4, {});
  for (int l = 0; l < 3; ++l) {
    EXPECT_TRUE(presence.Whole(l, 4));
    EXPECT_FALSE(presence.Whole(l, 5));
    for (int g = 0; g < 2; ++g) {
      for (int t = 0; t < 8; ++t) {
        EXPECT_EQ(presence.layer(l)[g * 8 + t], t < 4 ? 1 : 0);
      }
    }
  }
  EXPECT_EQ(presence.total(), 3 * 2 * 4);
}

TEST(RowPresenceTest, OneLayerAtATimeAsAPrefillAppends) {
  RowPresence presence(2, 1, 4);
  presence.Mark(1, 1, 0, 3, {});
  EXPECT_TRUE(presence.Whole(1, 3));
  EXPECT_FALSE(presence.Whole(0, 1));
  EXPECT_EQ(presence.total(), 3);
}

TEST(RowPresenceTest, EvictedRowsAreNotPresentAndCountOnce) {
  RowPresence presence(2, 2, 8);
  presence.Mark(0, 2, 0, 5, {});
  const std::vector<EvictedToken> evicted = {
      {/*layer=*/1, /*kv_head=*/0, /*position=*/2},
      {1, 0, 2},  // the same row again: no second decrement
      {0, 1, 4},
  };
  presence.Mark(0, 2, 5, 1, evicted);
  EXPECT_EQ(presence.layer(1)[2], 0);
  EXPECT_EQ(presence.layer(1)[8 + 2], 1);  // the other head keeps it
  EXPECT_EQ(presence.layer(0)[8 + 4], 0);
  EXPECT_FALSE(presence.Whole(1, 6));
  EXPECT_FALSE(presence.Whole(0, 6));
  EXPECT_EQ(presence.total(), 2 * 2 * 6 - 2);
}

TEST(RowPresenceTest, ClearForgetsEverything) {
  RowPresence presence(1, 2, 4);
  presence.Mark(0, 1, 0, 4, {});
  presence.Clear();
  EXPECT_EQ(presence.total(), 0);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(presence.layer(0)[i], 0);
  EXPECT_TRUE(presence.Whole(0, 0));
}

}  // namespace
}  // namespace infinigen::gpu_worker::offloaded
