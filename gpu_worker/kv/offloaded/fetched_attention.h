// Attention of one new token over a fetch's rows plus its own, every way
// the backend can read them: where they lie as stored (a host backend:
// the fetch buffer, or the node's rows by index), staged on a device in
// one operation over every head, or decoded into the shared fp32 rows
// (DecodedRows) first. Which applies is the row source's choice
// (row_source.h). Owns nothing but its view of the shared buffers.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_FETCHED_ATTENTION_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_FETCHED_ATTENTION_H_

#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/kv_rows.h"
#include "gpu_worker/kv/offloaded/layer_fetch.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "model/config.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// The rows attention reads once decoded, shared by every sequence:
// [kv_head][stride][head_dim], a decode step's fetched rows plus the new
// token, or one prefill layer's keys and values; and the same in fp16
// while prefilling (Layout::half_rows).
struct DecodedRows {
  DeviceBuffer<float> k, v;
  DeviceBuffer<uint16_t> k_half, v_half;
  int stride = 0;  // rows between KV heads: max_seq_len + 1

  absl::Status Allocate(Backend& backend, const model::ModelConfig& c,
                        const Layout& layout);
};

// One query row's attention (backend memory): q [n_heads][head_dim], the
// new token's k_new and v_new [n_kv_heads][head_dim], into out (as q);
// prob_sums, where set, [n_heads][stride] gathers each head's
// probabilities (H2O) in plan order, then the new token's.
struct RowAttention {
  const float* q = nullptr;
  const float* k_new = nullptr;
  const float* v_new = nullptr;
  float* out = nullptr;
  float* prob_sums = nullptr;
  KvRowFormat format = KvRowFormat::kHalf;
};

// Where stored rows lie for attention in place: each head's rows at
// k + head * head_values (head_values 0: the fetch's plan order, K of
// every head then V), read by the plan's indices where by_index.
struct StoredRowsAt {
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  size_t head_values = 0;
  bool by_index = false;
};

// Where a device row cache's rows lie (StagedRowsAttention::slots): the
// slot arrays and, in backend memory, each plan row's slot (or -1 - its
// row among the misses staged in the fetch's staging); the misses staged.
struct SlotRowsAt {
  const uint16_t* slot_k = nullptr;
  const uint16_t* slot_v = nullptr;
  long slot_rows = 0;
  const int32_t* slots = nullptr;  // [plan rows]
  long staged_rows = 0;            // the misses
};

// Where one KV head's stored rows lie for attention in place: row t of
// the head's plan is row indices[t] of k and v where indices is set, else
// row t.
struct HeadRowsAt {
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  const int32_t* indices = nullptr;
};

class FetchedAttention {
 public:
  FetchedAttention(Backend& backend, const model::ModelConfig& config,
                   const Layout& layout, DecodedRows& decoded)
      : backend_(backend), c_(config), layout_(layout), decoded_(decoded) {}

  // Over rows where they lie (Backend::AttendStoredRows, head by head);
  // false, having done nothing, where the backend cannot.
  bool InPlace(const LayerFetch& f, const StoredRowsAt& at,
               const RowAttention& a);
  // The same, each head's rows where heads[g] says.
  bool InPlace(const LayerFetch& f, absl::Span<const HeadRowsAt> heads,
               const RowAttention& a);
  // Over the fetch's staged rows, every head in one operation
  // (Backend::AttendStagedRows); false, having done nothing, where the
  // backend cannot or probabilities are wanted.
  bool Staged(LayerFetch& f, const RowAttention& a);
  // Decodes the fetched rows (plan order, at `rows`) into DecodedRows with
  // the new token's after them, then attends over them.
  void Decoded(LayerFetch& f, const uint16_t* rows, const RowAttention& a);
  // A node-gathered fetch's rows: in place on a host backend, else
  // staged, else decoded.
  void Gathered(LayerFetch& f, const RowAttention& a);
  // Over a device row cache's rows (SlotRowsAt), every head in one
  // operation: each plan row from the cache's slots, or from the fetch's
  // staged misses; false, having done nothing, where the backend cannot
  // or probabilities are wanted.
  bool FromSlots(LayerFetch& f, const SlotRowsAt& at,
                 const RowAttention& a);

 private:
  // Staged (at null) or FromSlots.
  bool StagedOver(LayerFetch& f, const SlotRowsAt* at, const RowAttention& a);
  // Head g's attention over its rows at `h` (Backend::AttendStoredRows).
  bool AttendHead(const LayerFetch& f, int g, const HeadRowsAt& h,
                  const RowAttention& a);

  Backend& backend_;
  const model::ModelConfig& c_;
  const Layout& layout_;
  DecodedRows& decoded_;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_FETCHED_ATTENTION_H_
