// ThreadPool: a few threads that share one large task. Run(n, fn) calls
// fn(0), ..., fn(n - 1) and returns once all have returned: fn(0) on the
// caller, the others on the pool's threads (or on the caller too, when the
// pool's threads are busy with other callers' tasks). The store splits a
// gather above a size threshold into one task per thread, each a range of
// the plan's rows; the worker's InfiniGen policy spreads a layer's KV heads
// over one when it selects on the host.
//
// Owns its threads (threads - 1 of them: the caller is the first); stops
// and joins them on destruction. Run may be called from several threads at
// once; tasks queue in order. Happens-before: whatever the caller did before
// Run is visible to every task, and whatever a task did is visible to the
// caller after Run.
#ifndef INFINIGEN_COMMON_THREAD_POOL_H_
#define INFINIGEN_COMMON_THREAD_POOL_H_

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace infinigen {

class ThreadPool {
 public:
  // `threads` counts the caller: 1 (or less) starts no thread and Run
  // calls every task on the caller.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads a Run may use, the caller included.
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void Run(int n, absl::FunctionRef<void(int)> fn);

  // The thread count for `requested`: itself when positive, else the
  // host's cores (at least 1, at most 8).
  static int Resolve(int requested);

 private:
  struct Batch {
    absl::FunctionRef<void(int)> fn;
    int remaining;  // tasks not yet finished; guarded by the pool's mu_
  };
  struct Task {
    Batch* batch;
    int index;
  };

  void Work();
  // Runs one queued task with mu_ released; false when none is queued.
  bool RunOneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_THREAD_POOL_H_
