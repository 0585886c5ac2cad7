// The offloaded KV cache (kv_cache.h): the memory node holds the rows, the
// worker a bounded working set.
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
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/status.h"
#include "gpu_worker/kv/fetch_schedule.h"
#include "gpu_worker/kv/kv_cache_impl.h"
#include "kv_memory_service/prefix_keys.h"

namespace infinigen::gpu_worker {
namespace {

using kv_memory_service::AppendBlock;
using kv_memory_service::AppendResult;
using kv_memory_service::SequenceGeometry;

// Sizes of every buffer, from the options alone: Init allocates exactly
// these and WorkerBytes reports their sum.
struct Layout {
  int row_width = 0;        // uint16 per stored row
  size_t plan_rows = 0;     // most rows of one layer's plan, all heads
  size_t fetch_values = 0;  // uint16 per fetch buffer: K then V rows
  bool staged = false;      // fetched rows copied to device staging
  bool attention_probs = false;
  bool prefill_probs = false;
  int64_t policy_bytes = 0;

  int64_t PerSequence(const model::ModelConfig& c, int max_seq) const {
    const int64_t fetch = 2 * static_cast<int64_t>(fetch_values) * 2;
    return fetch * (staged ? 2 : 1) +
           int64_t{2} * c.n_layers * c.kv_dim() * 4 +        // step rows
           int64_t{2} * c.n_layers * c.n_kv_heads * row_width * 2 +  // encoded
           int64_t{c.n_layers} * c.n_kv_heads * max_seq +    // presence
           int64_t{c.n_layers} * 8 + policy_bytes;
  }
  int64_t Shared(const model::ModelConfig& c, int max_seq,
                 int max_chunk) const {
    const int64_t decoded =
        int64_t{2} * c.n_kv_heads * (max_seq + 1) * c.head_dim * 4;
    const int64_t stage = int64_t{2} * max_seq * c.n_kv_heads * row_width * 2;
    const int64_t host_rows =  // prefill chunk and step rows, read here
        int64_t{max_chunk} * (c.q_dim() + 2 * c.kv_dim()) * 4 +
        int64_t{2} * c.n_layers * c.kv_dim() * 4;
    // Probabilities (h2o): on the backend and their host copies.
    return decoded + stage + host_rows +
           (attention_probs ? int64_t{2} * c.n_heads * (max_seq + 1) * 4 : 0) +
           (prefill_probs ? int64_t{2} * c.n_heads * max_seq * 4 : 0);
  }
};

absl::StatusOr<Layout> MakeLayout(const model::Weights& weights,
                                  bool operates_on_host,
                                  const KvCacheOptions& options) {
  if (options.kv.kv_client == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("engine: policy %s needs a KV memory node",
                        PolicyName(options.kv.policy.kind)));
  }
  KvPolicy::Context ctx;
  ctx.weights = &weights;
  ctx.max_seq_len = options.max_seq_len;
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> policy,
                      KvPolicy::CreateUninitialized(options.kv.policy, ctx));
  Layout z;
  z.row_width = policy->RowWidth();
  z.plan_rows = static_cast<size_t>(weights.config.n_kv_heads) *
                policy->MaxPlanRows(options.max_seq_len);
  z.fetch_values = 2 * z.plan_rows * z.row_width;
  z.staged = !operates_on_host;
  z.attention_probs = policy->WantsAttentionProbs();
  z.prefill_probs = policy->WantsPrefillProbs();
  IG_ASSIGN_OR_RETURN(z.policy_bytes,
                      KvPolicy::StateBytes(options.kv.policy, ctx));
  return z;
}

class OffloadedKvCache final : public KvCache {
 public:
  OffloadedKvCache(const model::Weights& weights, Backend* backend,
                   const KvCacheOptions& options, const Layout& layout)
      : weights_(weights),
        c_(weights.config),
        backend_(*backend),
        options_(options),
        schedule_(FetchSchedule::Of(options.kv.policy, weights.config.n_layers)),
        layout_(layout),
        max_seq_(options.max_seq_len),
        stride_(options.max_seq_len + 1),
        sequences_(options.batch) {}

