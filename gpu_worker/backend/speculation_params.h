// The parameters of InfiniGen's speculated scores, shared by the Backend
// interface and the CUDA kernel (plain C++, no dependencies, so that nvcc
// compiles it too).
#ifndef INFINIGEN_GPU_WORKER_BACKEND_SPECULATION_PARAMS_H_
#define INFINIGEN_GPU_WORKER_BACKEND_SPECULATION_PARAMS_H_

#include <cstdint>

#include "speculator/partial_keys.h"

namespace infinigen::gpu_worker {

// InfiniGen's speculated attention logits over the partial key cache, per
// query head (speculator::SpeculateScores): for h in KV head g's group,
//   scores[h][t] = sum_c (q_skewed[h][cols[g][c]] / sqrt(d)) * k_g,t[c]
// where k_g,t is the partial key row [g][t] read back, 4-bit or fp32 by
// `format` (speculator/partial_keys.h).
struct SpeculationParams {
  const float* q_skewed;     // [n_heads, d]
  const uint8_t* partial_k;  // [n_kv_heads, k_stride] rows of
                             // PartialKeyRowBytes(n_cols) bytes
  const int32_t* cols;     // [n_kv_heads, n_cols], each in [0, d)
  float* scores;           // [n_heads, n_tokens]
  int n_heads = 0;
  int n_kv_heads = 0;  // divides n_heads
  int d = 0;           // head dimension
  int k_stride = 0;    // rows, >= n_tokens
  int n_tokens = 0;
  int n_cols = 0;  // 1..d
  speculator::PartialKeyFormat format = speculator::PartialKeyFormat::kInt4;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_SPECULATION_PARAMS_H_
