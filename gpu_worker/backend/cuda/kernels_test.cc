// Parity of each CUDA kernel with its CPU reference on random shapes: the
// CPU backend, speculator::SpeculateScores / SelectTokens, Int4Policy's
// decode (reached through KvPolicy::Create) and common/half.h. The parity
// tests skip with the reason when no CUDA device answers (CI machines have
// none); the argument checks run everywhere, since the launchers reject
// before touching CUDA.
#include "gpu_worker/backend/cuda/kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "common/half.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/backend/cuda/parity_testing.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gtest/gtest.h"
#include "model/weights.h"
#include "speculator/partial_keys.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker::cuda {
namespace {

// A device copy of a host vector, copied back by ToHost().
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(&data_, bytes()), cudaSuccess);
    // An empty vector's data() may be null, which cudaMemcpy refuses (and
    // the refusal would then be read back as the next launch's error).
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  explicit DeviceArray(size_t size) : DeviceArray(std::vector<T>(size)) {}
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data_); }

  T* get() const { return data_; }
  std::vector<T> ToHost() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  size_t bytes() const { return std::max<size_t>(size_, 1) * sizeof(T); }
  T* data_ = nullptr;
  size_t size_;
};

// The kernel's status, then every launch error and asynchronous fault.
void ExpectRan(int code) {
  ASSERT_EQ(code, 0) << cudaGetErrorString(static_cast<cudaError_t>(code));
  const cudaError_t err = cudaDeviceSynchronize();
  ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = NoDeviceReason(); !why.empty()) {
      GTEST_SKIP() << why;
    }
  }
  std::unique_ptr<Backend> cpu_ = NewCpuBackend();
  std::mt19937 rng_{5};
};

// Tolerance: 1e-4 * (1 + |want|): fp32 sums in another order.
TEST_F(CudaKernels, RmsNormMatchesCpu) {
  for (auto [n, dim] : {std::pair{1, 64}, {7, 577}, {33, 1000}, {2, 4096}}) {
    std::vector<float> x = Normal(n * dim, rng_), gain = Normal(dim, rng_);
    std::vector<float> want(n * dim);
    cpu_->RmsNorm(x.data(), n, dim, gain.data(), 1e-5f, want.data());
    DeviceArray<float> dx(x), dg(gain), dy(want.size());
    ExpectRan(
        LaunchRmsNorm({dx.get(), dg.get(), dy.get(), n, dim, 1e-5f}, nullptr));
    const std::vector<float> got = dy.ToHost();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-4f * (1 + std::abs(want[i])))
          << "n=" << n << " dim=" << dim << " i=" << i;
    }
  }
}

// Tolerance: 1e-4 * (1 + |want|); the rows have a mean far from 0, so the
// two-pass variance matters.
TEST_F(CudaKernels, LayerNormMatchesCpu) {
  for (auto [n, dim] : {std::pair{1, 64}, {7, 577}, {33, 1000}, {2, 4096}}) {
    std::vector<float> x = Normal(n * dim, rng_, 3.0f);
    for (float& v : x) v += 5.0f;
    std::vector<float> gain = Normal(dim, rng_), bias = Normal(dim, rng_);
    std::vector<float> want(n * dim);
    cpu_->LayerNorm(x.data(), n, dim, gain.data(), bias.data(), 1e-5f,
                    want.data());
    DeviceArray<float> dx(x), dg(gain), db(bias);
    // In place, as the engine may call it.
    ExpectRan(LaunchLayerNorm(
        {dx.get(), dg.get(), db.get(), dx.get(), n, dim, 1e-5f}, nullptr));
    const std::vector<float> got = dx.ToHost();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-4f * (1 + std::abs(want[i])))
          << "n=" << n << " dim=" << dim << " i=" << i;
    }
  }
}

// Tolerance: 1e-5 * (1 + |want|) plus, for the rotation angle, 2.5e-7 *
// position * (|a| + |b|): the CPU's powf and the kernel's correctly rounded
// frequency may differ by an ulp (2^-23 relative), which moves the angle
// at position p by up to p * 1.2e-7 rad.
TEST_F(CudaKernels, RopeMatchesCpu) {
  struct Case {
    int n, n_heads, head_dim;
    float theta;
  };
  for (const Case& c : {Case{1, 9, 64, 10000.0f}, Case{5, 3, 128, 500000.0f},
                        Case{17, 2, 8, 10000.0f}, Case{40, 9, 128, 10000.0f}}) {
    const int row = c.n_heads * c.head_dim, half = c.head_dim / 2;
    std::vector<float> x = Normal(c.n * row, rng_);
    std::vector<int> positions(c.n);
    std::uniform_int_distribution<int> pos(0, 4096);
    for (int& p : positions) p = pos(rng_);
    positions[0] = 0;
    std::vector<float> want = x;
    cpu_->Rope(want.data(), c.n, c.n_heads, c.head_dim, positions.data(),
               c.theta);
    DeviceArray<float> dx(x);
    DeviceArray<int> dp(positions);
    ExpectRan(LaunchRope(
        {dx.get(), dp.get(), c.n, c.n_heads, c.head_dim, c.theta}, nullptr));
    const std::vector<float> got = dx.ToHost();
    for (int i = 0; i < c.n; ++i) {
      for (int h = 0; h < c.n_heads; ++h) {
        for (int d = 0; d < c.head_dim; ++d) {
          const size_t at = static_cast<size_t>(i) * row + h * c.head_dim + d;
          const int j = d % half;
          const float ab =
              std::abs(x[at - d + j]) + std::abs(x[at - d + j + half]);
          const float tol =
              1e-5f * (1 + std::abs(want[at])) + 2.5e-7f * positions[i] * ab;
          ASSERT_NEAR(got[at], want[at], tol)
              << "head_dim=" << c.head_dim << " i=" << i << " h=" << h
              << " d=" << d << " position=" << positions[i];
        }
      }
    }
  }
}

