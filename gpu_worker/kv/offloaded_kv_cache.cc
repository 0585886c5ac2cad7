#include "gpu_worker/kv/offloaded_kv_cache.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::gpu_worker {
namespace offloaded {

OffloadedKvCache::OffloadedKvCache(const model::Weights& weights,
                                   Backend* backend,
                                   const KvCacheOptions& options,
                                   const Layout& layout)
    : weights_(weights),
      c_(weights.config),
      backend_(*backend),
      options_(options),
      node_address_(options.kv.kv_client->address()),
      schedule_(FetchSchedule::Of(*options.kv.policy, weights.config.n_layers)),
      layout_(layout),
      max_seq_(options.max_seq_len),
      sequences_(options.batch),
      attention_(*backend, weights.config, layout_, decoded_),
      planner_(*backend, layout_, weights.config.n_kv_heads,
               PolicyName(options.kv.policy->kind)),
      prefill_(*backend, weights.config, options_, layout_, decoded_,
               *options.kv.kv_client) {
  decoded_.stride = max_seq_ + 1;
  sources_.backend = backend;
  sources_.client = options.kv.kv_client;
  sources_.layout = &layout_;
  sources_.config = &c_;
  sources_.attention = &attention_;
  sources_.max_seq_len = max_seq_;
  sources_.node_address = node_address_;
  sources_.policy_name = PolicyName(options.kv.policy->kind);
}

OffloadedKvCache::~OffloadedKvCache() {
  prefill_.WaitAppend().IgnoreError();
  FinishAppends().IgnoreError();
  appender_.reset();
  for (Sequence& s : sequences_) {
    s.source.reset();  // unpins the node's rows
    if (s.seq != 0) options_.kv.kv_client->Close(s.seq).IgnoreError();
  }
  // Copies may still read the fetch buffers; unpin them before they go.
  backend_.WaitCopies().IgnoreError();
  for (Sequence& s : sequences_) {
    for (LayerFetch& f : s.fetches) f.Release(backend_);
    s.notes.Release(backend_);
  }
}

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
  IG_RETURN_IF_ERROR(decoded_.Allocate(backend_, c_, layout_));
  IG_RETURN_IF_ERROR(prefill_.Allocate());
  if (layout_.attention_probs) {
    const size_t n = static_cast<size_t>(c_.n_heads) * decoded_.stride;
    IG_ASSIGN_OR_RETURN(probs_, DeviceBuffer<float>::Make(
                                    &backend_, n, "attention probabilities"));
    probs_host_.assign(n, 0.0f);
  }
  new_rows_host_.resize(2 * static_cast<size_t>(c_.n_layers) * c_.kv_dim());
  prefix_ = std::make_unique<PrefixLoader>(options_, *sequences_[0].policy,
                                           geometry_, c_, layout_);
  bytes_ = options_.batch * layout_.PerSequence(c_, max_seq_) +
           layout_.Shared(c_, max_seq_, options_.max_chunk);
  appender_ = std::make_unique<Appender>(
      [this](int slot) { return AppendStep(slot); }, sequences_.size());
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::InitSequence(Sequence& s,
                                            const KvPolicy::Context& ctx,
                                            bool& pin_warned) {
  IG_ASSIGN_OR_RETURN(s.policy, KvPolicy::Create(*options_.kv.policy, ctx));
  for (LayerFetch& f : s.fetches) {
    IG_RETURN_IF_ERROR(f.Allocate(backend_, *options_.kv.kv_client, layout_,
                                  c_.n_kv_heads, pin_warned));
  }
  // Where a device may read this sequence's rows where the node keeps them
  // (not where the node may evict), room for every layer's plan made on
  // the backend, for the step's notes to the node.
  const int backend_rows = s.policy->MaxBackendPlanRows(max_seq_);
  if (layout_.staged && options_.kv.direct_reads &&
      geometry_.max_tokens >= max_seq_ && backend_rows > 0) {
    IG_RETURN_IF_ERROR(s.notes.Allocate(
        backend_, c_.n_layers, static_cast<size_t>(c_.n_kv_heads) * backend_rows,
        pin_warned));
  }
  s.presence = RowPresence(c_.n_layers, c_.n_kv_heads, max_seq_);
  const size_t step_values = static_cast<size_t>(c_.n_layers) * c_.kv_dim();
  IG_ASSIGN_OR_RETURN(s.new_rows, DeviceBuffer<float>::Make(
                                      &backend_, 2 * step_values,
                                      "step rows"));
  s.k_step.resize(static_cast<size_t>(c_.n_layers) * c_.n_kv_heads *
                  layout_.row_width);
  s.v_step.resize(s.k_step.size());
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::Flush() { return FinishAppends(); }
bool OffloadedKvCache::offloaded() const { return true; }
const FetchStats& OffloadedKvCache::fetch_stats(int slot) const {
  return sequences_[slot].stats;
}
int64_t OffloadedKvCache::worker_bytes() const { return bytes_; }
absl::Status OffloadedKvCache::AtNode(const absl::Status& status) const {
  return kv_memory_service::AtNode(node_address_, status);
}

int64_t OffloadedKvCache::node_bytes() const {
  int64_t bytes = 0;
  for (const Sequence& s : sequences_) {
    if (s.seq != 0) bytes += kv_memory_service::ReservedBytes(geometry_);
  }
  return bytes;
}

// --- Prefill: layer by layer; each layer's rows leave before the next.

absl::StatusOr<int> OffloadedKvCache::BeginPrefill(
    int slot, int first, absl::Span<const int> tokens, bool reuse) {
  const int n = static_cast<int>(tokens.size());
  if (first != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "forward: policy %s prefills a sequence in one call (slot %d holds "
        "%d tokens already)",
        PolicyName(options_.kv.policy->kind), slot, first));
  }
  IG_RETURN_IF_ERROR(FinishAppends());
  // A failed prefill's last append (its slot was reset).
  prefill_.WaitAppend().IgnoreError();
  Sequence& s = sequences_[slot];
  int cached = 0;
  if (s.seq == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    IG_ASSIGN_OR_RETURN(cached, OpenSequence(s, tokens, reuse));
    s.stats.open_seconds += std::chrono::duration<double>(
                                std::chrono::steady_clock::now() - t0)
                                .count();
  }
  prefill_slot_ = slot;
  PrefillTarget target;
  target.policy = s.policy.get();
  target.prefix = &s.prefix;
  target.presence = &s.presence;
  target.stats = &s.stats;
  target.seq = s.seq;
  prefill_.Begin(target, cached, n);
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
  // A reused prefix: the layer's cached rows first, fetched, and the next
  // layer's fetch leaves.
  if (pos == prefill_.first() && s.prefix.cached > 0) {
    IG_RETURN_IF_ERROR(UploadFetched(s, layer));
    LayerFetch& f = s.fetches.For(layer);
    prefix_->Load(backend_, s.prefix, f, f.fetched(layout_.staged),
                  s.policy->row_format(), decoded_);
    f.staged_free = backend_.MarkIssued();
    if (layer + 1 < c_.n_layers) {
      IG_RETURN_IF_ERROR(IssuePrefixFetch(s, layer + 1));
    }
  }
  return prefill_.Attention(*prefix_, layer, pos, rows, q, k, v, out);
}

