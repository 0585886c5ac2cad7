#include "gpu_worker/kv/offloaded_kv_cache.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "kv_memory_service/client/prefix_keys.h"

namespace infinigen::gpu_worker {
namespace offloaded {

absl::StatusOr<Layout> MakeLayout(const model::Weights& weights,
                                  bool operates_on_host,
                                  const KvCacheOptions& options) {
  KvPolicy::Context ctx;
  ctx.weights = &weights;
  ctx.max_seq_len = options.max_seq_len;
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> policy,
                      KvPolicy::CreateUninitialized(*options.kv.policy, ctx));
  Layout z;
  z.row_width = policy->RowWidth();
  z.plan_rows = static_cast<size_t>(weights.config.n_kv_heads) *
                policy->MaxPlanRows(options.max_seq_len);
  z.fetch_values = 2 * z.plan_rows * z.row_width;
  z.staged = !operates_on_host;
  const bool backend_plans = policy->MaxBackendPlanRows(options.max_seq_len) > 0;
  // As Init's geometry: a node that never evicts keeps positions at their
  // slots, which one-sided reads need.
  const bool reads_direct =
      z.staged && options.kv.direct_reads &&
      std::max(1, static_cast<int>(options.kv.kv_capacity *
                                   options.max_seq_len)) >= options.max_seq_len;
  z.plan_buffers = z.staged || backend_plans;
  z.plan_room = reads_direct || backend_plans ? z.plan_rows : 0;
  z.attention_probs = policy->WantsAttentionProbs();
  z.prefill_probs = policy->WantsPrefillProbs();
  z.half_rows = z.staged && options.half_local_kv &&
                policy->row_format() == KvRowFormat::kHalf &&
                policy->ReusesPrefix() && !z.prefill_probs;
  IG_ASSIGN_OR_RETURN(z.policy_bytes,
                      KvPolicy::StateBytes(*options.kv.policy, ctx));
  return z;
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
  IG_RETURN_IF_ERROR(InitSharedBuffers());
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
  IG_ASSIGN_OR_RETURN(s.policy, KvPolicy::Create(*options_.kv.policy, ctx));
  const int backend_rows = s.policy->MaxBackendPlanRows(max_seq_);
  // Whether a device may read this sequence's rows where the node keeps
  // them (BeginDirect decides for each sequence; not where the node may
  // evict).
  const bool reads_direct = layout_.staged && options_.kv.direct_reads &&
                            geometry_.max_tokens >= max_seq_;
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
    const size_t plan_values = layout_.plan_room + c_.n_kv_heads + 1;
    if (layout_.plan_buffers) {
      IG_ASSIGN_OR_RETURN(s.plan_dev[i],
                          DeviceBuffer<int32_t>::Make(&backend_, plan_values,
                                                      "fetch plan"));
    }
    if (layout_.plan_buffers && layout_.staged) {
      s.plan_host[i].assign(plan_values, 0);
      const absl::Status pinned = backend_.PinHost(
          s.plan_host[i].data(), s.plan_host[i].size() * sizeof(int32_t));
      if (!pinned.ok() && !pin_warned) {
        IG_LOG(WARNING) << "engine: fetch plans stay pageable (copies hold "
                           "the host): "
                        << pinned.message();
        pin_warned = true;
      }
    }
  }
  if (reads_direct && backend_rows > 0) {
    // Room for every layer's plan made on the backend, for the step's
    // notes to the node.
    s.note_rows = static_cast<size_t>(c_.n_kv_heads) * backend_rows;
    s.note_indices.assign(static_cast<size_t>(c_.n_layers) * s.note_rows, 0);
    s.note_offsets.assign(c_.n_layers, {});
    s.noted_layers.reserve(c_.n_layers);
    const absl::Status pinned =
        backend_.PinHost(s.note_indices.data(),
                         s.note_indices.size() * sizeof(int32_t));
    if (!pinned.ok() && !pin_warned) {
      IG_LOG(WARNING) << "engine: plan notes stay pageable (copies run "
                         "slower): "
                      << pinned.message();
      pin_warned = true;
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
  if (layout_.half_rows) {
    IG_ASSIGN_OR_RETURN(k_rows_half_, DeviceBuffer<uint16_t>::Make(
                                          &backend_, decoded, "fp16 K rows"));
    IG_ASSIGN_OR_RETURN(v_rows_half_, DeviceBuffer<uint16_t>::Make(
                                          &backend_, decoded, "fp16 V rows"));
  }
  const size_t chunk = static_cast<size_t>(options_.max_chunk);
  IG_ASSIGN_OR_RETURN(
      chunk_rows_, DeviceBuffer<float>::Make(&backend_, 2 * chunk * c_.kv_dim(),
                                             "prefill chunk rows"));
  if (layout_.staged) {
    IG_ASSIGN_OR_RETURN(
        chunk_stage_,
        DeviceBuffer<uint16_t>::Make(
            &backend_, 2 * chunk * c_.n_kv_heads * layout_.row_width,
            "prefill chunk staging"));
  }
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
  q_host_.resize(chunk * c_.q_dim());
  k_host_.resize(chunk * c_.kv_dim());
  v_host_.resize(chunk * c_.kv_dim());
  new_rows_host_.resize(2 * static_cast<size_t>(c_.n_layers) * c_.kv_dim());
  const size_t stage =
      static_cast<size_t>(max_seq_) * c_.n_kv_heads * layout_.row_width;
  // Two stages: one layer's append leaves from one while the next layer
  // fills the other.
  k_stage_.resize(2 * stage);
  v_stage_.resize(2 * stage);
  if (layout_.staged) {
    // A device's encoded prefill rows are queued here: pinned, so that the
    // copies run beside its work.
    for (std::vector<uint16_t>* stage_rows : {&k_stage_, &v_stage_}) {
      const absl::Status pinned = backend_.PinHost(
          stage_rows->data(), stage_rows->size() * sizeof(uint16_t));
      if (!pinned.ok()) {
        IG_LOG(WARNING) << "engine: the prefill's row stage stays pageable "
                           "(copies run slower): "
                        << pinned.message();
        break;
      }
    }
  }
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
      options_.kv.model_identity, PolicyName(options_.kv.policy->kind),
      options_.kv.policy->rank_columns_by_keys ? 1 : 0,
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
  absl::StatusOr<kv_memory_service::OpenedSequence> opened_or =
      options_.kv.kv_client->OpenSequence(geometry_, prefix);
  if (!opened_or.ok()) return AtNode(opened_or.status());
  const kv_memory_service::OpenedSequence& opened = *opened_or;
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
          meta.size(), PolicyName(options_.kv.policy->kind), meta_bytes));
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
  BeginDirect(s);
  return cached;
}

