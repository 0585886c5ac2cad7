// The CUDA backend against the CPU backend, operation by operation, as the
// engine drives it: buffers from AllocateShared, weights registered with
// RegisterConstant (and used through pointers inside their ranges). Then
// the errors: bad shapes, pointers the backend cannot reach, sticky
// errors, devices that do not exist. Skips with the reason when no CUDA
// device answers, except CudaBackendWithoutDevice, which checks that
// creation fails cleanly for a missing device.
#include "gpu_worker/backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <iostream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/half.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/backend/cuda/parity_testing.h"
#include "gpu_worker/backend/shared_vector.h"
#include "gtest/gtest.h"
#include "speculator/partial_keys.h"

namespace infinigen::gpu_worker::cuda {
namespace {

std::unique_ptr<Backend> NewGpu(bool half_precision) {
  CudaBackendOptions options;
  options.half_precision = half_precision;
  auto backend = CreateCudaBackend(0, options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(*backend) : nullptr;
}

bool Contains(const absl::Status& status, const std::string& text) {
  return std::string(status.message()).find(text) != std::string::npos;
}

// `prob` on `backend`: its inputs copied to shared memory, one Attention
// call (with the problem's prob_sums when it has them), synchronized.
struct AttentionRun {
  AttentionRun(Backend* backend, const AttentionProblem& prob)
      : out(prob.want.size(), 0.0f, SharedAllocator<float>(backend)),
        sums(prob.sums.begin(), prob.sums.end(),
             SharedAllocator<float>(backend)) {
    SharedVector<float> q(prob.q.begin(), prob.q.end(),
                          SharedAllocator<float>(backend));
    SharedVector<float> k(prob.k.begin(), prob.k.end(),
                          SharedAllocator<float>(backend));
    SharedVector<float> v(prob.v.begin(), prob.v.end(),
                          SharedAllocator<float>(backend));
    AttentionParams a = prob.shape;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.out = out.data();
    a.prob_sums = prob.c.prob_sums ? sums.data() : nullptr;
    backend->Attention(a);
    status = backend->Synchronize();
  }
  SharedVector<float> out, sums;
  absl::Status status;
};

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = NoDeviceReason(); !why.empty()) {
      GTEST_SKIP() << why;
    }
    gpu_ = NewGpu(/*half_precision=*/false);
    ASSERT_NE(gpu_, nullptr);
  }

  // A copy of `host` in `backend`'s shared memory.
  template <typename T>
  static SharedVector<T> Shared(Backend* backend, const std::vector<T>& host) {
    return SharedVector<T>(host.begin(), host.end(),
                           SharedAllocator<T>(backend));
  }

  // `host` registered with `backend` as a constant; it lives as long as the
  // fixture (a freed range's address could be reused by the next one).
  const float* Constant(Backend* backend, std::vector<float> host) {
    constants_.push_back(std::move(host));
    const std::vector<float>& c = constants_.back();
    EXPECT_TRUE(backend->RegisterConstant(c.data(), c.size()).ok());
    return c.data();
  }

  std::mt19937 rng_{11};
  std::unique_ptr<Backend> cpu_ = NewCpuBackend();
  std::deque<std::vector<float>> constants_;  // outlives the backends below
  std::unique_ptr<Backend> gpu_;              // fp32 weights
};

struct LinearCase {
  int n, in, out;
  bool bias;
  bool registered;  // else the weights are in shared memory
};

// Tolerance rel * (1 + |want| + sqrt(sum_k (x_k w_k)^2)), the last term the
// size of a dot product's rounding error: rel = 1e-4 for fp32 weights
// (cuBLAS sums in another order), 2e-2 for fp16 (each fp16 operand is off
// by up to 2^-11 relative, about 1e-3 for the sum).
TEST_F(CudaBackendTest, LinearMatchesCpu) {
  const LinearCase cases[] = {
      {1, 64, 96, true, true},     {7, 577, 129, false, true},
      {33, 1000, 257, true, true}, {128, 2048, 64, false, true},
      {1, 4096, 11, true, true},   {5, 300, 70, true, false},
  };
  for (bool half : {false, true}) {
    std::unique_ptr<Backend> half_gpu = half ? NewGpu(true) : nullptr;
    Backend* gpu = half ? half_gpu.get() : gpu_.get();
    ASSERT_NE(gpu, nullptr);
    const float rel = half ? 2e-2f : 1e-4f;
    for (const LinearCase& c : cases) {
      const size_t w_size = static_cast<size_t>(c.out) * c.in;
      std::vector<float> x = Normal(static_cast<size_t>(c.n) * c.in, rng_);
      std::vector<float> w = Normal(w_size, rng_, 0.1f);
      std::vector<float> bias = Normal(c.out, rng_);
      std::vector<float> want(static_cast<size_t>(c.n) * c.out);
      cpu_->Linear(x.data(), c.n, c.in, w.data(),
                   c.bias ? bias.data() : nullptr, c.out, want.data());

      SharedVector<float> gx = Shared(gpu, x);
      SharedVector<float> gy(want.size(), 0.0f, SharedAllocator<float>(gpu));
      SharedVector<float> gy2(want.size(), 0.0f, SharedAllocator<float>(gpu));
      auto shared_w = SharedVector<float>(SharedAllocator<float>(gpu));
      auto shared_bias = SharedVector<float>(SharedAllocator<float>(gpu));
      const float* gw;
      const float* gbias;
      if (c.registered) {
        // One range holding padding, the matrix and the bias: the backend
        // must map pointers inside it.
        std::vector<float> range(17, 0.0f);
        range.insert(range.end(), w.begin(), w.end());
        range.insert(range.end(), bias.begin(), bias.end());
        const float* base = Constant(gpu, std::move(range));
        gw = base + 17;
        gbias = gw + w_size;
      } else {
        shared_w = Shared(gpu, w);
        shared_bias = Shared(gpu, bias);
        gw = shared_w.data();
        gbias = shared_bias.data();
      }
      gpu->Linear(gx.data(), c.n, c.in, gw, c.bias ? gbias : nullptr, c.out,
                  gy.data());
      // Again: the cached fp16 weights must give the same result.
      gpu->Linear(gx.data(), c.n, c.in, gw, c.bias ? gbias : nullptr, c.out,
                  gy2.data());
      ASSERT_TRUE(gpu->Synchronize().ok()) << gpu->Synchronize();
      for (int i = 0; i < c.n; ++i) {
        for (int j = 0; j < c.out; ++j) {
          double ss = 0.0;
          for (int k = 0; k < c.in; ++k) {
            const double p =
                static_cast<double>(x[static_cast<size_t>(i) * c.in + k]) *
                w[static_cast<size_t>(j) * c.in + k];
            ss += p * p;
          }
          const size_t at = static_cast<size_t>(i) * c.out + j;
          const float tol = rel * (1 + std::abs(want[at]) +
                                   static_cast<float>(std::sqrt(ss)));
          ASSERT_NEAR(gy[at], want[at], tol)
              << (half ? "fp16" : "fp32") << " n=" << c.n << " in=" << c.in
              << " out=" << c.out << " i=" << i << " j=" << j;
          ASSERT_EQ(gy2[at], gy[at]);
        }
      }
    }
  }
}

