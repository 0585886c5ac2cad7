#include "kv_memory_service/store/stored_sequence.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace infinigen::kv_memory_service {

RowMemory::RowMemory(size_t bytes,
                     std::shared_ptr<std::atomic<int64_t>> memfds,
                     int64_t max_memfds)
    : bytes_(bytes == 0 ? 1 : bytes) {
  if (memfds != nullptr && memfds->fetch_add(1) < max_memfds) {
    // A sparse memfd: pages are taken as rows are written, as below. Sealed
    // once the node holds its own writable mapping, before any descriptor
    // can leave the node: whoever holds one, even reopened writable
    // through /proc, can neither write, resize nor punch holes, so the node
    // never faults on its own rows. Without the seals the rows stay
    // private.
    const int fd =
        memfd_create("infinigen-kv-rows", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes_)) == 0) {
      void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_NORESERVE, fd, 0);
      if (p != MAP_FAILED) {
        if (fcntl(fd, F_ADD_SEALS, kRowSeals) == 0) {
          data_ = static_cast<uint16_t*>(p);
          fd_ = fd;
          memfds_ = std::move(memfds);
          return;
        }
        munmap(p, bytes_);
      }
    }
    if (fd >= 0) close(fd);
  }
  if (memfds != nullptr) memfds->fetch_sub(1);
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  data_ = p == MAP_FAILED ? nullptr : static_cast<uint16_t*>(p);
}

RowMemory::~RowMemory() {
  if (data_ != nullptr) munmap(data_, bytes_);
  if (fd_ >= 0) {
    close(fd_);
    memfds_->fetch_sub(1);
  }
}

StoredSequence::StoredSequence(SequenceId id, const SequenceGeometry& g,
                               EvictionPolicy policy, RowMemory k, RowMemory v)
    : id_(id),
      g_(g),
      policy_(policy),
      row_elems_(g.head_dim),
      row_bytes_(g.head_dim * sizeof(uint16_t)),
      head_elems_(static_cast<size_t>(g.max_tokens) * g.head_dim),
      k_(std::move(k)),
      v_(std::move(v)),
      layer_length_(g.n_layers, 0) {
  heads_.reserve(static_cast<size_t>(g.n_layers) * g.n_kv_heads);
  for (int64_t i = 0; i < int64_t{g.n_layers} * g.n_kv_heads; ++i) {
    heads_.emplace_back(policy, g.max_tokens);
  }
}

