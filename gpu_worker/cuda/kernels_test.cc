// Parity of the CUDA kernels with the CPU backend, on random shapes. Skips
// with the reason when no CUDA device answers (CI machines have none).
#include <cuda_runtime.h>

#include <random>
#include <vector>

#include "gpu_worker/backend.h"
#include "gpu_worker/cuda/kernels.h"
#include "gtest/gtest.h"

namespace infinigen::gpu_worker::cuda {
namespace {

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no CUDA device: " << cudaGetErrorString(err);
    }
  }
};

TEST_F(CudaKernels, RmsNormMatchesCpu) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  auto cpu = NewCpuBackend();
  for (auto [n, dim] : {std::pair{1, 64}, {7, 576}, {33, 1000}, {2, 4096}}) {
    std::vector<float> x(n * dim), gain(dim), want(n * dim), got(n * dim);
    for (float& v : x) v = normal(rng);
    for (float& v : gain) v = normal(rng);
    cpu->RmsNorm(x.data(), n, dim, gain.data(), 1e-5f, want.data());
    float *dx, *dg, *dy;
    ASSERT_EQ(cudaMalloc(&dx, x.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dg, gain.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dy, x.size() * 4), cudaSuccess);
    cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dg, gain.data(), gain.size() * 4, cudaMemcpyHostToDevice);
    RmsNormParams p{dx, dg, dy, n, dim, 1e-5f};
    ASSERT_EQ(LaunchRmsNorm(p, nullptr), 0);
    ASSERT_EQ(cudaMemcpy(got.data(), dy, x.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-4f * (1 + std::abs(want[i])))
          << "n=" << n << " dim=" << dim << " i=" << i;
    }
    cudaFree(dx);
    cudaFree(dg);
    cudaFree(dy);
  }
}

TEST_F(CudaKernels, RejectsEmptyShapes) {
  RmsNormParams p{nullptr, nullptr, nullptr, 0, 64, 1e-5f};
  EXPECT_NE(LaunchRmsNorm(p, nullptr), 0);
}

}  // namespace
}  // namespace infinigen::gpu_worker::cuda
