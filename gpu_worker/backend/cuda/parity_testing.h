// Test helpers shared by the CUDA parity tests (kernels_test,
// cuda_backend_test): random inputs, the device check every fixture makes,
// and one attention problem with its CPU-backend reference and tolerances.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_CUDA_PARITY_TESTING_H_
#define INFINIGEN_GPU_WORKER_BACKEND_CUDA_PARITY_TESTING_H_

#include <random>
#include <string>
#include <vector>

#include "gpu_worker/backend/backend.h"

namespace infinigen::gpu_worker::cuda {

// n values drawn from N(0, sd^2).
std::vector<float> Normal(size_t n, std::mt19937& rng, float sd = 1.0f);

// Empty when a CUDA device answers; else why not, for GTEST_SKIP.
std::string NoDeviceReason();

struct AttentionCase {
  int n, n_heads, n_kv_heads, head_dim, kv_len0;
  int extra_stride;  // kv_stride - (kv_len0 + n - 1)
  bool prob_sums;
  int kv_splits = 1;  // kernel tests only; the backend picks its own
  int window = 0;     // > 0: sliding-window attention
};

// Random q, k, v (queries at twice the keys' scale, so that peaked softmaxes
// test the running max) and prob_sums starting values, and the CPU
// backend's outputs for them.
struct AttentionProblem {
  AttentionCase c;
  AttentionParams shape;  // every field but the pointers
  std::vector<float> q, k, v, sums;
  std::vector<float> want, want_sums;
};
AttentionProblem MakeAttentionProblem(const AttentionCase& c,
                                      std::mt19937& rng, Backend& cpu);

// Outputs within 1e-4 * (1 + |want|); probability sums within
// 1e-4 * |want| + 1e-7 (relative: a score's rounding error moves its exp by
// that much). `sums` is read only when the case has prob_sums. Fatal
// failures: wrap in ASSERT_NO_FATAL_FAILURE.
void ExpectAttentionMatches(const AttentionProblem& p, const float* out,
                            const float* sums);

}  // namespace infinigen::gpu_worker::cuda

#endif  // INFINIGEN_GPU_WORKER_BACKEND_CUDA_PARITY_TESTING_H_
