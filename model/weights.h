// Weights: every parameter of a model, fp32, in host memory.
//
// Loaders fill it once (dequantizing quantized formats); the engine reads it.
// Matrices are row-major [out_features, in_features], as torch.nn.Linear
// stores them, so y = W x is a GEMV with W's rows as outputs. Query and key
// projections are in the Hugging Face rotary layout (each head's first half
// pairs with its second half: dims i and i + head_dim/2 rotate together);
// loaders of interleaved formats (llama2.c, GGUF) permute rows into it.
// Empty vectors mean "this architecture has no such tensor".
#ifndef INFINIGEN_MODEL_WEIGHTS_H_
#define INFINIGEN_MODEL_WEIGHTS_H_

#include <vector>

#include "model/config.h"

namespace infinigen::model {

struct LayerWeights {
  std::vector<float> attn_norm;       // (dim) RMSNorm / LayerNorm gain
  std::vector<float> attn_norm_bias;  // (dim) OPT only
  std::vector<float> wq;              // (n_heads * head_dim, dim)
  std::vector<float> wk;              // (n_kv_heads * head_dim, dim)
  std::vector<float> wv;              // (n_kv_heads * head_dim, dim)
  std::vector<float> wo;              // (dim, n_heads * head_dim)
  std::vector<float> bq, bk, bv;      // OPT only: (q_dim), (kv_dim), (kv_dim)
  std::vector<float> bo;              // OPT only: (dim)
  std::vector<float> ffn_norm;        // (dim)
  std::vector<float> ffn_norm_bias;   // (dim) OPT only
  // Llama: w1 = gate, w3 = up, w2 = down; out = w2 (silu(w1 x) * w3 x).
  // OPT: w1 = fc1, w2 = fc2 (w3 empty); out = w2 relu(w1 x + b1) + b2.
  std::vector<float> w1;              // (hidden_dim, dim)
  std::vector<float> w3;              // (hidden_dim, dim) Llama only
  std::vector<float> w2;              // (dim, hidden_dim)
  std::vector<float> b1;              // (hidden_dim) OPT only
  std::vector<float> b2;              // (dim) OPT only
  // Gemma 3 only: RMSNorm gains of each query and key head (head_dim), and
  // of the attention's and the MLP's outputs (dim). Gemma 3's MLP is
  // w2 (gelu_tanh(w1 x) * w3 x).
  std::vector<float> q_norm, k_norm;
  std::vector<float> post_attn_norm, post_ffn_norm;
};

struct Weights {
  ModelConfig config;
  std::vector<float> token_embedding;  // (vocab_size, dim)
  // OPT only: (max_seq_len + 2, dim); position p uses row p + 2.
  std::vector<float> position_embedding;
  std::vector<LayerWeights> layers;    // n_layers
  std::vector<float> final_norm;       // (dim)
  std::vector<float> final_norm_bias;  // (dim) OPT only
  // (vocab_size, dim). Empty when the classifier is tied to token_embedding.
  std::vector<float> lm_head;

  const float* classifier() const {
    return lm_head.empty() ? token_embedding.data() : lm_head.data();
  }

  // Checks every tensor's size against `config` (and which tensors the
  // architecture needs). InvalidArgument naming the first offender.
  absl::Status Validate() const;
};

// Reorders the rows of a projection from interleaved rotary pairs
// (2i, 2i+1) per head, as llama2.c and GGUF store them, to the Hugging Face
// half-split layout (i, i + head_dim/2). `w` is (n_heads * head_dim, cols).
void PermuteInterleavedToHalfSplit(std::vector<float>& w, int n_heads,
                                   int head_dim, int cols);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_WEIGHTS_H_
