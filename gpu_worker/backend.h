// Backend: the arithmetic of a transformer layer, on one kind of device.
//
// The engine owns every buffer and calls these operations in order; a backend
// owns no model state. All pointers are to backend-accessible memory (host
// memory for the CPU backend). Matrices are row-major. Implementations are
// not required to be thread-safe: one engine drives one backend.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_H_
#define INFINIGEN_GPU_WORKER_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace infinigen::gpu_worker {

// Causal attention of n queries over a key/value cache.
struct AttentionParams {
  const float* q;    // [n, n_heads, head_dim]
  const float* k;    // [n_kv_heads, kv_stride, head_dim]
  const float* v;    // [n_kv_heads, kv_stride, head_dim]
  float* out;        // [n, n_heads, head_dim]
  int n = 0;         // queries
  int n_heads = 0;
  int n_kv_heads = 0;  // query head h reads KV head h / (n_heads / n_kv_heads)
  int head_dim = 0;
  int kv_stride = 0;   // rows between consecutive KV heads
  // Query i sees KV rows [0, kv_len0 + i): the first query sees kv_len0 rows.
  int kv_len0 = 0;
  float scale = 1.0f;  // applied to q.k before the softmax
  // Optional [n_heads, kv_len0 + n - 1]: each query's attention
  // probabilities are added here (H2O's accumulated attention).
  float* prob_sums = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // y[n, out] = x[n, in] . w[out, in]^T (+ bias[out] if not null).
  virtual void Linear(const float* x, int n, int in, const float* w,
                      const float* bias, int out, float* y) = 0;
  // y[n, dim] = x / rms(x) * gain, per row.
  virtual void RmsNorm(const float* x, int n, int dim, const float* gain,
                       float eps, float* y) = 0;
  // y[n, dim] = (x - mean) / std * gain + bias, per row.
  virtual void LayerNorm(const float* x, int n, int dim, const float* gain,
                         const float* bias, float eps, float* y) = 0;
  // Rotary embedding in place, half-split layout: dims j and j + head_dim/2
  // of each head rotate by positions[i] * theta^(-2j/head_dim).
  // x is [n, n_heads, head_dim].
  virtual void Rope(float* x, int n, int n_heads, int head_dim,
                    const int* positions, float theta) = 0;
  virtual void Attention(const AttentionParams& p) = 0;
  // gate[i] = silu(gate[i]) * up[i], for i < count.
  virtual void SwiGlu(float* gate, const float* up, long count) = 0;
  // x[i] = max(x[i], 0).
  virtual void Relu(float* x, long count) = 0;
  // x[i] += y[i].
  virtual void Add(float* x, const float* y, long count) = 0;
};

// The CPU backend: OpenBLAS for matrix work, plain loops elsewhere. It is
// the reference every other backend is compared with.
std::unique_ptr<Backend> NewCpuBackend();

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_H_
