// HeadSlots: the token bookkeeping of one (layer, KV head) of a stored
// sequence: which slot of the head's rows holds which position, the present
// tokens in position order, and the LRU and counter eviction candidates.
// Rows themselves live in the sequence (stored_sequence.h); this class only
// says where.
//
// Addressing is arithmetic wherever it can be. Until the head first evicts,
// its tokens take slots 0, 1, 2, ... in position order, so a position's slot
// is the position itself. Under FIFO a full head gives each new token the
// slot of the token max_tokens before it, so position p lives in slot
// p % max_tokens and the present positions are the last max_tokens
// appended. Under LRU and counter a full head keeps a ring of max_tokens
// slot numbers for the last max_tokens positions (-1: evicted) and a hash
// map for the older positions still present (never more than max_tokens):
// the one case with a lookup, and only for rows older than the window.
//
// Memory: one Slot per present token, plus the ring and map once the head
// evicts under LRU or counter. Eviction costs O(log present) per evicted
// row: present tokens are kept on a list in position order (FIFO takes its
// head), and LRU and counter keep their candidates (the older half) in a
// min-heap with lazy deletion, built when the head first evicts.
// Not thread-safe: the sequence's lock guards it.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_STORE_HEAD_SLOTS_H_
#define INFINIGEN_KV_MEMORY_SERVICE_STORE_HEAD_SLOTS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

class HeadSlots {
 public:
  // One occupied slot.
  struct Slot {
    int32_t position = -1;
    int32_t prev = -1;  // the slot of the next older present token; -1: none
    int32_t next = -1;  // the slot of the next newer present token; -1: none
    // leading_fetches_ (its low 32 bits) when the slot last had them folded
    // in, or was placed: the leading fetches since then all read this slot
    // (fewer than fold_period, so the difference fits).
    uint32_t leading_base = 0;
    // Fetches counted on the slot itself; FetchCount and LastFetch add
    // the leading fetches (NoteLeadingFetches) not yet folded in.
    int64_t fetch_count = 0;
    uint64_t last_fetch = 0;  // 0 = never
    // The row lives in an attached prefix block, not in the sequence's own
    // rows; cleared when the slot is reused.
    bool shared = false;
    // Its candidate key changed since its heap entry (NoteFetch).
    bool dirty = false;
  };

  // fold_period: every slot has the leading fetches folded in each time
  // this many have been counted (a power of two up to 2^31; small ones
  // for tests).
  HeadSlots(EvictionPolicy policy, int32_t max_tokens,
            int64_t fold_period = int64_t{1} << 31)
      : policy_(policy), max_tokens_(max_tokens), fold_period_(fold_period) {}

  // The slot of `pos` (0 <= pos < length, the layer's length); -1 when it
  // was evicted.
  // The arithmetic cases inline (the gather calls this once a row).
  int32_t SlotOf(int32_t pos, int32_t length) const {
    if (!evicting_) return pos;
    if (policy_ == EvictionPolicy::kFifo) {
      return pos >= length - max_tokens_ ? pos % max_tokens_ : -1;
    }
    return RingSlotOf(pos, length);
  }

  // Whether the head has evicted (slot == position no longer holds).
  bool evicting() const { return evicting_; }
  // Whether every present position's slot is arithmetic (no lookup).
  bool arithmetic() const {
    return !evicting_ || policy_ == EvictionPolicy::kFifo;
  }

  // Place(first), ..., Place(first + count - 1) where none of them evicts
  // (the head is not evicting and has room for count more slots): the same
  // slots, statistics and eviction order, in one pass. Returns the first
  // slot; the others follow it.
  int32_t PlaceRun(int32_t first, int32_t count);

  // Takes a slot for `position` (the layer's length: positions arrive in
  // order), evicting a token by the policy when the head is full:
  // *victim is its position, else -1. The slot's statistics start at 0.
  int32_t Place(int32_t position, int32_t* victim);
  // Takes the next slot for `position` of an attached prefix block (a fresh
  // head: slot == position).
  void PlaceShared(int32_t position);

