// Finding and initialising a CUDA device for the backend: its stream, copy
// stream, events and cuBLAS handle, or why the device cannot serve.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "gpu_worker/backend/cuda/cuda_backend.h"
#include "gpu_worker/backend/cuda/cuda_backend_impl.h"

namespace infinigen::gpu_worker::cuda {

std::string CudaError(cudaError_t err) {
  return absl::StrFormat("%s (%s)", cudaGetErrorName(err),
                         cudaGetErrorString(err));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int device, const CudaBackendOptions& options) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError("no CUDA device: cudaGetDeviceCount: " +
                                  CudaError(err));
  }
  if (count == 0) {
    return absl::UnavailableError(
        "no CUDA device: cudaGetDeviceCount reports 0 devices");
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(absl::StrFormat(
        "CUDA device %d is out of range: %d device(s) answer", device, count));
  }
  cudaDeviceProp prop;
  if ((err = cudaSetDevice(device)) != cudaSuccess ||
      (err = cudaGetDeviceProperties(&prop, device)) != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrFormat("CUDA device %d: %s", device, CudaError(err)));
  }
  if (!prop.managedMemory) {
    return absl::UnavailableError(absl::StrFormat(
        "CUDA device %d (%s) has no managed memory", device, prop.name));
  }
  cudaStream_t stream = nullptr;
  if ((err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)) !=
      cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrFormat(
        "CUDA device %d: cudaStreamCreate: %s", device, CudaError(err)));
  }
  cudaStream_t copy_stream = nullptr;
  std::vector<cudaEvent_t> marks;
  cudaEvent_t copied = nullptr;
  auto destroy_events = [&] {
    for (cudaEvent_t e : marks) cudaEventDestroy(e);
    if (copied != nullptr) cudaEventDestroy(copied);
    if (copy_stream != nullptr) cudaStreamDestroy(copy_stream);
  };
  err = cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking);
  for (int i = 0; err == cudaSuccess && i <= kMarkEvents; ++i) {
    cudaEvent_t e = nullptr;
    err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (err != cudaSuccess) break;
    if (i < kMarkEvents) {
      marks.push_back(e);
    } else {
      copied = e;
    }
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    destroy_events();
    cudaStreamDestroy(stream);
    return absl::UnavailableError(absl::StrFormat(
        "CUDA device %d: copy stream and events: %s", device, CudaError(err)));
  }
  cublasHandle_t cublas = nullptr;
  cublasStatus_t status = cublasCreate(&cublas);
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasSetStream(cublas, stream);
    if (status != CUBLAS_STATUS_SUCCESS) cublasDestroy(cublas);
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    destroy_events();
    cudaStreamDestroy(stream);
    return absl::UnavailableError(absl::StrFormat(
        "CUDA device %d: cuBLAS: %s", device, cublasGetStatusString(status)));
  }
  IG_LOG(INFO) << "cuda backend: device " << device << " " << prop.name << ", "
               << prop.multiProcessorCount << " SMs, "
               << (prop.totalGlobalMem >> 20) << " MiB, "
               << (options.half_precision ? "fp16" : "fp32") << " weights";
  return NewCudaBackendOver(device, prop, options, stream, copy_stream,
                            std::move(marks), copied, cublas);
}

}  // namespace infinigen::gpu_worker::cuda
