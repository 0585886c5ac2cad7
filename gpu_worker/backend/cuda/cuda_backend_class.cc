// CudaBackend (cuda_backend_class.h): its end, the sticky first error,
// and the arguments of an operation resolved to device addresses.
#include "gpu_worker/backend/cuda/cuda_backend_class.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/log.h"

namespace infinigen::gpu_worker::cuda {

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(copy_stream_);
  cudaStreamSynchronize(stream_);
  if (touch_stream_ != nullptr) {
    cudaStreamSynchronize(touch_stream_);
    cudaStreamDestroy(touch_stream_);
    cudaFree(touch_sink_);
  }
  for (auto& [begin, range] : pinned_) {
    if (range.owned) cudaHostUnregister(reinterpret_cast<void*>(begin));
  }
  for (auto& [begin, range] : constants_) cudaFree(range.device);
  for (auto& [key, half] : half_weights_) cudaFree(half);
  cublasDestroy(cublas_);
  for (cudaEvent_t e : marks_) cudaEventDestroy(e);
  cudaEventDestroy(copied_);
  cudaStreamDestroy(copy_stream_);
  cudaStreamDestroy(stream_);
}

void CudaBackend::Fail(absl::Status status) {
  if (!error_.ok()) return;
  IG_LOG(ERROR) << name_ << ": " << status.message();
  error_ = std::move(status);
}

void CudaBackend::FailShape(const char* op, const std::string& shape) {
  Fail(absl::InvalidArgumentError(
      absl::StrFormat("%s: invalid shape: %s", op, shape)));
}

const void* CudaBackend::Resolve(const void* p, size_t bytes, bool write,
                                 const char* op, const char* arg,
                                 bool* constant) {
  if (p == nullptr) {
    Fail(absl::InvalidArgumentError(
        absl::StrFormat("%s: %s is null", op, arg)));
    return nullptr;
  }
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto c = FindRange(constants_, a);
  if (c != constants_.end()) {
    if (write) {
      Fail(absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s (%p) would write into a registered constant", op, arg, p)));
      return nullptr;
    }
    if (a + bytes > c->first + c->second.bytes) {
      Fail(absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s (%p, %zu bytes) runs past the end of its registered range",
          op, arg, p, bytes)));
      return nullptr;
    }
    if (constant != nullptr) *constant = true;
    return c->second.device + (a - c->first);
  }
  auto s = FindRange(shared_, a);
  if (s != shared_.end()) {
    if (a + bytes > s->first + s->second) {
      Fail(absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s (%p, %zu bytes) runs past the end of its AllocateShared "
          "buffer",
          op, arg, p, bytes)));
      return nullptr;
    }
    return p;
  }
  // Memory the caller allocated with CUDA itself.
  cudaPointerAttributes attributes;
  const cudaError_t err = cudaPointerGetAttributes(&attributes, p);
  if (err != cudaSuccess) cudaGetLastError();
  if (err == cudaSuccess && (attributes.type == cudaMemoryTypeManaged ||
                             (attributes.type == cudaMemoryTypeDevice &&
                              attributes.device == device_))) {
    return p;
  }
  Fail(absl::InvalidArgumentError(absl::StrFormat(
      "%s: %s (%p) is neither managed or device memory nor inside a range "
      "given to RegisterConstant",
      op, arg, p)));
  return nullptr;
}

std::unique_ptr<Backend> NewCudaBackendOver(
    int device, const cudaDeviceProp& prop, const CudaBackendOptions& options,
    cudaStream_t stream, cudaStream_t copy_stream,
    std::vector<cudaEvent_t> marks, cudaEvent_t copied,
    cublasHandle_t cublas) {
  return std::make_unique<CudaBackend>(device, prop, options, stream,
                                       copy_stream, std::move(marks), copied,
                                       cublas);
}

}  // namespace infinigen::gpu_worker::cuda
