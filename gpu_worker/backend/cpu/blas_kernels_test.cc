#include "gpu_worker/backend/cpu/blas_kernels.h"

#include <cblas.h>

#include <vector>

#include "gtest/gtest.h"

namespace infinigen::gpu_worker {
namespace {

TEST(BlasKernels, CoreNamesHaveTheirLevels) {
  EXPECT_EQ(BlasCoreLevel("Prescott"), VectorLevel::kSse);
  EXPECT_EQ(BlasCoreLevel("Nehalem"), VectorLevel::kSse);
  EXPECT_EQ(BlasCoreLevel("Sandybridge"), VectorLevel::kAvx);
  EXPECT_EQ(BlasCoreLevel("Haswell"), VectorLevel::kAvx2);
  EXPECT_EQ(BlasCoreLevel("Zen"), VectorLevel::kAvx2);
  EXPECT_EQ(BlasCoreLevel("SkylakeX"), VectorLevel::kAvx512);
  EXPECT_EQ(BlasCoreLevel("COOPERLAKE"), VectorLevel::kAvx512);
  EXPECT_EQ(BlasCoreLevel("SapphireRapids"), VectorLevel::kAvx512);
  EXPECT_EQ(BlasCoreLevel("no such core"), VectorLevel::kSse);
}

TEST(BlasKernels, AnUnknownCpuGetsTheKernelsOfItsFeatures) {
  // OpenBLAS 0.3.21 on an Emerald Rapids Xeon: Prescott.
  EXPECT_EQ(BetterBlasCore("Prescott", VectorLevel::kAvx512), "SkylakeX");
  EXPECT_EQ(BetterBlasCore("Prescott", VectorLevel::kAvx2), "Haswell");
  EXPECT_EQ(BetterBlasCore("Core2", VectorLevel::kAvx), "Sandybridge");
  EXPECT_EQ(BetterBlasCore("Sandybridge", VectorLevel::kAvx512), "SkylakeX");
}

TEST(BlasKernels, AKnownCpuKeepsOpenBlasChoice) {
  EXPECT_EQ(BetterBlasCore("SkylakeX", VectorLevel::kAvx512), "");
  EXPECT_EQ(BetterBlasCore("Cooperlake", VectorLevel::kAvx512), "");
  EXPECT_EQ(BetterBlasCore("Haswell", VectorLevel::kAvx2), "");
  EXPECT_EQ(BetterBlasCore("Zen", VectorLevel::kAvx2), "");
  // Kernels above what the CPU does are never chosen here.
  EXPECT_EQ(BetterBlasCore("Haswell", VectorLevel::kAvx), "");
  EXPECT_EQ(BetterBlasCore("Prescott", VectorLevel::kSse), "");
}

TEST(BlasKernels, TheLoadedKernelsMultiply) {
  // Whatever OpenBLAS loaded (OPENBLAS_CORETYPE may be set by the test
  // runner), it names its core and computes a product right.
  EXPECT_FALSE(BlasCoreName().empty());
  const int n = 67;  // not a multiple of any kernel's tile
  std::vector<float> a(n * n), b(n * n), c(n * n);
  for (int i = 0; i < n * n; ++i) {
    a[i] = static_cast<float>((i * 7) % 13) - 6.0f;
    b[i] = static_cast<float>((i * 5) % 11) - 5.0f;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f,
              a.data(), n, b.data(), n, 0.0f, c.data(), n);
  for (int i = 0; i < n; i += 11) {
    for (int j = 0; j < n; j += 7) {
      float want = 0.0f;
      for (int k = 0; k < n; ++k) want += a[i * n + k] * b[k * n + j];
      EXPECT_EQ(c[i * n + j], want) << i << "," << j;  // small integers: exact
    }
  }
}

}  // namespace
}  // namespace infinigen::gpu_worker
