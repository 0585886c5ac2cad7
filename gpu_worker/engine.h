// Engine: one sequence's forward pass over a model, with its KV cache.
//
// Holds a reference to the Weights (the caller keeps them alive), owns the
// backend, a local KV cache ([layer][kv_head][position][head_dim], K and V,
// used by the dense prefill and by the `ideal` policy) and every scratch
// buffer, all sized at Create so that decoding allocates nothing.
//
// With any policy but `ideal`, every token's K and V rows also go to the
// memory node through a KvClient (not owned), and each decode step's
// attention reads only the rows the policy fetches from it, plus the new
// token's own. The prefill is dense and local (ALGORITHM.md). Not
// thread-safe: one caller drives one engine.
#ifndef INFINIGEN_GPU_WORKER_ENGINE_H_
#define INFINIGEN_GPU_WORKER_ENGINE_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/kv_policy.h"
#include "kv_memory_service/kv_client.h"
#include "model/weights.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

struct EngineOptions {
  // Longest sequence the cache holds; 0 means the model's context length.
  int max_seq_len = 0;
  // Most tokens one Forward call processes at once (prefill chunk); longer
  // inputs are split. Bounds the scratch memory.
  int max_chunk = 256;
  // How K and V reach attention when decoding.
  PolicyOptions policy;
  // The memory node, for every policy but ideal (not owned; outlives the
  // engine).
  kv_memory_service::KvClient* kv_client = nullptr;
  // Tokens the memory node keeps per (layer, KV head) for this sequence, as
  // a fraction of max_seq_len; below 1 the pool evicts (its own policy).
  double kv_capacity = 1.0;
  // Diagnostics: multiply every post-RoPE query and key by these skew
  // matrices before attention. The logits must not change (A A^T = I).
  const speculator::SkewMatrices* attention_skew = nullptr;
  // Calibration: called with each layer's post-RoPE queries
  // [n, n_heads, head_dim] and keys [n, n_kv_heads, head_dim].
  std::function<void(int layer, const float* q, const float* k, int n)>
      observer;
};

// What the policy moved, over the decode steps since the last Reset.
struct FetchStats {
  long steps = 0;
  double fraction_sum = 0;   // sum over steps of fetched rows / cached rows
  double fraction_max = 0;
  long rows_fetched = 0;     // K/V row pairs, all layers and heads
  long bytes_fetched = 0;    // K and V bytes as stored (fp16 or int4)
  double fraction_mean() const { return steps ? fraction_sum / steps : 0.0; }
};

class Engine {
 public:
  // InvalidArgument if the weights are inconsistent, options out of range,
  // or a policy other than ideal has no kv_client.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const model::Weights& weights, std::unique_ptr<Backend> backend,
      const EngineOptions& options = {});
  ~Engine();

  // Runs `tokens` at the next positions of the sequence and appends their
  // keys and values to the cache. Returns the logits of every token
  // ([tokens.size(), vocab]) when `all_logits`, else of the last one
  // ([vocab]); the span is valid until the next call. all_logits needs
  // tokens.size() <= max_chunk. InvalidArgument for an empty input, a token
  // outside the vocabulary or a sequence longer than max_seq_len (the cache
  // is then unchanged). With a policy other than ideal, the first call is
  // the dense prefill and later calls decode one token each
  // (FailedPrecondition otherwise); memory-node errors are returned as is.
  absl::StatusOr<absl::Span<const float>> Forward(absl::Span<const int> tokens,
                                                  bool all_logits);

  // Forgets the sequence (closing it on the memory node); the next Forward
  // starts at position 0 and resets the fetch statistics.
  absl::Status Reset();

  int position() const { return position_; }
  int max_seq_len() const { return max_seq_len_; }
  const model::ModelConfig& config() const { return weights_.config; }
  Backend& backend() { return *backend_; }
  PolicyKind policy() const { return options_.policy.kind; }
  const FetchStats& fetch_stats() const { return stats_; }

 private:
  Engine(const model::Weights& weights, std::unique_ptr<Backend> backend,
         const EngineOptions& options, int max_seq_len, int max_chunk);
  absl::Status Init();
  // Runs one chunk of at most max_chunk tokens densely over the local
  // cache; logits for all or the last.
  absl::Status ForwardChunk(const int* tokens, int n, bool all_logits,
                            float* logits);
  // One token through the policy's fetched rows.
  absl::Status DecodeStep(int token, float* logits);
  absl::Status OpenSequence();
  absl::Status AppendToMemoryNode(int n);
  void ApplyEvictions(const kv_memory_service::AppendResult& result);
  absl::Status IssueFetch(int layer, const float* xb_prev);
  // Attention of the new token at `layer` over fetched rows plus its own.
  absl::Status FetchedAttention(int layer);
  void Embed(const int* tokens, int n);
  void Logits(int first, int rows, float* logits);
  void Mlp(const model::LayerWeights& w, int n);
  float* KeyCache(int layer) {
    return k_cache_.data() + static_cast<size_t>(layer) * layer_cache_size_;
  }
  float* ValueCache(int layer) {
    return v_cache_.data() + static_cast<size_t>(layer) * layer_cache_size_;
  }

  const model::Weights& weights_;
  std::unique_ptr<Backend> backend_;
  const EngineOptions options_;
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
  std::vector<float> skew_row_;    // [head_dim]
  std::vector<int> positions_;     // [chunk]
  std::vector<float> logits_;      // [chunk, vocab]

  // Offloaded policies (everything below is unused by ideal).
  std::unique_ptr<KvPolicy> policy_;
  kv_memory_service::SequenceId seq_ = 0;
  bool decoding_ = false;          // prefill finished
  int row_width_ = 0;              // uint16 per stored row
  std::vector<uint16_t> k_stage_;  // [layer][chunk][kv_head][row_width]
  std::vector<uint16_t> v_stage_;
  std::vector<uint8_t> present_;   // [layer][kv_head][pos]
  std::vector<long> present_count_;  // [layer]: present rows, all heads
  std::unique_ptr<kv_memory_service::FetchBuffer> buffers_[2];
  kv_memory_service::OwnedFetchPlan plans_[2];
  kv_memory_service::FetchHandle handles_[2];
  std::vector<float> xb_prev_;     // [dim] previous layer's attention input
  std::vector<float> kf_, vf_;     // [kv_head][max_seq + 1][head_dim]
  std::vector<float> fetched_;     // [2][rows][head_dim] decoded rows
  std::vector<float> probs_;       // [n_heads][max_seq + 1]
  std::vector<float> prefill_probs_;  // [n_heads][max_seq]
  FetchStats stats_;
  long step_rows_ = 0;             // rows fetched in the current step
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_ENGINE_H_