// Tolerance 1e-4 * (1 + |want|).
TEST_F(CudaBackendTest, NormsMatchCpu) {
  for (auto [n, dim] : {std::pair{1, 64}, {7, 577}, {33, 1000}, {2, 4096}}) {
    std::vector<float> x = Normal(static_cast<size_t>(n) * dim, rng_, 3.0f);
    for (float& v : x) v += 2.0f;
    std::vector<float> gain = Normal(dim, rng_), bias = Normal(dim, rng_);
    std::vector<float> want_rms(x.size()), want_ln(x.size());
    cpu_->RmsNorm(x.data(), n, dim, gain.data(), 1e-5f, want_rms.data());
    cpu_->LayerNorm(x.data(), n, dim, gain.data(), bias.data(), 1e-5f,
                    want_ln.data());
    const float* ggain = Constant(gpu_.get(), gain);
    const float* gbias = Constant(gpu_.get(), bias);
    SharedVector<float> rms = Shared(gpu_.get(), x);
    SharedVector<float> gx = Shared(gpu_.get(), x);
    SharedVector<float> ln(x.size(), 0.0f, SharedAllocator<float>(gpu_.get()));
    gpu_->RmsNorm(rms.data(), n, dim, ggain, 1e-5f, rms.data());  // in place
    gpu_->LayerNorm(gx.data(), n, dim, ggain, gbias, 1e-5f, ln.data());
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_NEAR(rms[i], want_rms[i], 1e-4f * (1 + std::abs(want_rms[i])))
          << "RmsNorm n=" << n << " dim=" << dim << " i=" << i;
      ASSERT_NEAR(ln[i], want_ln[i], 1e-4f * (1 + std::abs(want_ln[i])))
          << "LayerNorm n=" << n << " dim=" << dim << " i=" << i;
    }
  }
}

// Tolerance 1e-5 * (1 + |want|) + 2.5e-7 * position * (|a| + |b|): the
// frequencies may differ by an ulp (see kernels.h, LaunchRope).
TEST_F(CudaBackendTest, RopeMatchesCpu) {
  struct Case {
    int n, n_heads, head_dim;
    float theta;
  };
  for (const Case& c : {Case{1, 9, 64, 10000.0f}, Case{7, 3, 128, 500000.0f},
                        Case{33, 9, 128, 10000.0f}}) {
    const int row = c.n_heads * c.head_dim, half = c.head_dim / 2;
    std::vector<float> x = Normal(static_cast<size_t>(c.n) * row, rng_);
    std::vector<int> positions(c.n);
    std::uniform_int_distribution<int> pos(0, 4096);
    for (int& p : positions) p = pos(rng_);
    std::vector<float> want = x;
    cpu_->Rope(want.data(), c.n, c.n_heads, c.head_dim, positions.data(),
               c.theta);
    SharedVector<float> gx = Shared(gpu_.get(), x);
    SharedVector<int> gpos = Shared(gpu_.get(), positions);
    gpu_->Rope(gx.data(), c.n, c.n_heads, c.head_dim, gpos.data(), c.theta);
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    for (size_t at = 0; at < x.size(); ++at) {
      const int i = static_cast<int>(at / row);
      const int d = static_cast<int>(at % c.head_dim);
      const size_t head = at - d;
      const float ab =
          std::abs(x[head + d % half]) + std::abs(x[head + d % half + half]);
      ASSERT_NEAR(
          gx[at], want[at],
          1e-5f * (1 + std::abs(want[at])) + 2.5e-7f * positions[i] * ab)
          << "head_dim=" << c.head_dim << " at=" << at;
    }
  }
}

// SwiGlu 1e-5 * (1 + |want|); Relu and Add exact.
TEST_F(CudaBackendTest, PointwiseMatchCpu) {
  for (long count : {1L, 1000L, (1L << 20) + 3}) {
    std::vector<float> gate = Normal(count, rng_, 4.0f),
                       up = Normal(count, rng_);
    std::vector<float> want_swiglu = gate, want_relu = gate, want_add = gate;
    cpu_->SwiGlu(want_swiglu.data(), up.data(), count);
    cpu_->Relu(want_relu.data(), count);
    cpu_->Add(want_add.data(), up.data(), count);
    SharedVector<float> swiglu = Shared(gpu_.get(), gate);
    SharedVector<float> relu = Shared(gpu_.get(), gate);
    SharedVector<float> add = Shared(gpu_.get(), gate);
    SharedVector<float> gup = Shared(gpu_.get(), up);
    SharedVector<float> copied = Shared(gpu_.get(), std::vector<float>(count));
    const float* constant_up = Constant(gpu_.get(), up);  // as a position table
    gpu_->SwiGlu(swiglu.data(), gup.data(), count);
    gpu_->Relu(relu.data(), count);
    gpu_->Add(add.data(), constant_up, count);
    gpu_->Copy(copied.data(), gup.data(), count);
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    for (long i = 0; i < count; ++i) {
      ASSERT_NEAR(swiglu[i], want_swiglu[i],
                  1e-5f * (1 + std::abs(want_swiglu[i])))
          << "count=" << count << " i=" << i;
      ASSERT_EQ(relu[i], want_relu[i]) << "count=" << count << " i=" << i;
      ASSERT_EQ(add[i], want_add[i]) << "count=" << count << " i=" << i;
      ASSERT_EQ(copied[i], up[i]) << "count=" << count << " i=" << i;
    }
  }
}