  ~OffloadedKvCache() override {
    if (appender_.joinable()) {
      FinishAppends().IgnoreError();
      {
        absl::MutexLock lock(&append_mu_);
        stopping_ = true;
      }
      appender_.join();
    }
    for (Sequence& s : sequences_) {
      if (s.seq != 0) options_.kv.kv_client->Close(s.seq).IgnoreError();
    }
    // Copies may still read the fetch buffers; unpin them before they go.
    backend_.WaitCopies().IgnoreError();
    for (Sequence& s : sequences_) {
      for (int i = 0; i < 2; ++i) {
        s.handles[i].Wait().IgnoreError();
        if (s.buffers[i] != nullptr) backend_.UnpinHost(s.buffers[i]->data());
      }
    }
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
  absl::Status BeginStep(absl::Span<const int> slots,
                         absl::Span<const int> positions) override;
  absl::Status LayerInput(int layer, const float* xb) override;
  bool WantsPostAttentionInput() const override {
    return schedule_.WantsPostAttentionInput();
  }
  absl::Status PostAttentionInput(int layer, const float* xb_next) override;
  absl::Status DecodeAttention(int layer, const float* q, const float* k,
                               const float* v, float* out) override;
  absl::Status LayerDone(int layer) override;
  absl::Status EndStep() override;
  absl::Status Reset(int slot) override;
  absl::Status Flush() override { return FinishAppends(); }
  bool offloaded() const override { return true; }
  const FetchStats& fetch_stats(int slot) const override {
    return sequences_[slot].stats;
  }
  int64_t worker_bytes() const override { return bytes_; }
  int64_t node_bytes() const override {
    int64_t bytes = 0;
    for (const Sequence& s : sequences_) {
      if (s.seq != 0) bytes += kv_memory_service::ReservedBytes(geometry_);
    }
    return bytes;
  }

 private:
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
  // Waits for `layer`'s fetch and makes its rows readable by the backend
  // (a copy to its staging, queued once per fetch).
  absl::Status UploadFetched(Sequence& s, int layer);
  // Issues, for every slot of the step, the fetch due at `point` of
  // `layer`'s pass (FetchSchedule::DueAt), ranked by x [slots][dim] (null
  // at the step's start).
  absl::Status IssueDue(FetchPoint point, int layer, const float* x);
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

  void AppenderLoop();
  void StartAppends();
  absl::Status FinishAppends();

  const model::Weights& weights_;
  const model::ModelConfig& c_;
  Backend& backend_;
  const KvCacheOptions options_;
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
  // Attention probabilities (h2o), on the backend and their host copies.
  DeviceBuffer<float> probs_;          // [n_heads][stride_]
  DeviceBuffer<float> prefill_probs_;  // [n_heads][max_seq]
  std::vector<float> probs_host_, prefill_probs_host_;
  // Host copies: a prefill chunk's q, k, v [max_chunk][...] and a step's
  // new rows [layer][kv_dim].
  std::vector<float> q_host_, k_host_, v_host_;
  std::vector<float> new_rows_host_;
  // One prefill layer's rows for the memory node: [pos][kv_head][width].
  std::vector<uint16_t> k_stage_, v_stage_;

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
  // The step in progress.
  std::vector<int> step_slots_;

  std::thread appender_;
  absl::Mutex append_mu_;
  std::vector<int> append_slots_ ABSL_GUARDED_BY(append_mu_);
  bool append_pending_ ABSL_GUARDED_BY(append_mu_) = false;
  bool append_done_ ABSL_GUARDED_BY(append_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(append_mu_) = false;
};

absl::Status OffloadedKvCache::Init() {
  KvPolicy::Context ctx;
  ctx.weights = &weights_;
  ctx.backend = &backend_;
  ctx.max_seq_len = max_seq_;
  geometry_.n_layers = c_.n_layers;
  geometry_.n_kv_heads = c_.n_kv_heads;
  geometry_.head_dim = layout_.row_width;
  geometry_.max_tokens =
      std::max(1, static_cast<int>(options_.kv.kv_capacity * max_seq_));
  bool pin_warned = false;
  for (Sequence& s : sequences_) {
    IG_RETURN_IF_ERROR(InitSequence(s, ctx, pin_warned));
  }
  IG_RETURN_IF_ERROR(InitSharedBuffers());
  step_slots_.reserve(sequences_.size());
  InitPrefixIdentity();
  bytes_ = options_.batch * layout_.PerSequence(c_, max_seq_) +
           layout_.Shared(c_, max_seq_, options_.max_chunk);
  {
    absl::MutexLock lock(&append_mu_);
    append_slots_.reserve(sequences_.size());
  }
  appender_ = std::thread([this] { AppenderLoop(); });
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::InitSequence(Sequence& s,
                                            const KvPolicy::Context& ctx,
                                            bool& pin_warned) {
  IG_ASSIGN_OR_RETURN(s.policy, KvPolicy::Create(options_.kv.policy, ctx));
  for (int i = 0; i < 2; ++i) {
    IG_ASSIGN_OR_RETURN(s.buffers[i], options_.kv.kv_client->NewFetchBuffer(
                                          layout_.fetch_values));
    const absl::Status pinned = backend_.PinHost(
        s.buffers[i]->data(), s.buffers[i]->size() * sizeof(uint16_t));
    if (!pinned.ok() && !pin_warned) {
      IG_LOG(WARNING) << "engine: fetch buffers stay pageable (copies run "
                         "slower): "
                      << pinned.message();
      pin_warned = true;
    }
    if (layout_.staged) {
      IG_ASSIGN_OR_RETURN(s.staged[i], DeviceBuffer<uint16_t>::Make(
                                           &backend_, layout_.fetch_values,
                                           "fetch staging"));
    }
  }
  s.present.assign(
      static_cast<size_t>(c_.n_layers) * c_.n_kv_heads * max_seq_, 0);
  s.present_count.assign(c_.n_layers, 0);
  const size_t step_values = static_cast<size_t>(c_.n_layers) * c_.kv_dim();
  IG_ASSIGN_OR_RETURN(s.new_rows, DeviceBuffer<float>::Make(
                                      &backend_, 2 * step_values,
                                      "step rows"));
  s.k_step.resize(static_cast<size_t>(c_.n_layers) * c_.n_kv_heads *
                  layout_.row_width);
  s.v_step.resize(s.k_step.size());
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::InitSharedBuffers() {
  const size_t decoded = static_cast<size_t>(c_.n_kv_heads) * stride_ *
                         c_.head_dim;
  IG_ASSIGN_OR_RETURN(k_rows_, DeviceBuffer<float>::Make(&backend_, decoded,
                                                         "decoded K rows"));
  IG_ASSIGN_OR_RETURN(v_rows_, DeviceBuffer<float>::Make(&backend_, decoded,
                                                         "decoded V rows"));
  if (layout_.attention_probs) {
    const size_t n = static_cast<size_t>(c_.n_heads) * stride_;
    IG_ASSIGN_OR_RETURN(probs_, DeviceBuffer<float>::Make(
                                    &backend_, n, "attention probabilities"));
    probs_host_.assign(n, 0.0f);
  }
  if (layout_.prefill_probs) {
    const size_t n = static_cast<size_t>(c_.n_heads) * max_seq_;
    IG_ASSIGN_OR_RETURN(prefill_probs_,
                        DeviceBuffer<float>::Make(&backend_, n,
                                                  "attention probabilities"));
    prefill_probs_host_.assign(n, 0.0f);
  }
  const size_t chunk = options_.max_chunk;
  q_host_.resize(chunk * c_.q_dim());
  k_host_.resize(chunk * c_.kv_dim());
  v_host_.resize(chunk * c_.kv_dim());
  new_rows_host_.resize(2 * static_cast<size_t>(c_.n_layers) * c_.kv_dim());
  const size_t stage =
      static_cast<size_t>(max_seq_) * c_.n_kv_heads * layout_.row_width;
  k_stage_.resize(stage);
  v_stage_.resize(stage);
  return absl::OkStatus();
}

void OffloadedKvCache::InitPrefixIdentity() {
  const KvPolicy& policy = *sequences_[0].policy;
  if (options_.kv.prefix_block_tokens <= 0 || options_.kv.model_identity.empty() ||
      !policy.ReusesPrefix()) {
    return;
  }
  // Rows are reusable between workers that store the same bits and read
  // the same summaries: same model, policy, row format and shape.
  identity_ = absl::StrFormat(
      "%s|policy=%s|rank_by_keys=%d|format=%d|layers=%d|kv_heads=%d|"
      "width=%d|dtype=%d",
      options_.kv.model_identity, PolicyName(options_.kv.policy.kind),
      options_.kv.policy.rank_columns_by_keys ? 1 : 0,
      static_cast<int>(policy.row_format()), geometry_.n_layers,
      geometry_.n_kv_heads, geometry_.head_dim,
      static_cast<int>(geometry_.dtype));
  state_floats_ = policy.PrefixStateFloats();
}

absl::StatusOr<int> OffloadedKvCache::OpenSequence(
    Sequence& s, absl::Span<const int> tokens, bool reuse) {
  const int n = static_cast<int>(tokens.size());
  const int block = options_.kv.prefix_block_tokens;
  kv_memory_service::PrefixRequest prefix;
  if (reuse && !identity_.empty()) {
    // Whole blocks only, at least one token left to compute (its logits
    // are the prefill's answer), no more than a layer's fetch holds.
    const int per_head = static_cast<int>(layout_.plan_rows) / c_.n_kv_heads;
    const int usable =
        std::min({n - 1, per_head, static_cast<int>(geometry_.max_tokens)});
    if (usable >= block) {
      const std::vector<int32_t> ids(tokens.begin(),
                                     tokens.begin() + usable / block * block);
      prefix.block_tokens = block;
      prefix.keys = kv_memory_service::PrefixKeys(identity_, block, ids);
    }
  }
  IG_ASSIGN_OR_RETURN(kv_memory_service::OpenedSequence opened,
                      options_.kv.kv_client->OpenSequence(geometry_, prefix));
  s.seq = opened.id;
  const int cached = opened.cached_tokens;
  const int blocks = block > 0 ? cached / block : 0;
  const size_t meta_bytes =
      static_cast<size_t>(c_.n_layers) * state_floats_ * sizeof(float);
  absl::Status bad;
  if (cached < 0 || cached > static_cast<int>(prefix.keys.size()) * block ||
      (block > 0 && cached % block != 0)) {
    bad = absl::InternalError(absl::StrFormat(
        "kv cache: the memory node attached %d cached tokens for %d blocks of "
        "%d", cached, prefix.keys.size(), block));
  } else if (static_cast<int>(opened.prefix_meta.size()) != blocks) {
    bad = absl::InternalError(absl::StrFormat(
        "kv cache: %d attached blocks came with %d annotations", blocks,
        opened.prefix_meta.size()));
  }
  for (const std::string& meta : opened.prefix_meta) {
    if (bad.ok() && meta.size() != meta_bytes) {
      bad = absl::DataLossError(absl::StrFormat(
          "kv cache: a reused prefix block's policy summary has %d bytes, "
          "%s expects %d",
          meta.size(), PolicyName(options_.kv.policy.kind), meta_bytes));
    }
  }
  if (!bad.ok()) return bad;
  // The attached blocks' prompt statistics, as if the policy had seen them.
  std::vector<float> state(static_cast<size_t>(state_floats_));
  for (const std::string& meta : opened.prefix_meta) {
    for (int l = 0; l < c_.n_layers && state_floats_ > 0; ++l) {
      std::memcpy(state.data(), meta.data() + l * state.size() * sizeof(float),
                  state.size() * sizeof(float));
      s.policy->AddPrefixState(l, state.data());
    }
  }
  s.cached = cached;
  s.annotated_first = blocks;
  s.block_state.assign(
      state_floats_ > 0 ? (prefix.keys.size() - blocks) * c_.n_layers *
                              static_cast<size_t>(state_floats_)
                        : 0,
      0.0f);
  if (cached > 0) {
    AppendResult none;
    MarkAppended(s, 0, c_.n_layers, 0, cached, none);
  }
  return cached;
}

absl::Status OffloadedKvCache::IssuePrefixFetch(Sequence& s, int layer) {
  IG_RETURN_IF_ERROR(backend_.WaitCopies());
  const int i = layer % 2;
  s.uploaded[i] = false;
  kv_memory_service::OwnedFetchPlan& plan = s.plans[i];
  plan.indices.clear();
  plan.head_offsets.assign(1, 0);
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    for (int p = 0; p < s.cached; ++p) plan.indices.push_back(p);
    plan.head_offsets.push_back(static_cast<int32_t>(plan.indices.size()));
  }
  s.handles[i] = options_.kv.kv_client->FetchAsync(s.seq, layer, plan.view(),
                                                s.buffers[i].get());
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::LoadPrefix(Sequence& s, int layer) {
  IG_RETURN_IF_ERROR(UploadFetched(s, layer));
  const int i = layer % 2;
  const int hd = c_.head_dim, width = layout_.row_width;
  const size_t total = s.plans[i].indices.size();
  const uint16_t* k_rows = FetchedRows(s, layer);
  const uint16_t* v_rows = k_rows + total * width;
  const KvRowFormat format = s.policy->row_format();
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const size_t begin = s.plans[i].head_offsets[g];
    backend_.DecodeKvRows(k_rows + begin * width, s.cached, hd, format,
                          k_rows_.data() + static_cast<size_t>(g) * stride_ * hd);
    backend_.DecodeKvRows(v_rows + begin * width, s.cached, hd, format,
                          v_rows_.data() + static_cast<size_t>(g) * stride_ * hd);
  }
  s.staged_free[i] = backend_.MarkIssued();
  if (layer + 1 < c_.n_layers) IG_RETURN_IF_ERROR(IssuePrefixFetch(s, layer + 1));
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::Reset(int slot) {
  FinishAppends().IgnoreError();
  Sequence& s = sequences_[slot];
  s.lost = absl::OkStatus();
  // A step that failed may have left a prefetch in flight: end it, so the
  // buffer takes the next generation's fetches.
  for (kv_memory_service::FetchHandle& h : s.handles) h.Wait().IgnoreError();
  s.stats = FetchStats();
  s.cached = 0;
  s.annotated_first = 0;
  s.block_state.clear();
  s.policy->Reset();
  std::fill(s.present.begin(), s.present.end(), 0);
  std::fill(s.present_count.begin(), s.present_count.end(), 0);
  if (s.seq != 0) {
    const kv_memory_service::SequenceId seq = s.seq;
    s.seq = 0;
    IG_RETURN_IF_ERROR(options_.kv.kv_client->Close(seq));
  }
  return absl::OkStatus();
}

// --- Prefill: layer by layer; each layer's rows leave before the next.

absl::StatusOr<int> OffloadedKvCache::BeginPrefill(
    int slot, int first, absl::Span<const int> tokens, bool reuse) {
  const int n = static_cast<int>(tokens.size());
  if (first != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "forward: policy %s prefills a sequence in one call (slot %d holds "
        "%d tokens already)",
        PolicyName(options_.kv.policy.kind), slot, first));
  }
  IG_RETURN_IF_ERROR(FinishAppends());
  Sequence& s = sequences_[slot];
  int cached = 0;
  if (s.seq == 0) {
    IG_ASSIGN_OR_RETURN(cached, OpenSequence(s, tokens, reuse));
  }
  prefill_slot_ = slot;
  prefill_first_ = cached;
  prefill_tokens_ = n;
  if (cached > 0) IG_RETURN_IF_ERROR(IssuePrefixFetch(s, 0));
  return cached;
}

absl::Status OffloadedKvCache::PrefillAttention(int layer, int pos, int rows,
                                                const float* q,
                                                const float* k,
                                                const float* v, float* out) {
  Sequence& s = sequences_[prefill_slot_];
  if (rows > options_.max_chunk) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kv cache: a prefill chunk of %d rows exceeds max_chunk %d", rows,
        options_.max_chunk));
  }
  const int hd = c_.head_dim, kvd = c_.kv_dim();
  // A reused prefix: the layer's cached rows first, fetched.
  if (pos == prefill_first_ && s.cached > 0) {
    IG_RETURN_IF_ERROR(LoadPrefix(s, layer));
  }
  // The host encodes the chunk's rows for the memory node and shows the
  // policy its queries and keys.
  const size_t kv_values = static_cast<size_t>(rows) * kvd;
  IG_RETURN_IF_ERROR(backend_.CopyToHost(
      q_host_.data(), q, static_cast<size_t>(rows) * c_.q_dim() * sizeof(float)));
  IG_RETURN_IF_ERROR(
      backend_.CopyToHost(k_host_.data(), k, kv_values * sizeof(float)));
  IG_RETURN_IF_ERROR(
      backend_.CopyToHost(v_host_.data(), v, kv_values * sizeof(float)));
  const size_t at = static_cast<size_t>(pos) * c_.n_kv_heads *
                    layout_.row_width;
  s.policy->EncodeRows(k_host_.data(), rows * c_.n_kv_heads, &k_stage_[at]);
  s.policy->EncodeRows(v_host_.data(), rows * c_.n_kv_heads, &v_stage_[at]);
  // The layer's keys and values so far, exact, for its attention.
  for (int i = 0; i < rows; ++i) {
    for (int g = 0; g < c_.n_kv_heads; ++g) {
      const size_t dst = (static_cast<size_t>(g) * stride_ + pos + i) * hd;
      const size_t src = static_cast<size_t>(i) * kvd + g * hd;
      backend_.Copy(k_rows_.data() + dst, k + src, hd);
      backend_.Copy(v_rows_.data() + dst, v + src, hd);
    }
  }
  float* probs = nullptr;
  const size_t prob_values = static_cast<size_t>(c_.n_heads) * (pos + rows);
  if (layout_.prefill_probs) {
    // Zeroed through the host copy; CopyToHost below waits for this copy
    // before the host array changes again.
    probs = prefill_probs_.data();
    std::fill(prefill_probs_host_.begin(),
              prefill_probs_host_.begin() + prob_values, 0.0f);
    backend_.CopyFromHost(probs, prefill_probs_host_.data(),
                          prob_values * sizeof(float), backend_.MarkIssued());
  }
  QueueAttention(backend_, c_, q, k_rows_.data(), v_rows_.data(), stride_,
                 rows, pos + 1, out, probs);
  if (probs != nullptr) {
    IG_RETURN_IF_ERROR(backend_.CopyToHost(prefill_probs_host_.data(), probs,
                                           prob_values * sizeof(float)));
  }
  s.policy->ObservePrefill(layer, q_host_.data(), k_host_.data(), rows, pos,
                           probs != nullptr ? prefill_probs_host_.data()
                                            : nullptr);
  // Summaries of the whole blocks this sequence will share.
  if (!s.block_state.empty()) {
    const int block = options_.kv.prefix_block_tokens;
    const size_t per_block = static_cast<size_t>(c_.n_layers) * state_floats_;
    const size_t blocks = s.block_state.size() / per_block;
    for (int i = 0; i < rows;) {
      const int b = (pos + i) / block - s.annotated_first;
      const int run = std::min(rows - i, (b + s.annotated_first + 1) * block -
                                             (pos + i));
      if (b >= 0 && static_cast<size_t>(b) < blocks) {
        s.policy->SummarizePrefill(
            layer, q_host_.data() + static_cast<size_t>(i) * c_.q_dim(),
            k_host_.data() + static_cast<size_t>(i) * kvd, run,
            &s.block_state[b * per_block +
                           static_cast<size_t>(layer) * state_floats_]);
      }
      i += run;
    }
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::EndPrefillLayer(int layer) {
  Sequence& s = sequences_[prefill_slot_];
  AppendResult result;
  const int n = prefill_tokens_ - prefill_first_;
  const size_t at = static_cast<size_t>(prefill_first_) * c_.n_kv_heads *
                    layout_.row_width;
  // With the last layer, the summaries of the blocks to share.
  std::vector<std::string> meta;
  if (layer + 1 == c_.n_layers && !s.block_state.empty()) {
    const size_t per_block = static_cast<size_t>(c_.n_layers) * state_floats_;
    for (size_t b = 0; b < s.block_state.size() / per_block; ++b) {
      meta.emplace_back(
          reinterpret_cast<const char*>(&s.block_state[b * per_block]),
          per_block * sizeof(float));
    }
  }
  IG_RETURN_IF_ERROR(AppendRows(s, layer, 1, &k_stage_[at], &v_stage_[at], n,
                                &result, &meta, s.annotated_first));
  MarkAppended(s, layer, 1, prefill_first_, n, result);
  return s.policy->FinishPrefillLayer(layer, prefill_tokens_, k_rows_.data(),
                                      stride_);
}

absl::Status OffloadedKvCache::EndPrefill() {
  prefill_slot_ = -1;
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::AppendRows(Sequence& s, int first_layer,
                                          int n_layers, const uint16_t* k,
                                          const uint16_t* v, int n,
                                          AppendResult* result,
                                          const std::vector<std::string>* meta,
                                          int meta_first_block) {
  AppendBlock block;
  if (meta != nullptr && !meta->empty()) {
    block.prefix_meta = *meta;
    block.prefix_meta_first_block = meta_first_block;
  }
  block.first_layer = first_layer;
  block.n_layers = n_layers;
  block.n_tokens = n;
  const size_t size = static_cast<size_t>(n_layers) * n * c_.n_kv_heads *
                      layout_.row_width;
  block.k = absl::MakeConstSpan(k, size);
  block.v = absl::MakeConstSpan(v, size);
  IG_ASSIGN_OR_RETURN(*result, options_.kv.kv_client->Append(s.seq, block));
  return absl::OkStatus();
}

void OffloadedKvCache::MarkAppended(Sequence& s, int first_layer,
                                    int n_layers, int first, int n,
                                    const AppendResult& result) {
  // The new positions are present; then drop what the pool evicted.
  for (int l = first_layer; l < first_layer + n_layers; ++l) {
    for (int g = 0; g < c_.n_kv_heads; ++g) {
      uint8_t* pr =
          &s.present[(static_cast<size_t>(l) * c_.n_kv_heads + g) * max_seq_];
      std::fill(pr + first, pr + first + n, 1);
    }
    s.present_count[l] += static_cast<long>(n) * c_.n_kv_heads;
  }
  for (const auto& e : result.evicted) {
    uint8_t& pr =
        s.present[(static_cast<size_t>(e.layer) * c_.n_kv_heads + e.kv_head) *
                      max_seq_ +
                  e.position];
    if (pr) {
      pr = 0;
      --s.present_count[e.layer];
    }
  }
}

// --- Decode.

absl::Status OffloadedKvCache::BeginStep(absl::Span<const int> slots,
                                         absl::Span<const int> positions) {
  // The previous step's appends must be in before this step fetches.
  IG_RETURN_IF_ERROR(FinishAppends());
  step_slots_.assign(slots.begin(), slots.end());
  for (int slot : slots) IG_RETURN_IF_ERROR(sequences_[slot].lost);
  for (size_t i = 0; i < slots.size(); ++i) {
    Sequence& s = sequences_[slots[i]];
    s.position = positions[i];
    s.step_rows = 0;
  }
  return IssueDue(FetchPoint::kStepStart, 0, nullptr);
}

absl::Status OffloadedKvCache::LayerInput(int layer, const float* xb) {
  IG_RETURN_IF_ERROR(IssueDue(FetchPoint::kOwnInput, layer, xb));
  return IssueDue(FetchPoint::kPreviousInput, layer, xb);
}

absl::Status OffloadedKvCache::PostAttentionInput(int layer,
                                                  const float* xb_next) {
  return IssueDue(FetchPoint::kPreviousAttention, layer, xb_next);
}

absl::Status OffloadedKvCache::IssueDue(FetchPoint point, int layer,
                                        const float* x) {
  const int due = schedule_.DueAt(point, layer);
  if (due < 0) return absl::OkStatus();
  for (size_t i = 0; i < step_slots_.size(); ++i) {
    IG_RETURN_IF_ERROR(IssueFetch(sequences_[step_slots_[i]], due,
                                  x == nullptr ? nullptr : x + i * c_.dim));
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::DecodeAttention(int layer, const float* q,
                                               const float* k, const float* v,
                                               float* out) {
  const size_t kvd = c_.kv_dim();
  for (size_t i = 0; i < step_slots_.size(); ++i) {
    Sequence& s = sequences_[step_slots_[i]];
    // The new token's rows, kept until the step's appends are encoded.
    float* new_k = s.new_rows.data() + layer * kvd;
    backend_.Copy(new_k, k + i * kvd, kvd);
    backend_.Copy(new_k + c_.n_layers * kvd, v + i * kvd, kvd);
    IG_RETURN_IF_ERROR(
        FetchedAttention(s, layer, static_cast<int>(i), q, k, v, out));
  }
  // Every fetch of the step is done: the host encodes the step's new rows
  // and the appends run while the last layer's MLP and the classifier
  // compute.
  if (layer + 1 == c_.n_layers) {
    for (int slot : step_slots_) {
      IG_RETURN_IF_ERROR(StageStepRows(sequences_[slot]));
    }
    StartAppends();
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::LayerDone(int layer) {
  // The next layer's rows move to the backend while this layer computes
  // (its fetch left before this layer's end).
  if (!schedule_.UploadsEarly(layer + 1)) return absl::OkStatus();
  for (int slot : step_slots_) {
    IG_RETURN_IF_ERROR(UploadFetched(sequences_[slot], layer + 1));
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::EndStep() {
  for (int slot : step_slots_) {
    Sequence& s = sequences_[slot];
    long cached = 0;
    for (long r : s.present_count) cached += r;
    const double fraction =
        cached > 0 ? static_cast<double>(s.step_rows) / cached : 0.0;
    ++s.stats.steps;
    s.stats.fraction_sum += fraction;
    s.stats.fraction_max = std::max(s.stats.fraction_max, fraction);
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::IssueFetch(Sequence& s, int layer,
                                          const float* xb_prev) {
  // The last copy out of this fetch buffer must have read it.
  IG_RETURN_IF_ERROR(backend_.WaitCopies());
  s.uploaded[layer % 2] = false;
  kv_memory_service::OwnedFetchPlan& plan = s.plans[layer % 2];
  IG_RETURN_IF_ERROR(s.policy->PlanFetch(
      layer, s.position, xb_prev,
      &s.present[static_cast<size_t>(layer) * c_.n_kv_heads * max_seq_],
      plan));
  if (plan.indices.size() > layout_.plan_rows) {
    return absl::InternalError(absl::StrFormat(
        "kv cache: policy %s planned %d rows for layer %d, above the %d its "
        "staging holds",
        PolicyName(options_.kv.policy.kind), plan.indices.size(), layer,
        layout_.plan_rows));
  }
  s.step_rows += static_cast<long>(plan.indices.size());
  s.stats.rows_fetched += static_cast<long>(plan.indices.size());
  s.stats.bytes_fetched +=
      static_cast<long>(plan.indices.size()) * 2 * layout_.row_width * 2;
  s.handles[layer % 2] = options_.kv.kv_client->FetchAsync(
      s.seq, layer, plan.view(), s.buffers[layer % 2].get());
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::UploadFetched(Sequence& s, int layer) {
  const int i = layer % 2;
  if (s.uploaded[i]) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status fetched = s.handles[i].Wait();
  s.stats.wait_seconds += std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - t0)
                              .count();
  IG_RETURN_IF_ERROR(fetched);
  if (layout_.staged) {
    // K rows of every head, then V rows, as stored.
    const size_t values = 2 * s.plans[i].indices.size() * layout_.row_width;
    backend_.CopyFromHost(s.staged[i].data(), s.buffers[i]->data(),
                          values * sizeof(uint16_t), s.staged_free[i]);
  }
  s.uploaded[i] = true;
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::FetchedAttention(Sequence& s, int layer,
                                                int row, const float* q_all,
                                                const float* k_all,
                                                const float* v_all,
                                                float* out) {
  const int group = c_.n_heads / c_.n_kv_heads;
  const int i = layer % 2;
  IG_RETURN_IF_ERROR(UploadFetched(s, layer));
  const kv_memory_service::OwnedFetchPlan& plan = s.plans[i];
  const bool want_probs = s.policy->WantsAttentionProbs();
  const float* q = q_all + static_cast<size_t>(row) * c_.q_dim();
  const float* k_new = k_all + static_cast<size_t>(row) * c_.kv_dim();
  const float* v_new = v_all + static_cast<size_t>(row) * c_.kv_dim();
  float* att = out + static_cast<size_t>(row) * c_.q_dim();
  if (want_probs) IG_RETURN_IF_ERROR(ZeroProbabilityRows(plan));
  if (!layout_.staged && AttendInPlace(s, layer, q, k_new, v_new, att)) {
    // Attention read the fetched rows where they lie: nothing decoded.
  } else {
    DecodeFetched(s, layer, k_new, v_new);
    s.staged_free[i] = backend_.MarkIssued();
    DecodedAttention(s, layer, q, att);
  }
  if (want_probs) {
    // One copy (one wait) through the last head's row: the rows between
    // heads' entries come back too, unread.
    const int last = c_.n_heads - 1;
    const int count =
        plan.head_offsets[last / group + 1] - plan.head_offsets[last / group];
    const size_t values = static_cast<size_t>(last) * stride_ + count + 1;
    IG_RETURN_IF_ERROR(backend_.CopyToHost(probs_host_.data(), probs_.data(),
                                           values * sizeof(float)));
    s.policy->ObserveAttention(layer, plan.view(), probs_host_.data(), stride_);
  }
  return absl::OkStatus();
}

bool OffloadedKvCache::AttendInPlace(Sequence& s, int layer, const float* q,
                                     const float* k_new, const float* v_new,
                                     float* att) {
  const int hd = c_.head_dim, group = c_.n_heads / c_.n_kv_heads;
  const kv_memory_service::OwnedFetchPlan& plan = s.plans[layer % 2];
  const int total = static_cast<int>(plan.indices.size());
  const int width = layout_.row_width;
  const uint16_t* k_rows = FetchedRows(s, layer);
  const uint16_t* v_rows = k_rows + static_cast<size_t>(total) * width;
  const bool want_probs = s.policy->WantsAttentionProbs();
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    StoredRowsAttention p;
    p.q = q + static_cast<size_t>(g) * group * hd;
    p.k = k_rows + static_cast<size_t>(begin) * width;
    p.v = v_rows + static_cast<size_t>(begin) * width;
    p.k_new = k_new + static_cast<size_t>(g) * hd;
    p.v_new = v_new + static_cast<size_t>(g) * hd;
    p.out = att + static_cast<size_t>(g) * group * hd;
    p.group = group;
    p.count = plan.head_offsets[g + 1] - begin;
    p.head_dim = hd;
    p.row_width = width;
    p.format = s.policy->row_format();
    p.scale = 1.0f / std::sqrt(static_cast<float>(hd));
    if (want_probs) {
      p.prob_sums = probs_.data() + static_cast<size_t>(g) * group * stride_;
      p.prob_stride = stride_;
    }
    // The format is the same for every head: the first answer holds.
    if (!backend_.AttendStoredRows(p)) return false;
  }
  return true;
}

void OffloadedKvCache::DecodedAttention(Sequence& s, int layer, const float* q,
                                        float* att) {
  const int hd = c_.head_dim, group = c_.n_heads / c_.n_kv_heads;
  const kv_memory_service::OwnedFetchPlan& plan = s.plans[layer % 2];
  const bool want_probs = s.policy->WantsAttentionProbs();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    const int count = plan.head_offsets[g + 1] - begin;
    float* kg = k_rows_.data() + static_cast<size_t>(g) * stride_ * hd;
    float* vg = v_rows_.data() + static_cast<size_t>(g) * stride_ * hd;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      AttentionParams p;
      p.q = q + h * hd;
      p.k = kg;
      p.v = vg;
      p.out = att + h * hd;
      p.n = 1;
      p.n_heads = 1;
      p.n_kv_heads = 1;
      p.head_dim = hd;
      p.kv_stride = stride_;
      p.kv_len0 = count + 1;
      p.scale = scale;
      if (want_probs) {
        p.prob_sums = probs_.data() + static_cast<size_t>(h) * stride_;
      }
      backend_.Attention(p);
    }
  }
}

void OffloadedKvCache::DecodeFetched(Sequence& s, int layer,
                                     const float* k_new, const float* v_new) {
  const int hd = c_.head_dim;
  const kv_memory_service::OwnedFetchPlan& plan = s.plans[layer % 2];
  const int total = static_cast<int>(plan.indices.size());
  const KvRowFormat format = s.policy->row_format();
  const int width = layout_.row_width;
  const uint16_t* k_rows = FetchedRows(s, layer);
  const uint16_t* v_rows = k_rows + static_cast<size_t>(total) * width;
  // Each KV head's rows, decoded where attention reads them, then the new
  // token's exact (unstored) row.
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    const int count = plan.head_offsets[g + 1] - begin;
    float* kg = k_rows_.data() + static_cast<size_t>(g) * stride_ * hd;
    float* vg = v_rows_.data() + static_cast<size_t>(g) * stride_ * hd;
    if (count > 0) {
      backend_.DecodeKvRows(k_rows + static_cast<size_t>(begin) * width,
                            count, hd, format, kg);
      backend_.DecodeKvRows(v_rows + static_cast<size_t>(begin) * width,
                            count, hd, format, vg);
    }
    backend_.Copy(kg + static_cast<size_t>(count) * hd, k_new + g * hd, hd);
    backend_.Copy(vg + static_cast<size_t>(count) * hd, v_new + g * hd, hd);
  }
}

absl::Status OffloadedKvCache::ZeroProbabilityRows(
    const kv_memory_service::OwnedFetchPlan& plan) {
  const int group = c_.n_heads / c_.n_kv_heads;
  // Each head's probability row zeroed from the host copy (a previous
  // CopyToHost waited for earlier copies out of it).
  IG_RETURN_IF_ERROR(backend_.WaitCopies());
  for (int h = 0; h < c_.n_heads; ++h) {
    const int count = plan.head_offsets[h / group + 1] -
                      plan.head_offsets[h / group];
    const size_t at = static_cast<size_t>(h) * stride_;
    std::fill(probs_host_.begin() + at, probs_host_.begin() + at + count + 1,
              0.0f);
    backend_.CopyFromHost(probs_.data() + at, probs_host_.data() + at,
                          (count + 1) * sizeof(float),
                          backend_.MarkIssued());
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::StageStepRows(Sequence& s) {
  const size_t kvd = c_.kv_dim();
  const int width = layout_.row_width;
  IG_RETURN_IF_ERROR(backend_.CopyToHost(new_rows_host_.data(),
                                         s.new_rows.data(),
                                         s.new_rows.bytes()));
  const float* new_k = new_rows_host_.data();
  const float* new_v = new_k + c_.n_layers * kvd;
  for (int l = 0; l < c_.n_layers; ++l) {
    const size_t at = static_cast<size_t>(l) * c_.n_kv_heads * width;
    s.policy->EncodeRows(new_k + l * kvd, c_.n_kv_heads, &s.k_step[at]);
    s.policy->EncodeRows(new_v + l * kvd, c_.n_kv_heads, &s.v_step[at]);
    s.policy->OnDecodeAppend(l, s.position, s.new_rows.data() + l * kvd);
  }
  return absl::OkStatus();
}

// --- The background appender: one batch of decode-step appends at a time.

void OffloadedKvCache::AppenderLoop() {
  std::vector<int> slots;
  slots.reserve(sequences_.size());
  while (true) {
    {
      absl::MutexLock lock(&append_mu_);
      append_mu_.Await(absl::Condition(
          +[](OffloadedKvCache* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(
               e->append_mu_) {
            return e->stopping_ || (e->append_pending_ && !e->append_done_);
          },
          this));
      if (stopping_) return;
      slots.assign(append_slots_.begin(), append_slots_.end());
    }
    // Each slot's step rows are staged in k_step/v_step; nobody touches them
    // until FinishAppends returns.
    for (int i : slots) {
      Sequence& s = sequences_[i];
      s.append_status = AppendRows(s, 0, c_.n_layers, s.k_step.data(),
                                   s.v_step.data(), 1, &s.appended);
    }
    absl::MutexLock lock(&append_mu_);
    append_done_ = true;
  }
}

void OffloadedKvCache::StartAppends() {
  absl::MutexLock lock(&append_mu_);
  append_slots_.assign(step_slots_.begin(), step_slots_.end());
  append_pending_ = true;
  append_done_ = false;
}

absl::Status OffloadedKvCache::FinishAppends() {
  if (!appender_.joinable()) return absl::OkStatus();
  {
    absl::MutexLock lock(&append_mu_);
    if (!append_pending_) return absl::OkStatus();
    append_mu_.Await(absl::Condition(&append_done_));
    append_pending_ = false;
  }
  absl::Status first;
  std::vector<int> slots;
  {
    absl::MutexLock lock(&append_mu_);
    slots.swap(append_slots_);
  }
  for (int i : slots) {
    Sequence& s = sequences_[i];
    if (!s.append_status.ok()) {
      if (first.ok()) first = s.append_status;
      if (s.lost.ok()) s.lost = s.append_status;
      continue;
    }
    MarkAppended(s, 0, c_.n_layers, s.position, 1, s.appended);
  }
  {
    absl::MutexLock lock(&append_mu_);
    append_slots_.swap(slots);  // keep the capacity
  }
  return first;
}

}  // namespace

absl::StatusOr<int64_t> OffloadedKvCacheBytes(const model::Weights& weights,
                                              const KvCacheOptions& options) {
  // Sized as for a device backend (with staging): the larger of the two.
  IG_ASSIGN_OR_RETURN(const Layout z,
                      MakeLayout(weights, /*operates_on_host=*/false, options));
  return options.batch * z.PerSequence(weights.config, options.max_seq_len) +
         z.Shared(weights.config, options.max_seq_len, options.max_chunk);
}

absl::StatusOr<std::unique_ptr<KvCache>> NewOffloadedKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options) {
  IG_ASSIGN_OR_RETURN(
      const Layout z,
      MakeLayout(weights, backend->OperatesOnHostMemory(), options));
  auto cache =
      std::make_unique<OffloadedKvCache>(weights, backend, options, z);
  IG_RETURN_IF_ERROR(cache->Init());
  return std::unique_ptr<KvCache>(std::move(cache));
}

}  // namespace infinigen::gpu_worker
