// Engine: the forward pass of a batch of sequences over one model.
//
// Holds a reference to the Weights (the caller keeps them alive) and owns
// the backend, one slot per sequence (its position, local KV cache
// [layer][kv_head][position][head_dim], policy state and fetch buffers) and
// every scratch buffer, all sized at Create so that decoding allocates
// nothing.
//
// Prefill is dense and local, one slot at a time (Forward). Decoding runs
// every given slot together (DecodeBatch): the matrix work is one GEMM over
// the batch, attention is per sequence. With any policy but `ideal`, every
// token's K and V rows also go to the memory node through a KvClient (not
// owned), and each decode step's attention reads only the rows the policy
// fetched, plus the new token's own. Layer l + 1's fetch leaves before layer
// l's attention and MLP; once those are queued, its rows are copied to the
// backend (a device backend's copy queue, from fetch buffers it pinned)
// while they run, and decoded there at layer l + 1's attention.
// Speculation (infinigen) runs on the backend too; only its scores come
// back to the host mid-step, for the selection. The
// step's appends run on a background thread while the last MLP and the
// classifier compute. Not thread-safe: one caller drives one engine.
#ifndef INFINIGEN_GPU_WORKER_ENGINE_H_
#define INFINIGEN_GPU_WORKER_ENGINE_H_

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/kv_policy.h"
#include "kv_memory_service/kv_client.h"
#include "model/weights.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

struct EngineOptions {
  // Longest sequence each slot holds; 0 means the model's context length.
  int max_seq_len = 0;
  // Most tokens one Forward call processes at once (prefill chunk); longer
  // inputs are split. Bounds the scratch memory.
  int max_chunk = 256;
  // Sequence slots: the largest batch DecodeBatch takes.
  int batch = 1;
  // How K and V reach attention when decoding.
  PolicyOptions policy;
  // The memory node, for every policy but ideal (not owned; outlives the
  // engine).
  kv_memory_service::KvClient* kv_client = nullptr;
  // Tokens the memory node keeps per (layer, KV head) for a sequence, as a
  // fraction of max_seq_len; below 1 the pool evicts (its own policy).
  double kv_capacity = 1.0;
  // Diagnostics: multiply every post-RoPE query and key by these skew
  // matrices before attention. The logits must not change (A A^T = I).
  const speculator::SkewMatrices* attention_skew = nullptr;
  // Calibration: called with each layer's post-RoPE queries
  // [n, n_heads, head_dim] and keys [n, n_kv_heads, head_dim] (prefill).
  std::function<void(int layer, const float* q, const float* k, int n)>
      observer;
};

// What a slot's policy moved, over its decode steps since its last Reset.
struct FetchStats {
  long steps = 0;
  double fraction_sum = 0;   // sum over steps of fetched rows / cached rows
  double fraction_max = 0;
  long rows_fetched = 0;     // K/V row pairs, all layers and heads
  long bytes_fetched = 0;    // K and V bytes as stored (fp16 or int4)
  double wait_seconds = 0;   // blocked in fetch Wait()
  double fraction_mean() const { return steps ? fraction_sum / steps : 0.0; }
  void Add(const FetchStats& o);
};

class Engine {
 public:
  // InvalidArgument if the weights are inconsistent, options out of range,
  // or a policy other than ideal has no kv_client.
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
  // memory-node errors are returned as is.
  absl::StatusOr<absl::Span<const float>> Forward(int slot,
                                                  absl::Span<const int> tokens,
                                                  bool all_logits);
  absl::StatusOr<absl::Span<const float>> Forward(absl::Span<const int> tokens,
                                                  bool all_logits) {
    return Forward(0, tokens, all_logits);
  }

  // One decode step of every slot in `slots` (distinct, each already
  // prefilled), with token tokens[i] for slots[i]. Returns logits
  // [slots.size(), vocab], valid until the next call.
  absl::StatusOr<absl::Span<const float>> DecodeBatch(
      absl::Span<const int> slots, absl::Span<const int> tokens);

  // Forgets `slot`'s sequence (closing it on the memory node); its next
  // Forward starts at position 0 and its fetch statistics restart.
  absl::Status Reset(int slot = 0);

  int position(int slot = 0) const { return slots_[slot].position; }
  int max_seq_len() const { return max_seq_len_; }
  int batch() const { return static_cast<int>(slots_.size()); }
  const model::ModelConfig& config() const { return weights_.config; }
  Backend& backend() { return *backend_; }
  PolicyKind policy() const { return options_.policy.kind; }
  const FetchStats& fetch_stats(int slot = 0) const {
    return slots_[slot].stats;
  }