void OffloadedKvCache::BeginDirect(Sequence& s) {
  s.direct = false;
  // Positions stay at their own slots only without an attached prefix and
  // without eviction.
  if (!options_.kv.direct_reads || s.cached > 0 ||
      geometry_.max_tokens < max_seq_ ||
      (!layout_.staged && !AttendsNodeRows(s.policy->row_format()))) {
    return;
  }
  absl::StatusOr<kv_memory_service::DirectRows> rows =
      options_.kv.kv_client->GetDirectRows(s.seq);
  if (!rows.ok()) {
    // A node elsewhere, or rows it does not share: the node gathers.
    if (!direct_refusal_logged_) {
      IG_LOG(INFO) << "kv cache: --kv_direct_reads: the node gathers instead ("
                   << rows.status().message() << ")";
      direct_refusal_logged_ = true;
    }
    return;
  }
  const size_t bytes =
      static_cast<size_t>(c_.n_layers) * rows->layer_values * sizeof(uint16_t);
  // The rows never move while the sequence is open; PinHost takes them
  // read-only in effect (nothing here writes through them).
  auto* k = const_cast<uint16_t*>(rows->k);
  auto* v = const_cast<uint16_t*>(rows->v);
  absl::Status pinned = backend_.PinHost(k, bytes);
  if (pinned.ok()) {
    pinned = backend_.PinHost(v, bytes);
    if (!pinned.ok()) backend_.UnpinHost(k);
  }
  if (!pinned.ok()) {
    IG_LOG(WARNING) << "kv cache: the node's rows could not be pinned for "
                       "one-sided reads; the node gathers them: "
                    << pinned.message();
    return;
  }
  s.rows = *rows;
  s.direct = true;
}

bool OffloadedKvCache::AttendsNodeRows(KvRowFormat format) {
  // One new row and no stored one: the backend answers for the format and
  // for rows read by index, touching nothing of the node.
  const int hd = c_.head_dim;
  std::vector<float> q(hd, 0.0f), row(hd, 0.0f), out(hd);
  const int32_t no_index = 0;
  StoredRowsAttention p;
  p.q = q.data();
  p.k_new = p.v_new = row.data();
  p.out = out.data();
  p.group = 1;
  p.count = 0;
  p.head_dim = hd;
  p.row_width = layout_.row_width;
  p.format = format;
  p.indices = &no_index;
  return backend_.AttendStoredRows(p);
}

