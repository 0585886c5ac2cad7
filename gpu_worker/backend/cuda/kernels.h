// CUDA kernels of the GPU worker, callable from plain C++.
//
// Each launcher takes a parameter struct whose pointers are device memory
// (device or managed; shapes in the comments), a caller-owned stream (a
// cudaStream_t passed as void*; null is the legacy default stream),
// allocates nothing, and returns the launch's cudaError_t as an int (0 on
// success), so that this header needs no CUDA headers. Empty or
// inconsistent shapes and missing pointers are rejected before anything is
// launched with cudaErrorInvalidValue (1). The arithmetic follows the CPU
// reference (gpu_worker/backend/cpu/cpu_backend.cc),
// speculator::SpeculateScores and the int4 row format (KvRowFormat::kInt4:
// EncodeKvRows and DecodeKvRows in gpu_worker/backend/kv_rows.h) formula for
// formula; only the order of float additions differs.
//
// Sources: layer_kernels.cu (norms, RoPE, pointwise, conversions),
// attention.cu, flash_attention.cu, gather.cu, speculation.cu.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_CUDA_KERNELS_H_
#define INFINIGEN_GPU_WORKER_BACKEND_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "gpu_worker/backend/gather_rows.h"
#include "gpu_worker/backend/kv_rows.h"
#include "gpu_worker/backend/speculation_params.h"

