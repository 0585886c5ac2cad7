// The CUDA backend: the Backend interface (gpu_worker/backend/backend.h) on one
// NVIDIA device, cuBLAS for Linear and the kernels of kernels.h for the
// rest.
//
// Every operation is issued asynchronously on the backend's one stream.
// Buffers from AllocateDevice are plain device memory (cudaMalloc), reached
// from the host only by CopyFromHost (on a second, copy stream, ordered by
// events) and CopyToHost; buffers from AllocateShared are CUDA managed
// memory, which host code reads after Synchronize(). RegisterConstant copies a weight range to the
// device once (fp32); operations given a host pointer inside a registered
// range use the device copy at the same offset. With half_precision, the
// first Linear over a matrix also makes an fp16 copy of it, kept for the
// backend's lifetime (weights then take 1.5x their fp32 size on the device),
// and attention over many queries (prefill chunks) runs on tensor cores.
//
// Errors are sticky: the first one (an invalid shape, a pointer that is
// neither managed nor registered, a failed launch or cuBLAS call, an
// asynchronous fault) is recorded, every later operation is skipped, and
// every Synchronize() returns it. Not thread-safe (one engine drives one
// backend); it may share a process with other backends on other devices.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_H_
#define INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"

namespace infinigen::gpu_worker::cuda {

struct CudaBackendOptions {
  // true: Linear converts weights (once) and activations (per call) to fp16
  // and runs cublasGemmEx with fp32 output and CUBLAS_COMPUTE_32F (tensor
  // cores; about 1e-3 relative error per product), and Attention of
  // kMinFlashQueries or more queries runs LaunchFlashAttention (q, k, v in
  // fp16 on tensor cores, softmax in fp32). false: fp32 cublasSgemm and the
  // fp32 attention kernel, for tight parity with the CPU backend.
  bool half_precision = true;
};

// From this many queries in one Attention call on, half_precision runs the
// tensor-core kernel: below it (decoding) the rows are read once per query
// anyway and the fp32 kernel, split over the KV rows, fills the device.
inline constexpr int kMinFlashQueries = 16;

// The backend on CUDA device `device`. Unavailable, with the CUDA error
// string, when no device answers (cudaGetDeviceCount fails or reports 0),
// `device` is out of range, or the device cannot be initialised (no managed
// memory, no stream, no cuBLAS handle). The worker reaches it through
// NewCudaBackend (backend.h), which loads it from the CUDA plugin
// (cuda_plugin.cc) so that the binary runs on hosts without CUDA; tests that
// link it directly call this one, with options.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int device, const CudaBackendOptions& options = {});

}  // namespace infinigen::gpu_worker::cuda

#endif  // INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_H_
