#include "gpu_worker/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

using model::Architecture;
using model::LayerWeights;
using model::ModelConfig;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const model::Weights& weights, std::unique_ptr<Backend> backend,
    const EngineOptions& options) {
  IG_RETURN_IF_ERROR(weights.Validate());
  if (backend == nullptr) {
    return absl::InvalidArgumentError("engine: no backend");
  }
  const ModelConfig& c = weights.config;
  const int max_seq = options.max_seq_len > 0 ? options.max_seq_len
                                              : c.max_seq_len;
  if (c.arch == Architecture::kOpt && max_seq > c.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "engine: max_seq_len %d exceeds OPT's %d learned positions", max_seq,
        c.max_seq_len));
  }
  if (options.max_chunk <= 0) {
    return absl::InvalidArgumentError("engine: max_chunk must be positive");
  }
  return std::unique_ptr<Engine>(new Engine(
      weights, std::move(backend), max_seq, std::min(options.max_chunk, max_seq)));
}

Engine::Engine(const model::Weights& weights, std::unique_ptr<Backend> backend,
               int max_seq_len, int max_chunk)
    : weights_(weights),
      backend_(std::move(backend)),
      max_seq_len_(max_seq_len),
      max_chunk_(max_chunk) {
  const ModelConfig& c = weights.config;
  layer_cache_size_ = static_cast<size_t>(c.n_kv_heads) * max_seq_len_ *
                      c.head_dim;
  k_cache_.assign(layer_cache_size_ * c.n_layers, 0.0f);
  v_cache_.assign(layer_cache_size_ * c.n_layers, 0.0f);
  const size_t n = max_chunk_;
  x_.resize(n * c.dim);
  xb_.resize(n * c.dim);
  q_.resize(n * c.q_dim());
  k_.resize(n * c.kv_dim());
  v_.resize(n * c.kv_dim());
  att_.resize(n * c.q_dim());
  proj_.resize(n * c.dim);
  h1_.resize(n * c.hidden_dim);
  h3_.resize(n * c.hidden_dim);
  positions_.resize(n);
  logits_.resize(n * c.vocab_size);
}

absl::StatusOr<absl::Span<const float>> Engine::Forward(
    absl::Span<const int> tokens, bool all_logits) {
  const ModelConfig& c = weights_.config;
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("forward: no tokens");
  if (all_logits && n > max_chunk_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: all_logits for %d tokens exceeds max_chunk %d", n,
        max_chunk_));
  }
  if (position_ + n > max_seq_len_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: sequence of %d tokens exceeds the cache's %d positions",
        position_ + n, max_seq_len_));
  }
  for (int t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "forward: token %d outside the vocabulary of %d", t, c.vocab_size));
    }
  }
  for (int start = 0; start < n; start += max_chunk_) {
    const int len = std::min(max_chunk_, n - start);
    const bool last_chunk = start + len == n;
    ForwardChunk(tokens.data() + start, len, all_logits,
                 last_chunk || all_logits ? logits_.data() : nullptr);
  }
  if (all_logits) {
    return absl::Span<const float>(logits_.data(),
                                   static_cast<size_t>(n) * c.vocab_size);
  }
  return absl::Span<const float>(logits_.data(), c.vocab_size);
}

