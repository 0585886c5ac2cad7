#include "gpu_worker/kv/offloaded/row_presence.h"

#include <algorithm>

namespace infinigen::gpu_worker {
namespace offloaded {

RowPresence::RowPresence(int n_layers, int n_kv_heads, int max_seq)
    : n_kv_heads_(n_kv_heads),
      max_seq_(max_seq),
      present_(static_cast<size_t>(n_layers) * n_kv_heads * max_seq, 0),
      count_(n_layers, 0) {}

void RowPresence::Clear() {
  std::fill(present_.begin(), present_.end(), 0);
  std::fill(count_.begin(), count_.end(), 0);
}

void RowPresence::Mark(
    int first_layer, int n_layers, int first, int n,
    absl::Span<const kv_memory_service::EvictedToken> evicted) {
  for (int l = first_layer; l < first_layer + n_layers; ++l) {
    for (int g = 0; g < n_kv_heads_; ++g) {
      uint8_t* pr =
          &present_[(static_cast<size_t>(l) * n_kv_heads_ + g) * max_seq_];
      std::fill(pr + first, pr + first + n, 1);
    }
    count_[l] += static_cast<long>(n) * n_kv_heads_;
  }
  for (const kv_memory_service::EvictedToken& e : evicted) {
    uint8_t& pr =
        present_[(static_cast<size_t>(e.layer) * n_kv_heads_ + e.kv_head) *
                     max_seq_ +
                 e.position];
    if (pr) {
      pr = 0;
      --count_[e.layer];
    }
  }
}

long RowPresence::total() const {
  long rows = 0;
  for (long r : count_) rows += r;
  return rows;
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
