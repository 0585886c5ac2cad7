// The offloaded KV cache (kv_cache.h): the memory node holds the rows, the
// worker a bounded working set. Private to the :kv_cache target.
//
// The cache keeps the KvCache and KvStep facade and the schedule of each
// layer's fetch (FetchSchedule); its parts, under offloaded/, each own one
// job:
//   layout.h          every buffer's size, from the options alone
//   row_presence.h    which rows of a sequence the node holds
//   layer_fetch.h     one fetch in flight: plan, buffers, handle, staging
//   fetch_planner.h   which rows a layer's fetch moves (the policy asked)
//   row_source.h      how they move: the node's gather, a device's
//                     one-sided gather, or attention in place on the host
//   fetched_attention.h  attention over a fetch's rows
//   prefill.h         the prefill's chunks and its per-layer appends
//   prefix_loader.h   prefix reuse
//   appender.h        a decode step's appends and notes in the background
//
// What the worker holds, per sequence: its policy's state, two fetches
// (host memory the data plane chose, pinned by the backend, and on a
// device backend staging there), each sized for the largest plan of one
// layer (KvPolicy::MaxPlanRows), the new token's K and V of every layer,
// and the presence of each row (1 byte per position, layer and KV head).
// Shared by the sequences: the decoded rows attention reads (one layer,
// fp32), and for a prefill one layer's encoded prompt rows on their way to
// the memory node. Nothing grows with n_layers x max_seq_len.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_KV_CACHE_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/kv/fetch_schedule.h"
#include "gpu_worker/kv/kv_cache_impl.h"
#include "gpu_worker/kv/offloaded/appender.h"
#include "gpu_worker/kv/offloaded/fetch_planner.h"
#include "gpu_worker/kv/offloaded/fetched_attention.h"
#include "gpu_worker/kv/offloaded/layer_fetch.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "gpu_worker/kv/offloaded/prefill.h"
#include "gpu_worker/kv/offloaded/prefix_loader.h"
#include "gpu_worker/kv/offloaded/row_presence.h"
#include "gpu_worker/kv/offloaded/row_source.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::gpu_worker {
namespace offloaded {

class OffloadedKvCache final : public KvCache {
 public:
  OffloadedKvCache(const model::Weights& weights, Backend* backend,
                   const KvCacheOptions& options, const Layout& layout);
  ~OffloadedKvCache() override;

  absl::Status Init();

  absl::StatusOr<int> BeginPrefill(int slot, int first,
                                   absl::Span<const int> tokens,
                                   bool reuse) override;
  absl::Status PrefillAttention(int layer, int pos, int rows, const float* q,
                                const float* k, const float* v,
                                float* out) override;
  absl::Status EndPrefillLayer(int layer) override;
  absl::Status EndPrefill() override;
  absl::StatusOr<KvStepPtr> BeginStep(
      absl::Span<const int> slots, absl::Span<const int> positions) override;
  absl::Status Reset(int slot) override;
  absl::Status Flush() override;
  bool offloaded() const override;
  const FetchStats& fetch_stats(int slot) const override;
  int64_t worker_bytes() const override;
  int64_t node_bytes() const override;
  // The open step's fetches due at `point` of `layer` (the hybrid cache
  // names the points itself: FetchSchedule::DueAt).
  absl::Status IssueDue(FetchPoint point, int layer, const float* x);

 private:
  // The decode step (offloaded_step.cc), one per cache, reused: issues
  // each layer's fetch at the point the schedule names, attends over the
  // fetched rows, and starts the step's appends after the last layer's
  // attention.
  class Step final : public KvStep {
   public:
    explicit Step(OffloadedKvCache& cache);
    const FetchSchedule& schedule() const override;
    absl::Status LayerInput(int layer, const float* xb) override;
    absl::Status PostAttentionInput(int layer, const float* xb_next) override;
    absl::Status DecodeAttention(int layer, const float* q, const float* k,
                                 const float* v, float* out) override;
    absl::Status LayerDone(int layer) override;
    absl::Status End() override;
    // Issues, for every slot of the step, the fetch due at `point` of
    // `layer`'s pass (FetchSchedule::DueAt), ranked by x [slots][dim]
    // (null at the step's start): the one place a step's fetches leave.
    absl::Status IssueDue(FetchPoint point, int layer, const float* x);

   private:
    friend class OffloadedKvCache;
    void Close() override;