// Tolerances: ExpectAttentionMatches (parity_testing.h). The backend splits
// long decode caches over blocks by itself, so the long cases also cover
// the split path.
TEST_F(CudaBackendTest, AttentionMatchesCpu) {
  // {n, heads, kv_heads, head_dim, kv_len0, extra_stride, prob_sums}
  const AttentionCase cases[] = {
      {1, 9, 3, 64, 1, 0, true},      {1, 9, 3, 128, 37, 5, true},
      {1, 9, 3, 128, 4096, 3, true},  {1, 9, 3, 64, 4096, 0, false},
      {1, 9, 3, 128, 33000, 0, true}, {13, 9, 3, 64, 20, 4, true},
      {13, 9, 3, 128, 1, 0, true},    {64, 8, 8, 80, 100, 0, false},
      {3, 4, 1, 8, 5, 2, true},       {4, 9, 3, 64, 3000, 0, true},
      // Sliding windows, decode and a chunk.
      {1, 4, 1, 256, 5000, 0, true, 1, 512},
      {40, 4, 1, 256, 700, 0, false, 1, 512},
  };
  for (const AttentionCase& c : cases) {
    const AttentionProblem prob = MakeAttentionProblem(c, rng_, *cpu_);
    AttentionRun run(gpu_.get(), prob);
    ASSERT_TRUE(run.status.ok()) << run.status;
    ASSERT_NO_FATAL_FAILURE(
        ExpectAttentionMatches(prob, run.out.data(), run.sums.data()));
  }
}

// With half precision a prefill chunk (kMinFlashQueries queries or more)
// runs on tensor cores, within the flash kernel's 5e-3 * (1 + |want|)
// (kernels_test); decode steps, and chunks with H2O's probability sums,
// keep the fp32 kernel and its 1e-4.
TEST_F(CudaBackendTest, HalfPrecisionPrefillAttentionMatchesCpu) {
  std::unique_ptr<Backend> half = NewGpu(/*half_precision=*/true);
  ASSERT_NE(half, nullptr);
  const AttentionCase cases[] = {
      {kMinFlashQueries, 8, 2, 64, 1, 0, false},
      {300, 8, 8, 128, 40, 0, false},
      {100, 9, 3, 72, 5, 0, false},  // head_dim 72: the fp32 kernel
      {64, 4, 4, 64, 10, 0, true},   // prob_sums: the fp32 kernel
      {1, 9, 3, 128, 5000, 0, false},
      // A window: the fp32 kernel, whatever the precision.
      {64, 4, 1, 256, 600, 0, false, 1, 512},
  };
  for (const AttentionCase& c : cases) {
    const AttentionProblem prob = MakeAttentionProblem(c, rng_, *cpu_);
    AttentionRun run(half.get(), prob);
    ASSERT_TRUE(run.status.ok()) << run.status;
    const SharedVector<float>& gout = run.out;
    const SharedVector<float>& gsums = run.sums;
    const bool tensor_cores = c.n >= kMinFlashQueries && !c.prob_sums &&
                              c.head_dim % 16 == 0;
    if (!tensor_cores) {
      ASSERT_NO_FATAL_FAILURE(
          ExpectAttentionMatches(prob, gout.data(), gsums.data()));
      continue;
    }
    for (size_t i = 0; i < prob.want.size(); ++i) {
      ASSERT_NEAR(gout[i], prob.want[i], 5e-3f * (1 + std::abs(prob.want[i])))
          << "n=" << c.n << " head_dim=" << c.head_dim << " i=" << i;
    }
  }
}

// A local cache kept in fp16 (HalfKvCache on an fp16 backend): chunk rows
// converted into it with one strided operation as the host rounds them,
// and attention over its fp16 rows as the CPU computes over the same fp16
// rows: decode (the fp32 kernel, KV splits), a window, and prefill chunks
// on tensor cores (the flash kernel's 5e-3 * (1 + |want|)).
TEST_F(CudaBackendTest, HalfKvCacheMatchesCpu) {
  std::unique_ptr<Backend> half = NewGpu(/*half_precision=*/true);
  ASSERT_NE(half, nullptr);
  EXPECT_TRUE(half->HalfKvCache());
  EXPECT_FALSE(gpu_->HalfKvCache());

  const int rows = 37, width = 128, src_stride = 4096, dst_stride = 160;
  const std::vector<float> host = Normal(rows * src_stride, rng_, 3.0f);
  SharedVector<float> src = Shared(half.get(), host);
  SharedVector<uint16_t> dst(rows * dst_stride, 0x7777,
                             SharedAllocator<uint16_t>(half.get()));
  half->CopyRowsToHalf(dst.data(), dst_stride, src.data() + 16, src_stride,
                       rows, width);
  ASSERT_TRUE(half->Synchronize().ok()) << half->Synchronize();
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < dst_stride; ++j) {
      const uint16_t want =
          j < width ? FloatToHalf(host[r * src_stride + 16 + j]) : 0x7777;
      ASSERT_EQ(dst[r * dst_stride + j], want) << r << " " << j;
    }
  }

  // {n, heads, kv_heads, head_dim, kv_len0, extra_stride, prob_sums, ...}
  const AttentionCase cases[] = {
      {1, 9, 3, 128, 4096, 3, false}, {1, 32, 32, 128, 33000, 0, false},
      {1, 4, 1, 256, 5000, 0, false, 1, 512},  // a window
      {kMinFlashQueries, 8, 2, 64, 1, 0, false},
      {300, 8, 8, 128, 40, 0, false},
  };
  for (const AttentionCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "n=" << c.n << " kv_len0="
                                    << c.kv_len0);
    const AttentionProblem prob = MakeAttentionProblem(c, rng_, *cpu_);
    std::vector<uint16_t> k(prob.k.size()), v(prob.v.size());
    FloatToHalf(prob.k.data(), k.size(), k.data());
    FloatToHalf(prob.v.data(), v.size(), v.data());
    AttentionParams a = prob.shape;
    std::vector<float> want(prob.want.size());
    a.q = prob.q.data();
    a.k = a.v = nullptr;
    a.k_half = k.data();
    a.v_half = v.data();
    a.out = want.data();
    a.prob_sums = nullptr;
    cpu_->Attention(a);
    SharedVector<float> q = Shared(half.get(), prob.q);
    SharedVector<uint16_t> kd = Shared(half.get(), k);
    SharedVector<uint16_t> vd = Shared(half.get(), v);
    SharedVector<float> out(want.size(), 0.0f,
                            SharedAllocator<float>(half.get()));
    a.q = q.data();
    a.k_half = kd.data();
    a.v_half = vd.data();
    a.out = out.data();
    half->Attention(a);
    ASSERT_TRUE(half->Synchronize().ok()) << half->Synchronize();
    const bool tensor_cores = c.n >= kMinFlashQueries;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(out[i], want[i],
                  (tensor_cores ? 5e-3f : 1e-4f) * (1 + std::abs(want[i])))
          << "i=" << i;
    }
  }
  // fp16 K with probability sums: an invalid shape.
  SharedVector<float> x(64, 0.0f, SharedAllocator<float>(half.get()));
  SharedVector<uint16_t> kv(64, 0, SharedAllocator<uint16_t>(half.get()));
  AttentionParams bad;
  bad.q = bad.out = bad.prob_sums = x.data();
  bad.k = bad.v = nullptr;
  bad.k_half = bad.v_half = kv.data();
  bad.n = bad.n_heads = bad.n_kv_heads = 1;
  bad.head_dim = 8;
  bad.kv_stride = bad.kv_len0 = 1;
  half->Attention(bad);
  EXPECT_TRUE(absl::IsInvalidArgument(half->Synchronize()));
}

