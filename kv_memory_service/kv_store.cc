#include "kv_memory_service/kv_store.h"

#include <sys/mman.h>
#include <sys/random.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kv_memory_service/gather_pool.h"
#include "kv_memory_service/prefix_cache.h"

namespace infinigen::kv_memory_service {
namespace {

// The rows of a sequence: an anonymous private mapping, so the kernel
// commits its pages only as rows are written (an Open reserves capacity, it
// does not take memory), and Close returns all of it at once. Page-aligned,
// so a data plane may register it (RDMA, CUDA).
class RowMemory {
 public:
  RowMemory() = default;
  // Null (get() == nullptr) when the mapping fails.
  explicit RowMemory(size_t bytes) : bytes_(bytes == 0 ? 1 : bytes) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<uint16_t*>(p);
  }
  RowMemory(RowMemory&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
  }
  RowMemory& operator=(RowMemory&&) = delete;
  RowMemory(const RowMemory&) = delete;
  ~RowMemory() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  uint16_t* get() const { return data_; }
  bool operator==(std::nullptr_t) const { return data_ == nullptr; }

 private:
  uint16_t* data_ = nullptr;
  size_t bytes_ = 0;
};

// A fresh random 64-bit value, never 0: sequence and session ids are
// capabilities (whoever knows one may use it), so they must not be
// guessable from the ids a client was given.
uint64_t RandomId() {
  uint64_t id = 0;
  while (id == 0) {
    if (getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) {
      std::random_device rd;
      id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
  }
  return id;
}

}  // namespace

struct KvStore::Totals {
  std::atomic<int64_t> appended_rows{0};
  std::atomic<int64_t> evicted_rows{0};
  std::atomic<int64_t> fetches{0};
  std::atomic<int64_t> fetched_rows{0};
};

// One sequence: rows [layer][kv_head][slot][head_dim] for K and V, and for
// each (layer, kv_head) the map between token positions and slots.
//
// Addressing is arithmetic wherever it can be. Until a (layer, head) first
// evicts, its tokens take slots 0, 1, 2, ... in position order, so a
// position's slot is the position itself. Under FIFO a full head gives each
// new token the slot of the token max_tokens before it, so position p lives
// in slot p % max_tokens and the present positions are the last max_tokens
// appended. Under LRU and counter a full head keeps a ring of max_tokens
// slot numbers for the last max_tokens positions (-1: evicted) and a hash
// map for the older positions still present (never more than max_tokens):
// the one case with a lookup, and only for rows older than the window.
// Consecutive positions stored side by side are copied as one block.
//
// Memory follows what is stored, not what was reserved or ever appended: the
// rows are an mmap the kernel commits page by page as rows are written, and
// the bookkeeping of a (layer, head) is one Slot per present token, plus the
// ring and map once it evicts under LRU or counter. Eviction costs O(log
// present) per evicted row: present tokens are kept on a list in position
// order (FIFO takes its head), and the LRU and counter policies keep their
// candidates (the older half) in a min-heap with lazy deletion, built when
// the head first evicts.
//
// Fetches do no bookkeeping on their path: a gather copies rows under a
// reader lock (several gathers of a sequence run at once) and appends its
// plan to the sequence's fetch log, 4 bytes a row. The log is applied to the
// per-token statistics, in order: by an append that evicts or that finds it
// holding half as many positions as rows present, before the statistics are
// read, and by a gather that finds it at four times the rows present.
class KvStore::Sequence {
 public:
  Sequence(SequenceId id, const SequenceGeometry& g, EvictionPolicy policy,
           RowMemory k, RowMemory v)
      : id_(id),
        g_(g),
        policy_(policy),
        row_elems_(g.head_dim),
        row_bytes_(g.head_dim * sizeof(uint16_t)),
        head_elems_(static_cast<size_t>(g.max_tokens) * g.head_dim),
        k_(std::move(k)),
        v_(std::move(v)),
        heads_(static_cast<size_t>(g.n_layers) * g.n_kv_heads),
        layer_length_(g.n_layers, 0) {}

  const SequenceGeometry& geometry() const { return g_; }

