#include "gpu_worker/kv/offloaded/watched_rows.h"

#include <algorithm>

namespace infinigen::gpu_worker {
namespace offloaded {

void CountWatched(const std::vector<int32_t>& watch, const LayerFetch& f,
                  const uint8_t* present, int max_seq, int n_kv_heads,
                  int layer, int position, FetchStats& stats) {
  if (f.kind == LayerFetch::PlanKind::kOnBackend) return;
  for (std::vector<long>* v :
       {&stats.watched_layer_candidates, &stats.watched_layer_selected}) {
    if (static_cast<int>(v->size()) <= layer) v->resize(layer + 1, 0);
  }
  std::vector<int32_t> chosen;
  for (int g = 0; g < n_kv_heads; ++g) {
    const uint8_t* held = present + static_cast<size_t>(g) * max_seq;
    const int begin = f.plan.head_offsets[g], end = f.plan.head_offsets[g + 1];
    chosen.clear();
    if (f.kind == LayerFetch::PlanKind::kLeading) {
      for (const int32_t p : watch) {
        if (p < end - begin) chosen.push_back(p);
      }
    } else {
      for (int t = begin; t < end; ++t) {
        const int32_t p = f.plan.indices[t];
        if (std::binary_search(watch.begin(), watch.end(), p)) {
          chosen.push_back(p);
        }
      }
      std::sort(chosen.begin(), chosen.end());
      chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
    }
    for (const int32_t p : watch) {
      if (p >= position || p >= max_seq || !held[p]) continue;
      ++stats.watched_layer_candidates[layer];
      stats.watched_layer_selected[layer] +=
          std::binary_search(chosen.begin(), chosen.end(), p);
    }
  }
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