// One strided copy moves what a Copy per row moves (the local cache's
// prefill and decode store K and V rows this way); a stride below the
// width is an invalid shape.
TEST_F(CudaBackendTest, CopyRowsMatchesACopyPerRow) {
  const int rows = 37, width = 128, src_stride = 4096, dst_stride = 160;
  const std::vector<float> host = Normal(rows * src_stride, rng_);
  SharedVector<float> src = Shared(gpu_.get(), host);
  SharedVector<float> dst(rows * dst_stride, -7.0f,
                          SharedAllocator<float>(gpu_.get()));
  gpu_->CopyRows(dst.data(), dst_stride, src.data() + 16, src_stride, rows,
                 width);
  ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < dst_stride; ++j) {
      const float want =
          j < width ? host[r * src_stride + 16 + j] : -7.0f;
      ASSERT_EQ(dst[r * dst_stride + j], want) << r << " " << j;
    }
  }
  auto fresh = NewGpu(false);
  SharedVector<float> a(256, 0.0f, SharedAllocator<float>(fresh.get()));
  fresh->CopyRows(a.data(), 4, a.data() + 128, 8, 2, 16);  // stride < width
  const absl::Status status = fresh->Synchronize();
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_TRUE(Contains(status, "CopyRows")) << status;
}

TEST_F(CudaBackendTest, EmptyOperationsAreNoOps) {
  SharedVector<float> x(8, 1.0f, SharedAllocator<float>(gpu_.get()));
  gpu_->Linear(x.data(), 0, 8, x.data(), nullptr, 1, x.data());
  gpu_->RmsNorm(x.data(), 0, 8, x.data(), 1e-5f, x.data());
  gpu_->Add(x.data(), x.data(), 0);
  gpu_->Relu(x.data(), 0);
  AttentionParams a;
  a.q = a.k = a.v = x.data();
  a.out = x.data();
  a.n = 0;
  gpu_->Attention(a);
  EXPECT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
  EXPECT_EQ(x[0], 1.0f);
}

TEST_F(CudaBackendTest, InvalidShapesAreInvalidArgument) {
  struct BadCall {
    std::string op;
    void (*call)(Backend*, float*, int*);
  };
  const BadCall calls[] = {
      {"Attention",
       [](Backend* b, float* f, int*) {
         AttentionParams a;
         a.q = a.k = a.v = f;
         a.out = f;
         a.n = 1;
         a.n_heads = 9;
         a.n_kv_heads = 2;  // does not divide 9
         a.head_dim = 4;
         a.kv_stride = a.kv_len0 = 4;
         b->Attention(a);
       }},
      {"Attention",
       [](Backend* b, float* f, int*) {
         AttentionParams a;
         a.q = a.k = a.v = f;
         a.out = f;
         a.n = 1;
         a.n_heads = a.n_kv_heads = 1;
         a.head_dim = 4;
         a.kv_stride = 4;
         a.kv_len0 = 0;  // the first query must see a row
         b->Attention(a);
       }},
      {"Rope",
       [](Backend* b, float* f, int* pos) {
         b->Rope(f, 1, 1, 7, pos, 10000.0f);  // odd head_dim
       }},
      {"Linear", [](Backend* b, float* f,
                    int*) { b->Linear(f, -1, 4, f, nullptr, 4, f); }},
      {"RmsNorm",
       [](Backend* b, float* f, int*) { b->RmsNorm(f, 1, 0, f, 1e-5f, f); }},
      {"Add", [](Backend* b, float* f, int*) { b->Add(f, f, -3); }},
  };
  for (const BadCall& bad : calls) {
    std::unique_ptr<Backend> gpu = NewGpu(false);
    ASSERT_NE(gpu, nullptr);
    SharedVector<float> f(64, 0.0f, SharedAllocator<float>(gpu.get()));
    SharedVector<int> pos(4, 0, SharedAllocator<int>(gpu.get()));
    bad.call(gpu.get(), f.data(), pos.data());
    const absl::Status status = gpu->Synchronize();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << bad.op << ": " << status;
    EXPECT_TRUE(Contains(status, bad.op)) << status;
  }
}

// A plain host pointer is an error; errors are sticky and later operations
// are skipped.
TEST_F(CudaBackendTest, HostPointerIsAStickyError) {
  std::vector<float> host(16, 1.0f);
  SharedVector<float> x(16, 2.0f, SharedAllocator<float>(gpu_.get()));
  gpu_->Add(x.data(), host.data(), 16);
  const absl::Status status = gpu_->Synchronize();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, "Add")) << status;
  EXPECT_TRUE(Contains(status, "RegisterConstant")) << status;
  gpu_->Add(x.data(), x.data(), 16);  // valid, but skipped
  EXPECT_EQ(gpu_->Synchronize(), status);
  EXPECT_EQ(x[0], 2.0f);
}

TEST_F(CudaBackendTest, WritingIntoAConstantIsAnError) {
  const float* c = Constant(gpu_.get(), std::vector<float>(16, -1.0f));
  gpu_->Relu(const_cast<float*>(c), 16);
  const absl::Status status = gpu_->Synchronize();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, "Relu")) << status;
}

TEST_F(CudaBackendTest, ReadingPastARegisteredRangeIsAnError) {
  const float* w = Constant(gpu_.get(), std::vector<float>(100, 1.0f));
  SharedVector<float> x(10, 1.0f, SharedAllocator<float>(gpu_.get()));
  SharedVector<float> y(11, 0.0f, SharedAllocator<float>(gpu_.get()));
  gpu_->Linear(x.data(), 1, 10, w, nullptr, 11, y.data());  // needs 110
  const absl::Status status = gpu_->Synchronize();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, "Linear")) << status;
}

