// StoredSequence: one sequence of the memory node's store (kv_store.h), its
// K and V rows [layer][kv_head][slot][head_dim] and, per (layer, KV head),
// a HeadSlots (head_slots.h) saying which slot holds which position.
// Private to the store.
//
// Memory follows what is stored, not what was reserved or ever appended:
// the rows are an mmap the kernel commits page by page as rows are
// written; the bookkeeping is HeadSlots'. Consecutive positions stored side
// by side are gathered as one block, scattered ones with fixed-size copies
// prefetched ahead, and gathers over 1 MiB are split across the store's
// ThreadPool.
//
// Fetches do no bookkeeping on their path: a gather copies rows under a
// reader lock (several gathers of a sequence run at once) and appends its
// plan to the sequence's fetch log, 4 bytes a row. The log is applied to
// the per-token statistics, in order: by an append that evicts or that
// finds it holding half as many positions as rows present, before the
// statistics are read, and by a gather that finds it at four times the rows
// present.
//
// Thread-safe: appends and statistics take the sequence's lock, gathers
// share it.
//
// Defined in stored_sequence.cc (construction, appends, prefix blocks,
// statistics), stored_sequence_gather.cc (gathers) and
// stored_sequence_fetch_log.cc (reads in place and the fetch log).
#ifndef INFINIGEN_KV_MEMORY_SERVICE_STORE_STORED_SEQUENCE_H_
#define INFINIGEN_KV_MEMORY_SERVICE_STORE_STORED_SEQUENCE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "kv_memory_service/store/head_slots.h"
#include "kv_memory_service/client/kv_types.h"
#include "kv_memory_service/store/prefix_cache.h"
#include "kv_memory_service/store/row_memory.h"

namespace infinigen::kv_memory_service {

// The store's running totals, which every sequence adds to.
struct StoreTotals {
  std::atomic<int64_t> appended_rows{0};
  std::atomic<int64_t> evicted_rows{0};
  std::atomic<int64_t> fetches{0};
  std::atomic<int64_t> fetched_rows{0};
};

class StoredSequence {
 public:
  StoredSequence(SequenceId id, const SequenceGeometry& g,
                 EvictionPolicy policy, RowMemory k, RowMemory v);

  const SequenceGeometry& geometry() const { return g_; }

  // KvStore::Append on this sequence, at most max_append_tokens per call.
  // `published` receives the prefix blocks this append completed (see
  // Attach), for the store to share. `pool` (may be null) splits a layer's
  // rows above kAppendSplitBytes across its threads by KV head.
  absl::StatusOr<AppendResult> Append(
      const AppendBlock& b, int32_t max_append_tokens, StoreTotals& totals,
      std::vector<std::shared_ptr<const PrefixBlock>>* published,
      ThreadPool* pool = nullptr);
  static constexpr size_t kAppendSplitBytes = size_t{4} << 20;
  static constexpr size_t kAppendTaskBytes = size_t{1} << 20;

  // KvStore::Gather on this sequence; `pool` (may be null) splits large
  // gathers.
  absl::Status Gather(int32_t layer, const FetchPlan& plan,
                      absl::Span<uint16_t> dest, StoreTotals& totals,
                      ThreadPool* pool);

  // KvStore::NoteFetched on this sequence.
  absl::Status NoteFetched(int32_t layer, const FetchPlan& plan,
                           StoreTotals& totals);
  // KvStore::NoteHeld on this sequence.
  absl::Status NoteHeld(int32_t layer, const FetchPlan& plan,
                        StoreTotals& totals);
  // KvStore::NoteLeadingFetched on this sequence.
  absl::Status NoteLeadingFetched(int32_t layer,
                                  absl::Span<const int32_t> head_offsets,
                                  StoreTotals& totals);

  // The rows, [layer][kv_head][slot][head_dim] (KvStore::DirectRows).
  const uint16_t* k_rows() const { return k_.get(); }
  const uint16_t* v_rows() const { return v_.get(); }
  // The memfds of k_rows() and v_rows(), or -1 (RowMemory::fd).
  int k_fd() const { return k_.fd(); }
  int v_fd() const { return v_.fd(); }
  // The rows' memory, taken out of a closed sequence that no call uses any
  // more, for a new sequence to reuse (spare_rows.h); this one is not used
  // again.
  std::pair<RowMemory, RowMemory> TakeRows() {
    return {std::move(k_), std::move(v_)};
  }
  // Whether every position appended from now on is addressable in place:
  // no prefix block attached (its rows live in the block).
  bool attached() const;

