// One-sided reads of a memory node's rows: where a fetch plan's rows lie in
// a stored layer and where they go, for a reader that addresses the rows
// itself (a CUDA kernel reading mapped host memory, or the host) instead of
// asking the node to gather them.
//
// A stored layer holds its KV heads one after the other, each head's rows
// in slots of row_bytes bytes, head_stride slots a head (the node's layout,
// [kv_head][slot][row]; until a head evicts, a position's slot is the
// position). The destination is a fetch's (kv_types.h, FetchPlan): the K
// rows of every head in plan order, then the V rows. Plain C++, shared by
// the host and nvcc (kernels.h); GatherRowsOnHost is the reference the
// CUDA kernel (LaunchGatherRows) is tested against.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_GATHER_ROWS_H_
#define INFINIGEN_GPU_WORKER_BACKEND_GATHER_ROWS_H_

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define IG_HOST_DEVICE __host__ __device__
#else
#define IG_HOST_DEVICE
#endif

namespace infinigen::gpu_worker {

struct GatherRowsParams {
  const void* k_rows = nullptr;   // [n_heads, head_stride, row_bytes]
  const void* v_rows = nullptr;   // same layout
  long head_stride = 0;           // slots per head
  // The plan's slots, head by head; null for a leading plan: each head's
  // first n_rows / n_heads slots (a whole layer), head_offsets unused.
  const int32_t* indices = nullptr;
  const int32_t* head_offsets = nullptr;  // [n_heads + 1], from 0
  int n_heads = 0;
  long n_rows = 0;    // head_offsets[n_heads]: the plan's rows
  int row_bytes = 0;  // even (rows are uint16_t values)
  void* out = nullptr;  // [2, n_rows, row_bytes]: K rows, then V rows
};

// A row cache's fetched misses into its slots, in the backend's memory:
// staged row i of k_rows and v_rows (n_rows of them, as a fetch stages
// them) to row slots[i] of slot_k and slot_v, where slots[i] >= 0 (a
// negative entry is a row read from the staging itself). slots is backend
// memory; no two entries name the same slot. Backend::ScatterRows.
struct ScatterRowsParams {
  const uint16_t* k_rows = nullptr;  // [n_rows, row_width]
  const uint16_t* v_rows = nullptr;
  const int32_t* slots = nullptr;    // [n_rows]
  long n_rows = 0;
  int row_width = 0;
  uint16_t* slot_k = nullptr;        // [slot_rows, row_width]
  uint16_t* slot_v = nullptr;
  long slot_rows = 0;
};

// The head of plan row r (head_offsets[h] <= r < head_offsets[h + 1]; an
// empty head owns no row): a binary search over the offsets.
IG_HOST_DEVICE inline int GatherRowHead(const int32_t* head_offsets,
                                        int n_heads, long r) {
  int lo = 0, hi = n_heads - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (head_offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Byte offset, in k_rows or v_rows, of plan row r.
IG_HOST_DEVICE inline long GatherRowSource(const GatherRowsParams& p, long r) {
  if (p.indices == nullptr) {  // leading: every head the same count
    const long per_head = p.n_rows / p.n_heads;
    return ((r / per_head) * p.head_stride + r % per_head) * p.row_bytes;
  }
  const int h = GatherRowHead(p.head_offsets, p.n_heads, r);
  return (static_cast<long>(h) * p.head_stride + p.indices[r]) * p.row_bytes;
}

// The reference: every row copied with memcpy, in the kernel's arithmetic.
inline void GatherRowsOnHost(const GatherRowsParams& p) {
  auto* out = static_cast<char*>(p.out);
  const auto* k = static_cast<const char*>(p.k_rows);
  const auto* v = static_cast<const char*>(p.v_rows);
  for (long r = 0; r < p.n_rows; ++r) {
    const long from = GatherRowSource(p, r);
    std::memcpy(out + r * p.row_bytes, k + from, p.row_bytes);
    std::memcpy(out + (p.n_rows + r) * p.row_bytes, v + from, p.row_bytes);
  }
}

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_GATHER_ROWS_H_
