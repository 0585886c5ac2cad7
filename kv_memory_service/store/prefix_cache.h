// PrefixCache: the memory node's shared prefix blocks, content-addressed
// by PrefixKey (prefix_keys.h) and shared between sequences.
//
// A block holds the K and V rows of block_tokens consecutive tokens of
// every (layer, KV head), copied out of the sequence that computed them
// once every layer's rows were appended (KvStore publishes them). A
// sequence opened with the same leading keys attaches the blocks instead
// of recomputing and re-appending those tokens: it holds a reference to
// each attached block and reads its rows from there, so a block's rows
// exist once however many sequences use it, and its bytes count once
// against capacity_bytes.
//
// Eviction: when an insert would pass capacity_bytes, the least recently
// used blocks that no sequence holds are dropped; a block a live sequence
// uses is never dropped (when every block is in use, the new block is not
// kept). Dropping a block leaves later blocks of its chain unreachable
// until they age out too.
//
// Thread-safety: every method may be called concurrently.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_STORE_PREFIX_CACHE_H_
#define INFINIGEN_KV_MEMORY_SERVICE_STORE_PREFIX_CACHE_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::kv_memory_service {

// One block's rows: K and V each [layer][kv_head][token][head_dim]. The
// format (n_layers, n_kv_heads, head_dim, dtype; max_tokens unused) must
// equal an attaching sequence's, or the block is a miss.
struct PrefixBlock {
  PrefixKey key;
  SequenceGeometry format;
  int32_t tokens = 0;
  std::vector<uint16_t> k, v;
  std::string meta;  // AppendBlock::prefix_meta, opaque

  // Values of K (and as many of V) in a block of `tokens` tokens of
  // `format`.
  static size_t RowValues(const SequenceGeometry& format, int32_t tokens) {
    return static_cast<size_t>(format.n_layers) * format.n_kv_heads *
           tokens * format.head_dim;
  }
  int64_t bytes() const {
    return static_cast<int64_t>(k.size() + v.size()) * sizeof(uint16_t) +
           static_cast<int64_t>(meta.size());
  }
  size_t RowOffset(int32_t layer, int32_t kv_head, int32_t token) const {
    return ((static_cast<size_t>(layer) * format.n_kv_heads + kv_head) *
                tokens +
            token) *
           format.head_dim;
  }
};

struct PrefixCacheStats {
  int64_t blocks = 0;
  int64_t bytes = 0;
  int64_t capacity_bytes = 0;
  int64_t hit_tokens = 0;     // tokens Attach returned, life total
  int64_t lookup_tokens = 0;  // tokens Attach was asked for
  int64_t evicted_blocks = 0;
};

class PrefixCache {
 public:
  // capacity_bytes <= 0: holds nothing (every Attach misses, Insert drops).
  explicit PrefixCache(int64_t capacity_bytes)
      : capacity_bytes_(capacity_bytes) {}
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // The longest run of leading `keys` held with this format and block
  // size, each block referenced (never evicted while a returned pointer
  // lives) and marked as just used.
  std::vector<std::shared_ptr<const PrefixBlock>> Attach(
      const SequenceGeometry& format, int32_t block_tokens,
      absl::Span<const PrefixKey> keys);

  // Keeps `block` unless its key is already held (the first copy wins) or
  // no room can be made; true when kept.
  bool Insert(std::shared_ptr<const PrefixBlock> block);

  PrefixCacheStats Stats() const;
  int64_t capacity_bytes() const { return capacity_bytes_; }

 private:
  struct Entry {
    std::shared_ptr<const PrefixBlock> block;
    std::list<PrefixKey>::iterator lru;  // position in lru_
  };

  const int64_t capacity_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<PrefixKey, Entry> blocks_ ABSL_GUARDED_BY(mu_);
  std::list<PrefixKey> lru_ ABSL_GUARDED_BY(mu_);  // most recent first
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hit_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lookup_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evicted_blocks_ ABSL_GUARDED_BY(mu_) = 0;
};

// Whether two geometries store rows of one format (max_tokens aside).
bool SameRowFormat(const SequenceGeometry& a, const SequenceGeometry& b);

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_STORE_PREFIX_CACHE_H_