  // `published` receives the prefix blocks this append completed (see
  // Attach), for the store to share.
  absl::StatusOr<AppendResult> Append(
      const AppendBlock& b, int32_t max_append_tokens, Totals& totals,
      std::vector<std::shared_ptr<const PrefixBlock>>* published) {
    if (b.first_layer < 0 || b.n_layers <= 0 ||
        b.first_layer > g_.n_layers - b.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layers [", b.first_layer, ", ",
          int64_t{b.first_layer} + b.n_layers, ") are not within the sequence's ",
          g_.n_layers, " layers"));
    }
    if (b.n_tokens <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("n_tokens must be positive, got ", b.n_tokens));
    }
    if (b.prefix_meta_first_block < 0) {
      return absl::InvalidArgumentError("prefix_meta_first_block is negative");
    }
    for (const std::string& meta : b.prefix_meta) {
      if (meta.size() > kMaxPrefixMetaBytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a prefix block annotation of ", meta.size(),
            " bytes exceeds the limit of ", kMaxPrefixMetaBytes));
      }
    }
    if (b.n_tokens > max_append_tokens) {
      return absl::ResourceExhaustedError(
          absl::StrCat("append of ", b.n_tokens, " tokens exceeds the limit of ",
                       max_append_tokens, " per call"));
    }
    const size_t want = static_cast<size_t>(b.n_layers) * b.n_tokens *
                        g_.n_kv_heads * g_.head_dim;
    if (b.k.size() != want || b.v.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "K/V hold ", b.k.size(), "/", b.v.size(), " values; ", b.n_layers,
          " layers x ", b.n_tokens, " tokens x ", g_.n_kv_heads, " KV heads x ",
          g_.head_dim, " dims needs ", want));
    }
    absl::MutexLock lock(&mu_);
    // Judged once the sequence is ours: an append queued behind others on
    // the same sequence whose caller has gone writes nothing.
    if (b.cancelled && b.cancelled()) {
      return absl::CancelledError(
          "the append's caller cancelled it before it ran; nothing appended");
    }
    if (absl::Now() >= b.deadline) {
      return absl::DeadlineExceededError(
          "the append's deadline passed before it ran; nothing appended");
    }
    bool evicts = false;
    for (int32_t l = b.first_layer; l < b.first_layer + b.n_layers; ++l) {
      if (layer_length_[l] >
          std::numeric_limits<int32_t>::max() - b.n_tokens) {
        return absl::OutOfRangeError(absl::StrCat(
            "layer ", l, " would pass 2^31 - 1 positions"));
      }
      evicts = evicts || layer_length_[l] + b.n_tokens > g_.max_tokens;
    }
    // The eviction rules read the fetch statistics: bring them up to date;
    // otherwise apply the log here, off the fetch path, once it holds half
    // as many positions as there are rows (a decoding worker appends every
    // step, so the log stays short).
    if (evicts || LogPositions() > static_cast<size_t>(present_rows_ / 2)) {
      ApplyLogLocked();
    }

    AppendResult result;
    const size_t token_stride = static_cast<size_t>(g_.n_kv_heads) * row_elems_;
    for (int32_t i = 0; i < b.n_layers; ++i) {
      const int32_t layer = b.first_layer + i;
      const uint16_t* k_src =
          b.k.data() + static_cast<size_t>(i) * b.n_tokens * token_stride;
      const uint16_t* v_src =
          b.v.data() + static_cast<size_t>(i) * b.n_tokens * token_stride;
      for (int32_t t = 0; t < b.n_tokens; ++t) {
        const int32_t position = layer_length_[layer];
        for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
          Head& head = HeadAt(layer, h);
          AdvanceCandidates(head, position);
          int32_t slot;
          if (static_cast<int32_t>(head.slots.size()) < g_.max_tokens) {
            slot = static_cast<int32_t>(head.slots.size());
            head.slots.emplace_back();
          } else {
            if (!head.evicting) StartEvicting(head);
            slot = EvictionSlot(head);
            const int32_t victim = head.slots[slot].position;
            Unlink(head, slot);
            ForgetPosition(head, victim, position);
            result.evicted.push_back(EvictedToken{layer, h, victim});
          }
          Slot& s = head.slots[slot];
          s.position = position;
          s.shared = false;
          s.fetch_count = 0;
          s.last_fetch = 0;
          LinkAtTail(head, slot);
          if (head.evicting) RememberPosition(head, position, slot);
          const size_t src = static_cast<size_t>(t) * token_stride +
                             static_cast<size_t>(h) * row_elems_;
          std::memcpy(Row(k_.get(), layer, h, slot), k_src + src, row_bytes_);
          std::memcpy(Row(v_.get(), layer, h, slot), v_src + src, row_bytes_);
        }
        layer_length_[layer] = position + 1;
      }
    }
    evicted_rows_ += static_cast<int64_t>(result.evicted.size());
    present_rows_ += int64_t{b.n_layers} * b.n_tokens * g_.n_kv_heads -
                     static_cast<int64_t>(result.evicted.size());
    // Annotations of blocks still to publish are kept until then.
    const size_t first_pending = attached_.size() + next_pending_;
    for (size_t i = 0; i < b.prefix_meta.size(); ++i) {
      const size_t block = static_cast<size_t>(b.prefix_meta_first_block) + i;
      if (block < first_pending || block >= attached_.size() + pending_.size()) {
        continue;
      }
      pending_meta_.resize(pending_.size());
      pending_meta_[block - attached_.size()] = b.prefix_meta[i];
    }
    CollectPublishable(published);
    totals.appended_rows.fetch_add(
        int64_t{b.n_layers} * b.n_tokens * g_.n_kv_heads,
        std::memory_order_relaxed);
    totals.evicted_rows.fetch_add(static_cast<int64_t>(result.evicted.size()),
                                  std::memory_order_relaxed);
    return result;
  }

  absl::Status Gather(int32_t layer, const FetchPlan& plan,
                      absl::Span<uint16_t> dest, Totals& totals,
                      GatherPool* pool) {
    if (layer < 0 || layer >= g_.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, " is not within the sequence's ", g_.n_layers,
          " layers"));
    }
    IG_RETURN_IF_ERROR(ValidatePlanShape(plan, g_.n_kv_heads));
    const size_t n = plan.indices.size();
    const size_t need = FetchElements(plan, g_.head_dim);
    if (dest.size() < need) {
      return absl::InvalidArgumentError(absl::StrCat(
          "destination holds ", dest.size(), " values; the plan's ", n,
          " rows of K and V need ", need));
    }
    // Split across the pool's threads above kSplitBytes, a range of the
    // plan's rows each (at least kTaskBytes of rows a task).
    constexpr size_t kSplitBytes = size_t{1} << 20;
    constexpr size_t kTaskBytes = size_t{256} << 10;
    constexpr int kMaxTasks = 16;
    const size_t bytes = need * sizeof(uint16_t);
    int tasks = 1;
    if (pool != nullptr && bytes >= kSplitBytes) {
      tasks = static_cast<int>(std::min<size_t>(
          {static_cast<size_t>(pool->threads()), bytes / kTaskBytes,
           static_cast<size_t>(kMaxTasks)}));
    }
    bool apply = false;
    {
      absl::ReaderMutexLock lock(&mu_);
      const int32_t length = layer_length_[layer];
      absl::Status status;
      if (tasks <= 1) {
        status = CopyRows(layer, length, plan, 0, n, dest.data());
      } else {
        std::array<absl::Status, kMaxTasks> statuses;
        pool->Run(tasks, [&](int t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          statuses[t] = CopyRows(layer, length, plan, n * t / tasks,
                                 n * (t + 1) / tasks, dest.data());
        });
        for (int t = 0; t < tasks && status.ok(); ++t) status = statuses[t];
      }
      // Nothing is recorded for a gather that failed.
      if (!status.ok()) return status;
      absl::MutexLock log_lock(&log_mu_);
      LogFetchLocked(layer, plan);
      // A sequence fetched without appends applies its log here.
      apply = log_positions_.size() >
              std::max<size_t>(size_t{1} << 16, 4 * present_rows_);
    }
    totals.fetches.fetch_add(1, std::memory_order_relaxed);
    totals.fetched_rows.fetch_add(static_cast<int64_t>(n),
                                  std::memory_order_relaxed);
    if (apply) {
      absl::MutexLock lock(&mu_);
      ApplyLogLocked();
    }
    return absl::OkStatus();
  }

  // Makes the attached blocks the sequence's first tokens (a fresh
  // sequence: nothing appended yet) and remembers `pending` (the keys of
  // the blocks after them) to publish each of those blocks once every
  // layer's rows of it are appended. Returns the attached tokens.
  int32_t Attach(std::vector<std::shared_ptr<const PrefixBlock>> blocks,
                 int32_t block_tokens, std::vector<PrefixKey> pending) {
    absl::MutexLock lock(&mu_);
    block_tokens_ = block_tokens;
    attached_ = std::move(blocks);
    pending_ = std::move(pending);
    next_pending_ = 0;
    const int32_t tokens =
        static_cast<int32_t>(attached_.size()) * block_tokens;
    attached_tokens_ = tokens;
    for (int32_t layer = 0; layer < g_.n_layers; ++layer) {
      for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
        Head& head = HeadAt(layer, h);
        for (int32_t p = 0; p < tokens; ++p) {
          const int32_t slot = static_cast<int32_t>(head.slots.size());
          head.slots.emplace_back();
          head.slots[slot].position = p;
          head.slots[slot].shared = true;
          LinkAtTail(head, slot);
        }
      }
      layer_length_[layer] = tokens;
    }
    present_rows_ = int64_t{tokens} * g_.n_layers * g_.n_kv_heads;
    return tokens;
  }

  SequenceStats Stats() const {
    SequenceStats s;
    {
      absl::ReaderMutexLock lock(&mu_);
      s.id = id_;
      s.geometry = g_;
      s.layer_lengths = layer_length_;
      s.present_rows = present_rows_;
      s.evicted_rows = evicted_rows_;
      s.bytes_reserved = ReservedBytes(g_);
    }
    absl::MutexLock lock(&log_mu_);
    s.fetches = fetches_;
    s.fetched_rows = fetched_rows_;
    return s;
  }

  absl::StatusOr<std::vector<TokenFetchStats>> TokenStats(int32_t layer,
                                                          int32_t kv_head) {
    if (layer < 0 || layer >= g_.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer, " is not within the sequence's ", g_.n_layers,
          " layers"));
    }
    if (kv_head < 0 || kv_head >= g_.n_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KV head ", kv_head, " is not within the sequence's ", g_.n_kv_heads,
          " KV heads"));
    }
    absl::MutexLock lock(&mu_);
    ApplyLogLocked();
    const Head& head = HeadAt(layer, kv_head);
    std::vector<TokenFetchStats> out;
    out.reserve(head.slots.size());
    for (int32_t slot = head.oldest; slot >= 0; slot = head.slots[slot].next) {
      const Slot& s = head.slots[slot];
      out.push_back(TokenFetchStats{s.position, s.fetch_count, s.last_fetch});
    }
    return out;
  }

 private:
  // One occupied slot of a (layer, KV head).
  struct Slot {
    int32_t position = -1;
    int32_t prev = -1;  // the slot of the next older present token; -1: none
    int32_t next = -1;  // the slot of the next newer present token; -1: none
    int64_t fetch_count = 0;
    uint64_t last_fetch = 0;  // 0 = never
    // The row lives in an attached prefix block (position / block_tokens_),
    // not in k_/v_; cleared when the slot is reused.
    bool shared = false;
    // On dirty_ (ApplyLogLocked): its candidate key changed.
    bool dirty = false;
  };
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
  // Bookkeeping of one (layer, KV head): O(present) entries, never more
  // than max_tokens (the candidate heap up to about twice that).
  struct Head {
    std::vector<Slot> slots;  // [present]; grows to max_tokens, then reused
    // Set at the head's first eviction; until then slot == position.
    bool evicting = false;
    // LRU and counter, once evicting: ring[p % max_tokens] is the slot of
    // position p for the last max_tokens positions (-1: evicted), and
    // `older` the slots of the present positions before them.
    std::vector<int32_t> ring;
    absl::flat_hash_map<int32_t, int32_t> older;
    int32_t oldest = -1;  // present tokens by position: a list from here...
    int32_t newest = -1;  // ...to here
    // LRU and counter: every present token below this position is a
    // candidate (the older half of the last append's position);
    // `first_young` is the oldest non-candidate. Once the head evicts, each
    // candidate has one live entry in `heap`.
    int32_t candidates_below = 0;
    int32_t first_young = -1;
    int32_t candidates = 0;
    std::vector<Candidate> heap;
  };
  // One gather in the fetch log; its plan is at log_positions_[begin...]:
  // n_kv_heads + 1 head offsets, then the indices.
  struct LoggedFetch {
    uint64_t clock;
    int32_t layer;
    size_t begin;
  };
  // The K and V rows of a present position, and how many positions from it
  // on are stored one after the other from there (at least 1).
  struct RowRef {
    const uint16_t* k = nullptr;  // null: the position was evicted
    const uint16_t* v = nullptr;
    int32_t run = 0;
  };

  Head& HeadAt(int32_t layer, int32_t h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return heads_[static_cast<size_t>(layer) * g_.n_kv_heads + h];
  }
  const Head& HeadAt(int32_t layer, int32_t h) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return heads_[static_cast<size_t>(layer) * g_.n_kv_heads + h];
  }
  uint16_t* Row(uint16_t* base, int32_t layer, int32_t h, int32_t slot) const {
    return base +
           (static_cast<size_t>(layer) * g_.n_kv_heads + h) * head_elems_ +
           static_cast<size_t>(slot) * row_elems_;
  }

  // The slot of `pos` (0 <= pos < length, the layer's length) in `head`;
  // -1 when it was evicted.
  int32_t SlotOf(const Head& head, int32_t pos, int32_t length) const {
    if (!head.evicting) return pos;
    const int32_t window = length - g_.max_tokens;
    if (policy_ == EvictionPolicy::kFifo) {
      return pos >= window ? pos % g_.max_tokens : -1;
    }
    if (pos >= window) return head.ring[pos % g_.max_tokens];
    auto it = head.older.find(pos);
    return it == head.older.end() ? -1 : it->second;
  }

  // Where the rows of `pos` (0 <= pos < length) of (layer, h) are.
  RowRef Locate(const Head& head, int32_t layer, int32_t h, int32_t pos,
                int32_t length) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    RowRef r;
    const int32_t slot = SlotOf(head, pos, length);
    if (slot < 0) return r;
    if (pos < attached_tokens_ && head.slots[slot].shared) {
      const PrefixBlock& b = *attached_[pos / block_tokens_];
      const size_t at = b.RowOffset(layer, h, pos % block_tokens_);
      r.k = b.k.data() + at;
      r.v = b.v.data() + at;
      // The rest of the block, while slot == position.
      r.run = head.evicting && policy_ != EvictionPolicy::kFifo
                  ? 1
                  : block_tokens_ - pos % block_tokens_;
      return r;
    }
    r.k = Row(k_.get(), layer, h, slot);
    r.v = Row(v_.get(), layer, h, slot);
    if (!head.evicting) {
      r.run = length - pos;
    } else if (policy_ == EvictionPolicy::kFifo) {
      r.run = std::min(length - pos, g_.max_tokens - slot);
    } else {
      r.run = 1;
    }
    return r;
  }

  // Copies the rows of plan indices [begin, end) (any heads) into dest,
  // laid out as the whole plan's destination.
  absl::Status CopyRows(int32_t layer, int32_t length, const FetchPlan& plan,
                        size_t begin, size_t end, uint16_t* dest) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const size_t n = plan.indices.size();
    if (begin >= end) return absl::OkStatus();
    // The head of index `begin`: the last h with head_offsets[h] <= begin.
    int32_t h =
        static_cast<int32_t>(std::upper_bound(plan.head_offsets.begin(),
                                              plan.head_offsets.end(),
                                              static_cast<int32_t>(begin)) -
                             plan.head_offsets.begin()) -
        1;
    size_t j = begin;
    while (j < end) {
      const size_t head_end =
          std::min(end, static_cast<size_t>(plan.head_offsets[h + 1]));
      if (j < head_end) {
        IG_RETURN_IF_ERROR(CopyHead(layer, h, length, plan.indices, j, head_end,
                                    dest + j * row_elems_,
                                    dest + (n + j) * row_elems_));
      }
      j = head_end;
      ++h;
    }
    return absl::OkStatus();
  }

  // Copies the rows of indices [j, end) of head h to k_out and v_out.
  absl::Status CopyHead(int32_t layer, int32_t h, int32_t length,
                        absl::Span<const int32_t> indices, size_t j, size_t end,
                        uint16_t* k_out, uint16_t* v_out) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const Head& head = HeadAt(layer, h);
    // Scattered rows: fetch the row kPrefetch indices ahead while this one
    // is copied (where its place is arithmetic).
    constexpr size_t kPrefetch = 8;
    const bool arithmetic = !head.evicting || policy_ == EvictionPolicy::kFifo;
    while (j < end) {
      const int32_t pos = indices[j];
      if (pos < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "negative position ", pos, " for layer ", layer, " head ", h));
      }
      if (pos >= length) {
        return absl::OutOfRangeError(absl::StrCat("position ", pos,
                                                  " is beyond layer ", layer,
                                                  "'s length ", length));
      }
      const RowRef r = Locate(head, layer, h, pos, length);
      if (r.k == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("position ", pos, " of layer ", layer, " head ", h,
                         " was evicted"));
      }
      // Following indices that name the next positions, stored next.
      size_t m = 1;
      const size_t most = std::min(end - j, static_cast<size_t>(r.run));
      while (m < most && indices[j + m] == pos + static_cast<int32_t>(m)) ++m;
      if (m == 1) {
        if (arithmetic && j + kPrefetch < end) {
          const int32_t ahead = indices[j + kPrefetch];
          if (ahead >= attached_tokens_ && ahead < length) {
            const int32_t slot = head.evicting ? ahead % g_.max_tokens : ahead;
            Prefetch(Row(k_.get(), layer, h, slot));
            Prefetch(Row(v_.get(), layer, h, slot));
          }
        }
        CopyRow(k_out, r.k);
        CopyRow(v_out, r.v);
      } else {
        std::memcpy(k_out, r.k, m * row_bytes_);
        std::memcpy(v_out, r.v, m * row_bytes_);
      }
      k_out += m * row_elems_;
      v_out += m * row_elems_;
      j += m;
    }
    return absl::OkStatus();
  }

  // Asks for every cache line of the row at `p`.
  void Prefetch(const uint16_t* p) const {
    const char* c = reinterpret_cast<const char*>(p);
    for (size_t off = 0; off < row_bytes_; off += 64) {
      __builtin_prefetch(c + off, /*rw=*/0, /*locality=*/0);
    }
  }

  // One row; the common widths as fixed-size copies the compiler inlines.
  void CopyRow(uint16_t* dst, const uint16_t* src) const {
    switch (row_bytes_) {
      case 128:
        std::memcpy(dst, src, 128);
        return;
      case 256:
        std::memcpy(dst, src, 256);
        return;
      case 512:
        std::memcpy(dst, src, 512);
        return;
      default:
        std::memcpy(dst, src, row_bytes_);
    }
  }

  size_t LogPositions() const {
    absl::MutexLock lock(&log_mu_);
    return log_positions_.size();
  }

  // Appends a successful gather's plan to the fetch log.
  void LogFetchLocked(int32_t layer, const FetchPlan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(log_mu_) {
    log_.push_back(LoggedFetch{++clock_, layer, log_positions_.size()});
    log_positions_.insert(log_positions_.end(), plan.head_offsets.begin(),
                          plan.head_offsets.end());
    log_positions_.insert(log_positions_.end(), plan.indices.begin(),
                          plan.indices.end());
    ++fetches_;
    fetched_rows_ += static_cast<int64_t>(plan.indices.size());
  }

  // Applies the fetch log to the per-token statistics, in the order of the
  // gathers, and refreshes the heap entries of the candidates they touched.
  // Every logged position is present: nothing was evicted since its gather
  // (an append that evicts applies the log first).
  void ApplyLogLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
        Head& head = HeadAt(f.layer, h);
        const bool heap = head.evicting && policy_ != EvictionPolicy::kFifo;
        for (int32_t j = offsets[h]; j < offsets[h + 1]; ++j) {
          const int32_t pos = indices[j];
          const int32_t slot = SlotOf(head, pos, length);
          Slot& s = head.slots[slot];
          ++s.fetch_count;
          s.last_fetch = f.clock;
          if (heap && pos < head.candidates_below && !s.dirty) {
            s.dirty = true;
            dirty_.push_back({f.layer * g_.n_kv_heads + h, slot});
          }
        }
      }
    }
    // A candidate's key changed: its heap entry is stale, push a fresh one
    // (the stale one is skipped when it surfaces).
    for (const auto& [head_index, slot] : dirty_) {
      Head& head = heads_[head_index];
      head.slots[slot].dirty = false;
      PushCandidate(head, slot);
    }
    dirty_.clear();
    applying_.clear();
    applying_positions_.clear();
  }

  // Where the K (v = false) or V row of `slot` is: its attached block's
  // row, or the sequence's own.
  const uint16_t* RowOf(bool v, int32_t layer, int32_t h, int32_t slot,
                        const Slot& s) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (s.shared) {
      const PrefixBlock& b = *attached_[s.position / block_tokens_];
      return (v ? b.v.data() : b.k.data()) +
             b.RowOffset(layer, h, s.position % block_tokens_);
    }
    return Row(v ? v_.get() : k_.get(), layer, h, slot);
  }

  // Publishes the pending blocks every layer now holds in full: each
  // becomes a PrefixBlock (a copy of its rows) in `out`. A block with an
  // evicted row ends publishing: its later keys name rows no longer here.
  void CollectPublishable(std::vector<std::shared_ptr<const PrefixBlock>>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (next_pending_ >= pending_.size()) return;
    int32_t complete = layer_length_[0];
    for (int32_t len : layer_length_) complete = std::min(complete, len);
    const int32_t first_block = static_cast<int32_t>(attached_.size());
    while (next_pending_ < pending_.size()) {
      const int32_t block = first_block + static_cast<int32_t>(next_pending_);
      const int32_t begin = block * block_tokens_;
      if (begin + block_tokens_ > complete) return;
      auto b = std::make_shared<PrefixBlock>();
      b->key = pending_[next_pending_];
      b->format = g_;
      b->format.max_tokens = 0;
      b->tokens = block_tokens_;
      const size_t values = static_cast<size_t>(g_.n_layers) * g_.n_kv_heads *
                            block_tokens_ * row_elems_;
      b->k.resize(values);
      b->v.resize(values);
      for (int32_t layer = 0; layer < g_.n_layers; ++layer) {
        for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
          const Head& head = HeadAt(layer, h);
          for (int32_t t = 0; t < block_tokens_; ++t) {
            const int32_t slot = SlotOf(head, begin + t, layer_length_[layer]);
            if (slot < 0) {  // evicted
              next_pending_ = pending_.size();
              return;
            }
            const Slot& s = head.slots[slot];
            const size_t at = b->RowOffset(layer, h, t);
            std::memcpy(&b->k[at], RowOf(false, layer, h, slot, s), row_bytes_);
            std::memcpy(&b->v[at], RowOf(true, layer, h, slot, s), row_bytes_);
          }
        }
      }
      if (next_pending_ < pending_meta_.size()) {
        b->meta = std::move(pending_meta_[next_pending_]);
      }
      out->push_back(std::move(b));
      ++next_pending_;
    }
  }

  // What the LRU or counter rule ranks a candidate by (smaller: evicted
  // first; ties go to the smaller position).
  uint64_t Key(const Slot& s) const {
    return policy_ == EvictionPolicy::kCounter
               ? static_cast<uint64_t>(s.fetch_count)
               : s.last_fetch;
  }

  void LinkAtTail(Head& head, int32_t slot) {
    Slot& s = head.slots[slot];
    s.prev = head.newest;
    s.next = -1;
    if (head.newest >= 0) {
      head.slots[head.newest].next = slot;
    } else {
      head.oldest = slot;
    }
    head.newest = slot;
    if (head.first_young < 0) head.first_young = slot;
  }

  void Unlink(Head& head, int32_t slot) {
    Slot& s = head.slots[slot];
    if (s.position < head.candidates_below) {
      --head.candidates;
    } else if (head.first_young == slot) {
      head.first_young = s.next;
    }
    if (s.prev >= 0) {
      head.slots[s.prev].next = s.next;
    } else {
      head.oldest = s.next;
    }
    if (s.next >= 0) {
      head.slots[s.next].prev = s.prev;
    } else {
      head.newest = s.prev;
    }
    s.prev = s.next = -1;
  }

  // The head is full and about to evict for the first time: every slot
  // still holds its own position (slot == position, positions [0,
  // max_tokens)). LRU and counter start their ring and candidate heap.
  void StartEvicting(Head& head) {
    head.evicting = true;
    if (policy_ == EvictionPolicy::kFifo) return;
    head.ring.resize(g_.max_tokens);
    for (int32_t p = 0; p < g_.max_tokens; ++p) head.ring[p] = p;
    RebuildHeap(head);
  }

  // `victim` left an evicting head while `position` is appended (the
  // layer's length before it).
  void ForgetPosition(Head& head, int32_t victim, int32_t position) {
    if (policy_ == EvictionPolicy::kFifo) return;
    if (victim >= position - g_.max_tokens) {
      head.ring[victim % g_.max_tokens] = -1;
    } else {
      head.older.erase(victim);
    }
  }

  // `position` took `slot` of an evicting head: it enters the ring, and the
  // position max_tokens before it, if still present, moves to `older`.
  void RememberPosition(Head& head, int32_t position, int32_t slot) {
    if (policy_ == EvictionPolicy::kFifo) return;
    int32_t& entry = head.ring[position % g_.max_tokens];
    if (entry >= 0) head.older[position - g_.max_tokens] = entry;
    entry = slot;
  }

  void PushCandidate(Head& head, int32_t slot) {
    const Slot& s = head.slots[slot];
    head.heap.push_back(Candidate{Key(s), s.position, slot});
    std::push_heap(head.heap.begin(), head.heap.end());
    // Stale entries are dropped once they outnumber the live ones, so the
    // heap stays within about twice the present tokens.
    if (head.heap.size() > 2 * static_cast<size_t>(head.candidates) + 64) {
      RebuildHeap(head);
    }
  }

  void RebuildHeap(Head& head) {
    head.heap.clear();
    for (int32_t slot = head.oldest; slot >= 0 && slot != head.first_young;
         slot = head.slots[slot].next) {
      const Slot& s = head.slots[slot];
      head.heap.push_back(Candidate{Key(s), s.position, slot});
    }
    std::make_heap(head.heap.begin(), head.heap.end());
  }

  // Before `position` is appended: the present tokens below position / 2
  // become LRU / counter candidates (on the heap once the head evicts).
  void AdvanceCandidates(Head& head, int32_t position) {
    if (policy_ == EvictionPolicy::kFifo) return;
    head.candidates_below = position / 2;
    while (head.first_young >= 0 &&
           head.slots[head.first_young].position < head.candidates_below) {
      const int32_t slot = head.first_young;
      head.first_young = head.slots[slot].next;
      ++head.candidates;
      if (head.evicting) PushCandidate(head, slot);
    }
  }

  // The slot of the token to evict from a full head (the rules of
  // EvictionPolicy, kv_types.h).
  int32_t EvictionSlot(Head& head) {
    if (policy_ != EvictionPolicy::kFifo) {
      while (!head.heap.empty()) {
        std::pop_heap(head.heap.begin(), head.heap.end());
        const Candidate c = head.heap.back();
        head.heap.pop_back();
        const Slot& s = head.slots[c.slot];
        if (s.position == c.position && Key(s) == c.key &&
            c.position < head.candidates_below) {
          return c.slot;
        }
      }
    }
    return head.oldest;
  }

  const SequenceId id_;
  const SequenceGeometry g_;
  const EvictionPolicy policy_;
  const size_t row_elems_;   // head_dim
  const size_t row_bytes_;   // head_dim * 2
  const size_t head_elems_;  // max_tokens * head_dim
  // The rows never move; their contents and all below change under mu_.
  const RowMemory k_;
  const RowMemory v_;

  mutable absl::Mutex mu_;
  std::vector<Head> heads_ ABSL_GUARDED_BY(mu_);  // [layer * n_kv_heads + h]
  std::vector<int32_t> layer_length_ ABSL_GUARDED_BY(mu_);
  int64_t present_rows_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evicted_rows_ ABSL_GUARDED_BY(mu_) = 0;
  // ApplyLogLocked's scratch, kept for its capacity.
  std::vector<LoggedFetch> applying_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> applying_positions_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int32_t, int32_t>> dirty_ ABSL_GUARDED_BY(mu_);
  // Shared prefix blocks this sequence reads its first tokens from, and
  // the keys of the blocks it will publish (Attach).
  int32_t block_tokens_ ABSL_GUARDED_BY(mu_) = 1;
  int32_t attached_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::shared_ptr<const PrefixBlock>> attached_
      ABSL_GUARDED_BY(mu_);
  std::vector<PrefixKey> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pending_meta_ ABSL_GUARDED_BY(mu_);
  size_t next_pending_ ABSL_GUARDED_BY(mu_) = 0;

  // The fetch log (taken after mu_, held briefly).
  mutable absl::Mutex log_mu_ ABSL_ACQUIRED_AFTER(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(log_mu_) = 0;  // one tick per Gather
  int64_t fetches_ ABSL_GUARDED_BY(log_mu_) = 0;
  int64_t fetched_rows_ ABSL_GUARDED_BY(log_mu_) = 0;
  std::vector<LoggedFetch> log_ ABSL_GUARDED_BY(log_mu_);
  std::vector<int32_t> log_positions_ ABSL_GUARDED_BY(log_mu_);
};

