#include "gpu_worker/kv/offloaded/row_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"

namespace infinigen::gpu_worker {
namespace offloaded {
std::vector<RowCache::LayerRoom> RowCache::Rooms(int n_layers,
                                                 int whole_layers,
                                                 int n_kv_heads,
                                                 int max_tokens,
                                                 double fraction) {
  // The bound, in layers' worth of rows: fraction * n_layers. Whole layers
  // first where they fit with room left for the others.
  const double bound = fraction * n_layers;
  int whole = std::clamp(whole_layers, 0, n_layers);
  if (whole > 0 && !(bound >= whole && (bound > whole || whole == n_layers))) {
    whole = 0;
  }
  const double rest =
      whole < n_layers ? (bound - whole) / (n_layers - whole) : 0.0;
  std::vector<LayerRoom> rooms(n_layers);
  size_t row = 0;
  for (int l = 0; l < n_layers; ++l) {
    LayerRoom& r = rooms[l];
    r.fraction = l < whole ? 1.0 : std::min(rest, 1.0);
    r.capacity = static_cast<int>(
        std::clamp(std::ceil(r.fraction * max_tokens), 1.0,
                   static_cast<double>(max_tokens)));
    r.first_row = row;
    row += static_cast<size_t>(n_kv_heads) * 2 * r.capacity;
  }
  return rooms;
}

RowCache::RowCache(int n_layers, int whole_layers, int n_kv_heads,
                   int max_tokens, int row_width, double fraction)
    : n_kv_heads_(n_kv_heads),
      max_tokens_(max_tokens),
      row_width_(row_width),
      layer_room_(
          Rooms(n_layers, whole_layers, n_kv_heads, max_tokens, fraction)),
      slots_(static_cast<size_t>(n_layers) * n_kv_heads),
      layers_(n_layers) {
  size_t rows = 0;
  for (const LayerRoom& r : layer_room_) {
    rows += static_cast<size_t>(n_kv_heads) * 2 * r.capacity;
  }
  // Default-initialized: pages are touched only as slots fill.
  rows_.reset(new uint16_t[rows * row_width]);
  for (int l = 0; l < n_layers; ++l) {
    const int capacity = layer_room_[l].capacity;
    for (int g = 0; g < n_kv_heads; ++g) {
      Slots& s = At(l, g);
      s.slot_of.assign(max_tokens_, -1);
      s.position.assign(capacity, -1);
      s.prev.assign(capacity + 1, capacity);
      s.next.assign(capacity + 1, capacity);
    }
  }
}

int64_t RowCache::Bytes(int n_layers, int whole_layers, int n_kv_heads,
                        int max_tokens, int row_width, double fraction) {
  int64_t bytes = 0;
  for (const LayerRoom& r :
       Rooms(n_layers, whole_layers, n_kv_heads, max_tokens, fraction)) {
    // K and V slots, and the maps: position -> slot, slot -> position and
    // the recency list.
    const int64_t capacity = r.capacity;
    bytes += n_kv_heads *
             (2 * capacity * row_width * static_cast<int64_t>(sizeof(uint16_t)) +
              (max_tokens + 3 * (capacity + 1)) *
                  static_cast<int64_t>(sizeof(int32_t)));
  }
  return bytes;
}

int64_t RowCache::bytes() const {
  int64_t rows = 0;
  for (const Slots& s : slots_) rows += s.used;
  return rows * 2 * row_width_ * static_cast<int64_t>(sizeof(uint16_t));
}

uint16_t* RowCache::KSlot(int layer, int g, int slot) const {
  const LayerRoom& r = layer_room_[layer];
  return rows_.get() +
         (r.first_row + static_cast<size_t>(g) * 2 * r.capacity + slot) *
             row_width_;
}

void RowCache::MoveToFront(Slots& s, int slot) {
  const int sentinel = static_cast<int>(s.position.size());
  // Unlink (a slot just taken is linked nowhere: its links are its own
  // neighbours' business only once linked).
  if (s.next[slot] != slot || s.prev[slot] != slot) {
    s.next[s.prev[slot]] = s.next[slot];
    s.prev[s.next[slot]] = s.prev[slot];
  }
  s.next[slot] = s.next[sentinel];
  s.prev[slot] = sentinel;
  s.prev[s.next[sentinel]] = slot;
  s.next[sentinel] = slot;
}

absl::StatusOr<long> RowCache::Split(
    int layer, const kv_memory_service::FetchPlan& plan, int cached_tokens) {
  for (const int32_t p : plan.indices) {
    if (p < 0 || p >= max_tokens_) {
      return absl::InternalError(absl::StrFormat(
          "kv cache: layer %d's plan names position %d, outside the %d rows "
          "a head holds",
          layer, p, max_tokens_));
    }
  }
  LayerSplit& split = layers_[layer];
  const size_t n = plan.indices.size();
  split.plan_offsets.assign(plan.head_offsets.begin(),
                            plan.head_offsets.end());
  split.slots.assign(n, -1);
  split.misses.indices.clear();
  split.misses.head_offsets.assign(1, 0);
  split.hits.indices.clear();
  split.hits.head_offsets.assign(1, 0);
  split.miss_slot.clear();
  split.skipped.assign(n_kv_heads_, 0);
  const LayerRoom& share = layer_room_[layer];
  const int room = std::min(
      share.capacity,
      std::max(1, static_cast<int>(std::ceil(
                      share.fraction * std::max(cached_tokens, 1)))));
  long hits = 0;
  for (int g = 0; g < n_kv_heads_; ++g) {
    const int begin = plan.head_offsets[g], end = plan.head_offsets[g + 1];
    Slots& s = At(layer, g);
    if (end - begin > room) {
      // Larger than the room: every row fetched and read from the fetch.
      split.skipped[g] = 1;
      for (int t = begin; t < end; ++t) {
        split.misses.indices.push_back(plan.indices[t]);
        split.miss_slot.push_back(-1);
      }
    } else {
      // The step's hits first to the front: no victim below is one.
      for (int t = begin; t < end; ++t) {
        const int slot = s.slot_of[plan.indices[t]];
        if (slot < 0) continue;
        split.slots[t] = slot;
        MoveToFront(s, slot);
        split.hits.indices.push_back(plan.indices[t]);
        ++hits;
      }
      for (int t = begin; t < end; ++t) {
        if (split.slots[t] >= 0) continue;
        const int32_t p = plan.indices[t];
        // A position planned twice in a head is fetched once.
        int slot = s.slot_of[p];
        if (slot < 0) {
          if (s.used < room) {
            slot = s.used++;
            s.next[slot] = s.prev[slot] = slot;  // not linked yet
          } else {
            slot = s.prev[share.capacity];  // the least recently selected
            s.slot_of[s.position[slot]] = -1;
          }
          s.slot_of[p] = slot;
          s.position[slot] = p;
          split.misses.indices.push_back(p);
          split.miss_slot.push_back(slot);
        }
        MoveToFront(s, slot);
        split.slots[t] = slot;
      }
    }
    split.misses.head_offsets.push_back(
        static_cast<int32_t>(split.misses.indices.size()));
    split.hits.head_offsets.push_back(
        static_cast<int32_t>(split.hits.indices.size()));
  }
  return hits;
}

void RowCache::Fill(int layer, const uint16_t* fetched) {
  const LayerSplit& split = layers_[layer];
  const size_t total = split.misses.indices.size();
  const size_t bytes = static_cast<size_t>(row_width_) * sizeof(uint16_t);
  const size_t v_at =
      static_cast<size_t>(layer_room_[layer].capacity) * row_width_;
  for (int g = 0; g < n_kv_heads_; ++g) {
    if (split.skipped[g]) continue;
    for (int i = split.misses.head_offsets[g];
         i < split.misses.head_offsets[g + 1]; ++i) {
      uint16_t* k = KSlot(layer, g, split.miss_slot[i]);
      std::memcpy(k, fetched + static_cast<size_t>(i) * row_width_, bytes);
      std::memcpy(k + v_at,
                  fetched + (total + static_cast<size_t>(i)) * row_width_,
                  bytes);
    }
  }
}

RowCache::HeadRows RowCache::Head(int layer, int g,
                                  const uint16_t* fetched) const {
  const LayerSplit& split = layers_[layer];
  HeadRows h;
  if (split.skipped[g]) {
    const size_t total = split.misses.indices.size();
    const size_t at =
        static_cast<size_t>(split.misses.head_offsets[g]) * row_width_;
    h.k = fetched + at;
    h.v = fetched + total * row_width_ + at;
    return h;
  }
  h.k = KSlot(layer, g, 0);
  h.v = h.k + static_cast<size_t>(layer_room_[layer].capacity) * row_width_;
  h.indices = split.slots.data() + split.plan_offsets[g];
  return h;
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