// SwiGlu and the GELU gate: 1e-5 * (1 + |want|) (expf and tanhf against
// the CPU's); Relu, Add, Scale and the bias add are single IEEE operations:
// exact.
TEST_F(CudaKernels, PointwiseMatchCpu) {
  for (long count : {1L, 1000L, (1L << 20) + 3}) {
    std::vector<float> gate = Normal(count, rng_, 4.0f),
                       up = Normal(count, rng_);
    std::vector<float> want_swiglu = gate, want_relu = gate, want_add = gate;
    cpu_->SwiGlu(want_swiglu.data(), up.data(), count);
    cpu_->Relu(want_relu.data(), count);
    cpu_->Add(want_add.data(), up.data(), count);
    DeviceArray<float> dswiglu(gate), drelu(gate), dadd(gate), dup(up);
    ExpectRan(LaunchSwiGlu({dswiglu.get(), dup.get(), count}, nullptr));
    ExpectRan(LaunchRelu({drelu.get(), count}, nullptr));
    ExpectRan(LaunchAdd({dadd.get(), dup.get(), count}, nullptr));
    std::vector<float> want_gelu = gate, want_scale = gate;
    cpu_->GeluTanhGate(want_gelu.data(), up.data(), count);
    cpu_->Scale(want_scale.data(), count, 25.3f);
    DeviceArray<float> dgelu(gate), dscale(gate);
    ExpectRan(LaunchGeluTanhGate({dgelu.get(), dup.get(), count}, nullptr));
    ExpectRan(LaunchScale({dscale.get(), count, 25.3f}, nullptr));
    const std::vector<float> gelu = dgelu.ToHost(), scaled = dscale.ToHost();
    for (long i = 0; i < count; ++i) {
      ASSERT_NEAR(gelu[i], want_gelu[i], 1e-5f * (1 + std::abs(want_gelu[i])))
          << "count=" << count << " i=" << i;
      ASSERT_EQ(scaled[i], want_scale[i]) << "count=" << count << " i=" << i;
    }
    const std::vector<float> swiglu = dswiglu.ToHost(), relu = drelu.ToHost(),
                             add = dadd.ToHost();
    for (long i = 0; i < count; ++i) {
      ASSERT_NEAR(swiglu[i], want_swiglu[i],
                  1e-5f * (1 + std::abs(want_swiglu[i])))
          << "count=" << count << " i=" << i;
      ASSERT_EQ(relu[i], want_relu[i]) << "count=" << count << " i=" << i;
      ASSERT_EQ(add[i], want_add[i]) << "count=" << count << " i=" << i;
    }
  }
  for (auto [n, out] : {std::pair{1, 1}, {7, 129}, {300, 4096}}) {
    std::vector<float> y = Normal(n * out, rng_), bias = Normal(out, rng_);
    std::vector<float> want = y;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < out; ++j) want[i * out + j] += bias[j];
    }
    DeviceArray<float> dy(y), db(bias);
    ExpectRan(LaunchBiasAdd({dy.get(), db.get(), n, out}, nullptr));
    EXPECT_EQ(dy.ToHost(), want) << "n=" << n << " out=" << out;
  }
}

// Exact: both round to nearest even (NaN payloads are not compared).
TEST_F(CudaKernels, FloatToHalfMatchesCommonHalf) {
  std::vector<float> x = {0.0f,
                          -0.0f,
                          1.0f,
                          1.0f + 0x1p-11f,  // halfway: rounds to even (1)
                          1.0f + 0x1p-10f + 0x1p-11f,  // halfway: up
                          65504.0f,
                          65519.0f,
                          65520.0f,  // inf
                          -1e9f,
                          0x1p-24f,
                          0x1p-25f,  // ties to 0
                          0x1.8p-24f,
                          0x1p-14f,
                          0x1.ff8p-15f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
  std::uniform_real_distribution<float> exponent(-30.0f, 17.0f);
  std::normal_distribution<float> normal;
  for (int i = 0; i < 100000; ++i) {
    x.push_back(normal(rng_) * std::exp2(exponent(rng_)));
  }
  std::vector<uint16_t> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = FloatToHalf(x[i]);
  DeviceArray<float> dx(x);
  DeviceArray<uint16_t> dy(x.size());
  ExpectRan(LaunchFloatToHalf({dx.get(), dy.get(), static_cast<long>(x.size())},
                              nullptr));
  const std::vector<uint16_t> got = dy.ToHost();
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "x=" << x[i] << " (index " << i << ")";
  }
}

// Exact: every fp16 value (subnormals, infinities, NaNs) has one fp32
// value; NaNs are compared as NaNs.
TEST_F(CudaKernels, HalfToFloatMatchesCommonHalf) {
  std::vector<uint16_t> x(1 << 16);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(i);
  std::vector<float> want(x.size());
  HalfToFloat(x.data(), x.size(), want.data());
  DeviceArray<uint16_t> dx(x);
  DeviceArray<float> dy(x.size());
  ExpectRan(LaunchHalfToFloat({dx.get(), dy.get(), static_cast<long>(x.size())},
                              nullptr));
  const std::vector<float> got = dy.ToHost();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(want[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << "half 0x" << std::hex << i;
    } else {
      ASSERT_EQ(got[i], want[i]) << "half 0x" << std::hex << i;
    }
  }
}

// Exact: nibble * scale is exact in fp32, so the device's fused
// multiply-add rounds like the CPU's multiply and add.
TEST_F(CudaKernels, Int4DequantMatchesInt4Policy) {
  for (int head_dim : {8, 32, 64, 128, 256}) {
    model::Weights weights;
    weights.config.head_dim = head_dim;
    PolicyOptions options;
    options.kind = PolicyKind::kInt4;
    auto policy = KvPolicy::Create(options, {&weights, nullptr, 16});
    ASSERT_TRUE(policy.ok()) << policy.status();
    const int width = (*policy)->RowWidth();
    ASSERT_EQ(width, KvRowWidth(KvRowFormat::kInt4, head_dim));
    const int n_rows = 1031;
    std::vector<float> rows =
        Normal(static_cast<size_t>(n_rows) * head_dim, rng_, 2.0f);
    // A constant group (scale 0) and a group with one outlier.
    for (int d = 0; d < std::min(64, head_dim); ++d) rows[d] = 0.75f;
    rows[head_dim + 1] = 300.0f;
    std::vector<uint16_t> stored(static_cast<size_t>(n_rows) * width);
    (*policy)->EncodeRows(rows.data(), n_rows, stored.data());
    std::vector<float> want(rows.size());
    DecodeKvRows(KvRowFormat::kInt4, stored.data(), n_rows, head_dim,
                 want.data());
    DeviceArray<uint16_t> din(stored);
    DeviceArray<float> dout(rows.size());
    ExpectRan(
        LaunchInt4Dequant({din.get(), dout.get(), n_rows, head_dim}, nullptr));
    EXPECT_EQ(dout.ToHost(), want) << "head_dim=" << head_dim;
  }
}

// The kernel's parameters for `prob` over device copies of its arrays.
AttentionKernelParams KernelParams(const AttentionProblem& prob,
                                   const float* q, const float* k,
                                   const float* v, float* out) {
  AttentionKernelParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.n = prob.c.n;
  p.n_heads = prob.c.n_heads;
  p.n_kv_heads = prob.c.n_kv_heads;
  p.head_dim = prob.c.head_dim;
  p.kv_stride = prob.shape.kv_stride;
  p.kv_len0 = prob.c.kv_len0;
  p.scale = prob.shape.scale;
  p.window = prob.c.window;
  return p;
}