absl::StatusOr<AppendResult> StoredSequence::Append(
    const AppendBlock& b, int32_t max_append_tokens, StoreTotals& totals,
    std::vector<std::shared_ptr<const PrefixBlock>>* published,
    ThreadPool* pool) {
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
  // An annotation says something of its block's rows: at most twice the
  // bytes they hold (InfiniGen's column sums of one-token blocks, ranked by
  // q and k, are that), so that what waits to be published stays within
  // twice what the sequence's reservation covers.
  const size_t block_bytes = 2 * static_cast<size_t>(g_.n_layers) *
                             g_.n_kv_heads * block_tokens_ * row_bytes_;
  for (const std::string& meta : b.prefix_meta) {
    if (meta.size() > 2 * block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a prefix block annotation of ", meta.size(),
          " bytes exceeds twice its block's ", block_bytes, " bytes of rows"));
    }
  }
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
  // Whether a head of the block's layers evicts (or has): then tokens are
  // placed one at a time, in order.
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
  std::vector<int32_t>& run = run_slots_;  // [h]: the head's first new slot
  for (int32_t i = 0; i < b.n_layers; ++i) {
    const int32_t layer = b.first_layer + i;
    const int32_t first = layer_length_[layer];
    const uint16_t* k_src =
        b.k.data() + static_cast<size_t>(i) * b.n_tokens * token_stride;
    const uint16_t* v_src =
        b.v.data() + static_cast<size_t>(i) * b.n_tokens * token_stride;
    auto copy_row = [&](int32_t t, int32_t h, int32_t slot) {
      const size_t src = static_cast<size_t>(t) * token_stride +
                         static_cast<size_t>(h) * row_elems_;
      std::memcpy(Row(k_.get(), layer, h, slot), k_src + src, row_bytes_);
      std::memcpy(Row(v_.get(), layer, h, slot), v_src + src, row_bytes_);
    };
    if (evicts) {
      // Token by token, every head: the victims in that order.
      for (int32_t t = 0; t < b.n_tokens; ++t) {
        for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
          int32_t victim;
          const int32_t slot = HeadAt(layer, h).Place(first + t, &victim);
          if (victim >= 0) {
            result.evicted.push_back(EvictedToken{layer, h, victim});
          }
          copy_row(t, h, slot);
        }
      }
    } else {
      // Each head's new slots are one run, placed at once. The block is
      // token-major and the rows head-major: a transpose, done a tile of
      // tokens at a time so that the tile's source rows and each head's
      // destination rows stay within the TLB's reach (one token at a time,
      // every row of a long block lands on a page of its own).
      constexpr int32_t kTileTokens = 64;
      run.resize(g_.n_kv_heads);
      for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
        run[h] = HeadAt(layer, h).PlaceRun(first, b.n_tokens);
      }
      auto copy_heads = [&](int32_t h0, int32_t h1) {
        for (int32_t t0 = 0; t0 < b.n_tokens; t0 += kTileTokens) {
          const int32_t t1 = std::min(b.n_tokens, t0 + kTileTokens);
          for (int32_t h = h0; h < h1; ++h) {
            for (int32_t t = t0; t < t1; ++t) copy_row(t, h, run[h] + t);
          }
        }
      };
      // A prefill's layer (hundreds of MiB at long contexts) is split
      // across the pool's threads, a range of KV heads each: their rows
      // are disjoint, and one thread's copy runs far below the memory's
      // bandwidth. A decode step's few rows are copied here.
      const size_t bytes =
          2 * static_cast<size_t>(b.n_tokens) * g_.n_kv_heads * row_bytes_;
      const int tasks =
          pool == nullptr || bytes < kAppendSplitBytes
              ? 1
              : static_cast<int>(std::min<size_t>(
                    {static_cast<size_t>(pool->threads()),
                     static_cast<size_t>(g_.n_kv_heads),
                     bytes / kAppendTaskBytes}));
      if (tasks <= 1) {
        copy_heads(0, g_.n_kv_heads);
      } else {
        pool->Run(tasks, [&](int task) {
          copy_heads(g_.n_kv_heads * task / tasks,
                     g_.n_kv_heads * (task + 1) / tasks);
        });
      }
    }
    layer_length_[layer] = first + b.n_tokens;
  }
  evicted_rows_ += static_cast<int64_t>(result.evicted.size());
  present_rows_ += int64_t{b.n_layers} * b.n_tokens * g_.n_kv_heads -
                   static_cast<int64_t>(result.evicted.size());
  // Annotations of blocks still to publish are kept until then, only for
  // blocks whose rows are in (the longest layer covers them): at most one
  // per whole block of rows held.
  const size_t first_pending = attached_.size() + next_pending_;
  int32_t longest = 0;
  for (int32_t len : layer_length_) longest = std::max(longest, len);
  const size_t covered = static_cast<size_t>(longest / block_tokens_);
  for (size_t i = 0; i < b.prefix_meta.size(); ++i) {
    const size_t block = static_cast<size_t>(b.prefix_meta_first_block) + i;
    if (block < first_pending || block >= attached_.size() + pending_.size() ||
        block >= covered) {
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

namespace {

// A plan's position against its layer's length: InvalidArgument when
// negative, OutOfRange past the end (what Gather and NoteFetched answer).
absl::Status CheckPosition(int32_t pos, int32_t layer, int32_t h,
                           int32_t length) {
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

}  // namespace

absl::Status StoredSequence::CheckLayer(int32_t layer) const {
  if (layer < 0 || layer >= g_.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " is not within the sequence's ", g_.n_layers,
        " layers"));
  }
  return absl::OkStatus();
}

absl::Status StoredSequence::Gather(int32_t layer, const FetchPlan& plan,
                                    absl::Span<uint16_t> dest,
                                    StoreTotals& totals, ThreadPool* pool) {
  IG_RETURN_IF_ERROR(CheckLayer(layer));
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
    apply = LogFetch(layer, plan);
  }
  FinishFetch(n, apply, totals);
  return absl::OkStatus();
}

