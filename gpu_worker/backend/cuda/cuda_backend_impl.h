// The CUDA backend's private parts shared by its files: device memory
// bookkeeping (CudaBackend's, cuda_backend_class.h) and the backend's
// construction from the handles CreateCudaBackend makes (cuda_device.cc).
#ifndef INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_IMPL_H_
#define INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_IMPL_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/backend/backend.h"

namespace infinigen::gpu_worker::cuda {

struct CudaBackendOptions;  // cuda_backend.h

// Events MarkIssued records round-robin on the compute stream.
constexpr int kMarkEvents = 64;

// "cudaErrorX (its description)".
std::string CudaError(cudaError_t err);

// A registered weight range's device copy.
struct ConstantRange {
  size_t bytes;
  char* device;  // the copy of the host range
};

// A host range PinHost pinned, mapped for the device.
struct PinnedRange {
  size_t bytes;
  char* device;  // where kernels read it (cudaHostGetDevicePointer)
  bool owned;    // registered by PinHost (else by whoever pinned it first)
};

inline size_t RangeBytes(size_t bytes) { return bytes; }
inline size_t RangeBytes(const ConstantRange& range) { return range.bytes; }
inline size_t RangeBytes(const PinnedRange& range) { return range.bytes; }

// The entry of `ranges` (keyed by first address) that contains address a,
// or ranges.end().
template <typename Map>
typename Map::const_iterator FindRange(const Map& ranges, uintptr_t a) {
  auto it = ranges.upper_bound(a);
  if (it == ranges.begin()) return ranges.end();
  --it;
  return a < it->first + RangeBytes(it->second) ? it : ranges.end();
}

// Device memory that only grows: reused by every call once large enough.
// Growing waits for the stream, as queued kernels may still read the old
// buffer; contents do not survive growth.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() { cudaFree(data_); }

  cudaError_t Reserve(size_t bytes, cudaStream_t stream) {
    if (bytes <= capacity_) return cudaSuccess;
    const size_t grown = std::max(bytes, capacity_ + capacity_ / 2);
    cudaError_t err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return err;
    cudaFree(data_);
    data_ = nullptr;
    capacity_ = 0;
    err = cudaMalloc(&data_, grown);
    if (err != cudaSuccess) {
      data_ = nullptr;
      return err;
    }
    capacity_ = grown;
    return cudaSuccess;
  }
  char* data() const { return static_cast<char*>(data_); }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// The backend over handles CreateCudaBackend made on `device`; takes
// ownership of the streams, the events ([kMarkEvents] marks and `copied`)
// and the cuBLAS handle.
std::unique_ptr<Backend> NewCudaBackendOver(
    int device, const cudaDeviceProp& prop, const CudaBackendOptions& options,
    cudaStream_t stream, cudaStream_t copy_stream,
    std::vector<cudaEvent_t> marks, cudaEvent_t copied, cublasHandle_t cublas);

}  // namespace infinigen::gpu_worker::cuda

#endif  // INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_IMPL_H_
