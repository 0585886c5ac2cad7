// QueueAttention: one causal attention call on the backend, for every cache.
#include <cmath>

#include "gpu_worker/kv/kv_cache_impl.h"

namespace infinigen::gpu_worker {

void QueueAttention(Backend& backend, const model::ModelConfig& c,
                    const float* q, const float* k, const float* v,
                    int kv_stride, int n, int kv_len0, int window, float* out,
                    float* prob_sums, const uint16_t* k_half,
                    const uint16_t* v_half) {
  AttentionParams p;
  p.q = q;
  if (k_half != nullptr) {
    p.k = p.v = nullptr;
    p.k_half = k_half;
    p.v_half = v_half;
  } else {
    p.k = k;
    p.v = v;
  }
  p.out = out;
  p.n = n;
  p.n_heads = c.n_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.kv_stride = kv_stride;
  p.kv_len0 = kv_len0;
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  p.prob_sums = prob_sums;
  p.window = window;
  backend.Attention(p);
}

}  // namespace infinigen::gpu_worker
