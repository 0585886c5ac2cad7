#include "gpu_worker/kv/offloaded/appender.h"

#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace infinigen::gpu_worker::offloaded {
namespace {

using kv_memory_service::KvClient;

TEST(AppenderTest, RunsEachSlotOffTheCallersThreadAndReportsInOrder) {
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<int> ran;
  std::atomic<bool> other_thread{true};
  Appender appender(
      [&](int slot) {
        if (std::this_thread::get_id() == caller) other_thread = false;
        ran.push_back(slot);
        return slot == 3 ? absl::UnavailableError("node lost slot 3")
                         : absl::OkStatus();
      },
      4);
  const std::vector<int> slots = {2, 3, 0};
  appender.Start(slots);
  std::vector<std::pair<int, absl::StatusCode>> done;
  const absl::Status first = appender.Finish(
      [&](int slot, const absl::Status& s) { done.push_back({slot, s.code()}); });
  EXPECT_EQ(first.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(first.message(), "node lost slot 3");
  EXPECT_TRUE(other_thread);
  EXPECT_EQ(ran, slots);
  const std::vector<std::pair<int, absl::StatusCode>> want = {
      {2, absl::StatusCode::kOk},
      {3, absl::StatusCode::kUnavailable},
      {0, absl::StatusCode::kOk}};
  EXPECT_EQ(done, want);
}

TEST(AppenderTest, FinishWithNothingStartedReturnsAtOnce) {
  int calls = 0;
  Appender appender([&](int) {
    ++calls;
    return absl::OkStatus();
  }, 1);
  int done = 0;
  EXPECT_TRUE(appender.Finish([&](int, const absl::Status&) { ++done; }).ok());
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(done, 0);
}

TEST(AppenderTest, StepsFollowOneAnother) {
  std::atomic<int> calls{0};
  Appender appender([&](int) {
    ++calls;
    return absl::OkStatus();
  }, 2);
  for (int step = 0; step < 50; ++step) {
    const int slots[] = {0, 1};
    appender.Start(slots);
    int done = 0;
    ASSERT_TRUE(
        appender.Finish([&](int, const absl::Status&) { ++done; }).ok());
    ASSERT_EQ(done, 2);
  }
  EXPECT_EQ(calls, 100);
}

TEST(AppenderTest, DestroyedWhileWorkRunsWaitsForIt) {
  absl::Notification release;
  std::atomic<bool> finished{false};
  {
    Appender appender([&](int) {
      release.WaitForNotification();
      finished = true;
      return absl::OkStatus();
    }, 1);
    const int slots[] = {0};
    appender.Start(slots);
    release.Notify();
  }
  EXPECT_TRUE(finished);
}

TEST(LayerAppendTest, WaitReturnsTheAppendsStatusAndCountsTheWait) {
  LayerAppend append;
  EXPECT_FALSE(append.running());
  EXPECT_TRUE(append.Wait().ok());
  append.Start([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return absl::DataLossError("row lost");
  });
  EXPECT_TRUE(append.running());
  double waited = 0;
  const absl::Status status = append.Wait(&waited);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_GT(waited, 0.0);
  EXPECT_FALSE(append.running());
  EXPECT_TRUE(append.Wait().ok());  // nothing in flight any more
}

// AppendRows sends one block of every layer's rows, which the node then
// holds: a fetch of the appended positions reads them back.
TEST(AppendRowsTest, TheNodeHoldsWhatWasAppended) {
  auto client = kv_memory_service::ConnectKvClient("inproc:", {});
  ASSERT_TRUE(client.ok()) << client.status();
  kv_memory_service::SequenceGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 1;
  g.head_dim = 4;
  g.max_tokens = 8;
  auto opened = (*client)->OpenSequence(g, {});
  ASSERT_TRUE(opened.ok()) << opened.status();
  // [layer][token][kv_head][width]: 2 layers x 3 tokens x 4 values.
  std::vector<uint16_t> k(24), v(24);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<uint16_t>(i + 1);
    v[i] = static_cast<uint16_t>(100 + i);
  }
  auto appended = AppendRows(**client, opened->id, 1, 4, 0, 2, k.data(),
                             v.data(), 3);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_TRUE(appended->evicted.empty());
  auto buffer = (*client)->NewFetchBuffer(2 * 3 * 4);
  ASSERT_TRUE(buffer.ok());
  const auto plan = kv_memory_service::OwnedFetchPlan::SameForAllHeads(
      1, std::vector<int32_t>{0, 1, 2});
  ASSERT_TRUE((*client)
                  ->FetchAsync(opened->id, 1, plan.view(), buffer->get())
                  .Wait()
                  .ok());
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ((*buffer)->data()[i], k[12 + i]);
    EXPECT_EQ((*buffer)->data()[12 + i], v[12 + i]);
  }
  // A sequence the node does not know: the node's error (an in-process
  // node is not named: kv_memory_service::AtNode).
  auto unknown = AppendRows(**client, opened->id + 1000, 1, 4, 0, 2,
                            k.data(), v.data(), 3);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("no open sequence"),
            std::string::npos)
      << unknown.status();
}

}  // namespace
}  // namespace infinigen::gpu_worker::offloaded