KvStore::KvStore(const KvStoreOptions& options)
    : options_(options),
      totals_(new Totals),
      prefix_cache_(new PrefixCache(options.prefix_cache_bytes)),
      gather_pool_(
          new GatherPool(GatherPool::Resolve(options.gather_threads))) {}

KvStore::~KvStore() = default;

absl::StatusOr<SequenceId> KvStore::Open(const SequenceGeometry& geometry) {
  return Open(geometry, 0);
}

absl::StatusOr<SequenceId> KvStore::Open(const SequenceGeometry& geometry,
                                         SessionId session) {
  IG_RETURN_IF_ERROR(ValidateGeometry(geometry));
  const int64_t bytes = ReservedBytes(geometry);
  SequenceId id;
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  {
    absl::MutexLock lock(&mu_);
    Session* owner = nullptr;
    if (session != 0) {
      IG_ASSIGN_OR_RETURN(owner, LiveSessionLocked(session, Now(), &freed));
    }
    if (static_cast<int64_t>(sequences_.size()) >= options_.max_sequences) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the store already holds its limit of ",
                       options_.max_sequences, " sequences"));
    }
    if (options_.capacity_bytes > 0 &&
        bytes > options_.capacity_bytes - bytes_reserved_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the sequence needs ", bytes, " bytes; the store has ",
          options_.capacity_bytes - bytes_reserved_, " of its ",
          options_.capacity_bytes, " left"));
    }
    bytes_reserved_ += bytes;
    do {
      id = RandomId();
    } while (sequences_.contains(id));
    // A placeholder keeps the count and the id taken while the rows are
    // allocated outside the lock.
    sequences_[id] = nullptr;
    if (owner != nullptr) {
      owner->sequences[id] = bytes;
      owner_[id] = session;
    }
  }

  RowMemory k(static_cast<size_t>(bytes / 2));
  RowMemory v(static_cast<size_t>(bytes / 2));
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    // The session expired while the rows were allocated; the expiry has
    // released the reservation.
    return absl::NotFoundError(absl::StrCat(
        "session ", session, " expired while sequence ", id, " was opened"));
  }
  if (k == nullptr || v == nullptr) {
    sequences_.erase(it);
    bytes_reserved_ -= bytes;
    ForgetOwnerLocked(id);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of rows"));
  }
  // The bookkeeping is bounded by ValidateGeometry, but an allocation may
  // still fail: it must not escape (an RPC would see UNKNOWN) nor leave the
  // placeholder and its reservation behind.
  std::shared_ptr<Sequence> sequence;
  try {
    sequence = std::make_shared<Sequence>(id, geometry, options_.eviction,
                                          std::move(k), std::move(v));
  } catch (const std::bad_alloc&) {
  }
  if (sequence == nullptr) {
    sequences_.erase(it);
    bytes_reserved_ -= bytes;
    ForgetOwnerLocked(id);
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the bookkeeping of ", geometry.n_layers, " x ",
        geometry.n_kv_heads, " (layer, head) pairs"));
  }
  it->second = std::move(sequence);
  return id;
}

