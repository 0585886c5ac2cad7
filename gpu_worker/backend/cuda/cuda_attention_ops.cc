// CudaBackend's attention (cuda_backend_class.h): over the local cache
// (flash attention for fp16 prefills, split over the SMs for decoding),
// over staged offloaded rows, and the KV row codecs on the device.
#include "gpu_worker/backend/cuda/cuda_backend_class.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_format.h"
#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

// Decode attention splits a (query, head)'s rows over more blocks while
// there are fewer than kBlocksPerSm blocks per SM, in chunks of at least
// kMinRowsPerSplit rows.
constexpr long kBlocksPerSm = 4;
constexpr long kMinRowsPerSplit = 256;
constexpr int kMaxHeadDim = 256;  // the attention kernel's limit

}  // namespace

void CudaBackend::Attention(const AttentionParams& a) {
  constexpr const char* kOp = "Attention";
  if (!Begin() || a.n == 0) return;
  const long kv_max = static_cast<long>(a.kv_len0) + a.n - 1;
  if (a.n < 0 || a.n_heads <= 0 || a.n_kv_heads <= 0 ||
      a.n_heads % a.n_kv_heads != 0 || a.head_dim <= 0 ||
      a.head_dim > kMaxHeadDim || a.kv_len0 < 1 || a.kv_stride < kv_max) {
    return FailShape(
        kOp,
        absl::StrFormat("n=%d n_heads=%d n_kv_heads=%d (must divide n_heads) "
                        "head_dim=%d (1..%d) kv_len0=%d (>= 1) kv_stride=%d "
                        "(>= kv_len0 + n - 1)",
                        a.n, a.n_heads, a.n_kv_heads, a.head_dim, kMaxHeadDim,
                        a.kv_len0, a.kv_stride));
  }
  const bool half_kv = a.k_half != nullptr;
  if (half_kv && (a.v_half == nullptr || a.prob_sums != nullptr)) {
    return FailShape(kOp, "fp16 K needs fp16 V and no prob_sums");
  }
  const long q_count = static_cast<long>(a.n) * a.n_heads * a.head_dim;
  const long kv_count =
      ((a.n_kv_heads - 1L) * a.kv_stride + kv_max) * a.head_dim;
  AttentionKernelParams p;
  p.q = In(a.q, q_count, kOp, "q");
  if (half_kv) {
    p.k = p.v = nullptr;
    p.k_half = In(a.k_half, kv_count, kOp, "k_half");
    p.v_half = In(a.v_half, kv_count, kOp, "v_half");
  } else {
    p.k = In(a.k, kv_count, kOp, "k");
    p.v = In(a.v, kv_count, kOp, "v");
  }
  p.out = Out(a.out, q_count, kOp, "out");
  if (a.prob_sums != nullptr) {
    p.prob_sums = Out(a.prob_sums, a.n_heads * kv_max, kOp, "prob_sums");
  }
  if (!ok()) return;
  p.n = a.n;
  p.n_heads = a.n_heads;
  p.n_kv_heads = a.n_kv_heads;
  p.head_dim = a.head_dim;
  p.kv_stride = a.kv_stride;
  p.kv_len0 = a.kv_len0;
  p.scale = a.scale;
  p.window = a.window;
  if (options_.half_precision && a.n >= kMinFlashQueries &&
      FlashAttentionSupports(p)) {
    Launched(LaunchFlashAttention(p, stream_), kOp);
    return;
  }
  // Few (query, head) rows over a long cache (decoding): split the cache
  // so that every SM has blocks to run.
  const long rows = static_cast<long>(a.n) * a.n_heads;
  const long target = kBlocksPerSm * sm_count_;
  if (rows < target && kv_max >= 2 * kMinRowsPerSplit) {
    p.kv_splits = static_cast<int>(
        std::min(kv_max / kMinRowsPerSplit, (target + rows - 1) / rows));
  }
  if (p.kv_splits > 1) {
    const size_t bytes = AttentionWorkspaceFloats(p) * sizeof(float);
    if (!CheckCuda(attention_scratch_.Reserve(bytes, stream_), kOp)) return;
    p.workspace = reinterpret_cast<float*>(attention_scratch_.data());
  }
  Launched(LaunchAttention(p, stream_), kOp);
}

void CudaBackend::DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                               KvRowFormat format, float* rows) {
  constexpr const char* kOp = "DecodeKvRows";
  if (!Begin() || n_rows == 0) return;
  const bool int4 = format == KvRowFormat::kInt4;
  if (n_rows < 0 || head_dim <= 0 ||
      (int4 && (head_dim % 4 != 0 ||
                head_dim % std::min(64, head_dim) != 0))) {
    return FailShape(kOp, absl::StrFormat("n_rows=%d head_dim=%d format=%s",
                                          n_rows, head_dim,
                                          KvRowFormatName(format)));
  }
  const long count = static_cast<long>(n_rows) * head_dim;
  const uint16_t* id =
      In(in, static_cast<long>(n_rows) * KvRowWidth(format, head_dim), kOp,
         "in");
  float* od = Out(rows, count, kOp, "rows");
  if (!ok()) return;
  if (int4) {
    Int4DequantParams p;
    p.in = id;
    p.rows = od;
    p.n_rows = n_rows;
    p.head_dim = head_dim;
    Launched(LaunchInt4Dequant(p, stream_), kOp);
  } else {
    Launched(LaunchHalfToFloat({id, od, count}, stream_), kOp);
  }
}