void Engine::ForwardChunk(const int* tokens, int n, bool all_logits,
                          float* logits) {
  const ModelConfig& c = weights_.config;
  const bool opt = c.arch == Architecture::kOpt;
  const int dim = c.dim, hd = c.head_dim, qd = c.q_dim(), kvd = c.kv_dim();
  Backend& b = *backend_;

  for (int i = 0; i < n; ++i) {
    positions_[i] = position_ + i;
    std::memcpy(&x_[static_cast<size_t>(i) * dim],
                &weights_.token_embedding[static_cast<size_t>(tokens[i]) * dim],
                dim * sizeof(float));
    if (opt) {
      const float* pos = &weights_.position_embedding[
          static_cast<size_t>(positions_[i] + ModelConfig::kOptPositionOffset) *
          dim];
      b.Add(&x_[static_cast<size_t>(i) * dim], pos, dim);
    }
  }

  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    auto bias = [opt](const std::vector<float>& v) {
      return opt ? v.data() : nullptr;
    };
    // Attention block.
    if (opt) {
      b.LayerNorm(x_.data(), n, dim, w.attn_norm.data(),
                  w.attn_norm_bias.data(), c.norm_eps, xb_.data());
    } else {
      b.RmsNorm(x_.data(), n, dim, w.attn_norm.data(), c.norm_eps,
                xb_.data());
    }
    b.Linear(xb_.data(), n, dim, w.wq.data(), bias(w.bq), qd, q_.data());
    b.Linear(xb_.data(), n, dim, w.wk.data(), bias(w.bk), kvd, k_.data());
    b.Linear(xb_.data(), n, dim, w.wv.data(), bias(w.bv), kvd, v_.data());
    if (!opt) {
      b.Rope(q_.data(), n, c.n_heads, hd, positions_.data(), c.rope_theta);
      b.Rope(k_.data(), n, c.n_kv_heads, hd, positions_.data(), c.rope_theta);
    }
    // Append this chunk's keys and values: [pos][kv_head][d] -> cache layout.
    float* kc = KeyCache(l);
    float* vc = ValueCache(l);
    for (int i = 0; i < n; ++i) {
      for (int g = 0; g < c.n_kv_heads; ++g) {
        const size_t dst =
            (static_cast<size_t>(g) * max_seq_len_ + positions_[i]) * hd;
        const size_t src = static_cast<size_t>(i) * kvd + g * hd;
        std::memcpy(kc + dst, &k_[src], hd * sizeof(float));
        std::memcpy(vc + dst, &v_[src], hd * sizeof(float));
      }
    }
    AttentionParams p;
    p.q = q_.data();
    p.k = kc;
    p.v = vc;
    p.out = att_.data();
    p.n = n;
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = hd;
    p.kv_stride = max_seq_len_;
    p.kv_len0 = position_ + 1;
    p.scale = scale;
    b.Attention(p);
    b.Linear(att_.data(), n, qd, w.wo.data(), bias(w.bo), dim, proj_.data());
    b.Add(x_.data(), proj_.data(), static_cast<long>(n) * dim);

    // MLP block.
    if (opt) {
      b.LayerNorm(x_.data(), n, dim, w.ffn_norm.data(),
                  w.ffn_norm_bias.data(), c.norm_eps, xb_.data());
      b.Linear(xb_.data(), n, dim, w.w1.data(), w.b1.data(), c.hidden_dim,
               h1_.data());
      b.Relu(h1_.data(), static_cast<long>(n) * c.hidden_dim);
      b.Linear(h1_.data(), n, c.hidden_dim, w.w2.data(), w.b2.data(), dim,
               proj_.data());
    } else {
      b.RmsNorm(x_.data(), n, dim, w.ffn_norm.data(), c.norm_eps, xb_.data());
      b.Linear(xb_.data(), n, dim, w.w1.data(), nullptr, c.hidden_dim,
               h1_.data());
      b.Linear(xb_.data(), n, dim, w.w3.data(), nullptr, c.hidden_dim,
               h3_.data());
      b.SwiGlu(h1_.data(), h3_.data(), static_cast<long>(n) * c.hidden_dim);
      b.Linear(h1_.data(), n, c.hidden_dim, w.w2.data(), nullptr, dim,
               proj_.data());
    }
    b.Add(x_.data(), proj_.data(), static_cast<long>(n) * dim);
  }
  position_ += n;

  if (logits == nullptr) return;
  // Final norm and classifier: every row, or just the last one.
  const int first = all_logits ? 0 : n - 1;
  const int rows = n - first;
  const float* xr = &x_[static_cast<size_t>(first) * dim];
  if (opt) {
    b.LayerNorm(xr, rows, dim, weights_.final_norm.data(),
                weights_.final_norm_bias.data(), c.norm_eps, xb_.data());
  } else {
    b.RmsNorm(xr, rows, dim, weights_.final_norm.data(), c.norm_eps,
              xb_.data());
  }
  b.Linear(xb_.data(), rows, dim, weights_.classifier(), nullptr, c.vocab_size,
           logits);
}

}  // namespace infinigen::gpu_worker