// Tolerances: ExpectAttentionMatches (parity_testing.h).
TEST_F(CudaKernels, AttentionMatchesCpu) {
  // {n, heads, kv_heads, head_dim, kv_len0, extra_stride, prob_sums, splits}
  const AttentionCase cases[] = {
      {1, 9, 3, 64, 1, 0, true, 1},      {1, 9, 3, 128, 37, 5, true, 1},
      {1, 9, 3, 128, 4096, 3, true, 1},  {1, 9, 3, 128, 4096, 3, true, 7},
      {1, 9, 3, 64, 33000, 0, true, 16}, {1, 9, 3, 64, 33000, 0, false, 1},
      {13, 9, 3, 64, 20, 4, true, 1},    {13, 9, 3, 128, 1, 0, true, 3},
      {64, 8, 8, 80, 100, 0, true, 1},   {3, 4, 1, 8, 5, 2, true, 1},
      {2, 6, 2, 256, 300, 0, false, 2},  {200, 9, 3, 128, 57, 0, true, 1},
      // Sliding windows (Gemma 3's local layers): a decode step over a
      // long cache, split or not; a chunk whose windows start at
      // different rows; a window longer than the rows.
      {1, 4, 1, 256, 5000, 0, true, 1, 512},
      {1, 4, 1, 256, 5000, 0, true, 6, 512},
      {40, 4, 1, 256, 700, 3, true, 1, 512},
      {13, 9, 3, 64, 20, 4, true, 2, 100},
  };
  for (const AttentionCase& c : cases) {
    const AttentionProblem prob = MakeAttentionProblem(c, rng_, *cpu_);
    DeviceArray<float> dq(prob.q), dk(prob.k), dv(prob.v),
        dout(prob.want.size()), dsums(prob.sums);
    AttentionKernelParams p =
        KernelParams(prob, dq.get(), dk.get(), dv.get(), dout.get());
    p.prob_sums = c.prob_sums ? dsums.get() : nullptr;
    p.kv_splits = c.kv_splits;
    DeviceArray<float> workspace(
        static_cast<size_t>(AttentionWorkspaceFloats(p)));
    p.workspace = c.kv_splits > 1 ? workspace.get() : nullptr;
    ExpectRan(LaunchAttention(p, nullptr));
    ASSERT_NO_FATAL_FAILURE(ExpectAttentionMatches(
        prob, dout.ToHost().data(), dsums.ToHost().data()));
  }
}

// The tensor-core kernels round q, k and v to fp16 (a relative 5e-4 each)
// and their probabilities too: outputs within 5e-3 * (1 + |want|) of the
// CPU backend's fp32, with K and V given in fp32 or as fp16 rows (a local
// cache kept in fp16). head_dim 64 and 128 run the register-resident
// kernel, the others the WMMA one, which runs every case too. A masking,
// tiling or fragment-layout error moves an output by O(0.1).
TEST_F(CudaKernels, FlashAttentionMatchesCpu) {
  // {n, heads, kv_heads, head_dim, kv_len0, extra_stride}: odd lengths,
  // tiles cut short, GQA, the first query seeing one row, long prefixes.
  const AttentionCase cases[] = {
      {16, 4, 4, 16, 1, 0, false},     {65, 9, 3, 48, 1, 3, false},
      {130, 8, 2, 128, 1, 0, false},   {200, 9, 3, 128, 57, 0, false},
      {64, 4, 1, 256, 300, 5, false},  {1, 2, 2, 64, 10, 0, false},
      {257, 2, 1, 64, 4000, 0, false}, {100, 32, 32, 128, 1, 0, false},
      {63, 6, 6, 80, 2, 1, false},     {333, 8, 2, 128, 1500, 7, false},
      {17, 4, 4, 64, 1, 0, false},
  };
  for (const AttentionCase& c : cases) {
    const AttentionProblem prob = MakeAttentionProblem(c, rng_, *cpu_);
    DeviceArray<float> dq(prob.q), dk(prob.k), dv(prob.v),
        dout(prob.want.size());
    std::vector<uint16_t> k16(prob.k.size()), v16(prob.v.size());
    for (size_t i = 0; i < k16.size(); ++i) k16[i] = FloatToHalf(prob.k[i]);
    for (size_t i = 0; i < v16.size(); ++i) v16[i] = FloatToHalf(prob.v[i]);
    DeviceArray<uint16_t> dk16(k16), dv16(v16);
    for (const bool half_kv : {false, true}) {
      AttentionKernelParams p =
          KernelParams(prob, dq.get(), dk.get(), dv.get(), dout.get());
      if (half_kv) {
        p.k = p.v = nullptr;
        p.k_half = dk16.get();
        p.v_half = dv16.get();
      }
      ASSERT_TRUE(FlashAttentionSupports(p)) << "head_dim " << c.head_dim;
      for (const bool wmma : {false, true}) {
        // NaN everywhere first: every output must be written.
        ASSERT_EQ(cudaMemset(dout.get(), 0xff, prob.want.size() * sizeof(float)),
                  cudaSuccess);
        ExpectRan(wmma ? LaunchFlashAttentionWmma(p, nullptr)
                       : LaunchFlashAttention(p, nullptr));
        const std::vector<float> got = dout.ToHost();
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_NEAR(got[i], prob.want[i],
                      5e-3f * (1 + std::abs(prob.want[i])))
              << "n=" << c.n << " heads=" << c.n_heads << "/" << c.n_kv_heads
              << " head_dim=" << c.head_dim << " kv_len0=" << c.kv_len0
              << " fp16 K/V " << half_kv << " WMMA " << wmma << " query "
              << i / (c.n_heads * c.head_dim) << " head "
              << i / c.head_dim % c.n_heads << " dim " << i % c.head_dim;
        }
      }
    }
  }
}