namespace infinigen::gpu_worker::cuda {

// ---------------------------------------------------------------- norms

struct RmsNormParams {
  const float* x;     // [n, dim]
  const float* gain;  // [dim]
  float* y;           // [n, dim]; may be x
  int n = 0;
  int dim = 0;
  float eps = 1e-5f;
};

// y = x / sqrt(mean(x^2) + eps) * gain, one block per row.
int LaunchRmsNorm(const RmsNormParams& p, void* stream);

struct LayerNormParams {
  const float* x;     // [n, dim]
  const float* gain;  // [dim]
  const float* bias;  // [dim]
  float* y;           // [n, dim]; may be x
  int n = 0;
  int dim = 0;
  float eps = 1e-5f;
};

// y = (x - mean) / sqrt(var + eps) * gain + bias (biased variance), one
// block per row, two passes over the row as in the CPU reference.
int LaunchLayerNorm(const LayerNormParams& p, void* stream);

// ---------------------------------------------------------------- RoPE

struct RopeParams {
  float* x;              // [n, n_heads, head_dim], rotated in place
  const int* positions;  // [n]
  int n = 0;
  int n_heads = 0;
  int head_dim = 0;  // even
  float theta = 10000.0f;
};

// Half-split rotary embedding: dims j and j + head_dim/2 of each head of
// row i rotate by positions[i] * theta^(-2j/head_dim). The frequency is
// computed in double and rounded to float (the CPU's powf may differ from
// it by an ulp, which at position p moves the angle by about p * 6e-8).
int LaunchRope(const RopeParams& p, void* stream);

// ------------------------------------------------------------ pointwise

struct SwiGluParams {
  float* gate;      // [count], becomes silu(gate) * up
  const float* up;  // [count]
  long count = 0;
};
int LaunchSwiGlu(const SwiGluParams& p, void* stream);

// GELU (tanh form) gate: gate = gelu_tanh(gate) * up.
int LaunchGeluTanhGate(const SwiGluParams& p, void* stream);

struct ScaleParams {
  float* x;  // [count], becomes x * s
  long count = 0;
  float s = 1.0f;
};
int LaunchScale(const ScaleParams& p, void* stream);

struct ReluParams {
  float* x;  // [count], becomes max(x, 0)
  long count = 0;
};
int LaunchRelu(const ReluParams& p, void* stream);

struct AddParams {
  float* x;        // [count], becomes x + y
  const float* y;  // [count]
  long count = 0;
};
int LaunchAdd(const AddParams& p, void* stream);

struct BiasAddParams {
  float* y;           // [n, out], row i becomes y[i] + bias
  const float* bias;  // [out]
  int n = 0;
  int out = 0;
};
int LaunchBiasAdd(const BiasAddParams& p, void* stream);

struct FloatToHalfParams {
  const float* x;  // [count]
  uint16_t* y;     // [count] IEEE binary16, round to nearest even
  long count = 0;
};
// The fp16 inputs of cublasGemmEx (weights once, activations per call).
// Matches infinigen::FloatToHalf (common/half.h) bit for bit, NaN payloads
// aside; magnitudes above 65504 become infinities.
int LaunchFloatToHalf(const FloatToHalfParams& p, void* stream);

// FloatToHalf over `rows` rows of `width` values, strided: row r from
// x + r * x_stride to y + r * y_stride (a chunk's K or V rows into a local
// cache kept in fp16).
struct FloatRowsToHalfParams {
  const float* x;
  long x_stride = 0;  // >= width
  uint16_t* y;
  long y_stride = 0;  // >= width
  int rows = 0;
  long width = 0;
};
int LaunchFloatRowsToHalf(const FloatRowsToHalfParams& p, void* stream);

struct HalfToFloatParams {
  const uint16_t* x;  // [count] IEEE binary16
  float* y;           // [count]
  long count = 0;
};

// Fetched fp16 KV rows to the fp32 rows attention reads; exact, as
// infinigen::HalfToFloat.
int LaunchHalfToFloat(const HalfToFloatParams& p, void* stream);

// -------------------------------------------------------------- int4 KV

// Int4Policy's stored row (FlexGen's group-wise asymmetric 4-bit format):
// groups of g = min(64, head_dim) values; the row is head_dim / g pairs of
// fp16 (scale, min), then head_dim / 2 bytes of nibbles, value 2i in the
// low nibble of byte i and value 2i + 1 in its high nibble. Value =
// nibble * scale + min (KvRowFormat::kInt4).
struct Int4DequantParams {
  const uint16_t* in;  // [n_rows, KvRowWidth(kInt4, head_dim)]
  float* rows;         // [n_rows, head_dim]
  int n_rows = 0;
  int head_dim = 0;  // divisible by 4 and by min(64, head_dim)
};
int LaunchInt4Dequant(const Int4DequantParams& p, void* stream);

// ------------------------------------------------------------ attention

// Causal attention of n queries over a KV cache: query i of head h sees KV
// rows [0, kv_len0 + i) of KV head h / (n_heads / n_kv_heads). Each
// (query, head) is one block of 8 warps; each warp keeps an online softmax
// (running max, sum and output) over its share of the rows, and the warps
// merge at the end, so no memory grows with the KV length. For decoding
// (few queries, long caches) the rows can be split over kv_splits blocks
// whose partial results a second kernel merges through `workspace`.
struct AttentionKernelParams {
  const float* q;  // [n, n_heads, head_dim]
  const float* k;  // [n_kv_heads, kv_stride, head_dim]
  const float* v;  // [n_kv_heads, kv_stride, head_dim]
  float* out;      // [n, n_heads, head_dim]
  int n = 0;
  int n_heads = 0;
  int n_kv_heads = 0;  // divides n_heads
  int head_dim = 0;    // 1..256
  int kv_stride = 0;   // >= kv_len0 + n - 1
  int kv_len0 = 0;     // >= 1
  float scale = 1.0f;  // applied to q.k before the softmax
  // Optional [n_heads, kv_len0 + n - 1]: each query's normalised
  // probabilities are added (atomically) in a second pass over the rows.
  float* prob_sums = nullptr;
  // > 0: a sliding window; query i sees only rows
  // [max(0, kv_len0 + i - window), kv_len0 + i).
  int window = 0;
  // Blocks each (query, head)'s rows are split over; > 1 needs workspace.
  int kv_splits = 1;
  float* workspace = nullptr;  // [AttentionWorkspaceFloats(*this)]
  // Where set (k and v null): the K and V rows as fp16 bits, the same
  // layout (a local cache kept in fp16). Not with prob_sums.
  const uint16_t* k_half = nullptr;
  const uint16_t* v_half = nullptr;
};

// Floats of workspace an attention launch needs (0 for kv_splits <= 1).
inline long AttentionWorkspaceFloats(const AttentionKernelParams& p) {
  if (p.kv_splits <= 1) return 0;
  const long rows = static_cast<long>(p.n) * p.n_heads;
  // Per (row, split): output and (max, sum); per row: the merged (max, sum).
  return rows * p.kv_splits * (p.head_dim + 2) + rows * 2;
}

// Decode attention of one token's query heads over the rows a fetch staged
// on the device: KV head g's fetched rows are rows [head_offsets[g],
// head_offsets[g + 1]) of k_rows and v_rows (stored: fp16, or int4 as
// KvRowFormat::kInt4 lays them out, decoded as DecodeKvRows does), then
// the new token's exact row (k_new, v_new); every head in one launch, the
// counts read on the device. The arithmetic of LaunchAttention (its online
// softmax, warps and splits) over those rows.
struct StagedAttentionParams {
  const float* q;                // [n_heads, head_dim]
  const uint16_t* k_rows;        // [rows, row_width] as stored
  const uint16_t* v_rows;        // [rows, row_width] as stored
  const int32_t* head_offsets;   // [n_kv_heads + 1], from 0, ascending
  const float* k_new;            // [n_kv_heads, head_dim]
  const float* v_new;            // [n_kv_heads, head_dim]
  float* out;                    // [n_heads, head_dim]
  int n_heads = 0;
  int n_kv_heads = 0;            // divides n_heads
  int head_dim = 0;              // 1..256
  // fp16: head_dim; int4: KvRowWidth(kInt4, head_dim).
  int row_width = 0;
  int int4_group = 0;            // int4: values per group; 0: fp16
  float scale = 1.0f;
  // Blocks each head's rows are split over; > 1 needs workspace.
  int kv_splits = 1;
  float* workspace = nullptr;    // [StagedAttentionWorkspaceFloats(*this)]
  // A row cache's (StagedRowsAttention): plan row r at row slots[r] of
  // slot_k/slot_v where >= 0, else row -1 - slots[r] of k_rows/v_rows.
  const int32_t* slots = nullptr;  // [rows] or null
  const uint16_t* slot_k = nullptr;
  const uint16_t* slot_v = nullptr;
};

inline long StagedAttentionWorkspaceFloats(const StagedAttentionParams& p) {
  if (p.kv_splits <= 1) return 0;
  return static_cast<long>(p.n_heads) * p.kv_splits * (p.head_dim + 2) +
         static_cast<long>(p.n_heads) * 2;
}

int LaunchStagedAttention(const StagedAttentionParams& p, void* stream);

// A row cache's misses into its slots (ScatterRowsParams, backend.h): one
// warp per row, K and V.
int LaunchScatterRows(const ScatterRowsParams& p, void* stream);

int LaunchAttention(const AttentionKernelParams& p, void* stream);

// The largest head_dim LaunchFlashAttention takes.
constexpr int kMaxFlashHeadDim = 256;

// Whether LaunchFlashAttention computes `p`: no prob_sums, no window,
// head_dim a multiple of 16 up to kMaxFlashHeadDim, q, out and the K and V
// rows (k and v, or k_half and v_half) 16-byte aligned (kv_splits is
// ignored).
bool FlashAttentionSupports(const AttentionKernelParams& p);

// Dynamic shared memory a flash attention block takes at head_dim.
size_t FlashAttentionSharedBytes(int head_dim);

// LaunchAttention's result for many queries (a prefill chunk), on tensor
// cores: q, k and v rounded to fp16 (about 5e-4 relative error each),
// scores, softmax and sums in fp32. One block of 4 warps per 64 queries
// and query head walks the KV rows in tiles of 64 (FlashAttention's
// tiling and online softmax), so each K and V row is read once per 64
// queries instead of once per query. head_dim 64 and 128 keep scores,
// probabilities and outputs in registers (mma.sync fragments); other
// head_dims pass them through shared memory (WMMA). Rejects
// (cudaErrorInvalidValue) what FlashAttentionSupports does not take and
// LaunchAttention's bad shapes.
int LaunchFlashAttention(const AttentionKernelParams& p, void* stream);

// The same through the shared-memory (WMMA) kernel at every head_dim: the
// baseline the register-resident kernel is measured against
// (bench/gpu/flash_attention_bench) and tested beside.
int LaunchFlashAttentionWmma(const AttentionKernelParams& p, void* stream);

// --------------------------------------------------------- one-sided reads

// GatherRowsOnHost (gather_rows.h) on the device: the plan's K and V rows
// read from k_rows and v_rows (host memory mapped for the device, or
// device memory) into out (device memory), with no gather on the host.
// indices and head_offsets must be device-accessible, and every index
// below head_stride (the caller checked the plan against the store); a
// leading plan (indices null) needs n_rows a multiple of n_heads, at most
// head_stride rows a head.
// Moves the widest word (16 to 2 bytes) dividing row_bytes and the three
// base addresses; rejects (cudaErrorInvalidValue) an odd row, an empty
// plan and missing pointers.
int LaunchGatherRows(const GatherRowsParams& p, void* stream);

// One word read from every page of a range of host memory mapped for the
// device, so that the device's first access to each page is done before a
// read that needs the rows. *sink ^= the xor of every page's first 32-bit
// word (so the loads stay; a test checks the value). bytes and the address
// must be multiples of 4, page_bytes a power of two of at least 4.
struct TouchPagesParams {
  const void* data = nullptr;  // device address of the mapped range
  size_t bytes = 0;
  size_t page_bytes = 4096;
  unsigned* sink = nullptr;  // device memory, one word
};
int LaunchTouchPages(const TouchPagesParams& p, void* stream);

// ----------------------------------------------------------- speculation

// speculator::SpeculateScores on the device (SpeculationParams, in
// gpu_worker/backend/speculation_params.h, says what it computes).
int LaunchSpeculateScores(const SpeculationParams& p, void* stream);

struct QuantizePartialKeysParams {
  const float* keys;  // [n_rows, n_cols]
  uint8_t* rows;      // [n_rows] of speculator::PartialKeyRowBytes(n_cols)
  int n_rows = 0;
  int n_cols = 0;
  // Bytes from one row's start to the next; 0: the rows are packed.
  long row_stride = 0;
};

// speculator::QuantizePartialKeys on the device (the same bytes: the
// division and the rounding are IEEE's on both).
int LaunchQuantizePartialKeys(const QuantizePartialKeysParams& p,
                              void* stream);

struct AbsColumnSumsParams {
  const float* x;  // [n, heads, d]: each token's skewed rows
  float* sums;     // [heads / per_kv, d], added to
  int n = 0;
  int heads = 0;
  int per_kv = 1;  // heads summed into one row of sums
  int d = 0;       // at most 1024
};

// sums[h / per_kv][c] += sum over t < n, h < heads of |x[t][h][c]|: one
// block per KV head, the tokens split over a fixed number of lanes and the
// lanes' partial sums added in a fixed order (the same bits every run).
int LaunchAbsColumnSums(const AbsColumnSumsParams& p, void* stream);

struct SelectTopKParams {
  const float* scores;  // [n_kv_heads, n_tokens]
  int32_t* indices;     // [n_kv_heads, k]: each head's k chosen positions
  int n_kv_heads = 0;
  int n_tokens = 0;
  int k = 0;  // 1..n_tokens
  // Where set ([n_kv_heads + 1], device memory): head g takes
  // head_offsets[g + 1] - head_offsets[g] positions (0..n_tokens, which the
  // caller checked), written at indices + head_offsets[g]; k is unused.
  const int32_t* head_offsets = nullptr;
};

// Per KV head, the k highest-scoring positions (ties to the lower
// position; -0 equals +0; NaN below every number), written in ascending
// order: speculator::SelectTopKPerHead's `indices` for the same counts. One
// block per head: a four-pass radix select finds the k-th largest score,
// then one ordered scan emits the positions.
int LaunchSelectTopK(const SelectTopKParams& p, void* stream);

struct CombineHeadScoresParams {
  const float* head_scores;  // [n_heads, n_tokens]: speculated logits
  float* scores;             // [n_kv_heads, n_tokens]
  int n_heads = 0;           // a multiple of n_kv_heads
  int n_kv_heads = 0;
  int n_tokens = 0;
};

// speculator::CombineHeadScores with every token present: per KV head and
// token, the largest over its query heads of logit - log-sum-exp. One
// block per KV head; the sums run in another order than the CPU's (the
// log-sum-exp differs in its last bits).
int LaunchCombineHeadScores(const CombineHeadScoresParams& p, void* stream);

}  // namespace infinigen::gpu_worker::cuda

#endif  // INFINIGEN_GPU_WORKER_BACKEND_CUDA_KERNELS_H_
