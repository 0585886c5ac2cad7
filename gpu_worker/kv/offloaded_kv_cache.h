// The offloaded KV cache (kv_cache.h): the memory node holds the rows, the
// worker a bounded working set. Private to the :kv_cache target:
// offloaded_kv_cache.cc sets it up, opens sequences (prefix reuse) and runs
// the background appends; offloaded_prefill.cc and offloaded_decode.cc are
// its prefill and its decode step.
//
// What the worker holds, per sequence: its policy's state, two fetch
// buffers (host memory the data plane chose, pinned by the backend) and,
// on a device backend, two staging buffers on the device they are copied
// to, each sized for the largest plan of one layer (KvPolicy::MaxPlanRows),
// the new token's K and V of every layer, and the presence of each row
// (1 byte per position, layer and KV head). Shared by the sequences: the
// decoded rows attention reads (one layer, fp32), and for a prefill one
// layer's encoded prompt rows on their way to the memory node. Nothing
// grows with n_layers x max_seq_len.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_KV_CACHE_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu_worker/kv/fetch_schedule.h"
#include "gpu_worker/kv/kv_cache_impl.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::gpu_worker {
namespace offloaded {

using kv_memory_service::AppendBlock;
using kv_memory_service::AppendResult;
using kv_memory_service::SequenceGeometry;

// Sizes of every buffer, from the options alone: Init allocates exactly
// these and WorkerBytes reports their sum.
struct Layout {
  int row_width = 0;        // uint16 per stored row
  size_t plan_rows = 0;     // most rows of one layer's plan, all heads
  // Plan buffers (plan_dev, and on a device plan_host) per sequence: where
  // a device stages fetched rows (their head offsets) or the policy plans
  // on the backend; with room for plan_room indices before the head
  // offsets (plan_rows where the indices go there: one-sided reads onto a
  // device, plans made on the backend; else none).
  bool plan_buffers = false;
  size_t plan_room = 0;
  size_t fetch_values = 0;  // uint16 per fetch buffer: K then V rows
  bool staged = false;      // fetched rows copied to device staging
  bool attention_probs = false;
  bool prefill_probs = false;
  // A prefill layer's rows also kept in fp16 (half_rows), which its
  // attention reads: a device computing in fp16 (KvCacheOptions::
  // half_local_kv), fp16 stored rows, a policy that attends over the rows
  // as stored (KvPolicy::ReusesPrefix), no prefill probabilities. The same
  // values as the fp32 rows, at half the bytes to read.
  bool half_rows = false;
  int64_t policy_bytes = 0;

  int64_t PerSequence(const model::ModelConfig& c, int max_seq) const {
    const int64_t fetch = 2 * static_cast<int64_t>(fetch_values) * 2;
    // Two plan buffers, on the backend and (devices) pinned on the host.
    const int64_t plans =
        plan_buffers ? int64_t{staged ? 2 : 1} * 2 *
                           (plan_room + c.n_kv_heads + 1) * 4
                     : 0;
    return fetch * (staged ? 2 : 1) + plans +
           int64_t{2} * c.n_layers * c.kv_dim() * 4 +        // step rows
           int64_t{2} * c.n_layers * c.n_kv_heads * row_width * 2 +  // encoded
           int64_t{c.n_layers} * c.n_kv_heads * max_seq +    // presence
           int64_t{c.n_layers} * 8 + policy_bytes;
  }
  int64_t Shared(const model::ModelConfig& c, int max_seq,
                 int max_chunk) const {
    const int64_t decoded =
        int64_t{2} * c.n_kv_heads * (max_seq + 1) * c.head_dim * 4;
    // Two stages of a prefill layer's K and V rows.
    const int64_t stage =
        int64_t{2} * 2 * max_seq * c.n_kv_heads * row_width * 2;
    const int64_t host_rows =  // prefill chunk and step rows, read here
        int64_t{max_chunk} * (c.q_dim() + 2 * c.kv_dim()) * 4 +
        int64_t{2} * c.n_layers * c.kv_dim() * 4;
    // A prefill chunk's rows decoded from their stored form, and (device
    // backends) that form staged on the device.
    const int64_t chunk_rows =
        int64_t{2} * max_chunk * c.kv_dim() * 4 +
        (staged ? int64_t{2} * max_chunk * c.n_kv_heads * row_width * 2 : 0);
    // Probabilities (h2o): on the backend and their host copies.
    return decoded + (half_rows ? decoded / 2 : 0) + stage + host_rows +
           chunk_rows +
           (attention_probs ? int64_t{2} * c.n_heads * (max_seq + 1) * 4 : 0) +
           (prefill_probs ? int64_t{2} * c.n_heads * max_seq * 4 : 0);
  }
};

absl::StatusOr<Layout> MakeLayout(const model::Weights& weights,
                                  bool operates_on_host,
                                  const KvCacheOptions& options);

// The cache itself: one Sequence per slot (its memory-node sequence, policy,
// fetch buffers and presence), the shared buffers, and the appender thread
// that sends a decode step's new rows while the step finishes.
class OffloadedKvCache final : public KvCache {
 public:
  OffloadedKvCache(const model::Weights& weights, Backend* backend,
                   const KvCacheOptions& options, const Layout& layout)
      : weights_(weights),
        c_(weights.config),
        backend_(*backend),
        options_(options),
        node_address_(options.kv.kv_client->address()),
        schedule_(FetchSchedule::Of(*options.kv.policy, weights.config.n_layers)),
        layout_(layout),
        max_seq_(options.max_seq_len),
        stride_(options.max_seq_len + 1),
        sequences_(options.batch) {}

