// Engine: the forward pass of a batch of sequences over one model.
//
// Holds a reference to the Weights (the caller keeps them alive) and owns
// the backend, the KV cache (kv_cache.h: where K and V live, local for
// `ideal`, on the memory node for every other policy) and every scratch
// buffer, all sized at Create so that decoding allocates nothing.
//
// Prefill (Forward) runs one slot layer by layer over the prompt, each
// layer in chunks of at most max_chunk tokens, so an offloaded cache can
// send a layer's K and V to the memory node and drop them before the next.
// Decoding runs every given slot together (DecodeBatch): the matrix work is
// one GEMM over the batch, attention is per sequence, through the cache.
// Prefill and decode share one per-layer body. Not thread-safe: one caller
// drives one engine.
#ifndef INFINIGEN_GPU_WORKER_ENGINE_H_
#define INFINIGEN_GPU_WORKER_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/kv_policy.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/weights.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

// Calibration's view of a prefill (EngineOptions::observer), called on the
// engine's thread with host copies of the backend's activations.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  // Each prefill chunk of `layer`: post-RoPE queries q [n, n_heads,
  // head_dim], keys k and values v [n, n_kv_heads, head_dim], and the
  // residual stream entering the layer x [n, dim].
  virtual void OnLayer(int layer, const float* q, const float* k,
                       const float* v, const float* x, int n) = 0;
  // Whether OnPostAttention is wanted (it costs a copy per layer).
  virtual bool WantsPostAttention() const { return false; }
  // The residual stream after the layer's attention (its residual add,
  // before the MLP) x [n, dim].
  virtual void OnPostAttention(int layer, const float* x, int n) {}
};

struct EngineOptions {
  // Longest sequence each slot holds; 0 means the model's context length.
  int max_seq_len = 0;
  // Most tokens one Forward call processes at once (prefill chunk); longer
  // inputs are split. Bounds the scratch memory.
  int max_chunk = 256;
  // Sequence slots: the largest batch DecodeBatch takes.
  int batch = 1;
  // How K and V reach attention when decoding, and where they are kept:
  // the policy, the memory node, the worker's limit, prefix reuse
  // (kv_cache.h). Validated by the cache.
  KvOptions kv;
  // When the memory node loses a sequence (it restarted, evicted it, was
  // replaced) or cannot be reached mid-step: true re-prefills each slot of
  // the failed call from the tokens it holds and runs the call again, once
  // (greedy output unchanged); false returns the error.
  bool recompute_on_kv_loss = true;
  // Diagnostics: multiply every post-RoPE query and key by these skew
  // matrices before attention. The logits must not change (A A^T = I).
  const speculator::SkewMatrices* attention_skew = nullptr;
  // Calibration: what a prefill computes, layer by layer (not owned;
  // outlives the engine; null: nothing observed).
  EngineObserver* observer = nullptr;
  // Progress of a prefill: called after each layer with the layers done,
  // the model's layers and the tokens computed (a long prompt's progress
  // display). Null: nothing.
  std::function<void(int layers_done, int layers, int tokens)>
      on_prefill_layer;
};

