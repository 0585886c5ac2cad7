// Which of one sequence's rows the memory node holds: a byte per (layer,
// KV head, position) and each layer's count over its heads. Appends mark
// rows present; the node's evictions (AppendResult::evicted) clear them.
// The policies plan over it (KvPolicy::PlanFetch's `present`). Not
// thread-safe; one per sequence.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_PRESENCE_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_PRESENCE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::gpu_worker {
namespace offloaded {

class RowPresence {
 public:
  RowPresence() = default;
  RowPresence(int n_layers, int n_kv_heads, int max_seq);

  // No row present.
  void Clear();
  // Positions [first, first + n) of layers [first_layer, first_layer +
  // n_layers) are present in every head; then each evicted row is not.
  void Mark(int first_layer, int n_layers, int first, int n,
            absl::Span<const kv_memory_service::EvictedToken> evicted);
  // Layer `layer`'s presence, [kv_head][max_seq].
  const uint8_t* layer(int layer) const {
    return &present_[static_cast<size_t>(layer) * n_kv_heads_ * max_seq_];
  }
  // Whether every position [0, p) of every head of `layer` is present.
  bool Whole(int layer, int p) const {
    return count_[layer] == static_cast<long>(n_kv_heads_) * p;
  }
  // Present rows of every layer and head.
  long total() const;
  // Bytes held.
  size_t bytes() const { return present_.size() + count_.size() * 8; }

 private:
  int n_kv_heads_ = 0;
  int max_seq_ = 0;
  std::vector<uint8_t> present_;  // [layer][kv_head][pos]
  std::vector<long> count_;       // [layer]: present rows, all heads
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_PRESENCE_H_