void OffloadedKvCache::EndDirect(Sequence& s) {
  if (!s.direct) return;
  backend_.UnpinHost(const_cast<uint16_t*>(s.rows.k));
  backend_.UnpinHost(const_cast<uint16_t*>(s.rows.v));
  s.direct = false;
  s.direct_plan[0] = s.direct_plan[1] = false;
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
    const size_t at = static_cast<size_t>(g) * stride_ * hd;
    backend_.DecodeKvRows(k_rows + begin * width, s.cached, hd, format,
                          k_rows_.data() + at);
    backend_.DecodeKvRows(v_rows + begin * width, s.cached, hd, format,
                          v_rows_.data() + at);
    if (layout_.half_rows) {
      // fp16 rows as stored (width == head_dim, even), as float pairs.
      const long values = static_cast<long>(s.cached) * hd / 2;
      backend_.Copy(reinterpret_cast<float*>(k_rows_half_.data() + at),
                    reinterpret_cast<const float*>(k_rows + begin * width),
                    values);
      backend_.Copy(reinterpret_cast<float*>(v_rows_half_.data() + at),
                    reinterpret_cast<const float*>(v_rows + begin * width),
                    values);
    }
  }
  s.staged_free[i] = backend_.MarkIssued();
  if (layer + 1 < c_.n_layers) IG_RETURN_IF_ERROR(IssuePrefixFetch(s, layer + 1));
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::Reset(int slot) {
  FinishAppends().IgnoreError();
  // A prefill that failed may have left its last layer's append running.
  WaitPrefillAppend().IgnoreError();
  Sequence& s = sequences_[slot];
  s.lost = absl::OkStatus();
  // A step that failed may have left a prefetch in flight: end it, so the
  // buffer takes the next generation's fetches.
  for (kv_memory_service::FetchHandle& h : s.handles) {
    h.Wait().IgnoreError();
    h = kv_memory_service::FetchHandle();  // not the old outcome again
  }
  s.stats = FetchStats();
  s.cached = 0;
  s.annotated_first = 0;
  s.block_state.clear();
  s.policy->Reset();
  std::fill(s.present.begin(), s.present.end(), 0);
  std::fill(s.present_count.begin(), s.present_count.end(), 0);
  EndDirect(s);
  if (s.seq != 0) {
    const kv_memory_service::SequenceId seq = s.seq;
    s.seq = 0;
    IG_RETURN_IF_ERROR(AtNode(options_.kv.kv_client->Close(seq)));
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
      if (s.notes_in_background && s.append_status.ok()) {
        // The step's notes of plans made on the backend, then every note
        // of the step in (both buffers' last).
        s.append_status = SendBackendNotes(s);
        for (kv_memory_service::FetchHandle& h : s.handles) {
          const absl::Status noted = AtNode(h.Wait());
          if (s.append_status.ok()) s.append_status = noted;
        }
      }
    }
    absl::MutexLock lock(&append_mu_);
    append_done_ = true;
  }
}

void OffloadedKvCache::StartAppends(absl::Span<const int> slots) {
  absl::MutexLock lock(&append_mu_);
  append_slots_.assign(slots.begin(), slots.end());
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
    s.notes_in_background = false;
    s.noted_layers.clear();  // sent, or the sequence is lost
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

}  // namespace offloaded

absl::StatusOr<int64_t> OffloadedKvCacheBytes(const model::Weights& weights,
                                              const KvCacheOptions& options) {
  // Sized as for a device backend (with staging): the larger of the two.
  IG_ASSIGN_OR_RETURN(const offloaded::Layout z,
                      offloaded::MakeLayout(weights, /*operates_on_host=*/false, options));
  return options.batch * z.PerSequence(weights.config, options.max_seq_len) +
         z.Shared(weights.config, options.max_seq_len, options.max_chunk);
}

absl::StatusOr<std::unique_ptr<KvCache>> NewOffloadedKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options) {
  IG_ASSIGN_OR_RETURN(
      const offloaded::Layout z,
      offloaded::MakeLayout(weights, backend->OperatesOnHostMemory(), options));
  auto cache =
      std::make_unique<offloaded::OffloadedKvCache>(weights, backend, options, z);
  IG_RETURN_IF_ERROR(cache->Init());
  return std::unique_ptr<KvCache>(std::move(cache));
}

}  // namespace infinigen::gpu_worker