class Engine {
 public:
  // InvalidArgument if the weights are inconsistent, options out of range,
  // or a policy other than ideal has no kv_client; ResourceExhausted when
  // the KV cache would pass kv.max_worker_bytes or memory runs out.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const model::Weights& weights, std::unique_ptr<Backend> backend,
      const EngineOptions& options = {});
  ~Engine();

  // Runs `tokens` at the next positions of `slot`'s sequence and appends
  // their keys and values to its cache. Returns the logits of every token
  // ([tokens.size(), vocab]) when `all_logits`, else of the last one
  // ([vocab]); the span is valid until the next call. all_logits needs
  // tokens.size() <= max_chunk. InvalidArgument for a bad slot, an empty
  // input, a token outside the vocabulary or a sequence longer than
  // max_seq_len (the cache is then unchanged). With a policy other than
  // ideal, a slot's first call is its dense prefill and a later
  // single-token call is a decode step (FailedPrecondition for more tokens);
  // memory-node errors are returned as is, and a prefill that fails leaves
  // the slot empty.
  absl::StatusOr<absl::Span<const float>> Forward(int slot,
                                                  absl::Span<const int> tokens,
                                                  bool all_logits);
  absl::StatusOr<absl::Span<const float>> Forward(absl::Span<const int> tokens,
                                                  bool all_logits) {
    return Forward(0, tokens, all_logits);
  }
  // The logits of one row of a Forward call: row i predicts the call's
  // token i + 1 (the last row, the token after the call).
  using RowLogits =
      std::function<void(int row, absl::Span<const float> logits)>;
  // Forward(slot, tokens, /*all_logits=*/false) that also hands `row` the
  // logits of every row in order (a prompt's log-probabilities), for any
  // number of tokens up to max_seq_len: they are computed max_chunk rows at
  // a time. A prefill through it reuses no prefix (every row is computed).
  // Returns the last row's logits.
  absl::StatusOr<absl::Span<const float>> ForwardEachRow(
      int slot, absl::Span<const int> tokens, const RowLogits& row);

  // One decode step of every slot in `slots` (distinct, each already
  // prefilled), with token tokens[i] for slots[i]. Returns logits
  // [slots.size(), vocab], valid until the next call.
  absl::StatusOr<absl::Span<const float>> DecodeBatch(
      absl::Span<const int> slots, absl::Span<const int> tokens);

  // Forgets `slot`'s sequence (closing it on the memory node); its next
  // Forward starts at position 0 and its fetch statistics restart.
  absl::Status Reset(int slot = 0);
  // Waits for the work the last decode step left running (its rows' appends
  // and its notes to the memory node) and returns its first error; the next
  // step does as much before it fetches.
  absl::Status Flush();

  int position(int slot = 0) const { return positions_of_[slot]; }
  // Leading tokens of the slot's last prefill that were reused from the
  // memory node rather than computed (prefix reuse).
  int cached_tokens(int slot = 0) const { return cached_of_[slot]; }
  // Times a call recovered from a lost KV sequence by recomputing.
  int64_t kv_recoveries() const { return kv_recoveries_; }
  int max_seq_len() const { return max_seq_len_; }
  // Most tokens one Forward call takes.
  int max_chunk() const { return max_chunk_; }
  int batch() const { return static_cast<int>(positions_of_.size()); }
  const model::ModelConfig& config() const { return weights_.config; }
  Backend& backend() { return *backend_; }
  // "ideal" or the KV policy's name.
  const char* policy_name() const { return options_.kv.policy_name(); }
  const FetchStats& fetch_stats(int slot = 0) const {
    return cache_->fetch_stats(slot);
  }
  // Bytes the KV cache holds on the worker (K/V rows, staging, policy
  // state), and reserved on the memory node for the open sequences.
  int64_t worker_kv_bytes() const { return cache_->worker_bytes(); }
  int64_t node_kv_bytes() const { return cache_->node_bytes(); }

 private:
  Engine(const model::Weights& weights, std::unique_ptr<Backend> backend,
         const EngineOptions& options, int max_seq_len, int max_chunk);
  absl::Status Init();
  // Declares every weight tensor to the backend as a constant.
  absl::Status RegisterWeights();
  absl::Status CheckSlot(int slot) const;
  // Forward and ForwardEachRow (row non-null).
  absl::StatusOr<absl::Span<const float>> ForwardWith(
      int slot, absl::Span<const int> tokens, bool all_logits,
      const RowLogits* row);
  // Forward and DecodeBatch after their arguments were checked.
  absl::StatusOr<absl::Span<const float>> ForwardChecked(
      int slot, absl::Span<const int> tokens, bool all_logits,
      const RowLogits* row = nullptr);
  absl::StatusOr<absl::Span<const float>> DecodeChecked(
      absl::Span<const int> slots, absl::Span<const int> tokens);
  // Whether `status` from the KV path means the memory node lost what the
  // slots stored (or could not be reached) and recomputing may help.
  bool RecoverableKvLoss(const absl::Status& status) const;
  // Forgets the slots' sequences and computes each again from its tokens
  // as it was computed: its prompt in one prefill, then one decode step per
  // later token, so the rows (and the policy's state) come out the same.
  absl::Status Recompute(absl::Span<const int> slots,
                         const absl::Status& cause);
  // Returns the leading tokens reused rather than computed (0 unless
  // `reuse`); the residual stream's rows [0, n - that) are the rest.
  absl::StatusOr<int> Prefill(int slot, absl::Span<const int> tokens,
                              bool reuse);
  // One layer over n rows of the residual stream starting at row `first`:
  // a prefill chunk at positions [pos, pos + n) of the slot being
  // prefilled (step null), or the decode step's n sequences.
  absl::Status RunLayer(int layer, int first, int n, KvStep* step, int pos);
  // Prefill diagnostics and calibration: the skew and the observer, on the
  // host.
  // x: the layer's input rows [n, dim] (backend memory).
  absl::Status ObservePrefill(int layer, int n, const float* x);
  // positions_ [0, n) = positions_host_ [0, n); x_ rows [0, n) = the
  // tokens' embeddings at those positions.
  void Embed(const int* tokens, int n);
  // The logits of x_ rows [first, first + rows), on the host.
  absl::StatusOr<absl::Span<const float>> Logits(int first, int rows);
  // xb_ = the layer's attention norm of x [n, dim]; q_, k_, v_ = its
  // projections, rotated at positions (Llama).
  void AttentionNorm(const model::LayerWeights& w, const float* x, int n);
  void QueryKeyValue(int layer, int n, const int* positions);
  void Mlp(const model::LayerWeights& w, float* x, int n);

  const model::Weights& weights_;
  std::unique_ptr<Backend> backend_;
  const EngineOptions options_;
  const int max_seq_len_;
  const int max_chunk_;
  const int rows_;                 // max(max_chunk, batch): scratch rows
  std::vector<int> positions_of_;  // [slot]: tokens in its sequence
  std::vector<int> cached_of_;     // [slot]: reused by its last prefill
  std::vector<std::vector<int>> history_;  // [slot]: its tokens so far
  std::vector<int> prompt_of_;  // [slot]: tokens of its first (prefill) call
  int64_t kv_recoveries_ = 0;

  // Scratch in the backend's device memory. The residual stream and
  // positions hold a whole prompt (the prefill runs layer by layer over it);
  // the rest one chunk or batch, [rows_, ...]:
  DeviceBuffer<float> x_;           // [max(max_seq, batch), dim]
  DeviceBuffer<int> positions_;     // [max(max_seq, batch)]
  DeviceBuffer<float> xb_;          // normed input [rows, dim]
  DeviceBuffer<float> q_;           // [rows, q_dim]
  DeviceBuffer<float> k_;           // [rows, kv_dim]
  DeviceBuffer<float> v_;           // [rows, kv_dim]
  DeviceBuffer<float> att_;         // [rows, q_dim]
  DeviceBuffer<float> proj_;        // [rows, dim]
  DeviceBuffer<float> h1_;          // [rows, hidden]
  DeviceBuffer<float> h3_;          // [rows, hidden]
  DeviceBuffer<float> logits_;      // [batch, vocab], or an all_logits chunk
  // Host side:
  std::vector<int> positions_host_;  // [max(max_seq, batch)]
  std::vector<float> logits_host_;   // what Forward and DecodeBatch return
  // Diagnostics: [rows, q_dim | kv_dim | kv_dim | dim].
  std::vector<float> q_host_, k_host_, v_host_, x_host_;
  std::vector<float> skew_rows_;     // attention_skew's product
  std::vector<int> step_positions_;  // [batch]

  // Declared last: destroyed first, while the backend is alive.
  std::unique_ptr<KvCache> cache_;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_ENGINE_H_