// One-sided reads: the kernel copies exactly GatherRowsOnHost's bytes, from
// host memory mapped for the device (the node's rows) and from device
// memory, for fp16 rows (256 bytes), int4 rows (72 bytes: 8-byte words) and
// odd widths (2-byte words); plans with empty heads, repeats and the last
// slot.
TEST_F(CudaKernels, GatherRowsMatchesHostGather) {
  struct Case {
    int n_heads, head_stride, row_bytes;
    bool mapped;
  };
  const Case cases[] = {{8, 1000, 256, true},  {8, 1000, 256, false},
                        {4, 513, 72, true},    {3, 64, 6, true},
                        {32, 4096, 256, true}, {1, 10, 512, false}};
  for (const Case& c : cases) {
    const size_t bytes =
        static_cast<size_t>(c.n_heads) * c.head_stride * c.row_bytes;
    std::vector<uint8_t> k(bytes), v(bytes);
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& x : k) x = static_cast<uint8_t>(byte(rng_));
    for (auto& x : v) x = static_cast<uint8_t>(byte(rng_));
    std::vector<int32_t> indices, offsets{0};
    std::uniform_int_distribution<int> slot(0, c.head_stride - 1),
        count(0, 300);
    for (int h = 0; h < c.n_heads; ++h) {
      const int n = h % 3 == 1 ? 0 : count(rng_);
      for (int i = 0; i < n; ++i) indices.push_back(slot(rng_));
      if (n > 0) indices.back() = c.head_stride - 1;
      offsets.push_back(static_cast<int32_t>(indices.size()));
    }
    if (indices.empty()) indices.push_back(0), offsets.back() = 1;
    GatherRowsParams host;
    host.k_rows = k.data();
    host.v_rows = v.data();
    host.head_stride = c.head_stride;
    host.indices = indices.data();
    host.head_offsets = offsets.data();
    host.n_heads = c.n_heads;
    host.n_rows = static_cast<long>(indices.size());
    host.row_bytes = c.row_bytes;
    std::vector<uint8_t> want(2 * indices.size() * c.row_bytes);
    host.out = want.data();
    GatherRowsOnHost(host);

    // The rows where the kernel reads them: pinned host memory mapped for
    // the device, or device memory.
    void* k_src = nullptr;
    void* v_src = nullptr;
    if (c.mapped) {
      ASSERT_EQ(cudaHostAlloc(&k_src, bytes, cudaHostAllocMapped), cudaSuccess);
      ASSERT_EQ(cudaHostAlloc(&v_src, bytes, cudaHostAllocMapped), cudaSuccess);
      std::memcpy(k_src, k.data(), bytes);
      std::memcpy(v_src, v.data(), bytes);
    } else {
      ASSERT_EQ(cudaMalloc(&k_src, bytes), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&v_src, bytes), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(k_src, k.data(), bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(v_src, v.data(), bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    DeviceArray<int32_t> dindices(indices), doffsets(offsets);
    DeviceArray<uint8_t> dout(std::vector<uint8_t>(want.size(), 0xee));
    GatherRowsParams p = host;
    p.k_rows = k_src;
    p.v_rows = v_src;
    p.indices = dindices.get();
    p.head_offsets = doffsets.get();
    p.out = dout.get();
    ExpectRan(LaunchGatherRows(p, nullptr));
    EXPECT_EQ(dout.ToHost(), want)
        << c.n_heads << " heads, " << c.row_bytes << "-byte rows, "
        << (c.mapped ? "mapped host" : "device") << " memory";
    if (c.mapped) {
      cudaFreeHost(k_src);
      cudaFreeHost(v_src);
    } else {
      cudaFree(k_src);
      cudaFree(v_src);
    }
  }
}

// A leading plan (no indices): each head's first rows, as the host reads
// them, from mapped host memory.
TEST_F(CudaKernels, GatherRowsReadsLeadingRows) {
  const int n_heads = 3, head_stride = 200, row_bytes = 256, per_head = 77;
  const size_t bytes = static_cast<size_t>(n_heads) * head_stride * row_bytes;
  void* k_src = nullptr;
  void* v_src = nullptr;
  ASSERT_EQ(cudaHostAlloc(&k_src, bytes, cudaHostAllocMapped), cudaSuccess);
  ASSERT_EQ(cudaHostAlloc(&v_src, bytes, cudaHostAllocMapped), cudaSuccess);
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t i = 0; i < bytes; ++i) {
    static_cast<uint8_t*>(k_src)[i] = static_cast<uint8_t>(byte(rng_));
    static_cast<uint8_t*>(v_src)[i] = static_cast<uint8_t>(byte(rng_));
  }
  GatherRowsParams p;
  p.k_rows = k_src;
  p.v_rows = v_src;
  p.head_stride = head_stride;
  p.n_heads = n_heads;
  p.n_rows = static_cast<long>(n_heads) * per_head;
  p.row_bytes = row_bytes;
  std::vector<uint8_t> want(2 * p.n_rows * row_bytes);
  p.out = want.data();
  GatherRowsOnHost(p);
  DeviceArray<uint8_t> dout(std::vector<uint8_t>(want.size(), 0xee));
  p.out = dout.get();
  ExpectRan(LaunchGatherRows(p, nullptr));
  EXPECT_EQ(dout.ToHost(), want);
  p.n_rows += 1;  // not a whole count a head
  EXPECT_EQ(LaunchGatherRows(p, nullptr),
            static_cast<int>(cudaErrorInvalidValue));
  cudaFreeHost(k_src);
  cudaFreeHost(v_src);
}

// The first touch of every page: one word of each (the last page partial),
// xor'ed into the sink, at two page sizes.
TEST_F(CudaKernels, TouchPagesReadsEveryPagesFirstWord) {
  const size_t bytes = 10 * 4096 + 100;
  void* host = nullptr;
  ASSERT_EQ(cudaHostAlloc(&host, bytes, cudaHostAllocMapped), cudaSuccess);
  std::uniform_int_distribution<unsigned> word;
  auto* words = static_cast<unsigned*>(host);
  for (size_t i = 0; i < bytes / 4; ++i) words[i] = word(rng_);
  void* mapped = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host, 0), cudaSuccess);
  for (size_t page : {size_t{4096}, size_t{64}}) {
    SCOPED_TRACE(page);
    unsigned want = 0x12345678u;
    for (size_t at = 0; at < bytes; at += page) want ^= words[at / 4];
    DeviceArray<unsigned> sink(std::vector<unsigned>{0x12345678u});
    TouchPagesParams p;
    p.data = mapped;
    p.bytes = bytes;
    p.page_bytes = page;
    p.sink = sink.get();
    ExpectRan(LaunchTouchPages(p, nullptr));
    EXPECT_EQ(sink.ToHost()[0], want);
  }
  cudaFreeHost(host);
}

// Sorted random partial columns per KV head, as SelectPartialColumns gives.
std::vector<int32_t> RandomColumns(int n_kv_heads, int d, int n_cols,
                                   std::mt19937& rng) {
  std::vector<int32_t> cols;
  for (int g = 0; g < n_kv_heads; ++g) {
    std::vector<int32_t> all(d);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(n_cols);
    std::sort(all.begin(), all.end());
    cols.insert(cols.end(), all.begin(), all.end());
  }
  return cols;
}

// Per head: the k best positions by (score descending, position
// ascending), listed ascending.
std::vector<int32_t> CpuTopK(const std::vector<float>& scores, int n_kv_heads,
                             int n_tokens, int k) {
  std::vector<int32_t> out;
  for (int g = 0; g < n_kv_heads; ++g) {
    const float* s = scores.data() + static_cast<size_t>(g) * n_tokens;
    std::vector<int32_t> order(n_tokens);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [s](int32_t a, int32_t b) { return s[a] > s[b]; });
    order.resize(k);
    std::sort(order.begin(), order.end());
    out.insert(out.end(), order.begin(), order.end());
  }
  return out;
}

struct SpeculationCase {
  int d, n_tokens;
};