  const Slot& slot(int32_t i) const { return slots_[i]; }
  // A slot's fetch statistics, leading fetches included.
  int64_t FetchCount(int32_t i) const {
    return slots_[i].fetch_count + Unfolded(slots_[i]);
  }
  uint64_t LastFetch(int32_t i) const {
    const Slot& s = slots_[i];
    return Unfolded(s) > 0 ? std::max(s.last_fetch, leading_clock_)
                           : s.last_fetch;
  }
  // The oldest present token's slot (-1: none); then slot(i).next.
  int32_t oldest() const { return oldest_; }

  // Counts a fetch of `slot` at `clock`. True when its eviction key changed
  // on a candidate: RefreshCandidate it once the fetches are all counted.
  bool NoteFetch(int32_t slot, uint64_t clock);
  // NoteFetch of each present position of `positions` (the layer's length
  // `length`), the slots whose key changed appended to `dirty`. A head
  // that has not evicted has no candidates and its slots are its
  // positions: one tight loop.
  void NoteFetches(const int32_t* positions, int32_t n, int32_t length,
                   uint64_t clock, std::vector<int32_t>& dirty);
  // NoteFetch of positions [0, n) (a whole head read in place). A head
  // that has not evicted counts it once, not per slot: the slots below n
  // share one count and clock until they are read (FetchCount, LastFetch)
  // or the head starts evicting; only the slots at or past n (appended
  // after the read) are touched. An evicting head counts each slot, as
  // NoteFetches.
  void NoteLeadingFetches(int32_t n, int32_t length, uint64_t clock,
                          std::vector<int32_t>& dirty);
  void RefreshCandidate(int32_t slot);

 private:
  // An eviction candidate as it was when pushed; stale once the slot holds
  // another position or its key changed.
  struct Candidate {
    uint64_t key;
    int32_t position;
    int32_t slot;
    // std::push_heap keeps the largest on top; the best victim is the
    // smallest (key, position).
    bool operator<(const Candidate& o) const {
      return key != o.key ? key > o.key : position > o.position;
    }
  };

  // SlotOf of an evicting LRU or counter head: the ring, or the map for
  // positions older than the window.
  int32_t RingSlotOf(int32_t pos, int32_t length) const;
  uint64_t Key(const Slot& s) const;
  // The leading fetches since the slot's base (modulo 2^32, exact: fewer
  // than fold_period_).
  uint32_t Unfolded(const Slot& s) const {
    return static_cast<uint32_t>(leading_fetches_) - s.leading_base;
  }
  // Adds the leading fetches since the slot's base to its own count.
  void FoldLeading(Slot& s);
  void LinkAtTail(int32_t slot);
  void Unlink(int32_t slot);
  void StartEvicting();
  void ForgetPosition(int32_t victim, int32_t position);
  void RememberPosition(int32_t position, int32_t slot);
  void PushCandidate(int32_t slot);
  void RebuildHeap();
  void AdvanceCandidates(int32_t position);
  int32_t EvictionSlot();

  EvictionPolicy policy_;
  int32_t max_tokens_;
  std::vector<Slot> slots_;  // [present]; grows to max_tokens, then reused
  // Set at the head's first eviction; until then slot == position.
  bool evicting_ = false;
  // LRU and counter, once evicting: ring_[p % max_tokens] is the slot of
  // position p for the last max_tokens positions (-1: evicted), and
  // `older_` the slots of the present positions before them.
  std::vector<int32_t> ring_;
  absl::flat_hash_map<int32_t, int32_t> older_;
  int32_t oldest_ = -1;  // present tokens by position: a list from here...
  int32_t newest_ = -1;  // ...to here
  // LRU and counter: every present token below this position is a
  // candidate (the older half of the last append's position);
  // `first_young_` is the oldest non-candidate. Once the head evicts, each
  // candidate has one live entry in `heap_`.
  int32_t candidates_below_ = 0;
  int32_t first_young_ = -1;
  int32_t candidates_ = 0;
  std::vector<Candidate> heap_;
  // Leading fetches counted (NoteLeadingFetches) and the last one's clock.
  int64_t leading_fetches_ = 0;
  uint64_t leading_clock_ = 0;
  const int64_t fold_period_;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_STORE_HEAD_SLOTS_H_