bool CudaBackend::AttendStagedRows(const StagedRowsAttention& a) {
  constexpr const char* kOp = "AttendStagedRows";
  if (!Begin()) return true;
  const bool int4 = a.format == KvRowFormat::kInt4;
  if (a.n_heads <= 0 || a.n_kv_heads <= 0 ||
      a.n_heads % a.n_kv_heads != 0 || a.head_dim <= 0 || a.rows < 0 ||
      a.max_head_rows < 0 ||
      (int4 && (a.head_dim % 4 != 0 ||
                a.head_dim % std::min(64, a.head_dim) != 0))) {
    FailShape(kOp, absl::StrFormat("n_heads=%d n_kv_heads=%d (must divide) "
                                   "head_dim=%d rows=%d max_head_rows=%d",
                                   a.n_heads, a.n_kv_heads, a.head_dim,
                                   a.rows, a.max_head_rows));
    return true;
  }
  const long q_count = static_cast<long>(a.n_heads) * a.head_dim;
  const long new_count = static_cast<long>(a.n_kv_heads) * a.head_dim;
  const int row_width = KvRowWidth(a.format, a.head_dim);
  // With a row cache's slots the staging holds the misses alone.
  const long row_count =
      std::max(1L, a.slots != nullptr ? a.staged_rows : a.rows) * row_width;
  StagedAttentionParams p;
  p.q = In(a.q, q_count, kOp, "q");
  p.k_rows = In(a.k_rows, row_count, kOp, "k_rows");
  p.v_rows = In(a.v_rows, row_count, kOp, "v_rows");
  if (a.slots != nullptr) {
    const long slot_count = std::max(1L, a.slot_rows) * row_width;
    p.slots = In(a.slots, std::max(1L, a.rows), kOp, "slots");
    p.slot_k = In(a.slot_k, slot_count, kOp, "slot_k");
    p.slot_v = In(a.slot_v, slot_count, kOp, "slot_v");
  }
  p.head_offsets = In(a.head_offsets, a.n_kv_heads + 1L, kOp,
                      "head_offsets");
  p.k_new = In(a.k_new, new_count, kOp, "k_new");
  p.v_new = In(a.v_new, new_count, kOp, "v_new");
  p.out = Out(a.out, q_count, kOp, "out");
  if (!ok()) return true;
  p.n_heads = a.n_heads;
  p.n_kv_heads = a.n_kv_heads;
  p.head_dim = a.head_dim;
  p.row_width = row_width;
  p.int4_group = int4 ? std::min(64, a.head_dim) : 0;
  p.scale = a.scale;
  // Split each head's rows so that every SM has blocks to run, as
  // Attention does.
  const long seen = a.max_head_rows + 1L;
  const long target = kBlocksPerSm * sm_count_;
  if (a.n_heads < target && seen >= 2 * kMinRowsPerSplit) {
    p.kv_splits = static_cast<int>(std::min(
        seen / kMinRowsPerSplit, (target + a.n_heads - 1) / a.n_heads));
  }
  if (p.kv_splits > 1) {
    const size_t bytes = StagedAttentionWorkspaceFloats(p) * sizeof(float);
    if (!CheckCuda(attention_scratch_.Reserve(bytes, stream_), kOp)) {
      return true;
    }
    p.workspace = reinterpret_cast<float*>(attention_scratch_.data());
  }
  Launched(LaunchStagedAttention(p, stream_), kOp);
  return true;
}

void CudaBackend::ScatterRows(const ScatterRowsParams& a) {
  constexpr const char* kOp = "ScatterRows";
  if (!Begin() || a.n_rows == 0) return;
  if (a.n_rows < 0 || a.row_width <= 0 || a.slot_rows <= 0) {
    FailShape(kOp, absl::StrFormat("n_rows=%d row_width=%d slot_rows=%d",
                                   a.n_rows, a.row_width, a.slot_rows));
    return;
  }
  const long rows = a.n_rows * a.row_width;
  const long slots = a.slot_rows * a.row_width;
  ScatterRowsParams p = a;
  p.k_rows = In(a.k_rows, rows, kOp, "k_rows");
  p.v_rows = In(a.v_rows, rows, kOp, "v_rows");
  p.slots = In(a.slots, a.n_rows, kOp, "slots");
  p.slot_k = Out(a.slot_k, slots, kOp, "slot_k");
  p.slot_v = Out(a.slot_v, slots, kOp, "slot_v");
  if (ok()) Launched(LaunchScatterRows(p, stream_), kOp);
}

bool CudaBackend::EncodeKvRows(const float* rows, int n_rows, int head_dim,
                               KvRowFormat format, uint16_t* out) {
  constexpr const char* kOp = "EncodeKvRows";
  if (format != KvRowFormat::kHalf) return false;
  if (!Begin() || n_rows == 0) return true;
  if (n_rows < 0 || head_dim <= 0) {
    FailShape(kOp, absl::StrFormat("n_rows=%d head_dim=%d", n_rows,
                                   head_dim));
    return true;
  }
  const long count = static_cast<long>(n_rows) * head_dim;
  const float* in = In(rows, count, kOp, "rows");
  uint16_t* od = Out(out, count, kOp, "out");
  if (ok()) Launched(LaunchFloatToHalf({in, od, count}, stream_), kOp);
  return true;
}

}  // namespace infinigen::gpu_worker::cuda
