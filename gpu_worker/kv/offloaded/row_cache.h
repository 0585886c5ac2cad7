// A sequence's rows kept on the worker after a decode step fetched them,
// so that a later step fetches only the rows it does not hold.
//
// Per (layer, KV head) the cache owns a slot array of K and V rows as
// stored, which position each slot holds, and the slots' order of recent
// selection. A layer's plan splits into hits (rows a slot holds) and
// misses (Split); the misses alone are fetched, land in the slots Split
// gave them (Fill), and attention reads every planned row from the slots
// by index, in the plan's order (Head), so it computes what it would over
// the fetched rows. Replacement is by recency of selection, across steps
// only: Split moves the step's hits to the front of the order before it
// takes slots for misses from the free ones or the least recently
// selected, so no row the step selected is evicted. A head whose plan has
// more rows than its room (`fraction` of the cached tokens) skips the
// cache for that step: its rows are fetched and read from the fetch.
//
// A row's K and V never change while its sequence is open, whatever the
// node does with its copy. Host memory, touched only as slots fill; not
// thread-safe; one per sequence.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_CACHE_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::gpu_worker {
namespace offloaded {

class RowCache {
 public:
  // Room for `fraction` (in (0, 1]) of the cached tokens' rows of every
  // layer, `row_width` values a row. The first `whole_layers` layers (a
  // policy's dense layers: their plans name every row) get room for every
  // token where the bound allows it, and the other layers share the rest;
  // where it does not, every layer gets `fraction`.
  RowCache(int n_layers, int whole_layers, int n_kv_heads, int max_tokens,
           int row_width, double fraction);

  // Slots per (layer, KV head) of `layer`, and the bytes the cache can
  // take (slots and maps).
  int capacity(int layer) const { return layer_room_[layer].capacity; }
  static int64_t Bytes(int n_layers, int whole_layers, int n_kv_heads,
                       int max_tokens, int row_width, double fraction);
  // Bytes of the rows the slots hold.
  int64_t bytes() const;

  // Splits `plan` (layer `layer`, positions below `cached_tokens`) into
  // the rows to fetch (misses(), a plan of its own) and those held, and
  // gives each miss its slot. Until the layer's next Split, Fill and Head
  // read this split. Returns the plan's hits; InternalError naming a
  // position outside [0, max_tokens), the cache unchanged.
  absl::StatusOr<long> Split(int layer,
                             const kv_memory_service::FetchPlan& plan,
                             int cached_tokens);
  // The rows to fetch for `layer`'s last split, and those it held (for
  // the node's statistics: they were read all the same).
  const kv_memory_service::OwnedFetchPlan& misses(int layer) const {
    return layers_[layer].misses;
  }
  const kv_memory_service::OwnedFetchPlan& hits(int layer) const {
    return layers_[layer].hits;
  }
  // The misses' rows fetched: K rows of every head in the order of
  // misses(layer), then its V rows, as stored; copied into their slots.
  void Fill(int layer, const uint16_t* fetched);

  // Where attention reads head g's planned rows of `layer`: the slot
  // arrays by index (indices set), or, for a head that skipped the cache,
  // the fetched rows at `fetched` (Fill's) in plan order.
  struct HeadRows {
    const uint16_t* k = nullptr;
    const uint16_t* v = nullptr;
    const int32_t* indices = nullptr;
  };
  HeadRows Head(int layer, int g, const uint16_t* fetched) const;

 private:
  // One (layer, KV head)'s slots; slot `capacity` (position.size()) is
  // the recency list's sentinel (next: the most recent, prev: the least).
  struct Slots {
    std::vector<int32_t> slot_of;   // [max_tokens] position -> slot, -1
    std::vector<int32_t> position;  // [capacity] slot -> position
    std::vector<int32_t> prev, next;
    int used = 0;  // slots [0, used) hold rows
  };
  // A layer's last split.
  struct LayerSplit {
    kv_memory_service::OwnedFetchPlan misses, hits;
    std::vector<int32_t> plan_offsets;  // the plan's head offsets
    std::vector<int32_t> slots;      // plan order: each row's slot
    std::vector<int32_t> miss_slot;  // misses order: each row's slot, -1
    std::vector<char> skipped;       // [head]: read from the fetch
  };

  // A layer's share: of the cached tokens, and at most (slots a head).
  struct LayerRoom {
    double fraction = 0;
    int capacity = 0;
    size_t first_row = 0;  // its first head's K slots in rows_
  };
  static std::vector<LayerRoom> Rooms(int n_layers, int whole_layers,
                                      int n_kv_heads, int max_tokens,
                                      double fraction);

  Slots& At(int layer, int g) { return slots_[layer * n_kv_heads_ + g]; }
  uint16_t* KSlot(int layer, int g, int slot) const;
  void MoveToFront(Slots& s, int slot);

  const int n_kv_heads_, max_tokens_, row_width_;
  const std::vector<LayerRoom> layer_room_;  // [layer]
  std::vector<Slots> slots_;        // [layer][head]
  std::vector<LayerSplit> layers_;  // [layer]
  // [layer][head][K then V][capacity][row_width], left uninitialized.
  std::unique_ptr<uint16_t[]> rows_;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_CACHE_H_
