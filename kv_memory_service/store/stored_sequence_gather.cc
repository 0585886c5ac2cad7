// StoredSequence::Gather (stored_sequence.h): finding a plan's rows, in
// the sequence's own memory or an attached prefix block, and copying them
// out, split across the store's pool when large.
#include "kv_memory_service/store/stored_sequence.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace infinigen::kv_memory_service {

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

}  // namespace infinigen::kv_memory_service