  // Makes the attached blocks the sequence's first tokens (a fresh
  // sequence: nothing appended yet) and remembers `pending` (the keys of
  // the blocks after them) to publish each of those blocks once every
  // layer's rows of it are appended, in order, while their bytes (rows and
  // annotation) stay within `publish_bytes`. Returns the attached tokens.
  int32_t Attach(std::vector<std::shared_ptr<const PrefixBlock>> blocks,
                 int32_t block_tokens, std::vector<PrefixKey> pending,
                 int64_t publish_bytes);

  SequenceStats Stats() const;
  absl::StatusOr<std::vector<TokenFetchStats>> TokenStats(int32_t layer,
                                                          int32_t kv_head);

 private:
  // One gather in the fetch log; its plan is at log_positions_[begin...]:
  // n_kv_heads + 1 head offsets, then the indices, or (leading) the head
  // offsets alone, head h having read positions [0, its count).
  struct LoggedFetch {
    uint64_t clock;
    int32_t layer;
    size_t begin;
    bool leading;
  };
  // What a logged fetch was: a gather or a read in place (a tick of the
  // clock), or a note of rows the reader held (the clock of the layer's
  // last fetch).
  enum class Logged { kFetch, kLeading, kHeld };
  // The K and V rows of a present position, and how many positions from it
  // on are stored one after the other from there (at least 1).
  struct RowRef {
    const uint16_t* k = nullptr;  // null: the position was evicted
    const uint16_t* v = nullptr;
    int32_t run = 0;
  };