bool StoredSequence::attached() const {
  absl::ReaderMutexLock lock(&mu_);
  return attached_tokens_ > 0;
}

bool StoredSequence::LogFetch(int32_t layer, const FetchPlan& plan,
                              bool leading) {
  absl::MutexLock log_lock(&log_mu_);
  LogFetchLocked(layer, plan, leading);
  // A sequence fetched without appends applies its log here.
  return log_positions_.size() >
         std::max<size_t>(size_t{1} << 16, 4 * present_rows_);
}

void StoredSequence::FinishFetch(size_t rows, bool apply,
                                 StoreTotals& totals) {
  totals.fetches.fetch_add(1, std::memory_order_relaxed);
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
    apply = LogFetch(layer, plan, /*leading=*/true);
  }
  FinishFetch(static_cast<size_t>(head_offsets.back()), apply, totals);
  return absl::OkStatus();
}

int32_t StoredSequence::Attach(
    std::vector<std::shared_ptr<const PrefixBlock>> blocks,
    int32_t block_tokens, std::vector<PrefixKey> pending,
    int64_t publish_bytes) {
  absl::MutexLock lock(&mu_);
  block_tokens_ = block_tokens;
  attached_ = std::move(blocks);
  // Only the blocks whose rows fit the budget are kept to publish (with
  // their annotations, as they come): the rest would never be.
  const int64_t rows_bytes = std::max<int64_t>(PublishedRowBytes(), 1);
  pending.resize(std::min<size_t>(
      pending.size(),
      static_cast<size_t>(std::max<int64_t>(publish_bytes, 0) / rows_bytes)));
  pending_ = std::move(pending);
  next_pending_ = 0;
  publish_bytes_ = publish_bytes;
  const int32_t tokens =
      static_cast<int32_t>(attached_.size()) * block_tokens;
  attached_tokens_ = tokens;
  for (int32_t layer = 0; layer < g_.n_layers; ++layer) {
    for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
      HeadSlots& head = HeadAt(layer, h);
      for (int32_t p = 0; p < tokens; ++p) head.PlaceShared(p);
    }
    layer_length_[layer] = tokens;
  }
  present_rows_ = int64_t{tokens} * g_.n_layers * g_.n_kv_heads;
  return tokens;
}

SequenceStats StoredSequence::Stats() const {
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

absl::StatusOr<std::vector<TokenFetchStats>> StoredSequence::TokenStats(
    int32_t layer, int32_t kv_head) {
  IG_RETURN_IF_ERROR(CheckLayer(layer));
  if (kv_head < 0 || kv_head >= g_.n_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV head ", kv_head, " is not within the sequence's ", g_.n_kv_heads,
        " KV heads"));
  }
  absl::MutexLock lock(&mu_);
  ApplyLogLocked();
  const HeadSlots& head = HeadAt(layer, kv_head);
  std::vector<TokenFetchStats> out;
  for (int32_t slot = head.oldest(); slot >= 0; slot = head.slot(slot).next) {
    const HeadSlots::Slot& s = head.slot(slot);
    out.push_back(TokenFetchStats{s.position, head.FetchCount(slot),
                                  head.LastFetch(slot)});
  }
  return out;
}

