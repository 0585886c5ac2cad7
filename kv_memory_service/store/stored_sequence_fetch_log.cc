// StoredSequence's fetch log (stored_sequence.h): the reads a reader made
// in place (NoteFetched, NoteLeadingFetched) or from copies of its own
// (NoteHeld), the log every fetch appends
// to, and its application to the per-token statistics.
#include "kv_memory_service/store/stored_sequence.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace infinigen::kv_memory_service {

bool StoredSequence::LogFetch(int32_t layer, const FetchPlan& plan,
                              Logged kind) {
  absl::MutexLock log_lock(&log_mu_);
  LogFetchLocked(layer, plan, kind);
  // A sequence fetched without appends applies its log here.
  return log_positions_.size() >
         std::max<size_t>(size_t{1} << 16, 4 * present_rows_);
}

void StoredSequence::FinishFetch(size_t rows, bool apply,
                                 StoreTotals& totals, bool held) {
  if (!held) totals.fetches.fetch_add(1, std::memory_order_relaxed);
  totals.fetched_rows.fetch_add(static_cast<int64_t>(rows),
                                std::memory_order_relaxed);
  if (apply) {
    absl::MutexLock lock(&mu_);
    ApplyLogLocked();
  }
}

absl::Status StoredSequence::NoteFetched(int32_t layer, const FetchPlan& plan,
                                         StoreTotals& totals) {
  IG_RETURN_IF_ERROR(CheckLayer(layer));
  IG_RETURN_IF_ERROR(ValidatePlanShape(plan, g_.n_kv_heads));
  bool apply = false;
  {
    absl::ReaderMutexLock lock(&mu_);
    const int32_t length = layer_length_[layer];
    // The reader addressed position p of head h at slot p of the
    // sequence's own rows: true while the head has not evicted and p is
    // past the attached prefix.
    for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
      const bool moved = HeadAt(layer, h).evicting();
      const int32_t begin = plan.head_offsets[h], end = plan.head_offsets[h + 1];
      if (begin == end) continue;
      // Every position within [attached prefix, length) of a head that has
      // not evicted: the head's least and greatest position tell (a loop
      // the compiler vectorizes); the first offender is looked up only to
      // say which.
      int32_t lo = plan.indices[begin], hi = lo;
      for (int32_t j = begin; j < end; ++j) {
        const int32_t pos = plan.indices[j];
        lo = pos < lo ? pos : lo;
        hi = pos > hi ? pos : hi;
      }
      if (!moved && lo >= 0 && lo >= attached_tokens_ && hi < length) continue;
      for (int32_t j = begin; j < end; ++j) {
        const int32_t pos = plan.indices[j];
        IG_RETURN_IF_ERROR(CheckPosition(pos, layer, h, length));
        if (moved || pos < attached_tokens_) {
          return absl::FailedPreconditionError(absl::StrCat(
              "position ", pos, " of layer ", layer, " head ", h,
              " is not at its slot of the sequence's rows (",
              moved ? "the head evicts" : "an attached prefix block",
              "): it cannot be read in place"));
        }
      }
    }
    apply = LogFetch(layer, plan);
  }
  FinishFetch(plan.indices.size(), apply, totals);
  return absl::OkStatus();
}

absl::Status StoredSequence::NoteLeadingFetched(
    int32_t layer, absl::Span<const int32_t> head_offsets,
    StoreTotals& totals) {
  IG_RETURN_IF_ERROR(CheckLayer(layer));
  IG_RETURN_IF_ERROR(ValidateHeadOffsets(head_offsets, g_.n_kv_heads));
  FetchPlan plan;
  plan.head_offsets = head_offsets;
  bool apply = false;
  {
    absl::ReaderMutexLock lock(&mu_);
    const int32_t length = layer_length_[layer];
    // Head h read positions [0, count) at slots [0, count): true while the
    // head has not evicted and nothing is attached.
    for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
      const int32_t count = head_offsets[h + 1] - head_offsets[h];
      if (count == 0) continue;
      IG_RETURN_IF_ERROR(CheckPosition(count - 1, layer, h, length));
      const bool moved = HeadAt(layer, h).evicting();
      if (moved || attached_tokens_ > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "position 0 of layer ", layer, " head ", h,
            " is not at its slot of the sequence's rows (",
            moved ? "the head evicts" : "an attached prefix block",
            "): it cannot be read in place"));
      }
    }
    apply = LogFetch(layer, plan, Logged::kLeading);
  }
  FinishFetch(static_cast<size_t>(head_offsets.back()), apply, totals);
  return absl::OkStatus();
}