absl::Status OffloadedKvCache::EndPrefillLayer(int layer) {
  return prefill_.EndLayer(*prefix_, layer);
}

absl::Status OffloadedKvCache::EndPrefill() {
  const absl::Status appended = prefill_.WaitAppend();
  prefill_slot_ = -1;
  return appended;
}

absl::Status OffloadedKvCache::IssuePrefixFetch(Sequence& s, int layer) {
  IG_RETURN_IF_ERROR(backend_.WaitCopies());
  return prefix_->IssueFetch(*options_.kv.kv_client, s.seq, s.prefix, layer,
                             s.fetches.For(layer));
}

absl::StatusOr<int> OffloadedKvCache::OpenSequence(
    Sequence& s, absl::Span<const int> tokens, bool reuse) {
  const kv_memory_service::PrefixRequest prefix =
      prefix_->Request(tokens, reuse);
  absl::StatusOr<kv_memory_service::OpenedSequence> opened =
      options_.kv.kv_client->OpenSequence(geometry_, prefix);
  if (!opened.ok()) return AtNode(opened.status());
  s.seq = opened->id;
  IG_RETURN_IF_ERROR(prefix_->Attach(*opened, prefix, *s.policy, s.prefix));
  const int cached = s.prefix.cached;
  if (cached > 0) s.presence.Mark(0, c_.n_layers, 0, cached, {});
  // Positions stay at their own slots only without an attached prefix and
  // without eviction.
  const bool own_slots = cached == 0 && geometry_.max_tokens >= max_seq_;
  s.source = MakeRowSource(sources_, s.seq,
                           options_.kv.direct_reads && own_slots,
                           s.policy->row_format(), direct_refusal_logged_);
  return cached;
}

