#include "kv_memory_service/store/prefix_cache.h"

#include <utility>

namespace infinigen::kv_memory_service {

bool SameRowFormat(const SequenceGeometry& a, const SequenceGeometry& b) {
  return a.n_layers == b.n_layers && a.n_kv_heads == b.n_kv_heads &&
         a.head_dim == b.head_dim && a.dtype == b.dtype;
}

std::vector<std::shared_ptr<const PrefixBlock>> PrefixCache::Attach(
    const SequenceGeometry& format, int32_t block_tokens,
    absl::Span<const PrefixKey> keys) {
  std::vector<std::shared_ptr<const PrefixBlock>> out;
  absl::MutexLock lock(&mu_);
  lookup_tokens_ += static_cast<int64_t>(keys.size()) * block_tokens;
  for (const PrefixKey& key : keys) {
    auto it = blocks_.find(key);
    if (it == blocks_.end()) break;
    const PrefixBlock& b = *it->second.block;
    if (b.tokens != block_tokens || !SameRowFormat(b.format, format)) break;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    out.push_back(it->second.block);
  }
  hit_tokens_ += static_cast<int64_t>(out.size()) * block_tokens;
  return out;
}

bool PrefixCache::Insert(std::shared_ptr<const PrefixBlock> block) {
  if (block == nullptr) return false;
  const int64_t need = block->bytes();
  // Dropped outside the lock (their rows may be large).
  std::vector<std::shared_ptr<const PrefixBlock>> dropped;
  bool kept = false;
  {
    absl::MutexLock lock(&mu_);
    if (need > capacity_bytes_ || blocks_.contains(block->key)) return false;
    // Least recently used first; blocks some sequence holds stay.
    for (auto it = lru_.end(); bytes_ + need > capacity_bytes_ &&
                               it != lru_.begin();) {
      --it;
      auto entry = blocks_.find(*it);
      if (entry->second.block.use_count() > 1) continue;
      bytes_ -= entry->second.block->bytes();
      dropped.push_back(std::move(entry->second.block));
      blocks_.erase(entry);
      it = lru_.erase(it);
      ++evicted_blocks_;
    }
    if (bytes_ + need <= capacity_bytes_) {
      const PrefixKey key = block->key;
      lru_.push_front(key);
      bytes_ += need;
      blocks_.emplace(key, Entry{std::move(block), lru_.begin()});
      kept = true;
    }
  }
  return kept;
}

PrefixCacheStats PrefixCache::Stats() const {
  absl::MutexLock lock(&mu_);
  PrefixCacheStats s;
  s.blocks = static_cast<int64_t>(blocks_.size());
  s.bytes = bytes_;
  s.capacity_bytes = capacity_bytes_ > 0 ? capacity_bytes_ : 0;
  s.hit_tokens = hit_tokens_;
  s.lookup_tokens = lookup_tokens_;
  s.evicted_blocks = evicted_blocks_;
  return s;
}

}  // namespace infinigen::kv_memory_service
