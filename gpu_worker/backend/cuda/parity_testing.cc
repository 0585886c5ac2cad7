#include "gpu_worker/backend/cuda/parity_testing.h"

#include <cuda_runtime.h>

#include <cmath>

#include "gtest/gtest.h"

namespace infinigen::gpu_worker::cuda {

std::vector<float> Normal(size_t n, std::mt19937& rng, float sd) {
  std::normal_distribution<float> normal(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

std::string NoDeviceReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaSuccess && count > 0) return "";
  return std::string("no CUDA device: ") + cudaGetErrorString(err);
}

AttentionProblem MakeAttentionProblem(const AttentionCase& c,
                                      std::mt19937& rng, Backend& cpu) {
  AttentionProblem p;
  p.c = c;
  const int kv_max = c.kv_len0 + c.n - 1;
  const int kv_stride = kv_max + c.extra_stride;
  const size_t q_size = static_cast<size_t>(c.n) * c.n_heads * c.head_dim;
  const size_t kv_size =
      static_cast<size_t>(c.n_kv_heads) * kv_stride * c.head_dim;
  p.q = Normal(q_size, rng, 2.0f);
  p.k = Normal(kv_size, rng);
  p.v = Normal(kv_size, rng);
  p.sums = Normal(static_cast<size_t>(c.n_heads) * kv_max, rng);
  for (float& s : p.sums) s = std::abs(s);
  AttentionParams& a = p.shape;
  a.n = c.n;
  a.n_heads = c.n_heads;
  a.n_kv_heads = c.n_kv_heads;
  a.head_dim = c.head_dim;
  a.kv_stride = kv_stride;
  a.kv_len0 = c.kv_len0;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.window = c.window;
  p.want.assign(q_size, 0.0f);
  p.want_sums = p.sums;
  AttentionParams run = a;
  run.q = p.q.data();
  run.k = p.k.data();
  run.v = p.v.data();
  run.out = p.want.data();
  run.prob_sums = c.prob_sums ? p.want_sums.data() : nullptr;
  cpu.Attention(run);
  return p;
}

void ExpectAttentionMatches(const AttentionProblem& p, const float* out,
                            const float* sums) {
  const AttentionCase& c = p.c;
  const std::string where = "n=" + std::to_string(c.n) +
                            " heads=" + std::to_string(c.n_heads) + "/" +
                            std::to_string(c.n_kv_heads) +
                            " head_dim=" + std::to_string(c.head_dim) +
                            " kv_len0=" + std::to_string(c.kv_len0) +
                            " splits=" + std::to_string(c.kv_splits);
  for (size_t i = 0; i < p.want.size(); ++i) {
    ASSERT_NEAR(out[i], p.want[i], 1e-4f * (1 + std::abs(p.want[i])))
        << where << " i=" << i;
  }
  if (!c.prob_sums) return;
  for (size_t i = 0; i < p.want_sums.size(); ++i) {
    ASSERT_NEAR(sums[i], p.want_sums[i],
                1e-4f * std::abs(p.want_sums[i]) + 1e-7f)
        << where << " prob_sums[" << i << "]";
  }
}

}  // namespace infinigen::gpu_worker::cuda