absl::Status OffloadedKvCache::Reset(int slot) {
  FinishAppends().IgnoreError();
  // A prefill that failed may have left its last layer's append running.
  prefill_.WaitAppend().IgnoreError();
  Sequence& s = sequences_[slot];
  s.lost = absl::OkStatus();
  // A step that failed may have left a prefetch in flight: end it, so the
  // buffer takes the next generation's fetches.
  for (LayerFetch& f : s.fetches) f.Abandon();
  s.stats = FetchStats();
  s.prefix.Clear();
  s.policy->Reset();
  s.presence.Clear();
  s.source.reset();
  if (s.seq != 0) {
    const kv_memory_service::SequenceId seq = s.seq;
    s.seq = 0;
    IG_RETURN_IF_ERROR(AtNode(options_.kv.kv_client->Close(seq)));
  }
  return absl::OkStatus();
}

// --- The background appends: one batch of decode-step appends at a time.

absl::Status OffloadedKvCache::AppendStep(int slot) {
  // The slot's step rows are staged in k_step/v_step; nobody touches them
  // until FinishAppends returns.
  Sequence& s = sequences_[slot];
  IG_ASSIGN_OR_RETURN(
      s.appended,
      AppendRows(*options_.kv.kv_client, s.seq, c_.n_kv_heads,
                 layout_.row_width, 0, c_.n_layers, s.k_step.data(),
                 s.v_step.data(), 1));
  if (!s.notes_in_background) return absl::OkStatus();
  // The step's notes of plans made on the backend, then every note of the
  // step in (both buffers' last).
  absl::Status status = s.notes.Send(sources_, s.seq, s.fetches);
  for (LayerFetch& f : s.fetches) {
    const absl::Status noted = AtNode(f.handle.Wait());
    if (status.ok()) status = noted;
  }
  return status;
}

absl::Status OffloadedKvCache::FinishAppends() {
  if (appender_ == nullptr) return absl::OkStatus();
  return appender_->Finish([this](int slot, const absl::Status& status) {
    Sequence& s = sequences_[slot];
    s.notes_in_background = false;
    s.notes.Clear();  // sent, or the sequence is lost
    if (!status.ok()) {
      if (s.lost.ok()) s.lost = status;
      return;
    }
    s.presence.Mark(0, c_.n_layers, s.position, 1, s.appended.evicted);
  });
}

}  // namespace offloaded

absl::StatusOr<int64_t> OffloadedKvCacheBytes(const model::Weights& weights,
                                              const KvCacheOptions& options) {
  // The larger of a device backend's (with staging) and a host backend's
  // (with a row cache).
  int64_t bytes = 0;
  for (const bool on_host : {false, true}) {
    IG_ASSIGN_OR_RETURN(const offloaded::Layout z,
                        offloaded::MakeLayout(weights, on_host, options));
    bytes = std::max(
        bytes,
        options.batch * z.PerSequence(weights.config, options.max_seq_len) +
            z.Shared(weights.config, options.max_seq_len, options.max_chunk));
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<KvCache>> NewOffloadedKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options) {
  IG_ASSIGN_OR_RETURN(
      const offloaded::Layout z,
      offloaded::MakeLayout(weights, backend->OperatesOnHostMemory(), options));
  auto cache = std::make_unique<offloaded::OffloadedKvCache>(weights, backend,
                                                             options, z);
  IG_RETURN_IF_ERROR(cache->Init());
  return std::unique_ptr<KvCache>(std::move(cache));
}

}  // namespace infinigen::gpu_worker
