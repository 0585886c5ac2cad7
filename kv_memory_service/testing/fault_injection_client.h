// FaultInjectionKvClient: a KvClient that forwards to another one and fails
// the calls a test chooses, for testing what a caller (the worker's KV
// policy, a retry loop) does when the memory node misbehaves without
// needing a real server to misbehave. Thread-safe.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_TESTING_FAULT_INJECTION_CLIENT_H_
#define INFINIGEN_KV_MEMORY_SERVICE_TESTING_FAULT_INJECTION_CLIENT_H_

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::kv_memory_service {

class FaultInjectionKvClient final : public KvClientWrapper {
 public:
  explicit FaultInjectionKvClient(std::unique_ptr<KvClient> target)
      : KvClientWrapper(std::move(target)) {}

  // Fetches after the next `skip` fail with `status` (without reaching the
  // target) until ClearFaults. Appends likewise with FailAppends.
  void FailFetches(absl::Status status, int64_t skip = 0);
  void FailAppends(absl::Status status, int64_t skip = 0);
  void ClearFaults();

  // Fetches and appends seen, failed or not.
  int64_t fetches() const;
  int64_t appends() const;

  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override;
  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override;

 private:
  struct Fault {
    absl::Status status;  // OK: none
    int64_t skip = 0;
  };
  // The injected error for the next call, or OK; counts the call.
  absl::Status Next(Fault& fault, int64_t& calls)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  Fault fetch_fault_ ABSL_GUARDED_BY(mu_);
  Fault append_fault_ ABSL_GUARDED_BY(mu_);
  int64_t fetches_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t appends_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_TESTING_FAULT_INJECTION_CLIENT_H_