  ~OffloadedKvCache() override {
    WaitPrefillAppend().IgnoreError();
    if (appender_.joinable()) {
      FinishAppends().IgnoreError();
      {
        absl::MutexLock lock(&append_mu_);
        stopping_ = true;
      }
      appender_.join();
    }
    for (Sequence& s : sequences_) {
      EndDirect(s);
      if (s.seq != 0) options_.kv.kv_client->Close(s.seq).IgnoreError();
    }
    // Copies may still read the fetch buffers; unpin them before they go.
    backend_.WaitCopies().IgnoreError();
    for (Sequence& s : sequences_) {
      for (int i = 0; i < 2; ++i) {
        s.handles[i].Wait().IgnoreError();
        if (s.buffers[i] != nullptr) backend_.UnpinHost(s.buffers[i]->data());
        if (!s.plan_host[i].empty()) backend_.UnpinHost(s.plan_host[i].data());
      }
      if (!s.note_indices.empty()) backend_.UnpinHost(s.note_indices.data());
    }
    backend_.UnpinHost(k_stage_.data());
    backend_.UnpinHost(v_stage_.data());
  }

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
  absl::Status Flush() override { return FinishAppends(); }
  bool offloaded() const override { return true; }
  const FetchStats& fetch_stats(int slot) const override {
    return sequences_[slot].stats;
  }
  int64_t worker_bytes() const override { return bytes_; }
  // The open step's fetches due at `point` of `layer` (the hybrid cache
  // names the points itself: FetchSchedule::DueAt).
  absl::Status IssueDue(FetchPoint point, int layer, const float* x) {
    return step_.IssueDue(point, layer, x);
  }
  int64_t node_bytes() const override {
    int64_t bytes = 0;
    for (const Sequence& s : sequences_) {
      if (s.seq != 0) bytes += kv_memory_service::ReservedBytes(geometry_);
    }
    return bytes;
  }

 private:
  // The decode step (offloaded_decode.cc), one per cache, reused: issues
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

