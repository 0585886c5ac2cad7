// A sequence's rows kept on the worker after a decode step fetched them,
// so that a later step fetches only the rows it does not hold.
//
// Per (layer, KV head) the cache owns a slot array of K and V rows as
// stored, which position each slot holds, and the slots' order of recent
// selection. A layer's plan splits into hits (rows a slot holds) and
// misses (Split); the misses alone are fetched, land in the slots Split
// gave them (Fill), and attention reads every planned row from the slots
// by index, in the plan's order (Head), so it computes what it would over
// the fetched rows.
//
// The bound is one for the whole sequence: `fraction` of its cached rows,
// every layer and KV head together, so that the heads that select many
// rows (a dense layer's every row) hold as many as they need while the
// bound lasts. A miss takes a new slot while the bound allows, else the
// slot of its own head's least recently selected row (or, by frequency,
// its least often selected one: RowCacheReplacement); Split moves the
// step's hits to the front of the recency order first, so no row the step
// selected is evicted. A head that cannot hold all its misses that way
// skips the cache for the step: its rows are fetched and read from the
// fetch.
//
// The slots of every head lie in one array of K rows and one of V rows,
// sized for the bound at the sequence's last position and touched only as
// slots are taken. A row's K and V never change while its sequence is
// open, whatever the node does with its copy. Host memory; not
// thread-safe; one per sequence. On a device the slot arrays lie in its
// memory (the row source's): the cache keeps the maps alone (hold_rows
// false) and says where each row goes and lies (SlotsOf).
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_CACHE_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/kv/kv_cache.h"
#include "kv_memory_service/client/kv_types.h"

namespace infinigen::gpu_worker {
namespace offloaded {

class RowCache {
 public:
  // Room for `fraction` (in (0, 1]) of the cached tokens' rows of every
  // layer and KV head, `row_width` values a row.
  RowCache(int n_layers, int n_kv_heads, int max_tokens, int row_width,
           double fraction,
           RowCacheReplacement replacement = RowCacheReplacement::kRecency,
           bool hold_rows = true);

  // The most bytes the cache takes (rows at the bound, and maps).
  static int64_t Bytes(
      int n_layers, int n_kv_heads, int max_tokens, int row_width,
      double fraction,
      RowCacheReplacement replacement = RowCacheReplacement::kRecency);
  // The largest fraction whose Bytes are at most `bytes`; 0 where not even
  // the maps and one row fit.
  static double FractionWithin(
      int64_t bytes, int n_layers, int n_kv_heads, int max_tokens,
      int row_width,
      RowCacheReplacement replacement = RowCacheReplacement::kRecency);
  // Bytes of the rows the slots hold.
  int64_t bytes() const;
  // Slots at the bound: the rows of slot arrays held elsewhere.
  long max_rows() const { return max_rows_; }

  // Of a split plan: the rows held (hits), and the rows the layer's
  // previous split selected too (repeats: the overlap of consecutive
  // steps' selections, whatever the cache held).
  struct Counts {
    long hits = 0;
    long repeats = 0;
  };
  // Splits `plan` (layer `layer`, positions below `cached_tokens`) into
  // the rows to fetch (misses(), a plan of its own) and those held, and
  // gives each miss its slot. Until the layer's next Split, Fill and Head
  // read this split. InternalError naming a position outside
  // [0, max_tokens), the cache unchanged.
  absl::StatusOr<Counts> Split(int layer,
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

  // The same for slot arrays held elsewhere (hold_rows false), after
  // `layer`'s last Split: plan_slots [plan rows] each planned row's slot,
  // or, for a head that skipped the cache, -1 - its row among the misses
  // (StagedRowsAttention::slots); miss_slots [misses rows] the slot each
  // fetched miss goes to, -1 for a skipped head's (ScatterRowsParams).
  void SlotsOf(int layer, int32_t* plan_slots, int32_t* miss_slots) const;

 private:
  // One (layer, KV head)'s slots: which position each holds, and their
  // recency list through prev_ and next_ (-1 ends it).
  struct Slots {
    std::vector<int32_t> slot_of;   // [max_tokens] position -> slot, -1
    std::vector<int32_t> selected;  // [max_tokens] the last split naming it
    int32_t front = -1, back = -1;  // the most and least recently selected
    long held = 0;                  // slots it holds
  };
  // A layer's last split.
  struct LayerSplit {
    kv_memory_service::OwnedFetchPlan misses, hits;
    std::vector<int32_t> plan_offsets;  // the plan's head offsets
    std::vector<int32_t> slots;      // plan order: each row's slot
    std::vector<int32_t> miss_slot;  // misses order: each row's slot, -1
    std::vector<char> skipped;       // [head]: read from the fetch
    int32_t count = 0;               // splits so far
  };

  Slots& At(int layer, int g) { return slots_[layer * n_kv_heads_ + g]; }
  void Unlink(Slots& s, int32_t slot);
  void LinkFront(Slots& s, int32_t slot);
  // The slot a miss takes from head `s` once the bound is reached, of
  // those split `count` did not select (the back of the recency order):
  // the least recent, or by frequency the least often selected.
  int32_t Victim(const Slots& s, int32_t count) const;
  // Head g's split into `split`: its hits, then its misses' slots, or its
  // every row to fetch where they do not fit.
  void SplitHead(Slots& s, const kv_memory_service::FetchPlan& plan, int g,
                 long budget, LayerSplit& split, Counts& counts);

  const int n_kv_heads_, max_tokens_, row_width_;
  const double fraction_;  // of every layer and head's cached rows
  const RowCacheReplacement replacement_;
  const long rows_per_token_;  // layers x KV heads
  const long max_rows_;        // the bound at max_tokens
  long held_ = 0;              // slots taken, all layers and heads
  std::vector<Slots> slots_;        // [layer][head]
  std::vector<LayerSplit> layers_;  // [layer]
  // [max_rows_][row_width] each, and per slot its position and neighbours;
  // left uninitialized (written as slots are taken).
  std::unique_ptr<uint16_t[]> k_, v_;
  std::unique_ptr<int32_t[]> position_, prev_, next_;
  // By frequency: per slot, the selections since its row took it.
  std::unique_ptr<int32_t[]> uses_;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_CACHE_H_
