// StoredSequence (stored_sequence.h): construction, appends, attached and
// published prefix blocks, and the statistics.
#include "kv_memory_service/store/stored_sequence.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace infinigen::kv_memory_service {

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
  IG_RETURN_IF_ERROR(CheckAppend(b, max_append_tokens));
  absl::MutexLock lock(&mu_);
  IG_ASSIGN_OR_RETURN(const bool evicts, AdmitAppendLocked(b));

  AppendResult result;
  const size_t token_stride = static_cast<size_t>(g_.n_kv_heads) * row_elems_;
  for (int32_t i = 0; i < b.n_layers; ++i) {
    const int32_t layer = b.first_layer + i;
    const uint16_t* k_src =
        b.k.data() + static_cast<size_t>(i) * b.n_tokens * token_stride;
    const uint16_t* v_src =
        b.v.data() + static_cast<size_t>(i) * b.n_tokens * token_stride;
    if (evicts) {
      AppendEvictingLayer(layer, k_src, v_src, b.n_tokens, &result.evicted);
    } else {
      AppendLayerRuns(layer, k_src, v_src, b.n_tokens, pool);
    }
    layer_length_[layer] += b.n_tokens;
  }
  evicted_rows_ += static_cast<int64_t>(result.evicted.size());
  present_rows_ += int64_t{b.n_layers} * b.n_tokens * g_.n_kv_heads -
                   static_cast<int64_t>(result.evicted.size());
  KeepPendingMeta(b);
  CollectPublishable(published);
  totals.appended_rows.fetch_add(
      int64_t{b.n_layers} * b.n_tokens * g_.n_kv_heads,
      std::memory_order_relaxed);
  totals.evicted_rows.fetch_add(static_cast<int64_t>(result.evicted.size()),
                                std::memory_order_relaxed);
  return result;
}

absl::Status StoredSequence::CheckAppend(const AppendBlock& b,
                                         int32_t max_append_tokens) const {
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
  return absl::OkStatus();
}

absl::StatusOr<bool> StoredSequence::AdmitAppendLocked(const AppendBlock& b) {
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
  return evicts;
}

inline void StoredSequence::CopyAppendedRow(int32_t layer,
                                            const uint16_t* k_src,
                                            const uint16_t* v_src, int32_t t,
                                            int32_t h, int32_t slot) {
  const size_t src =
      static_cast<size_t>(t) * g_.n_kv_heads * row_elems_ +
      static_cast<size_t>(h) * row_elems_;
  std::memcpy(Row(k_.get(), layer, h, slot), k_src + src, row_bytes_);
  std::memcpy(Row(v_.get(), layer, h, slot), v_src + src, row_bytes_);
}

void StoredSequence::AppendEvictingLayer(int32_t layer, const uint16_t* k_src,
                                         const uint16_t* v_src,
                                         int32_t n_tokens,
                                         std::vector<EvictedToken>* evicted) {
  const int32_t first = layer_length_[layer];
  // Token by token, every head: the victims in that order.
  for (int32_t t = 0; t < n_tokens; ++t) {
    for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
      int32_t victim;
      const int32_t slot = HeadAt(layer, h).Place(first + t, &victim);
      if (victim >= 0) {
        evicted->push_back(EvictedToken{layer, h, victim});
      }
      CopyAppendedRow(layer, k_src, v_src, t, h, slot);
    }
  }
}

void StoredSequence::AppendLayerRuns(int32_t layer, const uint16_t* k_src,
                                     const uint16_t* v_src, int32_t n_tokens,
                                     ThreadPool* pool) {
  const int32_t first = layer_length_[layer];
  // Each head's new slots are one run, placed at once. The block is
  // token-major and the rows head-major: a transpose, done a tile of
  // tokens at a time so that the tile's source rows and each head's
  // destination rows stay within the TLB's reach (one token at a time,
  // every row of a long block lands on a page of its own).
  constexpr int32_t kTileTokens = 64;
  std::vector<int32_t>& run = run_slots_;  // [h]: the head's first new slot
  run.resize(g_.n_kv_heads);
  for (int32_t h = 0; h < g_.n_kv_heads; ++h) {
    run[h] = HeadAt(layer, h).PlaceRun(first, n_tokens);
  }
  auto copy_heads = [&](int32_t h0, int32_t h1) {
    for (int32_t t0 = 0; t0 < n_tokens; t0 += kTileTokens) {
      const int32_t t1 = std::min(n_tokens, t0 + kTileTokens);
      for (int32_t h = h0; h < h1; ++h) {
        for (int32_t t = t0; t < t1; ++t) {
          CopyAppendedRow(layer, k_src, v_src, t, h, run[h] + t);
        }
      }
    }
  };
  // A prefill's layer (hundreds of MiB at long contexts) is split
  // across the pool's threads, a range of KV heads each: their rows
  // are disjoint, and one thread's copy runs far below the memory's
  // bandwidth. A decode step's few rows are copied here.
  const size_t bytes =
      2 * static_cast<size_t>(n_tokens) * g_.n_kv_heads * row_bytes_;
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

void StoredSequence::KeepPendingMeta(const AppendBlock& b) {
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
}

absl::Status StoredSequence::CheckLayer(int32_t layer) const {
  if (layer < 0 || layer >= g_.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, " is not within the sequence's ", g_.n_layers,
        " layers"));
  }
  return absl::OkStatus();
}

bool StoredSequence::attached() const {
  absl::ReaderMutexLock lock(&mu_);
  return attached_tokens_ > 0;
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
