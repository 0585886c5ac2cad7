#include "model/weights.h"

#include <cstddef>
#include <string>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::model {
namespace {

absl::Status CheckSize(const std::string& name, const std::vector<float>& t,
                       size_t want) {
  if (t.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor %s has %d values, the config wants %d", name,
                        t.size(), want));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Weights::Validate() const {
  IG_RETURN_IF_ERROR(config.Validate());
  const ModelConfig& c = config;
  const size_t dim = c.dim, hid = c.hidden_dim, q = c.q_dim(), kv = c.kv_dim();
  const bool opt = c.arch == Architecture::kOpt;
  IG_RETURN_IF_ERROR(
      CheckSize("token_embedding", token_embedding, size_t(c.vocab_size) * dim));
  if (opt) {
    IG_RETURN_IF_ERROR(CheckSize(
        "position_embedding", position_embedding,
        size_t(c.max_seq_len + ModelConfig::kOptPositionOffset) * dim));
  }
  if (layers.size() != size_t(c.n_layers)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "weights have %d layers, the config wants %d", layers.size(),
        c.n_layers));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& l = layers[i];
    auto n = [i](const char* t) { return absl::StrFormat("layers.%d.%s", i, t); };
    IG_RETURN_IF_ERROR(CheckSize(n("attn_norm"), l.attn_norm, dim));
    IG_RETURN_IF_ERROR(CheckSize(n("wq"), l.wq, q * dim));
    IG_RETURN_IF_ERROR(CheckSize(n("wk"), l.wk, kv * dim));
    IG_RETURN_IF_ERROR(CheckSize(n("wv"), l.wv, kv * dim));
    IG_RETURN_IF_ERROR(CheckSize(n("wo"), l.wo, dim * q));
    IG_RETURN_IF_ERROR(CheckSize(n("ffn_norm"), l.ffn_norm, dim));
    IG_RETURN_IF_ERROR(CheckSize(n("w1"), l.w1, hid * dim));
    IG_RETURN_IF_ERROR(CheckSize(n("w2"), l.w2, dim * hid));
    if (opt) {
      IG_RETURN_IF_ERROR(CheckSize(n("attn_norm_bias"), l.attn_norm_bias, dim));
      IG_RETURN_IF_ERROR(CheckSize(n("ffn_norm_bias"), l.ffn_norm_bias, dim));
      IG_RETURN_IF_ERROR(CheckSize(n("bq"), l.bq, q));
      IG_RETURN_IF_ERROR(CheckSize(n("bk"), l.bk, kv));
      IG_RETURN_IF_ERROR(CheckSize(n("bv"), l.bv, kv));
      IG_RETURN_IF_ERROR(CheckSize(n("bo"), l.bo, dim));
      IG_RETURN_IF_ERROR(CheckSize(n("b1"), l.b1, hid));
      IG_RETURN_IF_ERROR(CheckSize(n("b2"), l.b2, dim));
    } else {
      IG_RETURN_IF_ERROR(CheckSize(n("w3"), l.w3, hid * dim));
    }
    if (c.arch == Architecture::kGemma3) {
      IG_RETURN_IF_ERROR(CheckSize(n("q_norm"), l.q_norm, c.head_dim));
      IG_RETURN_IF_ERROR(CheckSize(n("k_norm"), l.k_norm, c.head_dim));
      IG_RETURN_IF_ERROR(
          CheckSize(n("post_attn_norm"), l.post_attn_norm, dim));
      IG_RETURN_IF_ERROR(CheckSize(n("post_ffn_norm"), l.post_ffn_norm, dim));
    }
  }
  IG_RETURN_IF_ERROR(CheckSize("final_norm", final_norm, dim));
  if (opt) {
    IG_RETURN_IF_ERROR(CheckSize("final_norm_bias", final_norm_bias, dim));
  }
  if (!lm_head.empty()) {
    IG_RETURN_IF_ERROR(
        CheckSize("lm_head", lm_head, size_t(c.vocab_size) * dim));
  }
  return absl::OkStatus();
}

void PermuteInterleavedToHalfSplit(std::vector<float>& w, int n_heads,
                                   int head_dim, int cols) {
  std::vector<float> out(w.size());
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    for (int j = 0; j < head_dim; ++j) {
      // Source row 2i (even) -> i; 2i+1 (odd) -> i + half.
      const int dst = (j % 2 == 0) ? j / 2 : j / 2 + half;
      const float* src = &w[(size_t(h) * head_dim + j) * cols];
      std::copy(src, src + cols, &out[(size_t(h) * head_dim + dst) * cols]);
    }
  }
  w.swap(out);
}

}  // namespace infinigen::model
