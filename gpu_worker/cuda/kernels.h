// CUDA kernels of the GPU worker, callable from plain C++.
//
// Each launcher takes a parameter struct whose pointers are device memory
// (shapes in the comments), a caller-owned stream, allocates nothing, and
// returns the launch's cudaError_t as an int (0 on success), so that this
// header needs no CUDA headers.
#ifndef INFINIGEN_GPU_WORKER_CUDA_KERNELS_H_
#define INFINIGEN_GPU_WORKER_CUDA_KERNELS_H_

namespace infinigen::gpu_worker::cuda {

struct RmsNormParams {
  const float* x;     // [n, dim]
  const float* gain;  // [dim]
  float* y;           // [n, dim]
  int n = 0;
  int dim = 0;
  float eps = 1e-5f;
};

// y = x / sqrt(mean(x^2) + eps) * gain, one block per row.
int LaunchRmsNorm(const RmsNormParams& p, void* stream);

}  // namespace infinigen::gpu_worker::cuda

#endif  // INFINIGEN_GPU_WORKER_CUDA_KERNELS_H_