    OffloadedKvCache& cache_;
    std::vector<int> slots_;  // the step's, capacity for every slot
  };

  // One sequence slot: its memory-node sequence and what moves its rows.
  struct Sequence {
    std::unique_ptr<KvPolicy> policy;
    kv_memory_service::SequenceId seq = 0;
    int position = 0;  // this step's new token
    RowPresence presence;
    FetchPair fetches;
    std::unique_ptr<RowSource> source;  // while the sequence is open
    BackendNotes notes;
    // The step's new K rows [layer][kv_dim], then its V rows the same
    // (backend memory, copied to the host in one piece after the last
    // layer), encoded for the memory node into k_step/v_step
    // [layer][kv_head][row_width]; the appender's from StartAppends to
    // FinishAppends, with the notes where notes_in_background.
    DeviceBuffer<float> new_rows;
    std::vector<uint16_t> k_step, v_step;
    kv_memory_service::AppendResult appended;
    bool notes_in_background = false;
    // Set when a step's rows did not reach the memory node: the sequence
    // there lacks a position, so its next step fails with this (and the
    // engine recomputes it) rather than attend without the row.
    absl::Status lost;
    FetchStats stats;
    long step_rows = 0;  // rows fetched in the current step
    PrefixState prefix;
  };

  absl::Status InitSequence(Sequence& s, const KvPolicy::Context& ctx,
                            bool& pin_warned);
  // Opens the slot's sequence with the prefix keys of `tokens` (none
  // without reuse), takes over what it attached and chooses its row
  // source; returns the cached tokens.
  absl::StatusOr<int> OpenSequence(Sequence& s, absl::Span<const int> tokens,
                                   bool reuse);
  // Plans `layer`'s fetch and starts it.
  absl::Status IssueFetch(Sequence& s, int layer, const float* xb_prev);
  // Waits for `layer`'s fetch and makes its rows readable by the backend,
  // once per fetch; the node gathers from then on where the backend
  // cannot read its memory.
  absl::Status UploadFetched(Sequence& s, int layer);
  // Attention of the sequence's new token (row `row`) at `layer` over its
  // fetched rows plus its own; H2O's probabilities observed.
  absl::Status FetchedAttention(Sequence& s, int layer, int row,
                                const float* q, const float* k,
                                const float* v, float* out);
  // Each head's probability row zeroed for the accumulation (H2O).
  absl::Status ZeroProbabilityRows(
      const kv_memory_service::OwnedFetchPlan& plan);
  // After the step's last layer's attention is queued: encodes the new
  // token's rows of every layer (copied to the host) and tells the policy
  // about them.
  absl::Status StageStepRows(Sequence& s);
  // The step's notes of plans made on the backend, once their queued
  // copies have landed.
  absl::Status NoteBackendPlans(Sequence& s);
  // The appender's work for one slot: the step's rows, then its notes.
  absl::Status AppendStep(int slot);
  absl::Status FinishAppends();
  // Waits for the backend's copies, then fetches `layer`'s attached rows.
  absl::Status IssuePrefixFetch(Sequence& s, int layer);

  absl::Status AtNode(const absl::Status& status) const;

  const model::Weights& weights_;
  const model::ModelConfig& c_;
  Backend& backend_;
  const KvCacheOptions options_;
  const std::string node_address_;  // the KvClient's, for messages
  const FetchSchedule schedule_;  // when each layer's fetch leaves
  const Layout layout_;
  const int max_seq_;
  kv_memory_service::SequenceGeometry geometry_;
  std::vector<Sequence> sequences_;
  int64_t bytes_ = 0;

  DecodedRows decoded_;
  offloaded::FetchedAttention attention_;
  RowSourceContext sources_;
  FetchPlanner planner_;
  std::unique_ptr<PrefixLoader> prefix_;
  Prefill prefill_;
  int prefill_slot_ = -1;
  bool direct_refusal_logged_ = false;  // MakeRowSource's one line
  // Attention probabilities (h2o), [n_heads][stride], and their host copy.
  DeviceBuffer<float> probs_;
  std::vector<float> probs_host_;
  std::vector<float> new_rows_host_;  // a step's new rows [layer][kv_dim]
  bool step_open_ = false;  // step_ is handed out
  Step step_{*this};
  std::unique_ptr<Appender> appender_;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_KV_CACHE_H_
