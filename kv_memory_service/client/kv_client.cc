// FetchBuffer's completion state and FetchHandle: the parts of kv_client.h
// every data plane shares. ConnectKvClient is in connect.cc.
#include "kv_memory_service/client/kv_client.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace infinigen::kv_memory_service {

absl::Status AtNode(absl::string_view address, const absl::Status& status) {
  if (status.ok() || address == "inproc:" ||
      absl::StartsWith(status.message(), "memory node ")) {
    return status;
  }
  return absl::Status(status.code(), absl::StrCat("memory node ", address,
                                                  ": ", status.message()));
}

absl::StatusOr<uint16_t*> AllocateFetchMemory(size_t elements) {
  constexpr size_t kPage = 4096;
  const size_t bytes = (elements * sizeof(uint16_t) + kPage - 1) / kPage * kPage;
  auto* memory = static_cast<uint16_t*>(std::aligned_alloc(kPage, bytes));
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a fetch buffer of ", bytes, " bytes"));
  }
  return memory;
}

absl::Status FetchBuffer::BeginFetch() {
  absl::MutexLock lock(&mu_);
  if (pending_) {
    return absl::FailedPreconditionError(
        "the fetch buffer's previous fetch has not been waited on");
  }
  pending_ = true;
  done_ = false;
  status_ = absl::OkStatus();
  return absl::OkStatus();
}

void FetchBuffer::CompleteFetch(absl::Status status) {
  absl::MutexLock lock(&mu_);
  status_ = std::move(status);
  done_ = true;
}

absl::Status FetchBuffer::WaitForFetch() {
  AwaitCompletion(absl::InfiniteFuture());
  return TakeResult();
}

bool FetchBuffer::AwaitCompletion(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(&done_), deadline);
}

absl::Status FetchBuffer::TakeResult() {
  absl::MutexLock lock(&mu_);
  pending_ = false;
  done_ = false;
  return std::move(status_);
}

FetchHandle::FetchHandle(FetchHandle&& other) noexcept
    : buffer_(std::exchange(other.buffer_, nullptr)),
      failed_(std::move(other.failed_)) {}

FetchHandle& FetchHandle::operator=(FetchHandle&& other) noexcept {
  if (this != &other) {
    if (buffer_ != nullptr) Wait().IgnoreError();
    buffer_ = std::exchange(other.buffer_, nullptr);
    failed_ = std::move(other.failed_);
  }
  return *this;
}

FetchHandle::~FetchHandle() {
  if (buffer_ != nullptr) Wait().IgnoreError();
}

absl::Status FetchHandle::Wait() {
  if (buffer_ != nullptr) {
    failed_ = buffer_->WaitForFetch();
    buffer_ = nullptr;
  }
  return failed_;
}

}  // namespace infinigen::kv_memory_service