absl::Time KvStore::Now() const {
  return options_.clock ? options_.clock() : absl::Now();
}

bool KvStore::Expired(const Session& session, absl::Time now) const {
  return options_.lease_timeout > absl::ZeroDuration() &&
         now - session.renewed > options_.lease_timeout;
}

void KvStore::ForgetOwnerLocked(SequenceId seq) {
  auto owner = owner_.find(seq);
  if (owner == owner_.end()) return;
  auto session = sessions_.find(owner->second);
  if (session != sessions_.end()) session->second.sequences.erase(seq);
  owner_.erase(owner);
}

absl::StatusOr<SessionId> KvStore::OpenSession() {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store already holds its limit of ", options_.max_sessions,
        " sessions"));
  }
  SessionId id = RandomId();
  while (sessions_.contains(id)) id = RandomId();
  sessions_[id].renewed = Now();
  return id;
}

absl::Status KvStore::RenewSession(SessionId session) {
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  IG_ASSIGN_OR_RETURN(Session * live, LiveSessionLocked(session, now, &freed));
  live->renewed = now;
  return absl::OkStatus();
}

absl::StatusOr<KvStore::Session*> KvStore::LiveSessionLocked(
    SessionId id, absl::Time now,
    std::vector<std::shared_ptr<Sequence>>* freed) {
  auto it = sessions_.find(id);
  if (it != sessions_.end() && Expired(it->second, now)) {
    ExpireLocked(id, now, freed);
    it = sessions_.end();
  }
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "no session ", id, " (its lease expired, or the server restarted)"));
  }
  return &it->second;
}

