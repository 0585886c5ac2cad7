// The Backend defaults every backend starts from, on the CPU backend: the
// stored KV row formats, decoding them, and copies from host memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gpu_worker/backend.h"
#include "gpu_worker/cpu/cpu_backend.h"
#include "gpu_worker/kv_rows.h"
#include "gpu_worker/shared_vector.h"
#include "gtest/gtest.h"

namespace infinigen::gpu_worker {
namespace {

TEST(KvRows, Widths) {
  EXPECT_EQ(KvRowWidth(KvRowFormat::kHalf, 64), 64);
  // Groups of min(64, d): 2 fp16 per group, then d / 4 uint16 of nibbles.
  EXPECT_EQ(KvRowWidth(KvRowFormat::kInt4, 64), 2 + 16);
  EXPECT_EQ(KvRowWidth(KvRowFormat::kInt4, 128), 4 + 32);
  EXPECT_EQ(KvRowWidth(KvRowFormat::kInt4, 32), 2 + 8);
  EXPECT_STREQ(KvRowFormatName(KvRowFormat::kInt4), "int4");
}

TEST(KvRows, HalfRoundTripIsExactForHalfValues) {
  const std::vector<float> rows = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f,
                                   0x1p-24f, 0.333251953125f, -1024.0f};
  std::vector<uint16_t> stored(rows.size());
  EncodeKvRows(KvRowFormat::kHalf, rows.data(), 2, 4, stored.data());
  std::vector<float> back(rows.size());
  DecodeKvRows(KvRowFormat::kHalf, stored.data(), 2, 4, back.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(back[i], rows[i]) << i;
    EXPECT_EQ(std::signbit(back[i]), std::signbit(rows[i])) << i;
  }
}

// Each value comes back within half a quantization step of its group
// (plus the fp16 rounding of the group's minimum and scale).
TEST(KvRows, Int4ErrorIsWithinHalfAStep) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int d = 128, n = 9;
  std::vector<float> rows(n * d);
  for (float& x : rows) x = normal(rng);
  std::vector<uint16_t> stored(n * KvRowWidth(KvRowFormat::kInt4, d));
  EncodeKvRows(KvRowFormat::kInt4, rows.data(), n, d, stored.data());
  std::vector<float> back(rows.size());
  DecodeKvRows(KvRowFormat::kInt4, stored.data(), n, d, back.data());
  for (int r = 0; r < n; ++r) {
    for (int g = 0; g < d / 64; ++g) {
      const float* x = &rows[r * d + g * 64];
      float mn = x[0], mx = x[0];
      for (int i = 0; i < 64; ++i) {
        mn = std::min(mn, x[i]);
        mx = std::max(mx, x[i]);
      }
      const float step = (mx - mn) / 15.0f;
      for (int i = 0; i < 64; ++i) {
        EXPECT_NEAR(back[r * d + g * 64 + i], x[i], step * 0.5f + 1e-2f)
            << "row " << r << " value " << g * 64 + i;
      }
    }
  }
}

TEST(CpuBackend, DecodesStoredRowsLikeTheHost) {
  auto cpu = NewCpuBackend();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (KvRowFormat format : {KvRowFormat::kHalf, KvRowFormat::kInt4}) {
    const int d = 64, n = 5;
    std::vector<float> rows(n * d);
    for (float& x : rows) x = normal(rng);
    std::vector<uint16_t> stored(n * KvRowWidth(format, d));
    EncodeKvRows(format, rows.data(), n, d, stored.data());
    std::vector<float> want(rows.size()), got(rows.size(), -1.0f);
    DecodeKvRows(format, stored.data(), n, d, want.data());
    cpu->DecodeKvRows(stored.data(), n, d, format, got.data());
    EXPECT_EQ(got, want) << KvRowFormatName(format);
  }
}

// On the CPU a copy is done when CopyFromHost returns, in issue order, so
// marks carry no information (0) and pinning has nothing to do.
TEST(CpuBackend, CopiesFromHostAtOnce) {
  auto cpu = NewCpuBackend();
  std::vector<float> src = {1, 2, 3, 4};
  SharedVector<float> dst(4, 0.0f, SharedAllocator<float>(cpu.get()));
  EXPECT_TRUE(cpu->PinHost(src.data(), 16).ok());
  const Backend::Mark mark = cpu->MarkIssued();
  EXPECT_EQ(mark, 0u);
  cpu->CopyFromHost(dst.data(), src.data(), 3 * sizeof(float), mark);
  src[0] = 9;  // after WaitCopies the source is free again
  EXPECT_TRUE(cpu->WaitCopies().ok());
  EXPECT_EQ(std::vector<float>(dst.begin(), dst.end()),
            (std::vector<float>{1, 2, 3, 0}));
  cpu->UnpinHost(src.data());
  EXPECT_TRUE(cpu->Synchronize().ok());
}

// A wrapper forwards every call: its results are the wrapped backend's,
// and an override changes only what it overrides.
TEST(BackendWrapper, ForwardsEveryCallButTheOverridden) {
  class CountingLinear final : public BackendWrapper {
   public:
    CountingLinear() : BackendWrapper(NewCpuBackend()) {}
    void Linear(const float* x, int n, int in, const float* w, const float* b,
                int out, float* y) override {
      ++linears;
      BackendWrapper::Linear(x, n, in, w, b, out, y);
    }
    int linears = 0;
  };
  CountingLinear wrapped;
  auto cpu = NewCpuBackend();
  EXPECT_EQ(wrapped.name(), cpu->name());
  EXPECT_EQ(wrapped.OperatesOnHostMemory(), cpu->OperatesOnHostMemory());
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};  // [2, 3]
  const std::vector<float> w = {1, 0, -1, 2, 2, 2};  // [2, 3]
  const std::vector<float> bias = {0.5f, -0.5f};
  std::vector<float> want(4), got(4);
  cpu->Linear(x.data(), 2, 3, w.data(), bias.data(), 2, want.data());
  wrapped.Linear(x.data(), 2, 3, w.data(), bias.data(), 2, got.data());
  EXPECT_EQ(got, want);
  EXPECT_EQ(wrapped.linears, 1);
  std::vector<float> y = {1, -2, 3};
  wrapped.Relu(y.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{1, 0, 3}));
  void* p = wrapped.AllocateDevice(64);
  ASSERT_NE(p, nullptr);
  wrapped.FreeDevice(p);
  EXPECT_TRUE(wrapped.Synchronize().ok());
}

}  // namespace
}  // namespace infinigen::gpu_worker