// Scores: 1e-4 * (1 + |want|) (sums of n_cols products in another order).
// Top-k: exact, on the device's own scores, against a CPU top-k and against
// speculator::SelectTokens given the same k (an alpha so large that every
// token is a candidate makes its k the cap, int(n_tokens * max_fraction)).
TEST_F(CudaKernels, SpeculationMatchesSpeculator) {
  const int n_heads = 9, n_kv_heads = 3;
  for (const SpeculationCase& c : {SpeculationCase{64, 1},
                                   {128, 37},
                                   {64, 4096},
                                   {128, 4096},
                                   {128, 33000}}) {
    const int n_cols = speculator::PartialColumnCount(c.d, 0.3);
    const int k_stride = c.n_tokens + 7;
    std::vector<float> q = Normal(static_cast<size_t>(n_heads) * c.d, rng_);
    const std::vector<float> keys =
        Normal(static_cast<size_t>(n_kv_heads) * k_stride * n_cols, rng_);
    // The 4-bit rows, made on the device and on the CPU: the same bytes.
    std::vector<uint8_t> partial_k(static_cast<size_t>(n_kv_heads) *
                                   k_stride *
                                   speculator::PartialKeyRowBytes(n_cols));
    speculator::QuantizePartialKeys(keys.data(), n_kv_heads * k_stride,
                                    n_cols, partial_k.data());
    DeviceArray<float> dkeys(keys);
    DeviceArray<uint8_t> dk(partial_k.size());
    ExpectRan(LaunchQuantizePartialKeys(
        {dkeys.get(), dk.get(), n_kv_heads * k_stride, n_cols}, nullptr));
    ASSERT_EQ(dk.ToHost(), partial_k) << "d=" << c.d;
    std::vector<int32_t> cols = RandomColumns(n_kv_heads, c.d, n_cols, rng_);
    std::vector<float> want(static_cast<size_t>(n_heads) * c.n_tokens);
    speculator::SpeculateScores(q.data(), n_heads, n_kv_heads, c.d,
                                partial_k.data(), k_stride, c.n_tokens,
                                cols.data(), n_cols, want.data());
    DeviceArray<float> dq(q), dscores(want.size());
    DeviceArray<int32_t> dcols(cols);
    ExpectRan(LaunchSpeculateScores(
        {dq.get(), dk.get(), dcols.get(), dscores.get(), n_heads, n_kv_heads,
         c.d, k_stride, c.n_tokens, n_cols},
        nullptr));
    const std::vector<float> scores = dscores.ToHost();
    for (size_t i = 0; i < scores.size(); ++i) {
      ASSERT_NEAR(scores[i], want[i], 1e-4f * (1 + std::abs(want[i])))
          << "d=" << c.d << " n_tokens=" << c.n_tokens << " i=" << i;
    }

    // Each query head's row of scores as a head to select from.
    for (float fraction : {0.0f, 0.2f, 0.5f, 1.0f}) {
      const int k = std::max(1, static_cast<int>(c.n_tokens * fraction));
      DeviceArray<int32_t> dindices(static_cast<size_t>(n_heads) * k);
      ExpectRan(LaunchSelectTopK(
          {dscores.get(), dindices.get(), n_heads, c.n_tokens, k}, nullptr));
      const std::vector<int32_t> got = dindices.ToHost();
      EXPECT_EQ(got, CpuTopK(scores, n_heads, c.n_tokens, k))
          << "n_tokens=" << c.n_tokens << " k=" << k;
      speculator::SelectionOptions options;
      options.alpha = 1e30f;
      options.max_fraction = fraction;
      std::vector<int32_t> indices, offsets;
      ASSERT_EQ(speculator::SelectTokens(scores.data(), n_heads, c.n_tokens,
                                         nullptr, options, indices, offsets),
                k);
      EXPECT_EQ(got, indices) << "n_tokens=" << c.n_tokens << " k=" << k;
    }
  }
}

// Exact. Scores with many ties (small integers, both zeros, infinities):
// ties go to the lower position, -0 ties with +0.
TEST_F(CudaKernels, SelectTopKBreaksTiesByPosition) {
  const int n_kv_heads = 4;
  std::uniform_int_distribution<int> value(-3, 3);
  for (int n_tokens : {1, 5, 513, 4096, 33000}) {
    std::vector<float> scores(static_cast<size_t>(n_kv_heads) * n_tokens);
    for (float& s : scores) {
      const int v = value(rng_);
      s = v == 0 ? -0.0f : static_cast<float>(v);
    }
    for (size_t i = 0; i < scores.size(); i += 7) scores[i] = 0.0f;
    scores[0] = -std::numeric_limits<float>::infinity();
    if (scores.size() > 3) scores[3] = std::numeric_limits<float>::infinity();
    DeviceArray<float> dscores(scores);
    for (int k : {1, 2, n_tokens / 3 + 1, n_tokens}) {
      k = std::min(k, n_tokens);
      DeviceArray<int32_t> dindices(static_cast<size_t>(n_kv_heads) * k);
      ExpectRan(LaunchSelectTopK(
          {dscores.get(), dindices.get(), n_kv_heads, n_tokens, k}, nullptr));
      EXPECT_EQ(dindices.ToHost(), CpuTopK(scores, n_kv_heads, n_tokens, k))
          << "n_tokens=" << n_tokens << " k=" << k;
    }
  }
}

// Exact. Each head its own count (none, one, a third, all) over scores
// with NaN, infinities and ties: speculator::SelectTopKPerHead's rows.
TEST_F(CudaKernels, SelectTopKTakesEachHeadsCount) {
  const int n_kv_heads = 5;
  std::uniform_int_distribution<int> tie(0, 9);
  for (int n_tokens : {1, 700, 33000}) {
    std::vector<float> scores =
        Normal(static_cast<size_t>(n_kv_heads) * n_tokens, rng_);
    for (size_t i = 0; i < scores.size(); ++i) {
      const int r = tie(rng_);
      if (r == 0) scores[i] = std::nanf("");
      if (r == 1) scores[i] = 0.5f;
      if (r == 2 && i % 3 == 0) {
        scores[i] = -std::numeric_limits<float>::infinity();
      }
    }
    const int counts[n_kv_heads] = {0, 1, n_tokens / 3, n_tokens,
                                    (n_tokens + 1) / 2};
    std::vector<int32_t> offsets(1, 0);
    for (int k : counts) offsets.push_back(offsets.back() + k);
    std::vector<int32_t> want, want_offsets;
    speculator::SelectTopKPerHead(scores.data(), n_kv_heads, n_tokens,
                                  nullptr, counts, want, want_offsets);
    ASSERT_EQ(want_offsets, offsets);
    DeviceArray<float> dscores(scores);
    DeviceArray<int32_t> doffsets(offsets);
    DeviceArray<int32_t> dindices(std::max<size_t>(want.size(), 1));
    SelectTopKParams p{dscores.get(), dindices.get(), n_kv_heads, n_tokens, 0};
    p.head_offsets = doffsets.get();
    ExpectRan(LaunchSelectTopK(p, nullptr));
    std::vector<int32_t> got = dindices.ToHost();
    got.resize(want.size());
    EXPECT_EQ(got, want) << "n_tokens=" << n_tokens;
  }
}

// The combined rank of GQA heads against speculator::CombineHeadScores:
// 1e-5 * (1 + |want|) (the log-sum-exp summed in another order); a head of
// -inf logits adds nothing, as on the CPU.
TEST_F(CudaKernels, CombineHeadScoresMatchesSpeculator) {
  const int n_heads = 12, n_kv_heads = 3;
  for (int n_tokens : {1, 37, 5000}) {
    std::vector<float> logits =
        Normal(static_cast<size_t>(n_heads) * n_tokens, rng_);
    for (float& v : logits) v *= 4.0f;
    std::fill_n(logits.begin() + n_tokens, n_tokens,
                -std::numeric_limits<float>::infinity());  // head 1
    std::vector<float> want(static_cast<size_t>(n_kv_heads) * n_tokens);
    speculator::CombineHeadScores(logits.data(), n_heads, n_kv_heads,
                                  n_tokens, nullptr, want.data());
    DeviceArray<float> dlogits(logits), dscores(want.size());
    ExpectRan(LaunchCombineHeadScores(
        {dlogits.get(), dscores.get(), n_heads, n_kv_heads, n_tokens},
        nullptr));
    const std::vector<float> got = dscores.ToHost();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-5f * (1 + std::abs(want[i])))
          << "n_tokens=" << n_tokens << " i=" << i;
    }
  }
}