  // One sequence slot: its memory-node sequence, policy and fetch state.
  struct Sequence {
    std::unique_ptr<KvPolicy> policy;
    kv_memory_service::SequenceId seq = 0;
    int position = 0;                 // this step's new token
    std::vector<uint8_t> present;     // [layer][kv_head][pos]
    std::vector<long> present_count;  // [layer]: present rows, all heads
    std::unique_ptr<kv_memory_service::FetchBuffer> buffers[2];
    kv_memory_service::OwnedFetchPlan plans[2];
    kv_memory_service::FetchHandle handles[2];
    // buffers[i]'s rows copied to the backend (device backends only);
    // staged_free[i] marks the last operation that read staged[i].
    DeviceBuffer<uint16_t> staged[2];
    Backend::Mark staged_free[2] = {0, 0};
    bool uploaded[2] = {false, false};  // plans[i]'s rows are readable
    // The step's new K rows [layer][kv_dim], then its V rows the same
    // (backend memory, copied to the host in one piece after the last
    // layer), encoded for the memory node into k_step/v_step
    // [layer][kv_head][row_width].
    DeviceBuffer<float> new_rows;
    std::vector<uint16_t> k_step, v_step;
    AppendResult appended;  // last async append
    absl::Status append_status;
    // Set when a step's rows did not reach the memory node: the sequence
    // there lacks a position, so its next step fails with this (and the
    // engine recomputes it) rather than attend without the row.
    absl::Status lost;
    FetchStats stats;
    long step_rows = 0;  // rows fetched in the current step
    // Prefix reuse: leading tokens attached from shared blocks at the
    // prefill, and the policy summaries of the prompt's later whole blocks
    // [annotated_first, ...), [block][layer][PrefixStateFloats], sent with
    // the last layer's rows.
    int cached = 0;
    int annotated_first = 0;
    std::vector<float> block_state;
    // One-sided reads (KvOptions::direct_reads): the node's rows of this
    // sequence, pinned for a device, while `direct` is set; a fetch then
    // only plans (direct_plan[i]) and UploadFetched has a device read the
    // rows into its staging (a host backend's attention reads them in
    // place). plan_dev[i]: plans[i]'s indices (one-sided reads), then its
    // head offsets (device backends).
    kv_memory_service::DirectRows rows;
    bool direct = false;
    bool direct_plan[2] = {false, false};
    DeviceBuffer<int32_t> plan_dev[2];
    // plans[i]'s indices and head offsets on their way to plan_dev[i]
    // (device backends), pinned: a copy from pageable memory would hold the
    // host until the device reached it.
    std::vector<int32_t> plan_host[2];
    // Plans the policy made on the backend (KvPolicy::PlanFetchOnBackend)
    // land in plan_dev[i]. With one-sided reads onto a device the indices
    // stay there (plan_on_backend[i]; plans[i] holds the head offsets
    // alone): a queued copy brings each such layer's indices to
    // note_indices [layer][note_rows] (pinned) and its offsets are kept in
    // note_offsets[layer], and the node hears of them after the step's
    // last layer (noted_layers, in order), with no wait inside the step.
    bool plan_on_backend[2] = {false, false};
    // With one-sided reads, a plan of every row (KvPolicy::PlansEveryRow,
    // every position present) is each head's first `position` rows:
    // plans[i] holds its head offsets alone, the rows are read as a
    // whole (GatherRowsParams without indices) and the node hears of them
    // by the offsets (NoteLeadingFetchedAsync).
    bool plan_leading[2] = {false, false};
    // The step's notes go with its appends, on the appender's thread,
    // which owns noted_layers and the fetch buffers' handles until
    // FinishAppends.
    bool notes_in_background = false;
    size_t note_rows = 0;
    std::vector<int32_t> note_indices;
    std::vector<std::vector<int32_t>> note_offsets;
    std::vector<int> noted_layers;
  };