  HeadSlots& HeadAt(int32_t layer, int32_t h)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return heads_[static_cast<size_t>(layer) * g_.n_kv_heads + h];
  }
  const HeadSlots& HeadAt(int32_t layer, int32_t h) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return heads_[static_cast<size_t>(layer) * g_.n_kv_heads + h];
  }
  uint16_t* Row(uint16_t* base, int32_t layer, int32_t h, int32_t slot) const {
    return base +
           (static_cast<size_t>(layer) * g_.n_kv_heads + h) * head_elems_ +
           static_cast<size_t>(slot) * row_elems_;
  }

  // Append's steps, in order. The checks that need no lock: the block's
  // layers, sizes and annotations against the geometry and the limit.
  absl::Status CheckAppend(const AppendBlock& b,
                           int32_t max_append_tokens) const;
  // The checks once the sequence is ours (annotations against the block
  // size, cancellation, deadline, positions); returns whether a head of the
  // block's layers evicts (or has), and brings the fetch statistics up to
  // date when it does or when the log has grown long.
  absl::StatusOr<bool> AdmitAppendLocked(const AppendBlock& b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places layer `layer`'s n_tokens new positions and copies their rows
  // from k_src and v_src ([token][kv_head][head_dim]): token by token,
  // every head, noting the victims (a layer that evicts), or each head's
  // new slots as one run, split across `pool` when large.
  void AppendEvictingLayer(int32_t layer, const uint16_t* k_src,
                           const uint16_t* v_src, int32_t n_tokens,
                           std::vector<EvictedToken>* evicted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendLayerRuns(int32_t layer, const uint16_t* k_src,
                       const uint16_t* v_src, int32_t n_tokens,
                       ThreadPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies token t, head h of an appended layer's rows (as above) to
  // `slot` of (layer, h).
  void CopyAppendedRow(int32_t layer, const uint16_t* k_src,
                       const uint16_t* v_src, int32_t t, int32_t h,
                       int32_t slot);
  // Keeps the annotations of b's blocks still to publish whose rows are in.
  void KeepPendingMeta(const AppendBlock& b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // InvalidArgument naming `layer` unless 0 <= layer < n_layers.
  absl::Status CheckLayer(int32_t layer) const;
  // A plan's position against its layer's length: InvalidArgument when
  // negative, OutOfRange past the end (what Gather and NoteFetched answer).
  static absl::Status CheckPosition(int32_t pos, int32_t layer, int32_t h,
                                    int32_t length);
  RowRef Locate(const HeadSlots& head, int32_t layer, int32_t h, int32_t pos,
                int32_t length) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CopyRows(int32_t layer, int32_t length, const FetchPlan& plan,
                        size_t begin, size_t end, uint16_t* dest) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CopyHead(int32_t layer, int32_t h, int32_t length,
                        absl::Span<const int32_t> indices, size_t j, size_t end,
                        uint16_t* k_out, uint16_t* v_out) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void Prefetch(const uint16_t* p) const;
  void CopyRow(uint16_t* dst, const uint16_t* src) const;

  // Logs a fetch of `plan` (a gather's, or one read in place) under the
  // sequence's reader lock; true when the log should then be applied.
  bool LogFetch(int32_t layer, const FetchPlan& plan,
                Logged kind = Logged::kFetch) ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // After LogFetch, the lock released: counts the fetch and applies the log
  // when LogFetch asked for it.
  // A note of held rows adds its rows, not a fetch.
  void FinishFetch(size_t rows, bool apply, StoreTotals& totals,
                   bool held = false);

  size_t LogPositions() const;
  void LogFetchLocked(int32_t layer, const FetchPlan& plan, Logged kind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(log_mu_);
  void ApplyLogLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint16_t* RowOf(bool v, int32_t layer, int32_t h, int32_t slot,
                        const HeadSlots::Slot& s) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void CollectPublishable(std::vector<std::shared_ptr<const PrefixBlock>>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SequenceId id_;
  const SequenceGeometry g_;
  const EvictionPolicy policy_;
  const size_t row_elems_;   // head_dim
  const size_t row_bytes_;   // head_dim * 2
  const size_t head_elems_;  // max_tokens * head_dim
  // The rows never move (until TakeRows); their contents and all below
  // change under mu_.
  RowMemory k_;
  RowMemory v_;

  mutable absl::Mutex mu_;
  std::vector<HeadSlots> heads_ ABSL_GUARDED_BY(mu_);  // [layer * n_kv + h]
  std::vector<int32_t> layer_length_ ABSL_GUARDED_BY(mu_);
  int64_t present_rows_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evicted_rows_ ABSL_GUARDED_BY(mu_) = 0;
  // ApplyLogLocked's scratch, kept for its capacity.
  std::vector<LoggedFetch> applying_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> applying_positions_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int32_t, int32_t>> dirty_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> dirty_slots_ ABSL_GUARDED_BY(mu_);  // one head's
  // Shared prefix blocks this sequence reads its first tokens from, and
  // the keys of the blocks it will publish (Attach).
  int32_t block_tokens_ ABSL_GUARDED_BY(mu_) = 1;
  int32_t attached_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::shared_ptr<const PrefixBlock>> attached_
      ABSL_GUARDED_BY(mu_);
  std::vector<PrefixKey> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pending_meta_ ABSL_GUARDED_BY(mu_);
  size_t next_pending_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes the blocks still to publish may take (Attach's publish_bytes,
  // less what was published).
  int64_t publish_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // K and V bytes of a published block's rows.
  int64_t PublishedRowBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(
        2 * PrefixBlock::RowValues(g_, block_tokens_) * sizeof(uint16_t));
  }
  // Append's first new slot of each head, kept to spare an allocation a
  // call.
  std::vector<int32_t> run_slots_ ABSL_GUARDED_BY(mu_);

  // The fetch log (taken after mu_, held briefly).
  mutable absl::Mutex log_mu_ ABSL_ACQUIRED_AFTER(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(log_mu_) = 0;  // one tick per Gather
  // [layer]: the clock of the layer's last fetch (a note of held rows
  // takes it).
  std::vector<uint64_t> layer_clock_ ABSL_GUARDED_BY(log_mu_);
  int64_t fetches_ ABSL_GUARDED_BY(log_mu_) = 0;
  int64_t fetched_rows_ ABSL_GUARDED_BY(log_mu_) = 0;
  std::vector<LoggedFetch> log_ ABSL_GUARDED_BY(log_mu_);
  std::vector<int32_t> log_positions_ ABSL_GUARDED_BY(log_mu_);
};

// Inline: Gather checks every index of a plan.
inline absl::Status StoredSequence::CheckPosition(int32_t pos, int32_t layer,
                                                  int32_t h, int32_t length) {
  if (pos < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "negative position ", pos, " for layer ", layer, " head ", h));
  }
  if (pos >= length) {
    return absl::OutOfRangeError(absl::StrCat(
        "position ", pos, " is beyond layer ", layer, "'s length ", length));
  }
  return absl::OkStatus();
}

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_STORE_STORED_SEQUENCE_H_
