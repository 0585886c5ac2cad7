// Which of a sequence's watched rows (KvOptions::watch_positions: a
// needle's) a decode step's plan selects, per layer: an analysis of what a
// policy reads, counted into FetchStats::watched_layer_*.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_WATCHED_ROWS_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_WATCHED_ROWS_H_

#include <cstdint>
#include <vector>

#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/offloaded/layer_fetch.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// Of the watched positions (sorted) below `position` that the node holds
// (`present`, [kv_head][max_seq]), those `f`'s plan of `layer` selects,
// per KV head, added to `stats`. A plan left on the device is not counted.
void CountWatched(const std::vector<int32_t>& watch, const LayerFetch& f,
                  const uint8_t* present, int max_seq, int n_kv_heads,
                  int layer, int position, FetchStats& stats);

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_WATCHED_ROWS_H_
