// The host's pool of threads for the speculator's per-layer loops.
#include "common/thread_pool.h"
#include "speculator/speculator.h"

namespace infinigen::speculator {

const TaskRunner* HostTasks(size_t work) {
  if (work < (size_t{1} << 16)) return nullptr;
  // Shared by every sequence and policy of the process; never destroyed
  // (its threads outlive any caller).
  static const TaskRunner* runner = [] {
    auto* pool = new ThreadPool(ThreadPool::Resolve(0));
    return new TaskRunner(
        [pool](int n, absl::FunctionRef<void(int)> fn) { pool->Run(n, fn); });
  }();
  return runner;
}

}  // namespace infinigen::speculator
