#include "common/thread_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace infinigen {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskOnceAndWaitsForAll) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int n : {0, 1, 3, 17}) {
      std::vector<int> ran(n, 0);
      pool.Run(n, [&](int i) { ++ran[i]; });
      // Run returned: every task finished and its write is visible here.
      for (int i = 0; i < n; ++i) EXPECT_EQ(ran[i], 1) << threads << " " << i;
    }
  }
}

TEST(ThreadPoolTest, UsesItsThreads) {
  ThreadPool pool(3);
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  // Each task waits until another is running or a bound passes: with the
  // pool's threads, at least two run at once.
  pool.Run(3, [&](int) {
    const int now = ++inside;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    for (int spin = 0; spin < 2000 && most.load() < 2; ++spin) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    --inside;
  });
  EXPECT_GE(most.load(), 2);
}

TEST(ThreadPoolTest, ManyCallersAtOnce) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 200; ++r) pool.Run(5, [&](int i) { sum += i + 1; });
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4 * 200 * 15);
}

TEST(ThreadPoolTest, ResolvesTheAutomaticCount) {
  EXPECT_EQ(ThreadPool::Resolve(3), 3);
  EXPECT_GE(ThreadPool::Resolve(0), 1);
  EXPECT_LE(ThreadPool::Resolve(0), 8);
}

}  // namespace
}  // namespace infinigen