TEST_F(CudaBackendTest, RegisterConstantRejectsOverlaps) {
  std::vector<float> w(200, 1.0f);
  EXPECT_TRUE(gpu_->RegisterConstant(w.data(), 100).ok());
  EXPECT_TRUE(gpu_->RegisterConstant(w.data(), 100).ok());  // again: no-op
  EXPECT_TRUE(gpu_->RegisterConstant(w.data() + 100, 100).ok());  // adjacent
  EXPECT_EQ(gpu_->RegisterConstant(w.data() + 50, 100).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->RegisterConstant(nullptr, 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(gpu_->RegisterConstant(nullptr, 0).ok());
  EXPECT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
}

TEST_F(CudaBackendTest, NameAndFailedAllocation) {
  EXPECT_EQ(gpu_->name().rfind("cuda:", 0), 0u) << gpu_->name();
  EXPECT_EQ(gpu_->AllocateShared(size_t{1} << 52), nullptr);
  // A failed allocation is not an operation's error.
  SharedVector<float> x(4, -1.0f, SharedAllocator<float>(gpu_.get()));
  gpu_->Relu(x.data(), 4);
  EXPECT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
  EXPECT_EQ(x[3], 0.0f);
}

// The backend's QuantizePartialKeys and SpeculateScores (the InfiniGen
// policy's partial key rows and scoring) against the CPU backend's
// (speculator::QuantizePartialKeys, SpeculateScores): the same row bytes,
// scores within 1e-4 relative.
TEST_F(CudaBackendTest, SpeculateScoresMatchesCpu) {
  const int n_heads = 9, n_kv_heads = 3, d = 64;
  for (const int n_cols : {19, 64})
  for (const int n_tokens : {1, 300, 5000}) {
    const int k_stride = n_tokens + 3;
    std::vector<float> q = Normal(static_cast<size_t>(n_heads) * d, rng_);
    const std::vector<float> keys =
        Normal(static_cast<size_t>(n_kv_heads) * k_stride * n_cols, rng_);
    std::vector<uint8_t> partial_k(static_cast<size_t>(n_kv_heads) *
                                   k_stride *
                                   speculator::PartialKeyRowBytes(n_cols));
    cpu_->QuantizePartialKeys(keys.data(), n_kv_heads * k_stride, n_cols,
                              partial_k.data(),
                              speculator::PartialKeyRowBytes(n_cols));
    SharedVector<float> gkeys = Shared(gpu_.get(), keys);
    SharedVector<uint8_t> gk(partial_k.size(), 0,
                             SharedAllocator<uint8_t>(gpu_.get()));
    gpu_->QuantizePartialKeys(gkeys.data(), n_kv_heads * k_stride, n_cols,
                              gk.data(),
                              speculator::PartialKeyRowBytes(n_cols));
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    ASSERT_TRUE(std::equal(partial_k.begin(), partial_k.end(), gk.begin()))
        << "n_cols=" << n_cols;
    std::vector<int32_t> cols(static_cast<size_t>(n_kv_heads) * n_cols);
    for (size_t i = 0; i < cols.size(); ++i) cols[i] = (i * 7) % d;
    SpeculationParams p;
    p.n_heads = n_heads;
    p.n_kv_heads = n_kv_heads;
    p.d = d;
    p.k_stride = k_stride;
    p.n_tokens = n_tokens;
    p.n_cols = n_cols;
    std::vector<float> want(static_cast<size_t>(n_heads) * n_tokens);
    p.q_skewed = q.data();
    p.partial_k = partial_k.data();
    p.cols = cols.data();
    p.scores = want.data();
    cpu_->SpeculateScores(p);
    SharedVector<float> gq = Shared(gpu_.get(), q),
                        gscores(want.size(), 0.0f,
                                SharedAllocator<float>(gpu_.get()));
    SharedVector<int32_t> gcols = Shared(gpu_.get(), cols);
    p.q_skewed = gq.data();
    p.partial_k = gk.data();
    p.cols = gcols.data();
    p.scores = gscores.data();
    gpu_->SpeculateScores(p);
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(gscores[i], want[i], 1e-4f * (1 + std::abs(want[i])))
          << "n_tokens=" << n_tokens << " i=" << i;
    }
    // A stride shorter than the tokens is rejected.
    auto other = NewGpu(false);
    ASSERT_NE(other, nullptr);
    p.k_stride = n_tokens - 1;
    other->SpeculateScores(p);
    EXPECT_EQ(other->Synchronize().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// Device-side selection as the policy drives it: speculated logits in
// device memory, each head's count on the host, the chosen positions left
// in device memory. One query head per KV head ranks its logits: exactly
// the CPU's rows. GQA ranks the group's log-softmax, whose log-sum-exp is
// summed in another order: the rows agree but for positions whose combined
// score lies within 1e-4 of the head's cut. Counts above n_tokens are
// rejected.
TEST_F(CudaBackendTest, SelectTopKMatchesCpu) {
  for (const int n_heads : {4, 16}) {
    const int n_kv_heads = 4;
    for (const int n_tokens : {3, 4096, 32768}) {
      std::vector<float> logits =
          Normal(static_cast<size_t>(n_heads) * n_tokens, rng_);
      std::vector<int32_t> offsets(1, 0);
      for (int g = 0; g < n_kv_heads; ++g) {
        offsets.push_back(offsets.back() +
                          std::max(1, n_tokens * (g + 1) / 10));
      }
      TopKParams p;
      p.n_heads = n_heads;
      p.n_kv_heads = n_kv_heads;
      p.n_tokens = n_tokens;
      p.head_offsets = offsets.data();
      std::vector<int32_t> want(offsets.back());
      std::vector<float> combined(static_cast<size_t>(n_kv_heads) * n_tokens);
      p.scores = logits.data();
      p.indices = want.data();
      p.combined = combined.data();
      cpu_->SelectTopK(p);
      SharedVector<float> glogits = Shared(gpu_.get(), logits);
      SharedVector<float> gcombined(combined.size(), 0.0f,
                                    SharedAllocator<float>(gpu_.get()));
      SharedVector<int32_t> got(want.size(), -1,
                                SharedAllocator<int32_t>(gpu_.get()));
      p.scores = glogits.data();
      p.indices = got.data();
      p.combined = gcombined.data();
      gpu_->SelectTopK(p);
      ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
      for (int g = 0; g < n_kv_heads; ++g) {
        SCOPED_TRACE(absl::StrFormat("n_heads=%d n_tokens=%d head %d",
                                     n_heads, n_tokens, g));
        const std::vector<int32_t> w(want.begin() + offsets[g],
                                     want.begin() + offsets[g + 1]);
        const std::vector<int32_t> d(got.begin() + offsets[g],
                                     got.begin() + offsets[g + 1]);
        ASSERT_TRUE(std::is_sorted(d.begin(), d.end()));
        if (n_heads == n_kv_heads) {
          EXPECT_EQ(d, w);
          continue;
        }
        // The CPU's combined scores of this head: its cut is the least
        // chosen one.
        const float* c = combined.data() + static_cast<size_t>(g) * n_tokens;
        float cut = std::numeric_limits<float>::infinity();
        for (int32_t t : w) cut = std::min(cut, c[t]);
        std::vector<int32_t> only_one;
        std::set_symmetric_difference(d.begin(), d.end(), w.begin(), w.end(),
                                      std::back_inserter(only_one));
        for (int32_t t : only_one) {
          EXPECT_NEAR(c[t], cut, 1e-4f) << "position " << t;
        }
        EXPECT_LE(only_one.size(), 4u);
      }
    }
  }
  // A head asked for more tokens than there are.
  auto other = NewGpu(false);
  ASSERT_NE(other, nullptr);
  std::vector<int32_t> offsets = {0, 5};
  SharedVector<float> logits(4, 0.0f, SharedAllocator<float>(other.get()));
  SharedVector<int32_t> indices(5, 0, SharedAllocator<int32_t>(other.get()));
  TopKParams p;
  p.scores = logits.data();
  p.n_heads = p.n_kv_heads = 1;
  p.n_tokens = 4;
  p.head_offsets = offsets.data();
  p.indices = indices.data();
  other->SelectTopK(p);
  EXPECT_EQ(other->Synchronize().code(), absl::StatusCode::kInvalidArgument);
}

// A fetch's staged rows (fp16, int4) attended in one operation, the head
// offsets in device memory: the host reference's outputs (1e-4 * (1 +
// |want|)); long heads are split over blocks.
TEST_F(CudaBackendTest, AttendStagedRowsMatchesHost) {
  const int n_heads = 32, n_kv_heads = 8, hd = 128;
  for (const KvRowFormat format : {KvRowFormat::kHalf, KvRowFormat::kInt4})
  for (const int per_head : {0, 1, 700, 20000}) {
    const int width = KvRowWidth(format, hd);
    std::vector<int32_t> offsets(1, 0);
    for (int g = 0; g < n_kv_heads; ++g) {
      offsets.push_back(offsets.back() + (g % 2 == 0 ? per_head : per_head / 3));
    }
    const int rows = offsets.back();
    std::vector<uint16_t> stored(2 * static_cast<size_t>(std::max(1, rows)) *
                                 width);
    const std::vector<float> x =
        Normal(2 * static_cast<size_t>(std::max(1, rows)) * hd, rng_);
    EncodeKvRows(format, x.data(), 2 * std::max(1, rows), hd, stored.data());
    const std::vector<float> q = Normal(n_heads * hd, rng_);
    const std::vector<float> kv_new = Normal(2 * n_kv_heads * hd, rng_);
    std::vector<float> want(n_heads * hd);
    StagedRowsAttention p;
    p.q = q.data();
    p.k_rows = stored.data();
    p.v_rows = stored.data() + static_cast<size_t>(rows) * width;
    p.head_offsets = offsets.data();
    p.rows = rows;
    p.k_new = kv_new.data();
    p.v_new = kv_new.data() + n_kv_heads * hd;
    p.out = want.data();
    p.n_heads = n_heads;
    p.n_kv_heads = n_kv_heads;
    p.head_dim = hd;
    p.max_head_rows = per_head;
    p.format = format;
    p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    AttendStagedRowsOnHost(p);
    SharedVector<float> gq = Shared(gpu_.get(), q),
                        gkv_new = Shared(gpu_.get(), kv_new),
                        gout(want.size(), 0.0f,
                             SharedAllocator<float>(gpu_.get()));
    SharedVector<uint16_t> gstored = Shared(gpu_.get(), stored);
    SharedVector<int32_t> goffsets = Shared(gpu_.get(), offsets);
    p.q = gq.data();
    p.k_rows = gstored.data();
    p.v_rows = gstored.data() + static_cast<size_t>(rows) * width;
    p.head_offsets = goffsets.data();
    p.k_new = gkv_new.data();
    p.v_new = gkv_new.data() + n_kv_heads * hd;
    p.out = gout.data();
    ASSERT_TRUE(gpu_->AttendStagedRows(p));
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(gout[i], want[i], 1e-4f * (1 + std::abs(want[i])))
          << KvRowFormatName(format) << " per_head=" << per_head
          << " i=" << i;
    }
  }
}

// The policies' batched products in fp32 on cuBLAS against the CPU's
// Linear per entry (1e-4 relative: sums in another order), whatever
// half_precision says; partial key rows quantized a stride apart are the
// CPU's bytes.
TEST_F(CudaBackendTest, BatchedProductsAndStridedPartialKeysMatchCpu) {
  auto half = NewGpu(/*half_precision=*/true);
  ASSERT_NE(half, nullptr);
  const int batch = 32, n = 1, in = 128, out = 38;
  const long x_stride = in, w_stride = out * in, y_stride = 4096 * out;
  const std::vector<float> x = Normal(batch * x_stride, rng_);
  const std::vector<float> w = Normal(batch * w_stride, rng_);
  std::vector<float> want(batch * y_stride, 0.0f);
  cpu_->LinearBatched(x.data(), x_stride, n, in, w.data(), w_stride, out,
                      want.data(), y_stride, batch);
  SharedVector<float> gx = Shared(half.get(), x), gw = Shared(half.get(), w),
                      gy(want.size(), 0.0f, SharedAllocator<float>(half.get()));
  half->LinearBatched(gx.data(), x_stride, n, in, gw.data(), w_stride, out,
                      gy.data(), y_stride, batch);
  ASSERT_TRUE(half->Synchronize().ok()) << half->Synchronize();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(gy[i], want[i], 1e-4f * (1 + std::abs(want[i]))) << i;
  }
  const int n_cols = 38;
  const size_t row_bytes = speculator::PartialKeyRowBytes(n_cols);
  const size_t stride = 100 * row_bytes;
  std::vector<float> keys(batch * n_cols);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = gy[i * 97 % gy.size()];
  std::vector<uint8_t> rows(batch * stride, 0);
  cpu_->QuantizePartialKeys(keys.data(), batch, n_cols, rows.data(), stride);
  SharedVector<float> gkeys = Shared(half.get(), keys);
  SharedVector<uint8_t> grows(rows.size(), 0,
                              SharedAllocator<uint8_t>(half.get()));
  half->QuantizePartialKeys(gkeys.data(), batch, n_cols, grows.data(), stride);
  ASSERT_TRUE(half->Synchronize().ok()) << half->Synchronize();
  EXPECT_TRUE(std::equal(rows.begin(), rows.end(), grows.begin()));
}

// InfiniGen's prompt column sums on the device: the host's sums (the same
// products and magnitudes, added in another order), GQA heads summed into
// their KV head, over 300 tokens (a 256-token block and a tail), added to
// what the sums held; the same bits on a second run.
TEST_F(CudaBackendTest, SkewedColumnSumsMatchCpu) {
  const int n = 300, heads = 8, per_kv = 4, d = 128, groups = heads / per_kv;
  const std::vector<float> x = Normal(n * heads * d, rng_);
  const std::vector<float> skew_t = Normal(groups * d * d, rng_);
  std::vector<float> want(groups * d, 1.0f);
  cpu_->AddSkewedColumnSums(x.data(), n, heads, per_kv, d, skew_t.data(),
                            want.data());
  SharedVector<float> gx = Shared(gpu_.get(), x),
                      ga = Shared(gpu_.get(), skew_t);
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    SharedVector<float> gs(want.size(), 1.0f,
                           SharedAllocator<float>(gpu_.get()));
    gpu_->AddSkewedColumnSums(gx.data(), n, heads, per_kv, d, ga.data(),
                              gs.data());
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(gs[i], want[i], 1e-4f * want[i]) << i;
    }
    if (run == 0) {
      first.assign(gs.begin(), gs.end());
    } else {
      EXPECT_TRUE(std::equal(first.begin(), first.end(), gs.begin()));
    }
  }
}

