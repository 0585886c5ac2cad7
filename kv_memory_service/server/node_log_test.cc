// The periodic line of kv_memory_server: what an operator reads in it.
#include "kv_memory_service/server/node_log.h"

#include "gtest/gtest.h"

namespace infinigen::kv_memory_service {
namespace {

TEST(NodeSummaryLine, HoldingsAndTheIntervalsWork) {
  StoreStats before, now;
  before.fetches = 100;
  before.fetched_rows = 1000;
  now.open_sequences = 3;
  now.open_sessions = 2;
  now.bytes_reserved = int64_t{3} << 29;  // 1.5 GiB
  now.capacity_bytes = int64_t{6} << 30;
  now.fetches = 300;
  now.fetched_rows = 41000;
  now.appended_rows = 500;
  now.evicted_rows = 20;
  const ServedBytes served{4e9, 1e8};
  EXPECT_EQ(NodeSummaryLine(now, before, served, 2.0),
            "kv_memory_server: 3 sequences, 2 sessions, 1.50 GiB reserved of "
            "6.00 GiB; fetch 2.000 GB/s (100 fetches/s, 20000 rows/s), append "
            "0.050 GB/s (250 rows/s), 10 rows/s evicted");
  EXPECT_TRUE(NodeWasBusy(now, before, served));
  // Unlimited capacity: no "of".
  StoreStats idle;
  EXPECT_EQ(NodeSummaryLine(idle, idle, ServedBytes{}, 10.0),
            "kv_memory_server: 0 sequences, 0 sessions, 0.00 GiB reserved; "
            "fetch 0.000 GB/s (0 fetches/s, 0 rows/s), append 0.000 GB/s (0 "
            "rows/s), 0 rows/s evicted");
  EXPECT_FALSE(NodeWasBusy(idle, idle, ServedBytes{}));
  StoreStats opened = idle;
  opened.open_sessions = 1;
  EXPECT_TRUE(NodeWasBusy(opened, idle, ServedBytes{}));
  // Rows that clients still hold after their sequences closed are shown
  // beside the reservations, and their release is news.
  StoreStats pinned = idle;
  pinned.pinned_bytes = int64_t{1} << 29;
  pinned.pinned_sequences = 4;
  pinned.capacity_bytes = int64_t{1} << 30;
  EXPECT_EQ(NodeSummaryLine(pinned, idle, ServedBytes{}, 10.0),
            "kv_memory_server: 0 sequences, 0 sessions, 0.00 GiB reserved + "
            "0.50 GiB pinned by clients (4 closed sequences) of 1.00 GiB; "
            "fetch 0.000 GB/s (0 fetches/s, 0 rows/s), append 0.000 GB/s (0 "
            "rows/s), 0 rows/s evicted");
  EXPECT_TRUE(NodeWasBusy(idle, pinned, ServedBytes{}));
}

}  // namespace
}  // namespace infinigen::kv_memory_service
