#include <cuda_runtime.h>

#include "gpu_worker/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void RmsNormKernel(RmsNormParams p) {
  const int row = blockIdx.x;
  const float* x = p.x + static_cast<long>(row) * p.dim;
  float* y = p.y + static_cast<long>(row) * p.dim;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) ss += x[i] * x[i];
  // Warp reduction, then across warps through shared memory.
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_down_sync(0xffffffff, ss, off);
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float inv;
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    inv = rsqrtf(total / p.dim + p.eps);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    y[i] = x[i] * inv * p.gain[i];
  }
}

}  // namespace

int LaunchRmsNorm(const RmsNormParams& p, void* stream) {
  if (p.n <= 0 || p.dim <= 0) return static_cast<int>(cudaErrorInvalidValue);
  RmsNormKernel<<<p.n, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace infinigen::gpu_worker::cuda
