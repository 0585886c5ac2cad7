#include "gpu_worker/kv/offloaded_kv_cache.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "kv_memory_service/client/prefix_keys.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// --- Decode.

OffloadedKvCache::Step::Step(OffloadedKvCache& cache) : cache_(cache) {
  slots_.reserve(cache.options_.batch);
}

void OffloadedKvCache::Step::Close() { cache_.step_open_ = false; }

const FetchSchedule& OffloadedKvCache::Step::schedule() const {
  return cache_.schedule_;
}

absl::Status OffloadedKvCache::Step::IssueDue(FetchPoint point, int layer,
                                              const float* x) {
  const int due = schedule().DueAt(point, layer);
  if (due < 0) return absl::OkStatus();
  const int dim = cache_.c_.dim;
  for (size_t i = 0; i < slots_.size(); ++i) {
    IG_RETURN_IF_ERROR(
        cache_.IssueFetch(cache_.sequences_[slots_[i]], due,
                          x == nullptr ? nullptr : x + i * dim));
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::Step::LayerInput(int layer, const float* xb) {
  IG_RETURN_IF_ERROR(IssueDue(FetchPoint::kOwnInput, layer, xb));
  return IssueDue(FetchPoint::kPreviousInput, layer, xb);
}

absl::Status OffloadedKvCache::Step::PostAttentionInput(int layer,
                                                        const float* xb_next) {
  return IssueDue(FetchPoint::kPreviousAttention, layer, xb_next);
}

absl::Status OffloadedKvCache::Step::DecodeAttention(int layer,
                                                     const float* q,
                                                     const float* k,
                                                     const float* v,
                                                     float* out) {
  const model::ModelConfig& c = cache_.c_;
  const size_t kvd = c.kv_dim();
  for (size_t i = 0; i < slots_.size(); ++i) {
    Sequence& s = cache_.sequences_[slots_[i]];
    // The new token's rows, kept until the step's appends are encoded.
    float* new_k = s.new_rows.data() + layer * kvd;
    cache_.backend_.Copy(new_k, k + i * kvd, kvd);
    cache_.backend_.Copy(new_k + c.n_layers * kvd, v + i * kvd, kvd);
    IG_RETURN_IF_ERROR(cache_.FetchedAttention(s, layer, static_cast<int>(i),
                                               q, k, v, out));
  }
  // Every fetch of the step is done: the host encodes the step's new rows
  // and the appends run while the last layer's MLP and the classifier
  // compute.
  if (layer + 1 == c.n_layers) {
    for (int slot : slots_) {
      Sequence& s = cache_.sequences_[slot];
      IG_RETURN_IF_ERROR(cache_.StageStepRows(s));
      // StageStepRows waited for the backend: the plans' queued copies have
      // landed, and the appender tells the node of them after the rows.
      s.notes_in_background = !s.noted_layers.empty();
    }
    cache_.StartAppends(slots_);
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::Step::LayerDone(int layer) {
  // The next layer's rows move to the backend while this layer computes
  // (its fetch left before this layer's end).
  if (!schedule().UploadsEarly(layer + 1)) return absl::OkStatus();
  for (int slot : slots_) {
    IG_RETURN_IF_ERROR(
        cache_.UploadFetched(cache_.sequences_[slot], layer + 1));
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::Step::End() {
  for (int slot : slots_) {
    Sequence& s = cache_.sequences_[slot];
    // Notes in the background are the appender's, and so are their waits.
    if (!s.notes_in_background) {
      IG_RETURN_IF_ERROR(cache_.NoteBackendPlans(s));
      if (s.direct) {
        // The step's last notes of one-sided reads.
        for (kv_memory_service::FetchHandle& h : s.handles) {
          IG_RETURN_IF_ERROR(cache_.AtNode(h.Wait()));
        }
      }
    }
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

absl::StatusOr<KvStepPtr> OffloadedKvCache::BeginStep(
    absl::Span<const int> slots, absl::Span<const int> positions) {
  if (step_open_) {
    return absl::FailedPreconditionError(
        "kv cache: a decode step is already open");
  }
  // The previous step's appends must be in before this step fetches.
  IG_RETURN_IF_ERROR(FinishAppends());
  for (int slot : slots) IG_RETURN_IF_ERROR(sequences_[slot].lost);
  for (size_t i = 0; i < slots.size(); ++i) {
    Sequence& s = sequences_[slots[i]];
    s.position = positions[i];
    s.step_rows = 0;
    s.noted_layers.clear();  // a failed step's
  }
  step_.slots_.assign(slots.begin(), slots.end());
  step_open_ = true;
  KvStepPtr step(&step_);  // closes the step if the first fetches fail
  IG_RETURN_IF_ERROR(step_.IssueDue(FetchPoint::kStepStart, 0, nullptr));
  return step;
}

absl::Status OffloadedKvCache::PlanLayer(Sequence& s, int layer,
                                          const float* xb_prev) {
  const int i = layer % 2;
  kv_memory_service::OwnedFetchPlan& plan = s.plans[i];
  s.plan_on_backend[i] = false;
  s.plan_leading[i] = false;
  const int p = s.position;
  const bool whole =
      s.present_count[layer] == static_cast<long>(c_.n_kv_heads) * p;
  if (whole && s.direct && !s.policy->WantsAttentionProbs() &&
      s.policy->PlansEveryRow(layer, xb_prev)) {
    // Each head's first p rows, read in place as a whole: no indices to
    // write, upload, check or send.
    plan.indices.clear();
    plan.head_offsets.resize(c_.n_kv_heads + 1);
    for (int g = 0; g <= c_.n_kv_heads; ++g) plan.head_offsets[g] = g * p;
    s.plan_leading[i] = true;
    return CheckPlanRows(static_cast<size_t>(c_.n_kv_heads) * p, layer);
  }
  if (whole && s.plan_dev[i].data() != nullptr) {
    IG_ASSIGN_OR_RETURN(const bool made, s.policy->PlanFetchOnBackend(
                                             layer, p, xb_prev,
                                             s.plan_dev[i].data(),
                                             plan.head_offsets));
    if (made) {
      const size_t rows = plan.head_offsets.back();
      IG_RETURN_IF_ERROR(CheckPlanRows(rows, layer));
      if (s.direct && layout_.staged && rows <= s.note_rows) {
        // The device reads the rows by these indices where they lie; the
        // node hears of them with the step's appends, from a copy queued
        // now.
        plan.indices.clear();
        backend_.QueueCopyToHost(
            s.note_indices.data() + static_cast<size_t>(layer) * s.note_rows,
            s.plan_dev[i].data(), rows * sizeof(int32_t));
        s.note_offsets[layer] = plan.head_offsets;
        s.noted_layers.push_back(layer);
        s.plan_on_backend[i] = true;
        return absl::OkStatus();
      }
      plan.indices.resize(rows);
      return backend_.CopyToHost(plan.indices.data(), s.plan_dev[i].data(),
                                 rows * sizeof(int32_t));
    }
  }
  IG_RETURN_IF_ERROR(s.policy->PlanFetch(
      layer, p, xb_prev,
      &s.present[static_cast<size_t>(layer) * c_.n_kv_heads * max_seq_],
      plan));
  return CheckPlanRows(plan.indices.size(), layer);
}

absl::Status OffloadedKvCache::CheckPlanRows(size_t rows, int layer) const {
  if (rows <= layout_.plan_rows) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat(
      "kv cache: policy %s planned %d rows for layer %d, above the %d its "
      "staging holds",
      PolicyName(options_.kv.policy->kind), rows, layer, layout_.plan_rows));
}

absl::Status OffloadedKvCache::PlanToHost(Sequence& s, int layer) {
  const int i = layer % 2;
  if (s.plan_leading[i]) {
    s.plan_leading[i] = false;
    kv_memory_service::OwnedFetchPlan& plan = s.plans[i];
    plan.indices.resize(plan.head_offsets.back());
    for (int g = 0; g < c_.n_kv_heads; ++g) {
      std::iota(plan.indices.begin() + plan.head_offsets[g],
                plan.indices.begin() + plan.head_offsets[g + 1], 0);
    }
    return absl::OkStatus();
  }
  if (!s.plan_on_backend[i]) return absl::OkStatus();
  s.plan_on_backend[i] = false;
  kv_memory_service::OwnedFetchPlan& plan = s.plans[i];
  plan.indices.resize(plan.head_offsets.back());
  s.noted_layers.erase(
      std::remove(s.noted_layers.begin(), s.noted_layers.end(), layer),
      s.noted_layers.end());
  return backend_.CopyToHost(plan.indices.data(), s.plan_dev[i].data(),
                             plan.indices.size() * sizeof(int32_t));
}

absl::Status OffloadedKvCache::NoteBackendPlans(Sequence& s) {
  if (s.noted_layers.empty()) return absl::OkStatus();
  // The plans' queued copies have landed once the backend is idle.
  IG_RETURN_IF_ERROR(backend_.Synchronize());
  return SendBackendNotes(s);
}

absl::Status OffloadedKvCache::SendBackendNotes(Sequence& s) {
  for (const int layer : s.noted_layers) {
    const int i = layer % 2;
    const std::vector<int32_t>& offsets = s.note_offsets[layer];
    kv_memory_service::FetchPlan plan;
    plan.indices = absl::MakeConstSpan(
        s.note_indices.data() + static_cast<size_t>(layer) * s.note_rows,
        offsets.back());
    plan.head_offsets = offsets;
    // Each fetch buffer carries one note at a time.
    IG_RETURN_IF_ERROR(AtNode(s.handles[i].Wait()));
    s.handles[i] = options_.kv.kv_client->NoteFetchedAsync(
        s.seq, layer, plan, s.buffers[i].get());
  }
  s.noted_layers.clear();
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::IssueFetch(Sequence& s, int layer,
                                          const float* xb_prev) {
  // The last copy out of this fetch buffer must have read it.
  IG_RETURN_IF_ERROR(backend_.WaitCopies());
  s.uploaded[layer % 2] = false;
  kv_memory_service::OwnedFetchPlan& plan = s.plans[layer % 2];
  IG_RETURN_IF_ERROR(PlanLayer(s, layer, xb_prev));
  const size_t rows = plan.head_offsets.back();
  s.step_rows += static_cast<long>(rows);
  s.stats.rows_fetched += static_cast<long>(rows);
  s.stats.bytes_fetched +=
      static_cast<long>(rows) * 2 * layout_.row_width * 2;
  s.direct_plan[layer % 2] = s.direct;
  if (s.direct) {
    // Read before the node checks the plan (its note is waited for
    // later): every index must lie within the sequence's rows.
    IG_RETURN_IF_ERROR(CheckDirectPlan(s, layer));
    s.stats.rows_read_in_place += static_cast<long>(rows);
  } else {
    // A note of one-sided reads may still hold the buffer (they ended).
    IG_RETURN_IF_ERROR(AtNode(s.handles[layer % 2].Wait()));
    s.handles[layer % 2] = options_.kv.kv_client->FetchAsync(
        s.seq, layer, plan.view(), s.buffers[layer % 2].get());
  }
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::CheckDirectPlan(const Sequence& s,
                                               int layer) const {
  const int max_tokens = s.rows.max_tokens;
  // A plan made on the backend, or a leading one, names positions below
  // s.position only.
  if (s.plan_on_backend[layer % 2] || s.plan_leading[layer % 2]) {
    if (s.position <= max_tokens) return absl::OkStatus();
    return absl::InternalError(absl::StrFormat(
        "kv cache: layer %d's plan (%s) is for position %d, beyond the %d "
        "rows a head holds",
        layer, s.plan_leading[layer % 2] ? "every row" : "made on the backend",
        s.position, max_tokens));
  }
  // The least and greatest position tell (a loop the compiler vectorizes);
  // the offender is looked up only to name it.
  const std::vector<int32_t>& indices = s.plans[layer % 2].indices;
  int32_t lo = 0, hi = 0;
  for (const int32_t p : indices) {
    lo = p < lo ? p : lo;
    hi = p > hi ? p : hi;
  }
  if (lo >= 0 && hi < max_tokens) return absl::OkStatus();
  for (const int32_t p : indices) {
    if (p < 0 || p >= max_tokens) {
      return absl::InternalError(absl::StrFormat(
          "kv cache: policy %s planned position %d of layer %d, outside the "
          "%d rows a head holds",
          PolicyName(options_.kv.policy->kind), p, layer, max_tokens));
    }
  }
  return absl::OkStatus();  // unreachable: lo or hi was out of range
}

void OffloadedKvCache::UploadOffsets(Sequence& s, int i) {
  const std::vector<int32_t>& offsets = s.plans[i].head_offsets;
  int32_t* host = s.plan_host[i].data() + layout_.plan_room;
  std::copy(offsets.begin(), offsets.end(), host);
  backend_.CopyFromHost(s.plan_dev[i].data() + layout_.plan_room, host,
                        offsets.size() * sizeof(int32_t), s.staged_free[i]);
}

bool OffloadedKvCache::AttendStaged(Sequence& s, int layer, const float* q,
                                    const float* k_new, const float* v_new,
                                    float* att) {
  const int i = layer % 2;
  const std::vector<int32_t>& offsets = s.plans[i].head_offsets;
  StagedRowsAttention p;
  p.q = q;
  p.k_rows = s.staged[i].data();
  p.rows = offsets.back();
  p.v_rows = p.k_rows + p.rows * layout_.row_width;
  p.head_offsets = s.plan_dev[i].data() + layout_.plan_room;
  p.k_new = k_new;
  p.v_new = v_new;
  p.out = att;
  p.n_heads = c_.n_heads;
  p.n_kv_heads = c_.n_kv_heads;
  p.head_dim = c_.head_dim;
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    p.max_head_rows = std::max(p.max_head_rows, offsets[g + 1] - offsets[g]);
  }
  p.format = s.policy->row_format();
  p.scale = 1.0f / std::sqrt(static_cast<float>(c_.head_dim));
  return backend_.AttendStagedRows(p);
}

bool OffloadedKvCache::ReadDirect(Sequence& s, int layer) {
  const int i = layer % 2;
  const kv_memory_service::OwnedFetchPlan& plan = s.plans[i];
  const size_t n = plan.head_offsets.back();
  // The plan reaches the device on the copy queue once the rows staged[i]
  // last held (and so this plan buffer's last reader) were used; indices
  // made on the backend are there already.
  // Through the pinned plan_host[i], laid out as plan_dev[i] (the last
  // copy out of it has finished: IssueFetch waited for copies).
  int32_t* indices = s.plan_dev[i].data();
  int32_t* offsets = indices + layout_.plan_room;
  if (n > 0 && !s.plan_on_backend[i] && !s.plan_leading[i]) {
    int32_t* host = s.plan_host[i].data();
    std::memcpy(host, plan.indices.data(), n * sizeof(int32_t));
    backend_.CopyFromHost(indices, host, n * sizeof(int32_t),
                          s.staged_free[i]);
  }
  UploadOffsets(s, i);
  if (n == 0) return true;  // nothing to read
  const size_t at = static_cast<size_t>(layer) * s.rows.layer_values;
  GatherRowsParams p;
  p.k_rows = s.rows.k + at;
  p.v_rows = s.rows.v + at;
  p.head_stride = s.rows.max_tokens;
  p.indices = s.plan_leading[i] ? nullptr : indices;  // null: leading rows
  p.head_offsets = offsets;
  p.n_heads = c_.n_kv_heads;
  p.n_rows = static_cast<long>(n);
  p.row_bytes = layout_.row_width * static_cast<int>(sizeof(uint16_t));
  p.out = s.staged[i].data();
  return backend_.GatherRows(p);
}

absl::Status OffloadedKvCache::UploadFetched(Sequence& s, int layer) {
  const int i = layer % 2;
  if (s.uploaded[i]) return absl::OkStatus();
  if (s.direct_plan[i]) {
    s.direct_plan[i] = false;
    const auto t0 = std::chrono::steady_clock::now();
    // Without staging, attention reads the rows in place (AttendInPlace).
    if (!layout_.staged || ReadDirect(s, layer)) {
      if (s.plan_on_backend[i]) {
        s.uploaded[i] = true;  // noted with the step's appends
        return absl::OkStatus();
      }
      // The node learns of the fetch (statistics, eviction candidates) and
      // checks that every position was at its own slot; the note goes out
      // through the idle fetch buffer and is waited for when the buffer is
      // next needed (two layers on) or at the step's end.
      const absl::Status noted = s.handles[i].Wait();
      s.stats.wait_seconds += std::chrono::duration<double>(
                                  std::chrono::steady_clock::now() - t0)
                                  .count();
      IG_RETURN_IF_ERROR(AtNode(noted));
      s.handles[i] =
          s.plan_leading[i]
              ? options_.kv.kv_client->NoteLeadingFetchedAsync(
                    s.seq, layer, s.plans[i].head_offsets,
                    s.buffers[i].get())
              : options_.kv.kv_client->NoteFetchedAsync(
                    s.seq, layer, s.plans[i].view(), s.buffers[i].get());
      s.uploaded[i] = true;
      return absl::OkStatus();
    }
    // The backend cannot read the node's memory: the node gathers, from
    // now on (once the buffer's last note is in), this layer's rows and
    // the next layer's where its plan was made for one-sided reads.
    const int next = 1 - i;
    const bool next_planned = s.direct_plan[next];
    EndDirect(s);
    for (int l : {layer, layer + 1}) {
      const int j = l % 2;
      if (j == next && !next_planned) continue;
      IG_RETURN_IF_ERROR(PlanToHost(s, l));
      s.stats.rows_read_in_place -= s.plans[j].head_offsets.back();
      IG_RETURN_IF_ERROR(AtNode(s.handles[j].Wait()));
      s.handles[j] = options_.kv.kv_client->FetchAsync(
          s.seq, l, s.plans[j].view(), s.buffers[j].get());
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status fetched = s.handles[i].Wait();
  s.stats.wait_seconds += std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - t0)
                              .count();
  IG_RETURN_IF_ERROR(AtNode(fetched));
  if (layout_.staged) {
    // K rows of every head, then V rows, as stored.
    const size_t values = 2 * s.plans[i].indices.size() * layout_.row_width;
    backend_.CopyFromHost(s.staged[i].data(), s.buffers[i]->data(),
                          values * sizeof(uint16_t), s.staged_free[i]);
    UploadOffsets(s, i);
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
  if (!layout_.staged && s.direct) {
    // BeginDirect made sure the backend reads the node's rows in place.
    if (!AttendInPlace(s, layer, q, k_new, v_new, att)) {
      return absl::InternalError(
          "kv cache: the backend refused to attend over the node's rows in "
          "place");
    }
  } else if (!layout_.staged &&
             AttendInPlace(s, layer, q, k_new, v_new, att)) {
    // Attention read the fetched rows where they lie: nothing decoded.
  } else if (layout_.staged && !want_probs &&
             AttendStaged(s, layer, q, k_new, v_new, att)) {
    // One operation over every head's staged rows: nothing decoded.
    s.staged_free[i] = backend_.MarkIssued();
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
  const int total = plan.head_offsets.back();
  const int width = layout_.row_width;
  const bool want_probs = s.policy->WantsAttentionProbs();
  // The fetched rows in plan order, or (one-sided reads) the node's rows
  // of the layer, each head's rows at their positions.
  const uint16_t* k_rows;
  const uint16_t* v_rows;
  size_t head_values;
  if (s.direct) {
    const size_t at = static_cast<size_t>(layer) * s.rows.layer_values;
    k_rows = s.rows.k + at;
    v_rows = s.rows.v + at;
    head_values = static_cast<size_t>(s.rows.max_tokens) * width;
  } else {
    k_rows = FetchedRows(s, layer);
    v_rows = k_rows + static_cast<size_t>(total) * width;
    head_values = 0;
  }
  for (int g = 0; g < c_.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    StoredRowsAttention p;
    p.q = q + static_cast<size_t>(g) * group * hd;
    if (s.direct) {
      p.k = k_rows + g * head_values;
      p.v = v_rows + g * head_values;
      // A leading plan's rows are the head's first: no indices.
      if (!s.plan_leading[layer % 2]) p.indices = plan.indices.data() + begin;
    } else {
      p.k = k_rows + static_cast<size_t>(begin) * width;
      p.v = v_rows + static_cast<size_t>(begin) * width;
    }
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
  const int total = plan.head_offsets.back();
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

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