std::vector<ExpiredSession> KvStore::ExpireSessions() {
  std::vector<ExpiredSession> expired;
  if (options_.lease_timeout <= absl::ZeroDuration()) return expired;
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  std::vector<SessionId> ids;
  for (const auto& [id, session] : sessions_) {
    if (Expired(session, now)) ids.push_back(id);
  }
  for (SessionId id : ids) expired.push_back(ExpireLocked(id, now, &freed));
  return expired;
}

absl::Status KvStore::CloseSession(SessionId session) {
  std::vector<std::shared_ptr<Sequence>> freed;  // released after mu_
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  IG_RETURN_IF_ERROR(LiveSessionLocked(session, now, &freed).status());
  EndSessionLocked(session, now, &freed);
  return absl::OkStatus();
}

ExpiredSession KvStore::ExpireLocked(
    SessionId id, absl::Time now,
    std::vector<std::shared_ptr<Sequence>>* freed) {
  ExpiredSession out = EndSessionLocked(id, now, freed);
  if (out.session != 0) {
    ++expired_sessions_;
    expired_sequences_ += out.sequences;
  }
  return out;
}

ExpiredSession KvStore::EndSessionLocked(
    SessionId id, absl::Time now,
    std::vector<std::shared_ptr<Sequence>>* freed) {
  ExpiredSession out;
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return out;
  out.session = id;
  out.idle = now - it->second.renewed;
  for (const auto& [seq, bytes] : it->second.sequences) {
    auto s = sequences_.find(seq);
    if (s == sequences_.end()) continue;
    // A placeholder (rows still being allocated) goes too: Open notices.
    if (s->second != nullptr) freed->push_back(std::move(s->second));
    sequences_.erase(s);
    owner_.erase(seq);
    bytes_reserved_ -= bytes;
    out.bytes_freed += bytes;
    ++out.sequences;
  }
  sessions_.erase(it);
  return out;
}