// Prefill rows encoded on the device: the host's fp16 bits (EncodeKvRows),
// rounding and the largest and smallest values included; int4 rows are
// refused (the host encodes them), nothing written.
TEST_F(CudaBackendTest, EncodesHalfRowsLikeTheHost) {
  const int n_rows = 300, hd = 128;
  std::vector<float> rows = Normal(n_rows * hd, rng_);
  rows[0] = 65504.0f;
  rows[1] = -1e-8f;
  rows[2] = 70000.0f;  // beyond fp16: infinity on both
  std::vector<uint16_t> want(rows.size());
  EncodeKvRows(KvRowFormat::kHalf, rows.data(), n_rows, hd, want.data());
  SharedVector<float> grows = Shared(gpu_.get(), rows);
  SharedVector<uint16_t> got(want.size(), 0,
                             SharedAllocator<uint16_t>(gpu_.get()));
  ASSERT_TRUE(gpu_->EncodeKvRows(grows.data(), n_rows, hd, KvRowFormat::kHalf,
                                 got.data()));
  ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
  EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin()));
  std::fill(got.begin(), got.end(), 7);
  EXPECT_FALSE(gpu_->EncodeKvRows(grows.data(), n_rows, hd,
                                  KvRowFormat::kInt4, got.data()));
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_EQ(got[0], 7);
}