  // Opens the slot's sequence with the prefix keys of `tokens` (none
  // without reuse) and takes over what it attached; returns the cached
  // tokens.
  absl::StatusOr<int> OpenSequence(Sequence& s, absl::Span<const int> tokens,
                                   bool reuse);
  // Prefix reuse: fetches `layer`'s rows of the cached positions; then
  // (LoadPrefix) decodes them into k_rows_/v_rows_ and starts the next
  // layer's.
  absl::Status IssuePrefixFetch(Sequence& s, int layer);
  absl::Status LoadPrefix(Sequence& s, int layer);
  // Appends `n` tokens' rows of layers [first_layer, first_layer +
  // n_layers) (layout [layer][token][kv_head][row_width]) and marks them
  // present, less what the pool evicted.
  absl::Status AppendRows(Sequence& s, int first_layer, int n_layers,
                          const uint16_t* k, const uint16_t* v, int n,
                          AppendResult* result,
                          const std::vector<std::string>* meta = nullptr,
                          int meta_first_block = 0);
  void MarkAppended(Sequence& s, int first_layer, int n_layers, int first,
                    int n, const AppendResult& result);
  absl::Status IssueFetch(Sequence& s, int layer, const float* xb_prev);
  // IssueFetch's plan of `layer` into plans[layer % 2]: on the backend
  // where the policy can and every position is present, else the
  // policy's PlanFetch on the host.
  absl::Status PlanLayer(Sequence& s, int layer, const float* xb_prev);
  // InternalError where a plan names more rows than the staging holds.
  absl::Status CheckPlanRows(size_t rows, int layer) const;
  // InternalError where `layer`'s plan for one-sided reads names a position
  // outside the sequence's rows (checked before the device reads them).
  absl::Status CheckDirectPlan(const Sequence& s, int layer) const;
  // plans[i]'s indices brought to the host from plan_dev[i] where they
  // stayed on the backend, or written out where the plan was leading (a
  // fallback to the node's gather needs them), the layer's note then left
  // to the gather.
  absl::Status PlanToHost(Sequence& s, int layer);
  // The step's notes of plans made on the backend (noted_layers), once
  // their queued copies have landed (NoteBackendPlans waits for them;
  // SendBackendNotes, the appender's, is called after they did).
  absl::Status NoteBackendPlans(Sequence& s);
  absl::Status SendBackendNotes(Sequence& s);
  // One-sided reads: after the sequence opened, pins its rows on the node
  // and turns `direct` on where KvOptions::direct_reads allows; EndDirect
  // unpins them (before the sequence closes).
  void BeginDirect(Sequence& s);
  void EndDirect(Sequence& s);
  // Whether a host backend's attention reads stored rows of `format` by
  // index where they lie (AttendStoredRows with indices).
  bool AttendsNodeRows(KvRowFormat format);
  // The backend reads plans[i]'s rows of `layer` from the node's memory
  // into staged[i]; false (nothing done) where it cannot.
  bool ReadDirect(Sequence& s, int layer);
  // plans[i]'s head offsets to plan_dev[i] (after its indices' room),
  // through plan_host[i], once staged[i]'s last reader is done.
  void UploadOffsets(Sequence& s, int i);
  // Attention of one query row over the fetch's staged rows, every head in
  // one backend operation (AttendStagedRows); false, having done nothing,
  // where the backend cannot.
  bool AttendStaged(Sequence& s, int layer, const float* q,
                    const float* k_new, const float* v_new, float* att);
  // Waits for `layer`'s fetch and makes its rows readable by the backend
  // (a copy to its staging, queued once per fetch).
  absl::Status UploadFetched(Sequence& s, int layer);
  const uint16_t* FetchedRows(Sequence& s, int layer) {
    const int i = layer % 2;
    return layout_.staged ? s.staged[i].data() : s.buffers[i]->data();
  }
  // Attention of the sequence's new token (row `row`) at `layer` over its
  // fetched rows, decoded by the backend, plus its own.
  // Init's parts: one sequence slot's policy, fetch buffers and step rows;
  // the buffers every slot shares; the identity its prefix blocks carry.
  absl::Status InitSequence(Sequence& s, const KvPolicy::Context& ctx,
                            bool& pin_warned);
  absl::Status InitSharedBuffers();
  void InitPrefixIdentity();
  // Attention of one query row over the fetched rows where the backend
  // reads them as stored (AttendStoredRows); false, having done nothing,
  // where it cannot.
  bool AttendInPlace(Sequence& s, int layer, const float* q, const float* k_new,
                     const float* v_new, float* att);
  // The same after DecodeFetched: Attention over k_rows_ / v_rows_.
  void DecodedAttention(Sequence& s, int layer, const float* q, float* att);
  absl::Status FetchedAttention(Sequence& s, int layer, int row,
                                const float* q, const float* k,
                                const float* v, float* out);
  // FetchedAttention's parts: each KV head's fetched rows decoded where
  // attention reads them, with the new token's exact row after them; each
  // head's probability row zeroed for the accumulation (H2O).
  void DecodeFetched(Sequence& s, int layer, const float* k_new,
                     const float* v_new);
  absl::Status ZeroProbabilityRows(
      const kv_memory_service::OwnedFetchPlan& plan);
  // After the step's last layer's attention is queued: encodes the new
  // token's rows of every layer (copied to the host) and tells the policy
  // about them.
  absl::Status StageStepRows(Sequence& s);