struct StagedCase {
  int n_heads, n_kv_heads, head_dim, kv_splits;
  std::vector<int32_t> counts;  // each KV head's staged rows
  KvRowFormat format = KvRowFormat::kHalf;
};

// Every head's staged rows (fp16, int4) in one launch against the host
// reference (AttendStagedRowsOnHost): 1e-4 * (1 + |want|), sums in another
// order. Empty heads, one row, long heads split over blocks, GQA and MHA.
TEST_F(CudaKernels, StagedAttentionMatchesHost) {
  const StagedCase cases[] = {
      {4, 4, 64, 1, {0, 1, 7, 300}},
      {8, 2, 128, 1, {513, 0}},
      {8, 2, 128, 7, {5000, 2}},
      {32, 32, 128, 4, std::vector<int32_t>(32, 3277)},
      {6, 3, 80, 3, {1, 2000, 0}},
      {8, 4, 128, 1, {0, 9, 300, 1}, KvRowFormat::kInt4},
      {32, 32, 128, 4, std::vector<int32_t>(32, 1000), KvRowFormat::kInt4},
      {4, 2, 32, 2, {700, 3}, KvRowFormat::kInt4},
  };
  for (const StagedCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "heads " << c.n_heads << "/"
                                      << c.n_kv_heads << " d " << c.head_dim
                                      << " splits " << c.kv_splits);
    std::vector<int32_t> offsets(1, 0);
    int most = 0;
    for (int32_t n : c.counts) {
      offsets.push_back(offsets.back() + n);
      most = std::max(most, n);
    }
    const int rows = offsets.back();
    const int hd = c.head_dim;
    const int width = KvRowWidth(c.format, hd);
    std::vector<uint16_t> k16(std::max(1, rows) * width), v16(k16.size());
    for (auto* stored : {&k16, &v16}) {
      const std::vector<float> x =
          Normal(static_cast<size_t>(std::max(1, rows)) * hd, rng_);
      EncodeKvRows(c.format, x.data(), std::max(1, rows), hd, stored->data());
    }
    const std::vector<float> q = Normal(c.n_heads * hd, rng_);
    const std::vector<float> k_new = Normal(c.n_kv_heads * hd, rng_);
    const std::vector<float> v_new = Normal(c.n_kv_heads * hd, rng_);
    std::vector<float> want(c.n_heads * hd);
    StagedRowsAttention host;
    host.q = q.data();
    host.k_rows = k16.data();
    host.v_rows = v16.data();
    host.head_offsets = offsets.data();
    host.rows = rows;
    host.k_new = k_new.data();
    host.v_new = v_new.data();
    host.out = want.data();
    host.n_heads = c.n_heads;
    host.n_kv_heads = c.n_kv_heads;
    host.head_dim = hd;
    host.max_head_rows = most;
    host.format = c.format;
    host.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    AttendStagedRowsOnHost(host);
    DeviceArray<float> dq(q), dk_new(k_new), dv_new(v_new), dout(want.size());
    DeviceArray<uint16_t> dk(k16), dv(v16);
    DeviceArray<int32_t> doffsets(offsets);
    StagedAttentionParams p{dq.get(),     dk.get(),     dv.get(),
                            doffsets.get(), dk_new.get(), dv_new.get(),
                            dout.get()};
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = hd;
    p.row_width = width;
    p.int4_group = c.format == KvRowFormat::kInt4 ? std::min(64, hd) : 0;
    p.scale = host.scale;
    p.kv_splits = c.kv_splits;
    DeviceArray<float> workspace(
        std::max(1L, StagedAttentionWorkspaceFloats(p)));
    if (c.kv_splits > 1) p.workspace = workspace.get();
    ExpectRan(LaunchStagedAttention(p, nullptr));
    const std::vector<float> got = dout.ToHost();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-4f * (1 + std::abs(want[i]))) << i;
    }
  }
}

// A row cache on the device: the misses moved into their slots
// (LaunchScatterRows, against the host's ScatterRows), then every head's
// rows read by slot or from the staged misses, bit for bit what the same
// kernel gives over the rows staged in plan order (the same rows in the
// same order), fp16 and int4, with the heads split over blocks.
TEST_F(CudaKernels, SlottedAttentionReadsTheRowCacheAsStagedRows) {
  const StagedCase cases[] = {
      {4, 4, 64, 1, {0, 1, 7, 300}},
      {8, 2, 128, 7, {5000, 2}},
      {8, 4, 128, 3, {0, 9, 300, 1}, KvRowFormat::kInt4},
  };
  for (const StagedCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "heads " << c.n_heads << "/"
                                      << c.n_kv_heads << " d " << c.head_dim);
    std::vector<int32_t> offsets(1, 0);
    for (int32_t n : c.counts) offsets.push_back(offsets.back() + n);
    const int rows = offsets.back(), hd = c.head_dim;
    const int width = KvRowWidth(c.format, hd);
    std::vector<uint16_t> k16(std::max(1, rows) * width), v16(k16.size());
    for (auto* stored : {&k16, &v16}) {
      const std::vector<float> x =
          Normal(static_cast<size_t>(std::max(1, rows)) * hd, rng_);
      EncodeKvRows(c.format, x.data(), std::max(1, rows), hd, stored->data());
    }
    // Every fourth planned row a miss (the last one read from the staging),
    // the others held at slot 2r + 1 of a slot array.
    const int slot_rows = 2 * rows + 2;
    std::vector<uint16_t> slot_k(static_cast<size_t>(slot_rows) * width, 0),
        slot_v(slot_k.size(), 0), miss_k, miss_v;
    std::vector<int32_t> slots(std::max(1, rows)), miss_slots;
    for (int r = 0; r < rows; ++r) {
      const uint16_t* kr = &k16[static_cast<size_t>(r) * width];
      const uint16_t* vr = &v16[static_cast<size_t>(r) * width];
      if (r % 4 == 0) {
        miss_k.insert(miss_k.end(), kr, kr + width);
        miss_v.insert(miss_v.end(), vr, vr + width);
        const bool staged = r + 4 >= rows;
        miss_slots.push_back(staged ? -1 : 2 * r + 1);
        slots[r] = staged ? -static_cast<int32_t>(miss_slots.size())
                          : 2 * r + 1;
      } else {
        std::copy_n(kr, width, &slot_k[(2 * r + 1) * width]);
        std::copy_n(vr, width, &slot_v[(2 * r + 1) * width]);
        slots[r] = 2 * r + 1;
      }
    }
    if (miss_k.empty()) miss_k.assign(width, 0), miss_v.assign(width, 0);
    if (miss_slots.empty()) miss_slots.push_back(-1);
    // The host's scatter, then the device's into a zeroed copy.
    std::vector<uint16_t> want_k = slot_k, want_v = slot_v;
    ScatterRowsParams hs;
    hs.k_rows = miss_k.data();
    hs.v_rows = miss_v.data();
    hs.slots = miss_slots.data();
    hs.n_rows = static_cast<long>(miss_slots.size());
    hs.row_width = width;
    hs.slot_k = want_k.data();
    hs.slot_v = want_v.data();
    hs.slot_rows = slot_rows;
    NewCpuBackend()->ScatterRows(hs);
    DeviceArray<uint16_t> dslot_k(slot_k), dslot_v(slot_v), dmiss_k(miss_k),
        dmiss_v(miss_v), dk(k16), dv(v16);
    DeviceArray<int32_t> dmiss_slots(miss_slots), dslots(slots),
        doffsets(offsets);
    ScatterRowsParams ds = hs;
    ds.k_rows = dmiss_k.get();
    ds.v_rows = dmiss_v.get();
    ds.slots = dmiss_slots.get();
    ds.slot_k = dslot_k.get();
    ds.slot_v = dslot_v.get();
    ExpectRan(LaunchScatterRows(ds, nullptr));
    EXPECT_EQ(dslot_k.ToHost(), want_k);
    EXPECT_EQ(dslot_v.ToHost(), want_v);

    const std::vector<float> q = Normal(c.n_heads * hd, rng_);
    const std::vector<float> k_new = Normal(c.n_kv_heads * hd, rng_);
    const std::vector<float> v_new = Normal(c.n_kv_heads * hd, rng_);
    DeviceArray<float> dq(q), dk_new(k_new), dv_new(v_new),
        dplain(c.n_heads * hd), dslotted(c.n_heads * hd);
    StagedAttentionParams p{dq.get(),       dk.get(),     dv.get(),
                            doffsets.get(), dk_new.get(), dv_new.get(),
                            dplain.get()};
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = hd;
    p.row_width = width;
    p.int4_group = c.format == KvRowFormat::kInt4 ? std::min(64, hd) : 0;
    p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    p.kv_splits = c.kv_splits;
    DeviceArray<float> workspace(
        std::max(1L, StagedAttentionWorkspaceFloats(p)));
    if (c.kv_splits > 1) p.workspace = workspace.get();
    ExpectRan(LaunchStagedAttention(p, nullptr));
    StagedAttentionParams slotted = p;
    slotted.k_rows = dmiss_k.get();
    slotted.v_rows = dmiss_v.get();
    slotted.slots = dslots.get();
    slotted.slot_k = dslot_k.get();
    slotted.slot_v = dslot_v.get();
    slotted.out = dslotted.get();
    ExpectRan(LaunchStagedAttention(slotted, nullptr));
    EXPECT_EQ(dslotted.ToHost(), dplain.ToHost());
  }
}

