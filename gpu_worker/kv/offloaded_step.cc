// OffloadedKvCache's decode step: each layer's fetch planned and issued at
// the point the schedule names, its rows uploaded, attended over, and the
// step's rows handed to the appender after the last layer.
#include <algorithm>
#include <vector>

#include "common/status.h"
#include "gpu_worker/kv/offloaded/watched_rows.h"
#include "gpu_worker/kv/offloaded_kv_cache.h"

namespace infinigen::gpu_worker {
namespace offloaded {

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

absl::Status OffloadedKvCache::IssueDue(FetchPoint point, int layer,
                                        const float* x) {
  return step_.IssueDue(point, layer, x);
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
      s.notes_in_background = !s.notes.empty();
    }
    cache_.appender_->Start(slots_);
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
      IG_RETURN_IF_ERROR(s.source->EndStep(s.fetches, s.stats));
    }
    const long cached = s.presence.total();
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
    s.notes.Clear();  // a failed step's
  }
  step_.slots_.assign(slots.begin(), slots.end());
  step_open_ = true;
  KvStepPtr step(&step_);  // closes the step if the first fetches fail
  IG_RETURN_IF_ERROR(step_.IssueDue(FetchPoint::kStepStart, 0, nullptr));
  return step;
}

absl::Status OffloadedKvCache::IssueFetch(Sequence& s, int layer,
                                          const float* xb_prev) {
  // The last copy out of this fetch buffer must have read it.
  IG_RETURN_IF_ERROR(backend_.WaitCopies());
  LayerFetch& f = s.fetches.For(layer);
  f.uploaded = false;
  IG_RETURN_IF_ERROR(planner_.Plan(*s.policy, s.presence, layer, s.position,
                                   xb_prev, s.source->one_sided(), s.notes,
                                   f));
  const long rows = static_cast<long>(f.rows());
  s.step_rows += rows;
  if (!options_.kv.watch_positions.empty()) {
    CountWatched(options_.kv.watch_positions, f, s.presence.layer(layer),
                 max_seq_, c_.n_kv_heads, layer, s.position, s.stats);
  }
  // What moves: the plan's rows less those the row cache holds.
  const long held = s.stats.row_cache_hits;
  IG_RETURN_IF_ERROR(s.source->Issue(f, layer, s.position, s.stats));
  const long moved = rows - (s.stats.row_cache_hits - held);
  s.stats.rows_fetched += moved;
  s.stats.bytes_fetched += moved * 2 * layout_.row_width * 2;
  return absl::OkStatus();
}

absl::Status OffloadedKvCache::UploadFetched(Sequence& s, int layer) {
  if (s.fetches.For(layer).uploaded) return absl::OkStatus();
  IG_ASSIGN_OR_RETURN(const bool read,
                      s.source->Upload(s.fetches, layer, s.stats));
  if (read) return absl::OkStatus();
  // The backend cannot read the node's memory: the node gathers, from now
  // on (once the buffer's last note is in), this layer's rows and the next
  // layer's where its plan was made for one-sided reads.
  IG_RETURN_IF_ERROR(s.source->HandOff(s.fetches, layer, s.notes, s.stats));
  s.source = NodeGather(sources_, s.seq);
  return s.source->Upload(s.fetches, layer, s.stats).status();
}

absl::Status OffloadedKvCache::FetchedAttention(Sequence& s, int layer,
                                                int row, const float* q_all,
                                                const float* k_all,
                                                const float* v_all,
                                                float* out) {
  IG_RETURN_IF_ERROR(UploadFetched(s, layer));
  LayerFetch& f = s.fetches.For(layer);
  const bool want_probs = s.policy->WantsAttentionProbs();
  RowAttention a;
  a.q = q_all + static_cast<size_t>(row) * c_.q_dim();
  a.k_new = k_all + static_cast<size_t>(row) * c_.kv_dim();
  a.v_new = v_all + static_cast<size_t>(row) * c_.kv_dim();
  a.out = out + static_cast<size_t>(row) * c_.q_dim();
  a.format = s.policy->row_format();
  if (want_probs) {
    a.prob_sums = probs_.data();
    IG_RETURN_IF_ERROR(ZeroProbabilityRows(f.plan));
  }
  IG_RETURN_IF_ERROR(s.source->Attend(f, layer, a));
  if (want_probs) {
    // One copy (one wait) through the last head's row: the rows between
    // heads' entries come back too, unread.
    const int group = c_.n_heads / c_.n_kv_heads;
    const int last = c_.n_heads - 1;
    const int count = f.plan.head_offsets[last / group + 1] -
                      f.plan.head_offsets[last / group];
    const size_t values =
        static_cast<size_t>(last) * decoded_.stride + count + 1;
    IG_RETURN_IF_ERROR(backend_.CopyToHost(probs_host_.data(), probs_.data(),
                                           values * sizeof(float)));
    s.policy->ObserveAttention(layer, f.plan.view(), probs_host_.data(),
                               decoded_.stride);
  }
  return absl::OkStatus();
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
    const size_t at = static_cast<size_t>(h) * decoded_.stride;
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

absl::Status OffloadedKvCache::NoteBackendPlans(Sequence& s) {
  if (s.notes.empty()) return absl::OkStatus();
  // The plans' queued copies have landed once the backend is idle.
  IG_RETURN_IF_ERROR(backend_.Synchronize());
  return s.notes.Send(sources_, s.seq, s.fetches);
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