 private:
  // One sequence: its position, caches and, when offloaded, policy state.
  struct Slot {
    int position = 0;
    bool decoding = false;            // prefill finished
    SharedVector<float> k_cache;       // [layer][kv_head][pos][head_dim]
    SharedVector<float> v_cache;       // same
    std::unique_ptr<KvPolicy> policy;
    kv_memory_service::SequenceId seq = 0;
    std::vector<uint8_t> present;     // [layer][kv_head][pos]
    std::vector<long> present_count;  // [layer]: present rows, all heads
    std::unique_ptr<kv_memory_service::FetchBuffer> buffers[2];
    kv_memory_service::OwnedFetchPlan plans[2];
    kv_memory_service::FetchHandle handles[2];
    // buffers[i]'s rows copied to the backend's side (CopyFromHost), as
    // stored; staged_free[i] marks the last operation that read staged[i].
    SharedVector<uint16_t> staged[2];
    Backend::Mark staged_free[2] = {0, 0};
    bool uploaded[2] = {false, false};  // plans[i]'s rows are in staged[i]
    std::vector<uint16_t> k_step, v_step;  // [layer][kv_head][row_width]
    kv_memory_service::AppendResult appended;  // last async append
    absl::Status append_status;
    FetchStats stats;
    long step_rows = 0;               // rows fetched in the current step
  };

  Engine(const model::Weights& weights, std::unique_ptr<Backend> backend,
         const EngineOptions& options, int max_seq_len, int max_chunk);
  absl::Status Init();
  // Declares every weight tensor to the backend as a constant.
  absl::Status RegisterWeights();
  absl::Status CheckSlot(int slot) const;
  // Dense chunk of at most max_chunk tokens of one slot over its local
  // cache; logits for all or the last.
  absl::Status ForwardChunk(Slot& s, const int* tokens, int n, bool all_logits,
                            float* logits);
  absl::Status OpenSequence(Slot& s);
  // Appends `n` tokens' rows (layout [layer][token][kv_head][row_width])
  // and applies the pool's evictions.
  absl::Status AppendRows(Slot& s, const uint16_t* k, const uint16_t* v,
                          int n, kv_memory_service::AppendResult* result);
  void MarkAppended(Slot& s, int first, int n,
                    const kv_memory_service::AppendResult& result);
  absl::Status IssueFetch(Slot& s, int layer, const float* xb_prev);
  // Waits for `layer`'s fetch and queues the copy of its rows to the
  // backend (once per fetch).
  absl::Status UploadFetched(Slot& s, int layer);
  // Attention of the slot's new token (row `row` of the batch scratch) at
  // `layer` over its fetched rows, decoded by the backend, plus its own.
  absl::Status FetchedAttention(Slot& s, int layer, int row);
  // After a decode step's last layer (backend synchronized): encodes the
  // new token's K and V rows of every layer for the memory node and tells
  // the policy about them.
  void StageStepRows(Slot& s);
  void LocalAttention(Slot& s, int layer, int row, int n, int first_pos,
                      float* prob_sums);
  void Embed(const int* tokens, const int* positions, int n);
  void Logits(int first, int rows, float* logits);
  // xb_ = the layer's attention norm of x_; q_, k_, v_ = its projections
  // of xb_, rotated at positions_ (Llama).
  void AttentionNorm(const model::LayerWeights& w, int n);
  void QueryKeyValue(const model::LayerWeights& w, int n);
  void Mlp(const model::LayerWeights& w, int n);
  float* KeyCache(Slot& s, int layer) {
    return s.k_cache.data() + static_cast<size_t>(layer) * layer_cache_size_;
  }
  float* ValueCache(Slot& s, int layer) {
    return s.v_cache.data() + static_cast<size_t>(layer) * layer_cache_size_;
  }

  // The background appender: one batch of decode-step appends at a time.
  void AppenderLoop();
  void StartAppends(absl::Span<const int> slots);
  absl::Status FinishAppends();

  const model::Weights& weights_;
  std::unique_ptr<Backend> backend_;
  const EngineOptions options_;
  const int max_seq_len_;
  const int max_chunk_;
  const int rows_;                 // max(max_chunk, batch): scratch rows
  size_t layer_cache_size_;        // n_kv_heads * max_seq_len * head_dim
  int row_width_ = 0;              // uint16 per stored row
  std::vector<Slot> slots_;

  // Scratch, [rows_, ...]:
  SharedVector<float> x_;           // residual stream [rows, dim]
  SharedVector<float> xb_;          // normed input [rows, dim]
  SharedVector<float> q_;           // [rows, q_dim]
  SharedVector<float> k_;           // [rows, kv_dim]
  SharedVector<float> v_;           // [rows, kv_dim]
  SharedVector<float> att_;         // [rows, q_dim]
  SharedVector<float> proj_;        // [rows, dim]
  SharedVector<float> h1_;          // [rows, hidden]
  SharedVector<float> h3_;          // [rows, hidden]
  std::vector<float> skew_row_;    // [head_dim]
  SharedVector<int> positions_;    // [rows]
  SharedVector<float> logits_;      // [rows, vocab]
  std::vector<uint16_t> k_stage_;  // prefill rows [layer][chunk][kv][width]
  std::vector<uint16_t> v_stage_;
  SharedVector<float> kf_, vf_;    // [kv_head][max_seq + 1][head_dim]
  SharedVector<float> probs_;       // [n_heads][max_seq + 1]
  SharedVector<float> prefill_probs_;  // [n_heads][max_seq]

  std::thread appender_;
  absl::Mutex append_mu_;
  std::vector<int> append_slots_ ABSL_GUARDED_BY(append_mu_);
  bool append_pending_ ABSL_GUARDED_BY(append_mu_) = false;
  bool append_done_ ABSL_GUARDED_BY(append_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(append_mu_) = false;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_ENGINE_H_