// No device needed: every launcher rejects bad arguments before any CUDA
// call, with cudaErrorInvalidValue.
TEST(CudaKernelArguments, RejectedBeforeLaunch) {
  const int bad = static_cast<int>(cudaErrorInvalidValue);
  // Never dereferenced: every call below is rejected first.
  float* f = reinterpret_cast<float*>(0x1000);
  int* i = reinterpret_cast<int*>(0x1000);
  int32_t* i32 = reinterpret_cast<int32_t*>(0x1000);
  uint16_t* h = reinterpret_cast<uint16_t*>(0x1000);

  EXPECT_EQ(LaunchRmsNorm({f, f, f, 0, 64, 1e-5f}, nullptr), bad);
  EXPECT_EQ(LaunchRmsNorm({f, nullptr, f, 1, 64, 1e-5f}, nullptr), bad);
  EXPECT_EQ(LaunchLayerNorm({f, f, f, f, 2, 0, 1e-5f}, nullptr), bad);
  EXPECT_EQ(LaunchLayerNorm({f, f, nullptr, f, 2, 8, 1e-5f}, nullptr), bad);
  EXPECT_EQ(LaunchRope({f, i, 1, 2, 7, 10000.0f}, nullptr), bad);  // odd dim
  EXPECT_EQ(LaunchRope({f, i, 1, 0, 8, 10000.0f}, nullptr), bad);
  EXPECT_EQ(LaunchRope({f, i, 1, 2, 8, 0.0f}, nullptr), bad);
  EXPECT_EQ(LaunchSwiGlu({f, f, 0}, nullptr), bad);
  EXPECT_EQ(LaunchRelu({f, -1}, nullptr), bad);
  EXPECT_EQ(LaunchAdd({f, nullptr, 4}, nullptr), bad);
  EXPECT_EQ(LaunchBiasAdd({f, f, 3, 0}, nullptr), bad);
  EXPECT_EQ(LaunchFloatToHalf({f, h, 0}, nullptr), bad);
  EXPECT_EQ(LaunchHalfToFloat({h, f, 0}, nullptr), bad);
  EXPECT_EQ(LaunchHalfToFloat({nullptr, f, 4}, nullptr), bad);
  EXPECT_EQ(LaunchFloatRowsToHalf({f, 8, h, 8, 0, 8}, nullptr), bad);
  EXPECT_EQ(LaunchFloatRowsToHalf({f, 4, h, 8, 2, 8}, nullptr), bad);
  EXPECT_EQ(LaunchFloatRowsToHalf({f, 8, h, 4, 2, 8}, nullptr), bad);
  EXPECT_EQ(LaunchFloatRowsToHalf({f, 8, nullptr, 8, 2, 8}, nullptr), bad);
  EXPECT_EQ(LaunchInt4Dequant({h, f, 4, 6}, nullptr), bad);   // 6 % 4
  EXPECT_EQ(LaunchInt4Dequant({h, f, 4, 96}, nullptr), bad);  // 96 % 64
  EXPECT_EQ(LaunchInt4Dequant({h, f, 0, 64}, nullptr), bad);

  {
    ScatterRowsParams sc;
    sc.k_rows = h;
    sc.v_rows = h;
    sc.slots = i32;
    sc.n_rows = 4;
    sc.row_width = 64;
    sc.slot_k = h;
    sc.slot_v = nullptr;  // no V slots
    sc.slot_rows = 8;
    EXPECT_EQ(LaunchScatterRows(sc, nullptr), bad);
    sc.slot_v = h;
    sc.row_width = 0;
    EXPECT_EQ(LaunchScatterRows(sc, nullptr), bad);
  }
  AttentionKernelParams a;
  a.q = a.k = a.v = f;
  a.out = f;
  a.n = 1;
  a.n_heads = 9;
  a.n_kv_heads = 3;
  a.head_dim = 64;
  a.kv_stride = 10;
  a.kv_len0 = 10;
  AttentionKernelParams b = a;
  b.n_kv_heads = 2;  // does not divide 9
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  b = a;
  b.head_dim = 300;
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  b = a;
  b.kv_len0 = 0;
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  b = a;
  b.n = 2;  // needs kv_stride >= 11
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  b = a;
  b.kv_splits = 2;  // without a workspace
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  b = a;
  b.n = 0;
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  // fp16 K and V: instead of fp32 ones, both, without probability sums.
  b = a;
  b.k_half = b.v_half = h;
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);  // and fp32 ones too
  b.k = b.v = nullptr;
  b.prob_sums = f;
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  b.prob_sums = nullptr;
  b.v_half = nullptr;
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  b.v_half = h;
  b.head_dim = 64;
  EXPECT_TRUE(FlashAttentionSupports(b));
  b.k = f;  // both kinds
  EXPECT_FALSE(FlashAttentionSupports(b));
  b = a;
  b.out = nullptr;
  EXPECT_EQ(LaunchAttention(b, nullptr), bad);
  // The tensor-core kernel: what it does not take, and the same bad shapes.
  EXPECT_TRUE(FlashAttentionSupports(a));
  b = a;
  b.head_dim = 72;  // not a multiple of 16
  EXPECT_FALSE(FlashAttentionSupports(b));
  EXPECT_EQ(LaunchFlashAttention(b, nullptr), bad);
  EXPECT_EQ(LaunchFlashAttentionWmma(b, nullptr), bad);
  b = a;
  b.head_dim = kMaxFlashHeadDim + 16;
  EXPECT_EQ(LaunchFlashAttention(b, nullptr), bad);
  b = a;
  b.prob_sums = f;  // H2O's sums: the fp32 kernel's
  EXPECT_FALSE(FlashAttentionSupports(b));
  EXPECT_EQ(LaunchFlashAttention(b, nullptr), bad);
  b = a;
  b.q = f + 1;  // not 16-byte aligned
  EXPECT_FALSE(FlashAttentionSupports(b));
  b = a;
  b.n = 2;  // needs kv_stride >= 11
  EXPECT_EQ(LaunchFlashAttention(b, nullptr), bad);
  b = a;
  b.kv_len0 = 0;
  EXPECT_EQ(LaunchFlashAttention(b, nullptr), bad);
  EXPECT_EQ(LaunchFlashAttentionWmma(b, nullptr), bad);
  b = a;
  b.n_kv_heads = 2;
  EXPECT_EQ(LaunchFlashAttention(b, nullptr), bad);

  GatherRowsParams g;
  g.k_rows = g.v_rows = f;
  g.indices = g.head_offsets = i32;
  g.out = f;
  g.n_heads = 2;
  g.n_rows = 4;
  g.head_stride = 8;
  g.row_bytes = 256;
  GatherRowsParams bad_g = g;
  bad_g.row_bytes = 255;  // rows are uint16_t values
  EXPECT_EQ(LaunchGatherRows(bad_g, nullptr), bad);
  bad_g = g;
  bad_g.n_rows = 0;
  EXPECT_EQ(LaunchGatherRows(bad_g, nullptr), bad);
  bad_g = g;
  bad_g.head_offsets = nullptr;  // indices without their heads' offsets
  EXPECT_EQ(LaunchGatherRows(bad_g, nullptr), bad);
  bad_g = g;
  bad_g.indices = nullptr;  // leading: a count that does not split
  bad_g.n_rows = 2 * g.n_heads + 1;
  EXPECT_EQ(LaunchGatherRows(bad_g, nullptr), bad);
  bad_g.n_rows = g.n_heads * (g.head_stride + 1);  // more than a head holds
  EXPECT_EQ(LaunchGatherRows(bad_g, nullptr), bad);
  bad_g = g;
  bad_g.head_stride = 0;
  EXPECT_EQ(LaunchGatherRows(bad_g, nullptr), bad);

  TouchPagesParams touch;
  touch.data = f;
  touch.bytes = 4096;
  touch.sink = reinterpret_cast<unsigned*>(i32);
  TouchPagesParams bad_touch = touch;
  bad_touch.bytes = 4098;  // not whole words
  EXPECT_EQ(LaunchTouchPages(bad_touch, nullptr), bad);
  bad_touch = touch;
  bad_touch.page_bytes = 3000;  // not a power of two
  EXPECT_EQ(LaunchTouchPages(bad_touch, nullptr), bad);
  bad_touch = touch;
  bad_touch.sink = nullptr;
  EXPECT_EQ(LaunchTouchPages(bad_touch, nullptr), bad);
  bad_touch = touch;
  bad_touch.bytes = 0;
  EXPECT_EQ(LaunchTouchPages(bad_touch, nullptr), bad);

  uint8_t* u8 = reinterpret_cast<uint8_t*>(0x1000);
  SpeculationParams s{f, u8, i32, f, 9, 3, 64, 100, 100, 19};
  SpeculationParams t = s;
  t.n_cols = 65;  // more than d
  EXPECT_EQ(LaunchSpeculateScores(t, nullptr), bad);
  t = s;
  t.k_stride = 99;  // fewer than n_tokens
  EXPECT_EQ(LaunchSpeculateScores(t, nullptr), bad);
  t = s;
  t.n_kv_heads = 2;
  EXPECT_EQ(LaunchSpeculateScores(t, nullptr), bad);
  t = s;
  t.n_tokens = 0;
  EXPECT_EQ(LaunchSpeculateScores(t, nullptr), bad);

  EXPECT_EQ(LaunchQuantizePartialKeys({f, u8, 0, 19}, nullptr), bad);
  EXPECT_EQ(LaunchQuantizePartialKeys({f, u8, 5, 0}, nullptr), bad);
  EXPECT_EQ(LaunchQuantizePartialKeys({nullptr, u8, 5, 19}, nullptr), bad);

  EXPECT_EQ(LaunchSelectTopK({f, i32, 3, 100, 0}, nullptr), bad);
  EXPECT_EQ(LaunchSelectTopK({f, i32, 3, 100, 101}, nullptr), bad);
  EXPECT_EQ(LaunchSelectTopK({f, i32, 0, 100, 5}, nullptr), bad);
  {
    StagedAttentionParams s{f, h, h, i32, f, f, f};
    s.n_heads = 4;
    s.n_kv_heads = 2;
    s.head_dim = 64;
    s.row_width = 64;
    s.kv_splits = 2;  // without a workspace
    EXPECT_EQ(LaunchStagedAttention(s, nullptr), bad);
    s.kv_splits = 1;
    s.row_width = 63;  // not an fp16 row of 64
    EXPECT_EQ(LaunchStagedAttention(s, nullptr), bad);
    s.int4_group = 64;
    s.row_width = 64;  // not an int4 row of 64 (2 + 16)
    EXPECT_EQ(LaunchStagedAttention(s, nullptr), bad);
    s.int4_group = 0;
    s.head_dim = 257;
    s.row_width = 257;
    EXPECT_EQ(LaunchStagedAttention(s, nullptr), bad);
    s.head_dim = 64;
    s.row_width = 64;
    s.n_kv_heads = 3;
    EXPECT_EQ(LaunchStagedAttention(s, nullptr), bad);
    s.n_kv_heads = 2;
    s.head_offsets = nullptr;
    EXPECT_EQ(LaunchStagedAttention(s, nullptr), bad);
  }
  EXPECT_EQ(LaunchCombineHeadScores({f, f, 6, 4, 100}, nullptr), bad);
  EXPECT_EQ(LaunchCombineHeadScores({f, f, 6, 3, 0}, nullptr), bad);
  EXPECT_EQ(LaunchCombineHeadScores({nullptr, f, 6, 3, 100}, nullptr), bad);
}

}  // namespace
}  // namespace infinigen::gpu_worker::cuda
