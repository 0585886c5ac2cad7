#include "kv_memory_service/testing/fault_injection_client.h"

namespace infinigen::kv_memory_service {

void FaultInjectionKvClient::FailFetches(absl::Status status, int64_t skip) {
  absl::MutexLock lock(&mu_);
  fetch_fault_ = Fault{std::move(status), skip};
}

void FaultInjectionKvClient::FailAppends(absl::Status status, int64_t skip) {
  absl::MutexLock lock(&mu_);
  append_fault_ = Fault{std::move(status), skip};
}

void FaultInjectionKvClient::ClearFaults() {
  absl::MutexLock lock(&mu_);
  fetch_fault_ = Fault{};
  append_fault_ = Fault{};
}

int64_t FaultInjectionKvClient::fetches() const {
  absl::MutexLock lock(&mu_);
  return fetches_;
}

int64_t FaultInjectionKvClient::appends() const {
  absl::MutexLock lock(&mu_);
  return appends_;
}

absl::Status FaultInjectionKvClient::Next(Fault& fault, int64_t& calls) {
  ++calls;
  if (fault.status.ok()) return absl::OkStatus();
  if (fault.skip > 0) {
    --fault.skip;
    return absl::OkStatus();
  }
  return fault.status;
}

absl::StatusOr<AppendResult> FaultInjectionKvClient::Append(
    SequenceId seq, const AppendBlock& block) {
  absl::Status injected;
  {
    absl::MutexLock lock(&mu_);
    injected = Next(append_fault_, appends_);
  }
  if (!injected.ok()) return injected;
  return KvClientWrapper::Append(seq, block);
}

FetchHandle FaultInjectionKvClient::FetchAsync(SequenceId seq, int32_t layer,
                                               const FetchPlan& plan,
                                               FetchBuffer* dest) {
  absl::Status injected;
  {
    absl::MutexLock lock(&mu_);
    injected = Next(fetch_fault_, fetches_);
  }
  if (!injected.ok()) return FetchHandle(std::move(injected));
  return KvClientWrapper::FetchAsync(seq, layer, plan, dest);
}

}  // namespace infinigen::kv_memory_service