// QueueCopyToHost lands in host memory by the next Synchronize, holding
// what the source held when it was queued (a later operation's write to
// the source is not in it).
TEST_F(CudaBackendTest, QueuedCopiesToTheHostLandBySynchronize) {
  const std::vector<float> values = Normal(1 << 16, rng_);
  SharedVector<float> src = Shared(gpu_.get(), values);
  std::vector<float> dst(values.size(), 0.0f);
  ASSERT_TRUE(gpu_->PinHost(dst.data(), dst.size() * sizeof(float)).ok());
  gpu_->QueueCopyToHost(dst.data(), src.data(), dst.size() * sizeof(float));
  gpu_->Scale(src.data(), static_cast<long>(src.size()), 2.0f);
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_EQ(dst, values);
  gpu_->UnpinHost(dst.data());
}

// Fetched rows as the engine moves them: stored rows (fp16 and int4) in
// host memory, pinned, copied with CopyFromHost, decoded on the device.
// Both decodings are exact (the same conversions as the host's).
TEST_F(CudaBackendTest, FetchedRowsDecodeLikeTheHost) {
  for (const KvRowFormat format : {KvRowFormat::kHalf, KvRowFormat::kInt4}) {
    for (const int head_dim : {64, 128, 32}) {
      SCOPED_TRACE(testing::Message() << KvRowFormatName(format) << " d="
                                      << head_dim);
      const int n_rows = 37;
      const int width = KvRowWidth(format, head_dim);
      const std::vector<float> rows =
          Normal(static_cast<size_t>(n_rows) * head_dim, rng_, 2.0f);
      std::vector<uint16_t> stored(static_cast<size_t>(n_rows) * width);
      EncodeKvRows(format, rows.data(), n_rows, head_dim, stored.data());
      std::vector<float> want(rows.size());
      DecodeKvRows(format, stored.data(), n_rows, head_dim, want.data());

      ASSERT_TRUE(
          gpu_->PinHost(stored.data(), stored.size() * sizeof(uint16_t)).ok());
      SharedVector<uint16_t> staged(stored.size(), 0,
                                    SharedAllocator<uint16_t>(gpu_.get()));
      SharedVector<float> got(rows.size(), 0.0f,
                              SharedAllocator<float>(gpu_.get()));
      gpu_->CopyFromHost(staged.data(), stored.data(),
                         stored.size() * sizeof(uint16_t), gpu_->MarkIssued());
      gpu_->DecodeKvRows(staged.data(), n_rows, head_dim, format, got.data());
      ASSERT_TRUE(gpu_->WaitCopies().ok());
      gpu_->UnpinHost(stored.data());
      ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << "value " << i;
      }
    }
  }
}

// A copy waits for the operations before its mark (they read the old
// contents) and the operations after it see the new contents, while
// operations issued in between run on.
TEST_F(CudaBackendTest, CopyFromHostIsOrderedByMarks) {
  const long count = 1 << 20;  // long enough that a race would show
  std::vector<float> first(count, 1.0f), second(count, 2.0f);
  ASSERT_TRUE(gpu_->PinHost(second.data(), count * sizeof(float)).ok());
  SharedVector<float> staged(first.begin(), first.end(),
                             SharedAllocator<float>(gpu_.get()));
  SharedVector<float> before(count, 0.0f, SharedAllocator<float>(gpu_.get()));
  SharedVector<float> after(count, 0.0f, SharedAllocator<float>(gpu_.get()));
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(gpu_->Synchronize().ok());
    std::fill(staged.begin(), staged.end(), 1.0f);
    gpu_->Copy(before.data(), staged.data(), count);
    const Backend::Mark read = gpu_->MarkIssued();
    EXPECT_GT(read, 0u);
    gpu_->Relu(after.data(), count);  // in between: not waited for
    gpu_->CopyFromHost(staged.data(), second.data(), count * sizeof(float),
                       read);
    gpu_->Copy(after.data(), staged.data(), count);
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    EXPECT_EQ(before[0], 1.0f);
    EXPECT_EQ(before[count - 1], 1.0f);
    EXPECT_EQ(after[0], 2.0f);
    EXPECT_EQ(after[count - 1], 2.0f);
  }
  gpu_->UnpinHost(second.data());
  // Unpinned (pageable) memory copies too.
  std::vector<float> third(count, 3.0f);
  gpu_->CopyFromHost(staged.data(), third.data(), count * sizeof(float), 0);
  ASSERT_TRUE(gpu_->WaitCopies().ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_EQ(staged[count - 1], 3.0f);
}

