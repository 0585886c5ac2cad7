// Engine: one sequence's forward pass over a model, with its KV cache.
//
// Holds a reference to the Weights (the caller keeps them alive), owns the
// backend, the KV cache ([layer][kv_head][position][head_dim], K and V) and
// every scratch buffer, all sized at Create so that decoding allocates
// nothing. Not thread-safe: one caller drives one engine.
#ifndef INFINIGEN_GPU_WORKER_ENGINE_H_
#define INFINIGEN_GPU_WORKER_ENGINE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu_worker/backend.h"
#include "model/weights.h"

namespace infinigen::gpu_worker {

struct EngineOptions {
  // Longest sequence the cache holds; 0 means the model's context length.
  int max_seq_len = 0;
  // Most tokens one Forward call processes at once (prefill chunk); longer
  // inputs are split. Bounds the scratch memory.
  int max_chunk = 256;
};

class Engine {
 public:
  // InvalidArgument if the weights are inconsistent or options out of range.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const model::Weights& weights, std::unique_ptr<Backend> backend,
      const EngineOptions& options = {});

  // Runs `tokens` at the next positions of the sequence and appends their
  // keys and values to the cache. Returns the logits of every token
  // ([tokens.size(), vocab]) when `all_logits`, else of the last one
  // ([vocab]); the span is valid until the next call. all_logits needs
  // tokens.size() <= max_chunk. InvalidArgument for an empty input, a token
  // outside the vocabulary or a sequence longer than max_seq_len (the cache
  // is then unchanged).
  absl::StatusOr<absl::Span<const float>> Forward(absl::Span<const int> tokens,
                                                  bool all_logits);

  // Forgets the sequence; the next Forward starts at position 0.
  void Reset() { position_ = 0; }

  int position() const { return position_; }
  int max_seq_len() const { return max_seq_len_; }
  const model::ModelConfig& config() const { return weights_.config; }
  Backend& backend() { return *backend_; }

 private:
  Engine(const model::Weights& weights, std::unique_ptr<Backend> backend,
         int max_seq_len, int max_chunk);
  // Runs one chunk of at most max_chunk tokens; logits for all or the last.
  void ForwardChunk(const int* tokens, int n, bool all_logits, float* logits);
  float* KeyCache(int layer) {
    return k_cache_.data() + static_cast<size_t>(layer) * layer_cache_size_;
  }
  float* ValueCache(int layer) {
    return v_cache_.data() + static_cast<size_t>(layer) * layer_cache_size_;
  }

  const model::Weights& weights_;
  std::unique_ptr<Backend> backend_;
  const int max_seq_len_;
  const int max_chunk_;
  int position_ = 0;

  size_t layer_cache_size_;        // n_kv_heads * max_seq_len * head_dim
  std::vector<float> k_cache_;     // [layer][kv_head][pos][head_dim]
  std::vector<float> v_cache_;     // same
  // Scratch, [max_chunk, ...]:
  std::vector<float> x_;           // residual stream [chunk, dim]
  std::vector<float> xb_;          // normed input [chunk, dim]
  std::vector<float> q_;           // [chunk, q_dim]
  std::vector<float> k_;           // [chunk, kv_dim]
  std::vector<float> v_;           // [chunk, kv_dim]
  std::vector<float> att_;         // [chunk, q_dim]
  std::vector<float> proj_;        // [chunk, dim]
  std::vector<float> h1_;          // [chunk, hidden]
  std::vector<float> h3_;          // [chunk, hidden]
  std::vector<int> positions_;     // [chunk]
  std::vector<float> logits_;      // [chunk, vocab]
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_ENGINE_H_
