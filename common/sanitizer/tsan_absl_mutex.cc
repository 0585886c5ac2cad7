// Teaches ThreadSanitizer what Debian's absl::Mutex does. The system Abseil
// is not built with TSan, so its lock and unlock are invisible to it and
// every field an absl::Mutex guards would look raced. Linked only into
// `--config=tsan` builds (third_party:absl), these definitions take the
// place of the library's (the executable's symbols come first): each calls
// the library's own function (dlsym RTLD_NEXT) and tells TSan that an
// unlock releases and a lock acquires the mutex's address. A Condition is
// wrapped so that its evaluation, which the library may run on another
// thread that holds the mutex, also acquires it.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

extern "C" {
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}

namespace {

template <typename F>
F Next(const char* symbol) {
  void* f = dlsym(RTLD_NEXT, symbol);
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: no %s in the system Abseil\n",
                 symbol);
    std::abort();
  }
  return reinterpret_cast<F>(f);
}

void Acquire(const void* mu) { __tsan_acquire(const_cast<void*>(mu)); }
void Release(const void* mu) { __tsan_release(const_cast<void*>(mu)); }

struct Wrapped {
  const absl::Mutex* mu;
  const absl::Condition* cond;
};
// The waiter publishes its Wrapped (Release(&w)) before the library may
// hand it to another thread.
// Takes void* so that the library, not an instrumented template, reads the
// Condition that carries it.
bool EvalWrapped(void* arg) {
  auto* w = static_cast<Wrapped*>(arg);
  Acquire(w);
  Acquire(w->mu);
  const bool met = w->cond->Eval();
  // A false condition sends the waiter back to sleep, and the library then
  // lets the mutex go without an Unlock: release here what it read.
  Release(w->mu);
  return met;
}

using MuFn = void (*)(absl::Mutex*);
using MuTryFn = bool (*)(absl::Mutex*);
using MuCondFn = void (*)(absl::Mutex*, const absl::Condition&);
using MuCondTimeoutFn = bool (*)(absl::Mutex*, const absl::Condition&,
                                 absl::Duration);
using MuCondDeadlineFn = bool (*)(absl::Mutex*, const absl::Condition&,
                                  absl::Time);
using CvWaitFn = void (*)(absl::CondVar*, absl::Mutex*);
using CvTimeoutFn = bool (*)(absl::CondVar*, absl::Mutex*, absl::Duration);
using CvDeadlineFn = bool (*)(absl::CondVar*, absl::Mutex*, absl::Time);

// The deadlock detector's graph lives in uninstrumented code that TSan
// would see only through its memmove interceptor: off under TSan (TSan
// finds lock-order inversions itself).
const bool kNoDeadlockGraph = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

#define IG_NEXT(type, symbol)                           \
  static const type next = Next<type>(symbol)

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  IG_NEXT(MuFn, "_ZN4absl7debian35Mutex4LockEv");
  next(this);
  Acquire(this);
}
void Mutex::Unlock() {
  IG_NEXT(MuFn, "_ZN4absl7debian35Mutex6UnlockEv");
  Release(this);
  next(this);
}
bool Mutex::TryLock() {
  IG_NEXT(MuTryFn, "_ZN4absl7debian35Mutex7TryLockEv");
  const bool locked = next(this);
  if (locked) Acquire(this);
  return locked;
}
void Mutex::ReaderLock() {
  IG_NEXT(MuFn, "_ZN4absl7debian35Mutex10ReaderLockEv");
  next(this);
  Acquire(this);
}
void Mutex::ReaderUnlock() {
  IG_NEXT(MuFn, "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  Release(this);
  next(this);
}
bool Mutex::ReaderTryLock() {
  IG_NEXT(MuTryFn, "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  const bool locked = next(this);
  if (locked) Acquire(this);
  return locked;
}
void Mutex::Await(const Condition& cond) {
  IG_NEXT(MuCondFn,
          "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  Wrapped w{this, &cond};
  Release(&w);
  Release(this);
  next(this, Condition(&EvalWrapped, &w));
  Acquire(this);
}
bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  IG_NEXT(MuCondTimeoutFn,
          "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_"
          "8DurationE");
  Wrapped w{this, &cond};
  Release(&w);
  Release(this);
  const bool met = next(this, Condition(&EvalWrapped, &w), timeout);
  Acquire(this);
  return met;
}
bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  IG_NEXT(MuCondDeadlineFn,
          "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_"
          "4TimeE");
  Wrapped w{this, &cond};
  Release(&w);
  Release(this);
  const bool met = next(this, Condition(&EvalWrapped, &w), deadline);
  Acquire(this);
  return met;
}
void Mutex::LockWhen(const Condition& cond) {
  IG_NEXT(MuCondFn, "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  Wrapped w{this, &cond};
  Release(&w);
  next(this, Condition(&EvalWrapped, &w));
  Acquire(this);
}
void Mutex::ReaderLockWhen(const Condition& cond) {
  IG_NEXT(MuCondFn,
          "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Wrapped w{this, &cond};
  Release(&w);
  next(this, Condition(&EvalWrapped, &w));
  Acquire(this);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  IG_NEXT(MuCondTimeoutFn,
          "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_"
          "8DurationE");
  Wrapped w{this, &cond};
  Release(&w);
  const bool met = next(this, Condition(&EvalWrapped, &w), timeout);
  Acquire(this);
  return met;
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  IG_NEXT(MuCondDeadlineFn,
          "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_"
          "4TimeE");
  Wrapped w{this, &cond};
  Release(&w);
  const bool met = next(this, Condition(&EvalWrapped, &w), deadline);
  Acquire(this);
  return met;
}

void CondVar::Wait(Mutex* mu) {
  IG_NEXT(CvWaitFn, "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  Release(mu);
  next(this, mu);
  Acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  IG_NEXT(CvTimeoutFn,
          "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_"
          "8DurationE");
  Release(mu);
  const bool timed_out = next(this, mu, timeout);
  Acquire(mu);
  return timed_out;
}
bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  IG_NEXT(CvDeadlineFn,
          "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Release(mu);
  const bool timed_out = next(this, mu, deadline);
  Acquire(mu);
  return timed_out;
}

ABSL_NAMESPACE_END
}  // namespace absl