absl::StatusOr<std::shared_ptr<KvStore::Sequence>> KvStore::Find(
    SequenceId seq) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || it->second == nullptr) {
    return absl::NotFoundError(absl::StrCat("no open sequence ", seq));
  }
  return it->second;
}

absl::StatusOr<AppendResult> KvStore::Append(SequenceId seq,
                                             const AppendBlock& block) {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  std::vector<std::shared_ptr<const PrefixBlock>> published;
  absl::StatusOr<AppendResult> result =
      s->Append(block, options_.max_append_tokens, *totals_, &published);
  for (auto& b : published) prefix_cache_->Insert(std::move(b));
  return result;
}

absl::StatusOr<OpenedSequence> KvStore::Open(const SequenceGeometry& geometry,
                                             SessionId session,
                                             const PrefixRequest& prefix) {
  if (!prefix.keys.empty() &&
      (prefix.block_tokens <= 0 || prefix.block_tokens > kMaxBlockTokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix block_tokens must be in [1, ", kMaxBlockTokens,
                     "], got ", prefix.block_tokens));
  }
  IG_ASSIGN_OR_RETURN(const SequenceId id, Open(geometry, session));
  OpenedSequence opened;
  opened.id = id;
  if (prefix.keys.empty()) return opened;
  // Blocks past the sequence's capacity could not all stay: neither
  // attached nor published.
  const size_t usable = std::min(
      prefix.keys.size(),
      static_cast<size_t>(geometry.max_tokens / prefix.block_tokens));
  absl::Span<const PrefixKey> keys(prefix.keys.data(), usable);
  std::vector<std::shared_ptr<const PrefixBlock>> blocks =
      prefix_cache_->capacity_bytes() > 0
          ? prefix_cache_->Attach(geometry, prefix.block_tokens, keys)
          : std::vector<std::shared_ptr<const PrefixBlock>>();
  std::vector<PrefixKey> pending;
  if (prefix_cache_->capacity_bytes() > 0) {
    pending.assign(keys.begin() + blocks.size(), keys.end());
  }
  for (const auto& b : blocks) opened.prefix_meta.push_back(b->meta);
  auto s = Find(id);
  if (!s.ok()) return s.status();  // its session expired meanwhile
  opened.cached_tokens = (*s)->Attach(std::move(blocks), prefix.block_tokens,
                                      std::move(pending));
  return opened;
}