  // `status` from the memory node, naming it (kv_memory_service::AtNode).
  absl::Status AtNode(const absl::Status& status) const {
    return kv_memory_service::AtNode(node_address_, status);
  }

  void AppenderLoop();
  // Hands the step's new rows of `slots` (StageStepRows) to the appender.
  void StartAppends(absl::Span<const int> slots);
  absl::Status FinishAppends();

  const model::Weights& weights_;
  const model::ModelConfig& c_;
  Backend& backend_;
  const KvCacheOptions options_;
  const std::string node_address_;  // the KvClient's, for messages
  const FetchSchedule schedule_;  // when each layer's fetch leaves
  const Layout layout_;
  const int max_seq_;
  const int stride_;  // rows between KV heads in k_rows_/v_rows_
  SequenceGeometry geometry_;
  std::vector<Sequence> sequences_;
  int64_t bytes_ = 0;

  // Decoded rows attention reads, [kv_head][stride_][head_dim]: a decode
  // step's fetched rows plus the new token, or one prefill layer's keys and
  // values.
  DeviceBuffer<float> k_rows_, v_rows_;
  // The same rows in fp16 while prefilling (Layout::half_rows).
  DeviceBuffer<uint16_t> k_rows_half_, v_rows_half_;
  bool direct_refusal_logged_ = false;  // BeginDirect's one line
  // A prefill chunk's K then V rows [2][max_chunk][kv_dim] as the memory
  // node will hold them (encoded, then decoded on the backend), and on
  // device backends their encoded form copied there [2][max_chunk][kv_head]
  // [row_width]; chunk_stage_free_ marks the decode that last read it.
  DeviceBuffer<float> chunk_rows_;
  DeviceBuffer<uint16_t> chunk_stage_;
  Backend::Mark chunk_stage_free_ = 0;
  // Attention probabilities (h2o), on the backend and their host copies.
  DeviceBuffer<float> probs_;          // [n_heads][stride_]
  DeviceBuffer<float> prefill_probs_;  // [n_heads][max_seq]
  std::vector<float> probs_host_, prefill_probs_host_;
  // Host copies: a prefill chunk's q, k, v [max_chunk][...] and a step's
  // new rows [layer][kv_dim].
  std::vector<float> q_host_, k_host_, v_host_;
  std::vector<float> new_rows_host_;
  // Two stages of one prefill layer's rows for the memory node, each
  // [pos][kv_head][width]: the layer computing fills stage prefill_stage_
  // while the previous layer's append leaves from the other.
  std::vector<uint16_t> k_stage_, v_stage_;
  int prefill_stage_ = 0;
  uint16_t* StageRows(std::vector<uint16_t>& rows) {
    return rows.data() + prefill_stage_ * (rows.size() / 2);
  }
  // The prefill layer's append in flight, on a thread of its own, and what
  // MarkAppended needs once it is in.
  struct PrefillAppend {
    std::thread thread;
    int slot = 0, layer = 0, first = 0, n = 0;
    AppendResult result;
    absl::Status status;
  };
  PrefillAppend prefill_append_;
  // Joins the append in flight (if any) and marks its rows present;
  // returns its error.
  absl::Status WaitPrefillAppend();

  // The prefill in progress: positions [prefill_first_, prefill_tokens_)
  // computed, those before it cached.
  int prefill_slot_ = -1;
  int prefill_first_ = 0;
  int prefill_tokens_ = 0;
  // Prefix reuse: the identity hashed into the keys (KvCacheOptions::
  // model_identity plus policy and row format; empty: no reuse) and the
  // policy's per-layer summary size.
  std::string identity_;
  int state_floats_ = 0;
  bool step_open_ = false;  // step_ is handed out

  Step step_{*this};

  std::thread appender_;
  absl::Mutex append_mu_;
  std::vector<int> append_slots_ ABSL_GUARDED_BY(append_mu_);
  bool append_pending_ ABSL_GUARDED_BY(append_mu_) = false;
  bool append_done_ ABSL_GUARDED_BY(append_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(append_mu_) = false;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_KV_CACHE_H_