absl::Status StoredSequence::NoteHeld(int32_t layer, const FetchPlan& plan,
                                      StoreTotals& totals) {
  IG_RETURN_IF_ERROR(CheckLayer(layer));
  IG_RETURN_IF_ERROR(ValidatePlanShape(plan, g_.n_kv_heads));
  bool apply = false;
  size_t rows = plan.indices.size();
  {
    absl::ReaderMutexLock lock(&mu_);
    const int32_t length = layer_length_[layer];
    // Every position within [0, length), as a gather checks; those the
    // node has evicted since the reader took its copy have no statistics
    // to keep and are left out.
    bool all_present = true;
    for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
      const HeadSlots& head = HeadAt(layer, h);
      for (int32_t j = plan.head_offsets[h]; j < plan.head_offsets[h + 1];
           ++j) {
        const int32_t pos = plan.indices[j];
        if (pos < 0 || pos >= length) {
          return CheckPosition(pos, layer, h, length);
        }
        all_present = all_present && head.SlotOf(pos, length) >= 0;
      }
    }
    if (all_present) {
      apply = LogFetch(layer, plan, Logged::kHeld);
    } else {
      std::vector<int32_t> indices, offsets(1, 0);
      for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
        const HeadSlots& head = HeadAt(layer, h);
        for (int32_t j = plan.head_offsets[h]; j < plan.head_offsets[h + 1];
             ++j) {
          const int32_t pos = plan.indices[j];
          if (head.SlotOf(pos, length) >= 0) indices.push_back(pos);
        }
        offsets.push_back(static_cast<int32_t>(indices.size()));
      }
      rows = indices.size();
      FetchPlan present;
      present.indices = indices;
      present.head_offsets = offsets;
      apply = LogFetch(layer, present, Logged::kHeld);
    }
  }
  FinishFetch(rows, apply, totals, /*held=*/true);
  return absl::OkStatus();
}

size_t StoredSequence::LogPositions() const {
  absl::MutexLock lock(&log_mu_);
  return log_positions_.size();
}

// Appends a successful gather's plan to the fetch log.
void StoredSequence::LogFetchLocked(int32_t layer, const FetchPlan& plan,
                                    Logged kind) {
  if (layer_clock_.empty()) layer_clock_.assign(g_.n_layers, 0);
  if (kind != Logged::kHeld) layer_clock_[layer] = ++clock_;
  log_.push_back(LoggedFetch{layer_clock_[layer], layer, log_positions_.size(),
                             kind == Logged::kLeading});
  log_positions_.insert(log_positions_.end(), plan.head_offsets.begin(),
                        plan.head_offsets.end());
  log_positions_.insert(log_positions_.end(), plan.indices.begin(),
                        plan.indices.end());
  if (kind != Logged::kHeld) ++fetches_;
  fetched_rows_ += plan.head_offsets.back();
}

// Applies the fetch log to the per-token statistics, in the order of the
// gathers, and refreshes the heap entries of the candidates they touched.
// Every logged position is present: nothing was evicted since its gather
// (an append that evicts applies the log first).
void StoredSequence::ApplyLogLocked() {
  {
    absl::MutexLock lock(&log_mu_);
    if (log_.empty()) return;
    applying_.swap(log_);
    applying_positions_.swap(log_positions_);
  }
  const size_t heads = static_cast<size_t>(g_.n_kv_heads);
  for (const LoggedFetch& f : applying_) {
    const int32_t* offsets = applying_positions_.data() + f.begin;
    const int32_t* indices = offsets + heads + 1;
    const int32_t length = layer_length_[f.layer];
    for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
      dirty_slots_.clear();
      HeadSlots& head = HeadAt(f.layer, h);
      const int32_t count = offsets[h + 1] - offsets[h];
      if (f.leading) {
        head.NoteLeadingFetches(count, length, f.clock, dirty_slots_);
      } else {
        head.NoteFetches(indices + offsets[h], count, length, f.clock,
                         dirty_slots_);
      }
      for (const int32_t slot : dirty_slots_) {
        dirty_.push_back({f.layer * g_.n_kv_heads + h, slot});
      }
    }
  }
  // A candidate's key changed: its heap entry is stale, push a fresh one
  // (the stale one is skipped when it surfaces).
  for (const auto& [head_index, slot] : dirty_) {
    heads_[head_index].RefreshCandidate(slot);
  }
  dirty_.clear();
  applying_.clear();
  applying_positions_.clear();
}

}  // namespace infinigen::kv_memory_service
