#include "kv_memory_service/store/head_slots.h"

#include <algorithm>

namespace infinigen::kv_memory_service {

int32_t HeadSlots::PlaceRun(int32_t first, int32_t count) {
  const int32_t slot0 = static_cast<int32_t>(slots_.size());
  slots_.resize(slots_.size() + count);
  const uint32_t base = static_cast<uint32_t>(leading_fetches_);
  for (int32_t i = 0; i < count; ++i) {
    Slot& s = slots_[slot0 + i];
    s.position = first + i;
    s.leading_base = base;
    s.prev = i == 0 ? newest_ : slot0 + i - 1;
    s.next = i + 1 < count ? slot0 + i + 1 : -1;
  }
  if (count > 0) {
    if (newest_ >= 0) {
      slots_[newest_].next = slot0;
    } else {
      oldest_ = slot0;
    }
    newest_ = slot0 + count - 1;
    if (first_young_ < 0) first_young_ = slot0;
    // What the run's last Place would leave: the walk stops before the
    // slots past half the last position, the run's own among them.
    AdvanceCandidates(first + count - 1);
  }
  return slot0;
}

int32_t HeadSlots::Place(int32_t position, int32_t* victim) {
  AdvanceCandidates(position);
  int32_t slot;
  *victim = -1;
  if (static_cast<int32_t>(slots_.size()) < max_tokens_) {
    slot = static_cast<int32_t>(slots_.size());
    slots_.emplace_back();
  } else {
    if (!evicting_) StartEvicting();
    slot = EvictionSlot();
    *victim = slots_[slot].position;
    Unlink(slot);
    ForgetPosition(*victim, position);
  }
  Slot& s = slots_[slot];
  s.position = position;
  s.shared = false;
  s.fetch_count = 0;
  s.last_fetch = 0;
  s.leading_base = static_cast<uint32_t>(leading_fetches_);
  LinkAtTail(slot);
  if (evicting_) RememberPosition(position, slot);
  return slot;
}

void HeadSlots::PlaceShared(int32_t position) {
  const int32_t slot = static_cast<int32_t>(slots_.size());
  slots_.emplace_back();
  slots_[slot].position = position;
  slots_[slot].shared = true;
  slots_[slot].leading_base = static_cast<uint32_t>(leading_fetches_);
  LinkAtTail(slot);
}

bool HeadSlots::NoteFetch(int32_t slot, uint64_t clock) {
  Slot& s = slots_[slot];
  ++s.fetch_count;
  s.last_fetch = clock;
  // Only a candidate on the heap has a key to refresh.
  if (evicting_ && policy_ != EvictionPolicy::kFifo &&
      s.position < candidates_below_ && !s.dirty) {
    s.dirty = true;
    return true;
  }
  return false;
}

void HeadSlots::NoteFetches(const int32_t* positions, int32_t n,
                            int32_t length, uint64_t clock,
                            std::vector<int32_t>& dirty) {
  if (!evicting_) {
    Slot* slots = slots_.data();
    for (int32_t j = 0; j < n; ++j) {
      Slot& s = slots[positions[j]];
      ++s.fetch_count;
      s.last_fetch = clock;
    }
    return;
  }
  for (int32_t j = 0; j < n; ++j) {
    const int32_t slot = SlotOf(positions[j], length);
    if (NoteFetch(slot, clock)) dirty.push_back(slot);
  }
}

void HeadSlots::NoteLeadingFetches(int32_t n, int32_t length,
                                   uint64_t clock,
                                   std::vector<int32_t>& dirty) {
  if (evicting_) {
    for (int32_t pos = 0; pos < n; ++pos) {
      const int32_t slot = SlotOf(pos, length);
      if (slot >= 0 && NoteFetch(slot, clock)) dirty.push_back(slot);
    }
    return;
  }
  // Slots are positions: those at or past n were not read. Each keeps the
  // counts it has and starts past this fetch.
  const int32_t size = static_cast<int32_t>(slots_.size());
  for (int32_t slot = std::max(n, 0); slot < size; ++slot) {
    FoldLeading(slots_[slot]);
    slots_[slot].leading_base = static_cast<uint32_t>(leading_fetches_ + 1);
  }
  ++leading_fetches_;
  leading_clock_ = clock;
  // No slot's unfolded count reaches fold_period_ (its base is 32 bits).
  if (leading_fetches_ % fold_period_ == 0) {
    for (Slot& s : slots_) FoldLeading(s);
  }
}

void HeadSlots::FoldLeading(Slot& s) {
  if (const uint32_t unfolded = Unfolded(s); unfolded > 0) {
    s.fetch_count += unfolded;
    s.last_fetch = std::max(s.last_fetch, leading_clock_);
  }
  s.leading_base = static_cast<uint32_t>(leading_fetches_);
}

void HeadSlots::RefreshCandidate(int32_t slot) {
  slots_[slot].dirty = false;
  PushCandidate(slot);
}

int32_t HeadSlots::RingSlotOf(int32_t pos, int32_t length) const {
  if (pos >= length - max_tokens_) return ring_[pos % max_tokens_];
  auto it = older_.find(pos);
  return it == older_.end() ? -1 : it->second;
}

// What the LRU or counter rule ranks a candidate by (smaller: evicted
// first; ties go to the smaller position).
uint64_t HeadSlots::Key(const Slot& s) const {
  return policy_ == EvictionPolicy::kCounter
             ? static_cast<uint64_t>(s.fetch_count)
             : s.last_fetch;
}

void HeadSlots::LinkAtTail(int32_t slot) {
  Slot& s = slots_[slot];
  s.prev = newest_;
  s.next = -1;
  if (newest_ >= 0) {
    slots_[newest_].next = slot;
  } else {
    oldest_ = slot;
  }
  newest_ = slot;
  if (first_young_ < 0) first_young_ = slot;
}

void HeadSlots::Unlink(int32_t slot) {
  Slot& s = slots_[slot];
  if (s.position < candidates_below_) {
    --candidates_;
  } else if (first_young_ == slot) {
    first_young_ = s.next;
  }
  if (s.prev >= 0) {
    slots_[s.prev].next = s.next;
  } else {
    oldest_ = s.next;
  }
  if (s.next >= 0) {
    slots_[s.next].prev = s.prev;
  } else {
    newest_ = s.prev;
  }
  s.prev = s.next = -1;
}

// The head is full and about to evict for the first time: every slot still
// holds its own position (slot == position, positions [0, max_tokens)). LRU
// and counter start their ring and candidate heap.
void HeadSlots::StartEvicting() {
  // Candidates are ranked by their own counts from now on.
  for (Slot& s : slots_) FoldLeading(s);
  evicting_ = true;
  if (policy_ == EvictionPolicy::kFifo) return;
  ring_.resize(max_tokens_);
  for (int32_t p = 0; p < max_tokens_; ++p) ring_[p] = p;
  RebuildHeap();
}

// `victim` left an evicting head while `position` is appended (the layer's
// length before it).
void HeadSlots::ForgetPosition(int32_t victim, int32_t position) {
  if (policy_ == EvictionPolicy::kFifo) return;
  if (victim >= position - max_tokens_) {
    ring_[victim % max_tokens_] = -1;
  } else {
    older_.erase(victim);
  }
}

// `position` took `slot` of an evicting head: it enters the ring, and the
// position max_tokens before it, if still present, moves to `older_`.
void HeadSlots::RememberPosition(int32_t position, int32_t slot) {
  if (policy_ == EvictionPolicy::kFifo) return;
  int32_t& entry = ring_[position % max_tokens_];
  if (entry >= 0) older_[position - max_tokens_] = entry;
  entry = slot;
}

void HeadSlots::PushCandidate(int32_t slot) {
  const Slot& s = slots_[slot];
  heap_.push_back(Candidate{Key(s), s.position, slot});
  std::push_heap(heap_.begin(), heap_.end());
  // Stale entries are dropped once they outnumber the live ones, so the
  // heap stays within about twice the present tokens.
  if (heap_.size() > 2 * static_cast<size_t>(candidates_) + 64) RebuildHeap();
}

void HeadSlots::RebuildHeap() {
  heap_.clear();
  for (int32_t slot = oldest_; slot >= 0 && slot != first_young_;
       slot = slots_[slot].next) {
    const Slot& s = slots_[slot];
    heap_.push_back(Candidate{Key(s), s.position, slot});
  }
  std::make_heap(heap_.begin(), heap_.end());
}

// Before `position` is appended: the present tokens below position / 2
// become LRU / counter candidates (on the heap once the head evicts).
void HeadSlots::AdvanceCandidates(int32_t position) {
  if (policy_ == EvictionPolicy::kFifo) return;
  candidates_below_ = position / 2;
  while (first_young_ >= 0 &&
         slots_[first_young_].position < candidates_below_) {
    const int32_t slot = first_young_;
    first_young_ = slots_[slot].next;
    ++candidates_;
    if (evicting_) PushCandidate(slot);
  }
}

// The slot of the token to evict from a full head (the rules of
// EvictionPolicy, kv_types.h).
int32_t HeadSlots::EvictionSlot() {
  if (policy_ != EvictionPolicy::kFifo) {
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end());
      const Candidate c = heap_.back();
      heap_.pop_back();
      const Slot& s = slots_[c.slot];
      if (s.position == c.position && Key(s) == c.key &&
          c.position < candidates_below_) {
        return c.slot;
      }
    }
  }
  return oldest_;
}

}  // namespace infinigen::kv_memory_service