// One-sided reads of a whole layer (GatherRows without indices: each
// head's first rows): copied from pinned host rows as the host reference
// reads them, whatever the count (one row, some, every slot), and operations
// issued after it see the rows. Rows outside pinned memory are refused
// (the caller has the node gather), and a count that does not split over
// the heads is an error.
TEST_F(CudaBackendTest, LeadingRowsAreReadFromPinnedRows) {
  const int n_heads = 4, head_stride = 300, row_bytes = 256;
  const size_t bytes = static_cast<size_t>(n_heads) * head_stride * row_bytes;
  std::vector<uint8_t> k(bytes), v(bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& x : k) x = static_cast<uint8_t>(byte(rng_));
  for (auto& x : v) x = static_cast<uint8_t>(byte(rng_));
  GatherRowsParams p;
  p.k_rows = k.data();
  p.v_rows = v.data();
  p.head_stride = head_stride;
  p.n_heads = n_heads;
  p.row_bytes = row_bytes;
  std::vector<uint8_t> host_out(2 * bytes);
  p.out = host_out.data();
  p.n_rows = n_heads;
  EXPECT_FALSE(gpu_->GatherRows(p));  // not pinned
  ASSERT_TRUE(gpu_->PinHost(k.data(), bytes).ok());
  ASSERT_TRUE(gpu_->PinHost(v.data(), bytes).ok());
  for (int per_head : {1, 129, head_stride}) {
    SCOPED_TRACE(per_head);
    p.n_rows = static_cast<long>(n_heads) * per_head;
    std::vector<uint8_t> want(2 * p.n_rows * row_bytes);
    p.out = want.data();
    GatherRowsOnHost(p);
    SharedVector<uint16_t> out(want.size() / 2, 0xeeee,
                               SharedAllocator<uint16_t>(gpu_.get()));
    SharedVector<uint16_t> copy(out.size(), 0,
                                SharedAllocator<uint16_t>(gpu_.get()));
    p.out = out.data();
    ASSERT_TRUE(gpu_->GatherRows(p));
    gpu_->Copy(reinterpret_cast<float*>(copy.data()),
               reinterpret_cast<const float*>(out.data()),
               static_cast<long>(out.size() / 2));
    ASSERT_TRUE(gpu_->Synchronize().ok()) << gpu_->Synchronize();
    ASSERT_EQ(std::memcmp(out.data(), want.data(), want.size()), 0);
    ASSERT_EQ(std::memcmp(copy.data(), want.data(), want.size()), 0);
  }
  SharedVector<uint16_t> out(2 * bytes, 0,
                             SharedAllocator<uint16_t>(gpu_.get()));
  p.out = out.data();
  p.n_rows = n_heads * 10 + 1;  // not a whole count a head
  EXPECT_TRUE(gpu_->GatherRows(p));
  EXPECT_FALSE(gpu_->Synchronize().ok());
  gpu_->UnpinHost(k.data());
  gpu_->UnpinHost(v.data());
}

TEST_F(CudaBackendTest, CopyAndPinErrors) {
  std::vector<float> host(16, 1.0f);
  EXPECT_EQ(gpu_->PinHost(nullptr, 16).code(),
            absl::StatusCode::kInvalidArgument);
  // Memory pinned already (as the shm data plane pins its slots) is fine,
  // and stays the first pinner's to unpin.
  ASSERT_TRUE(gpu_->PinHost(host.data(), host.size() * sizeof(float)).ok());
  EXPECT_TRUE(gpu_->PinHost(host.data(), host.size() * sizeof(float)).ok());
  gpu_->UnpinHost(host.data());
  gpu_->UnpinHost(host.data());  // a second unpin does nothing
  EXPECT_TRUE(gpu_->Synchronize().ok());
  // A mark that was never issued is a sticky error.
  SharedVector<float> dst(16, 0.0f, SharedAllocator<float>(gpu_.get()));
  gpu_->CopyFromHost(dst.data(), host.data(), 16 * sizeof(float),
                     gpu_->MarkIssued() + 1000);
  EXPECT_EQ(gpu_->Synchronize().code(), absl::StatusCode::kInvalidArgument);
  // So is a destination the device cannot reach.
  auto fresh = NewGpu(false);
  ASSERT_NE(fresh, nullptr);
  std::vector<float> not_shared(16);
  fresh->CopyFromHost(not_shared.data(), host.data(), 16 * sizeof(float), 0);
  const absl::Status status = fresh->WaitCopies();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Contains(status, "CopyFromHost")) << status;
  // And a shape the int4 format cannot hold.
  auto other = NewGpu(false);
  ASSERT_NE(other, nullptr);
  SharedVector<uint16_t> in(64, 0, SharedAllocator<uint16_t>(other.get()));
  SharedVector<float> out(64, 0.0f, SharedAllocator<float>(other.get()));
  other->DecodeKvRows(in.data(), 1, 30, KvRowFormat::kInt4, out.data());
  EXPECT_EQ(other->Synchronize().code(), absl::StatusCode::kInvalidArgument);
}

// The tests below run everywhere.

TEST(CudaBackendWithoutDevice, MissingDeviceIsUnavailable) {
  for (int device : {99, -1}) {
    auto backend = CreateCudaBackend(device);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable)
        << backend.status();
  }
}

// Without a device, creation reports Unavailable with the reason rather
// than crashing.
TEST(CudaBackendWithoutDevice, CreationIsUnavailable) {
  auto backend = CreateCudaBackend(0);
  if (NoDeviceReason().empty()) {
    EXPECT_TRUE(backend.ok()) << backend.status();
    return;
  }
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable)
      << backend.status();
  EXPECT_TRUE(Contains(backend.status(), "no CUDA device")) << backend.status();
  std::cerr << "CreateCudaBackend(0): " << backend.status() << "\n";
  auto factory = NewCudaBackend(0);
  ASSERT_FALSE(factory.ok());
  EXPECT_EQ(factory.status().code(), absl::StatusCode::kUnavailable)
      << factory.status();
}

}  // namespace
}  // namespace infinigen::gpu_worker::cuda