// Where the rows of `pos` (0 <= pos < length) of (layer, h) are.
inline StoredSequence::RowRef StoredSequence::Locate(const HeadSlots& head,
                                              int32_t layer, int32_t h,
                                              int32_t pos,
                                              int32_t length) const {
  RowRef r;
  const int32_t slot = head.SlotOf(pos, length);
  if (slot < 0) return r;
  if (pos < attached_tokens_ && head.slot(slot).shared) {
    const PrefixBlock& b = *attached_[pos / block_tokens_];
    const size_t at = b.RowOffset(layer, h, pos % block_tokens_);
    r.k = b.k.data() + at;
    r.v = b.v.data() + at;
    // The rest of the block, while slot == position.
    r.run = !head.arithmetic()
                ? 1
                : block_tokens_ - pos % block_tokens_;
    return r;
  }
  r.k = Row(k_.get(), layer, h, slot);
  r.v = Row(v_.get(), layer, h, slot);
  if (!head.evicting()) {
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
absl::Status StoredSequence::CopyRows(int32_t layer, int32_t length,
                                      const FetchPlan& plan, size_t begin,
                                      size_t end, uint16_t* dest) const {
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
absl::Status StoredSequence::CopyHead(int32_t layer, int32_t h,
                                      int32_t length,
                                      absl::Span<const int32_t> indices,
                                      size_t j, size_t end, uint16_t* k_out,
                                      uint16_t* v_out) const {
  const HeadSlots& head = HeadAt(layer, h);
  // Scattered rows: fetch the row kPrefetch indices ahead while this one
  // is copied (where its place is arithmetic).
  constexpr size_t kPrefetch = 8;
  const bool arithmetic = head.arithmetic();
  while (j < end) {
    const int32_t pos = indices[j];
    IG_RETURN_IF_ERROR(CheckPosition(pos, layer, h, length));
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
          const int32_t slot =
              head.evicting() ? ahead % g_.max_tokens : ahead;
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
inline void StoredSequence::Prefetch(const uint16_t* p) const {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t off = 0; off < row_bytes_; off += 64) {
    __builtin_prefetch(c + off, /*rw=*/0, /*locality=*/0);
  }
}

// One row; the common widths as fixed-size copies the compiler inlines.
inline void StoredSequence::CopyRow(uint16_t* dst,
                                    const uint16_t* src) const {
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

size_t StoredSequence::LogPositions() const {
  absl::MutexLock lock(&log_mu_);
  return log_positions_.size();
}

// Appends a successful gather's plan to the fetch log.
void StoredSequence::LogFetchLocked(int32_t layer, const FetchPlan& plan,
                                    bool leading) {
  log_.push_back(
      LoggedFetch{++clock_, layer, log_positions_.size(), leading});
  log_positions_.insert(log_positions_.end(), plan.head_offsets.begin(),
                        plan.head_offsets.end());
  log_positions_.insert(log_positions_.end(), plan.indices.begin(),
                        plan.indices.end());
  ++fetches_;
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

// Where the K (v = false) or V row of `slot` is: its attached block's
// row, or the sequence's own.
const uint16_t* StoredSequence::RowOf(bool v, int32_t layer, int32_t h,
                                     int32_t slot,
                                     const HeadSlots::Slot& s) const {
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
void StoredSequence::CollectPublishable(
    std::vector<std::shared_ptr<const PrefixBlock>>* out) {
  if (next_pending_ >= pending_.size()) return;
  int32_t complete = layer_length_[0];
  for (int32_t len : layer_length_) complete = std::min(complete, len);
  const int32_t first_block = static_cast<int32_t>(attached_.size());
  while (next_pending_ < pending_.size()) {
    const int32_t block = first_block + static_cast<int32_t>(next_pending_);
    const int32_t begin = block * block_tokens_;
    if (begin + block_tokens_ > complete) return;
    const size_t values = PrefixBlock::RowValues(g_, block_tokens_);
    const int64_t bytes =
        PublishedRowBytes() +
        static_cast<int64_t>(next_pending_ < pending_meta_.size()
                                 ? pending_meta_[next_pending_].size()
                                 : 0);
    if (bytes > publish_bytes_) {
      // The cache could not keep it beside the blocks before it.
      next_pending_ = pending_.size();
      return;
    }
    publish_bytes_ -= bytes;
    auto b = std::make_shared<PrefixBlock>();
    b->key = pending_[next_pending_];
    b->format = g_;
    b->format.max_tokens = 0;
    b->tokens = block_tokens_;
    b->k.resize(values);
    b->v.resize(values);
    for (int32_t layer = 0; layer < g_.n_layers; ++layer) {
      for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
        const HeadSlots& head = HeadAt(layer, h);
        for (int32_t t = 0; t < block_tokens_; ++t) {
          const int32_t slot = head.SlotOf(begin + t, layer_length_[layer]);
          if (slot < 0) {  // evicted
            next_pending_ = pending_.size();
            return;
          }
          const HeadSlots::Slot& s = head.slot(slot);
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

}  // namespace infinigen::kv_memory_service
