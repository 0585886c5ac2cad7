#include "common/thread_pool.h"

#include <algorithm>

namespace infinigen {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

int ThreadPool::Resolve(int requested) {
  if (requested > 0) return requested;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores, 1, 8);
}

bool ThreadPool::RunOneLocked() {
  if (queue_.empty()) return false;
  const Task task = queue_.front();
  queue_.pop_front();
  mu_.Unlock();
  task.batch->fn(task.index);
  mu_.Lock();
  --task.batch->remaining;
  return true;
}

void ThreadPool::Work() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](ThreadPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
          return p->stop_ || !p->queue_.empty();
        },
        this));
    if (!RunOneLocked()) return;  // stopping, nothing left
  }
}

void ThreadPool::Run(int n, absl::FunctionRef<void(int)> fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  Batch batch{fn, n};
  {
    absl::MutexLock lock(&mu_);
    for (int i = 1; i < n; ++i) queue_.push_back(Task{&batch, i});
  }
  fn(0);
  absl::MutexLock lock(&mu_);
  --batch.remaining;
  // Help with whatever is queued (ours or another caller's) rather than
  // wait for a busy pool, then wait for the tasks other threads took.
  while (batch.remaining > 0 && RunOneLocked()) {
  }
  mu_.Await(absl::Condition(
      +[](Batch* b) { return b->remaining == 0; }, &batch));
}

}  // namespace infinigen