absl::Status KvStore::Gather(SequenceId seq, int32_t layer,
                             const FetchPlan& plan, absl::Span<uint16_t> dest) {
  if (static_cast<int64_t>(plan.indices.size()) > options_.max_fetch_indices) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "plan of ", plan.indices.size(), " indices exceeds the limit of ",
        options_.max_fetch_indices));
  }
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->Gather(layer, plan, dest, *totals_, gather_pool_.get());
}

absl::StatusOr<std::shared_ptr<KvStore::Sequence>> KvStore::FindOwned(
    SequenceId seq, SessionId session) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  auto owner = owner_.find(seq);
  if (it == sequences_.end() || it->second == nullptr ||
      (owner != owner_.end() && owner->second != session)) {
    return absl::NotFoundError(absl::StrCat("no open sequence ", seq));
  }
  return it->second;
}

absl::Status KvStore::CheckOwner(SequenceId seq, SessionId session) const {
  return FindOwned(seq, session).status();
}

absl::Status KvStore::Close(SequenceId seq) {
  std::shared_ptr<Sequence> s;  // freed after the lock is released
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || it->second == nullptr) {
    return absl::NotFoundError(absl::StrCat("no open sequence ", seq));
  }
  s = std::move(it->second);
  sequences_.erase(it);
  bytes_reserved_ -= ReservedBytes(s->geometry());
  ForgetOwnerLocked(seq);
  return absl::OkStatus();
}

