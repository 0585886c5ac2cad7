// ModelConfig: the geometry and conventions of a decoder-only transformer.
//
// Filled by a loader (llama2.c, GGUF, safetensors) and read by everything
// else. Plain value type; copy freely.
#ifndef INFINIGEN_MODEL_CONFIG_H_
#define INFINIGEN_MODEL_CONFIG_H_

#include <string>

#include "absl/status/status.h"

namespace infinigen::model {

enum class Architecture {
  // RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases.
  kLlama,
  // OPT: pre-LayerNorm with bias, learned positions (offset 2), multi-head
  // attention with biases, ReLU MLP with biases.
  kOpt,
  // Gemma 3: Llama's layout plus RMSNorm on each head's query and key,
  // norms after the attention and after the MLP (before their residual
  // adds), a GELU-gated MLP (tanh form), embeddings scaled by sqrt(dim),
  // and sliding-window (local) layers between global ones, each kind with
  // its own RoPE base. Norm gains are stored as used (1 + w).
  kGemma3,
};

const char* ArchitectureName(Architecture arch);

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  int dim = 0;          // hidden size
  int hidden_dim = 0;   // MLP intermediate size
  int n_layers = 0;
  int n_heads = 0;      // query heads
  int n_kv_heads = 0;   // key/value heads (== n_heads without GQA)
  int head_dim = 0;     // usually dim / n_heads
  int vocab_size = 0;
  int max_seq_len = 0;  // context length the model was trained for
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;  // Llama and Gemma 3 (its global layers)
  // Gemma 3: layer l is local (sliding window) unless (l + 1) is a multiple
  // of sliding_window_pattern; a local layer's query at position p sees
  // the keys at positions (p - sliding_window, p]. 0: every layer global.
  int sliding_window = 0;
  int sliding_window_pattern = 0;
  float rope_theta_local = 10000.0f;  // the local layers' RoPE base
  float embedding_scale = 1.0f;       // token embeddings are multiplied by it
  // OPT only: learned position table has max_seq_len + kOptPositionOffset
  // rows; position p reads row p + 2.
  static constexpr int kOptPositionOffset = 2;
  // Special tokens; -1 when the model has none.
  int bos_id = 1;
  int eos_id = 2;

  // Whether layer l attends over a sliding window (Gemma 3's local layers).
  bool IsLocalLayer(int l) const {
    return sliding_window > 0 && sliding_window_pattern > 0 &&
           (l + 1) % sliding_window_pattern != 0;
  }
  // The positions layer l's attention sees back from a query (the query
  // included); 0: all.
  int AttentionWindow(int l) const {
    return IsLocalLayer(l) ? sliding_window : 0;
  }
  float RopeTheta(int l) const {
    return IsLocalLayer(l) ? rope_theta_local : rope_theta;
  }
  int kv_dim() const { return n_kv_heads * head_dim; }
  int q_dim() const { return n_heads * head_dim; }

  // InvalidArgument naming the first inconsistent field.
  absl::Status Validate() const;
  std::string DebugString() const;
};

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_CONFIG_H_
