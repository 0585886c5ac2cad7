#include "gpu_worker/kv/offloaded/row_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"

namespace infinigen::gpu_worker {
namespace offloaded {
namespace {

// Rows the bound allows for `tokens` cached tokens.
long BoundRows(double fraction, long rows_per_token, long tokens) {
  return static_cast<long>(
      std::ceil(fraction * static_cast<double>(rows_per_token) * tokens));
}

}  // namespace

RowCache::RowCache(int n_layers, int n_kv_heads, int max_tokens,
                   int row_width, double fraction,
                   RowCacheReplacement replacement, bool hold_rows)
    : n_kv_heads_(n_kv_heads),
      max_tokens_(max_tokens),
      row_width_(row_width),
      fraction_(fraction),
      replacement_(replacement),
      rows_per_token_(static_cast<long>(n_layers) * n_kv_heads),
      max_rows_(BoundRows(fraction, rows_per_token_, max_tokens)),
      slots_(static_cast<size_t>(n_layers) * n_kv_heads),
      layers_(n_layers),
      k_(hold_rows ? new uint16_t[static_cast<size_t>(max_rows_) * row_width]
                   : nullptr),
      v_(hold_rows ? new uint16_t[static_cast<size_t>(max_rows_) * row_width]
                   : nullptr),
      position_(new int32_t[max_rows_]),
      prev_(new int32_t[max_rows_]),
      next_(new int32_t[max_rows_]),
      uses_(replacement == RowCacheReplacement::kFrequency
                ? new int32_t[max_rows_]
                : nullptr) {
  for (Slots& s : slots_) {
    s.slot_of.assign(max_tokens_, -1);
    s.selected.assign(max_tokens_, -1);
  }
}

int64_t RowCache::Bytes(int n_layers, int n_kv_heads, int max_tokens,
                        int row_width, double fraction,
                        RowCacheReplacement replacement) {
  const int64_t rows =
      BoundRows(fraction, static_cast<long>(n_layers) * n_kv_heads,
                max_tokens);
  // K and V rows at the bound; per position of each (layer, head) its slot
  // and the split that last selected it; per slot its position and its
  // neighbours in the recency list (and by frequency its selections).
  const int64_t per_slot =
      replacement == RowCacheReplacement::kFrequency ? 4 : 3;
  return rows * 2 * row_width * static_cast<int64_t>(sizeof(uint16_t)) +
         (int64_t{n_layers} * n_kv_heads * 2 * max_tokens + per_slot * rows) *
             static_cast<int64_t>(sizeof(int32_t));
}

double RowCache::FractionWithin(int64_t bytes, int n_layers, int n_kv_heads,
                                int max_tokens, int row_width,
                                RowCacheReplacement replacement) {
  const int64_t rows_per_token = int64_t{n_layers} * n_kv_heads;
  const int64_t maps = rows_per_token * 2 * max_tokens *
                       static_cast<int64_t>(sizeof(int32_t));
  const int64_t per_slot =
      replacement == RowCacheReplacement::kFrequency ? 4 : 3;
  const int64_t per_row = 2 * row_width * static_cast<int64_t>(sizeof(uint16_t)) +
                          per_slot * static_cast<int64_t>(sizeof(int32_t));
  const int64_t all = rows_per_token * max_tokens;
  // Rows first, then the fraction that asks for no more (the bound rounds
  // up: one row fewer where it rounds past them).
  for (int64_t rows = std::min(all, (bytes - maps) / per_row); rows > 0;
       --rows) {
    const double f = static_cast<double>(rows) / all;
    if (Bytes(n_layers, n_kv_heads, max_tokens, row_width, f, replacement) <=
        bytes) {
      return f;
    }
  }
  return 0.0;
}

int64_t RowCache::bytes() const {
  return static_cast<int64_t>(held_) * 2 * row_width_ *
         static_cast<int64_t>(sizeof(uint16_t));
}

void RowCache::Unlink(Slots& s, int32_t slot) {
  const int32_t p = prev_[slot], n = next_[slot];
  (p >= 0 ? next_[p] : s.front) = n;
  (n >= 0 ? prev_[n] : s.back) = p;
}

void RowCache::LinkFront(Slots& s, int32_t slot) {
  prev_[slot] = -1;
  next_[slot] = s.front;
  (s.front >= 0 ? prev_[s.front] : s.back) = slot;
  s.front = slot;
}

int32_t RowCache::Victim(const Slots& s, int32_t count) const {
  if (replacement_ == RowCacheReplacement::kRecency) return s.back;
  // From the least recent forward, up to the first slot the step selected
  // (they are all at the front): the least often selected, the least
  // recent of those.
  int32_t victim = s.back;
  for (int32_t slot = s.back;
       slot >= 0 && s.selected[position_[slot]] != count; slot = prev_[slot]) {
    if (uses_[slot] < uses_[victim]) victim = slot;
  }
  return victim;
}

void RowCache::SplitHead(Slots& s, const kv_memory_service::FetchPlan& plan,
                         int g, long budget, LayerSplit& split,
                         Counts& counts) {
  const int begin = plan.head_offsets[g], end = plan.head_offsets[g + 1];
  // The step's hits first to the front: no victim below is one.
  long hits = 0;
  for (int t = begin; t < end; ++t) {
    const int32_t slot = s.slot_of[plan.indices[t]];
    if (slot < 0) continue;
    split.slots[t] = slot;
    Unlink(s, slot);
    LinkFront(s, slot);
    if (uses_ != nullptr) ++uses_[slot];
    ++hits;
  }
  // The misses fit in new slots the bound allows and the head's slots the
  // step did not select (a position planned twice counts twice: it may
  // skip a head that would have fit, never the other way).
  const long misses = (end - begin) - hits;
  if (misses > std::max(0L, budget - held_) + (s.held - hits)) {
    split.skipped[g] = 1;
    for (int t = begin; t < end; ++t) {
      split.misses.indices.push_back(plan.indices[t]);
      split.miss_slot.push_back(-1);
    }
    return;
  }
  for (int t = begin; t < end; ++t) {
    if (split.slots[t] >= 0) {
      split.hits.indices.push_back(plan.indices[t]);
      ++counts.hits;
      continue;
    }
    const int32_t p = plan.indices[t];
    int32_t slot = s.slot_of[p];  // a position planned twice: taken above
    if (slot < 0) {
      if (held_ < budget) {
        slot = static_cast<int32_t>(held_++);
        ++s.held;
      } else {
        slot = Victim(s, split.count);  // not one of this step's
        Unlink(s, slot);
        s.slot_of[position_[slot]] = -1;
      }
      if (uses_ != nullptr) uses_[slot] = 1;
      position_[slot] = p;
      s.slot_of[p] = slot;
      split.misses.indices.push_back(p);
      split.miss_slot.push_back(slot);
    } else {
      Unlink(s, slot);
    }
    LinkFront(s, slot);
    split.slots[t] = slot;
  }
}

absl::StatusOr<RowCache::Counts> RowCache::Split(
    int layer, const kv_memory_service::FetchPlan& plan, int cached_tokens) {
  for (const int32_t p : plan.indices) {
    if (p < 0 || p >= max_tokens_) {
      return absl::InternalError(absl::StrFormat(
          "kv cache: layer %d's plan names position %d, outside the %d rows "
          "a head holds",
          layer, p, max_tokens_));
    }
  }
  LayerSplit& split = layers_[layer];
  split.plan_offsets.assign(plan.head_offsets.begin(),
                            plan.head_offsets.end());
  split.slots.assign(plan.indices.size(), -1);
  split.misses.indices.clear();
  split.misses.head_offsets.assign(1, 0);
  split.hits.indices.clear();
  split.hits.head_offsets.assign(1, 0);
  split.miss_slot.clear();
  split.skipped.assign(n_kv_heads_, 0);
  const long budget = std::min(
      max_rows_,
      BoundRows(fraction_, rows_per_token_, std::max(cached_tokens, 1)));
  Counts counts;
  const int32_t count = ++split.count;
  for (int g = 0; g < n_kv_heads_; ++g) {
    Slots& s = At(layer, g);
    for (int t = plan.head_offsets[g]; t < plan.head_offsets[g + 1]; ++t) {
      int32_t& last = s.selected[plan.indices[t]];
      counts.repeats += last == count - 1;
      last = count;
    }
    SplitHead(s, plan, g, budget, split, counts);
    split.misses.head_offsets.push_back(
        static_cast<int32_t>(split.misses.indices.size()));
    split.hits.head_offsets.push_back(
        static_cast<int32_t>(split.hits.indices.size()));
  }
  return counts;
}

void RowCache::Fill(int layer, const uint16_t* fetched) {
  const LayerSplit& split = layers_[layer];
  const size_t total = split.misses.indices.size();
  const size_t bytes = static_cast<size_t>(row_width_) * sizeof(uint16_t);
  for (int g = 0; g < n_kv_heads_; ++g) {
    if (split.skipped[g]) continue;
    for (int i = split.misses.head_offsets[g];
         i < split.misses.head_offsets[g + 1]; ++i) {
      const size_t at = static_cast<size_t>(split.miss_slot[i]) * row_width_;
      std::memcpy(k_.get() + at,
                  fetched + static_cast<size_t>(i) * row_width_, bytes);
      std::memcpy(v_.get() + at,
                  fetched + (total + static_cast<size_t>(i)) * row_width_,
                  bytes);
    }
  }
}

void RowCache::SlotsOf(int layer, int32_t* plan_slots,
                       int32_t* miss_slots) const {
  const LayerSplit& split = layers_[layer];
  std::copy(split.slots.begin(), split.slots.end(), plan_slots);
  std::copy(split.miss_slot.begin(), split.miss_slot.end(), miss_slots);
  for (int g = 0; g < n_kv_heads_; ++g) {
    if (!split.skipped[g]) continue;
    const int begin = split.plan_offsets[g], end = split.plan_offsets[g + 1];
    const int first_miss = split.misses.head_offsets[g];
    for (int t = begin; t < end; ++t) {
      plan_slots[t] = -1 - (first_miss + (t - begin));
    }
  }
}

RowCache::HeadRows RowCache::Head(int layer, int g,
                                  const uint16_t* fetched) const {
  const LayerSplit& split = layers_[layer];
  HeadRows h;
  if (split.skipped[g]) {
    const size_t total = split.misses.indices.size();
    const size_t at =
        static_cast<size_t>(split.misses.head_offsets[g]) * row_width_;
    h.k = fetched + at;
    h.v = fetched + total * row_width_ + at;
    return h;
  }
  h.k = k_.get();
  h.v = v_.get();
  h.indices = split.slots.data() + split.plan_offsets[g];
  return h;
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