absl::StatusOr<SequenceGeometry> KvStore::Geometry(SequenceId seq) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->geometry();
}

absl::StatusOr<SequenceGeometry> KvStore::Geometry(SequenceId seq,
                                                   SessionId session) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, FindOwned(seq, session));
  return s->geometry();
}

absl::StatusOr<SequenceStats> KvStore::GetSequenceStats(SequenceId seq) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->Stats();
}

StoreStats KvStore::GetStoreStats() const {
  StoreStats s;
  {
    absl::ReaderMutexLock lock(&mu_);
    s.open_sequences = static_cast<int32_t>(sequences_.size());
    s.bytes_reserved = bytes_reserved_;
    s.open_sessions = static_cast<int32_t>(sessions_.size());
    s.expired_sessions = expired_sessions_;
    s.expired_sequences = expired_sequences_;
  }
  s.lease_timeout_ms = absl::ToInt64Milliseconds(options_.lease_timeout);
  s.max_sequences = options_.max_sequences;
  s.capacity_bytes = options_.capacity_bytes;
  s.eviction = options_.eviction;
  s.appended_rows = totals_->appended_rows.load(std::memory_order_relaxed);
  s.evicted_rows = totals_->evicted_rows.load(std::memory_order_relaxed);
  s.fetches = totals_->fetches.load(std::memory_order_relaxed);
  s.fetched_rows = totals_->fetched_rows.load(std::memory_order_relaxed);
  const PrefixCacheStats p = prefix_cache_->Stats();
  s.prefix_blocks = p.blocks;
  s.prefix_bytes = p.bytes;
  s.prefix_capacity_bytes = p.capacity_bytes;
  s.prefix_hit_tokens = p.hit_tokens;
  s.prefix_lookup_tokens = p.lookup_tokens;
  s.prefix_evicted_blocks = p.evicted_blocks;
  return s;
}

absl::StatusOr<std::vector<TokenFetchStats>> KvStore::GetTokenStats(
    SequenceId seq, int32_t layer, int32_t kv_head) const {
  IG_ASSIGN_OR_RETURN(std::shared_ptr<Sequence> s, Find(seq));
  return s->TokenStats(layer, kv_head);
}

}  // namespace infinigen::kv_memory_service
