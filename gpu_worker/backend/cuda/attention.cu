// Causal attention over a KV cache (kernels.h, AttentionKernelParams).
//
// One block of kWarps warps per (query, head, KV split). A warp owns whole
// KV rows: each lane holds R = ceil(head_dim / 32) dims of the query, of
// every row it reads and of the running output, so a row's score is one
// warp reduction and rows are read coalesced. Each warp keeps an online
// softmax (running max m, sum l, unnormalised output acc) over its rows,
// kKeysPerStep rows at a time; the warps then merge through shared memory
// of kWarps * 32 * R floats. Nothing depends on the KV length but the loop
// count. With kv_splits > 1 the blocks of one (query, head) write their
// partial (acc, m, l) to the workspace and AttentionMergeKernel combines
// them. Probabilities for prob_sums need the final max and sum, so they are
// a second pass that recomputes each score exactly as the first did.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kKeysPerStep = 4;  // independent row loads in flight per warp
constexpr int kProbRowsPerBlock = 512;  // rows per block of the split pass
constexpr int kMaxHeadDim = 256;

__device__ float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1)
    v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

__device__ float HalfValue(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// A stored row (staged fetched rows: fp16, or int4 in groups of `group`
// values, KvRowFormat::kInt4's layout), or the new token's exact fp32 row
// where stored is null; row[d] is its d-th value as a float, decoded as
// DecodeKvRows decodes it (q * scale + min, rounded twice).
struct MixedRow {
  const uint16_t* stored;
  const float* exact;
  int group;     // int4: values per group; 0: fp16
  int n_groups;  // int4: groups per row
  __device__ float operator[](int d) const {
    if (stored == nullptr) return exact[d];
    if (group == 0) return HalfValue(stored[d]);
    // [scale, min] fp16 per group, then the nibbles, low one first.
    const int gi = d / group;
    const float scale = HalfValue(stored[2 * gi]);
    const float mn = HalfValue(stored[2 * gi + 1]);
    const auto* packed =
        reinterpret_cast<const uint8_t*>(stored + 2 * n_groups);
    const int q = (packed[d / 2] >> (4 * (d % 2))) & 0xF;
    return __fadd_rn(__fmul_rn(static_cast<float>(q), scale), mn);
  }
};

// This lane's dims (lane, lane + 32, ...) of a head_dim row; 0 past the end.
// Row: const float* or MixedRow.
template <int R, typename Row>
__device__ void LoadLaneDims(Row row, int head_dim, float (&out)[R]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int d = lane + 32 * r;
    out[r] = d < head_dim ? row[d] : 0.0f;
  }
}

// scale * q.k for one KV row, in every lane of the warp. Both passes score
// rows through this one function, so their scores agree bit for bit.
template <int R, typename Row>
__device__ float Score(const float (&q)[R], Row k_row, int head_dim,
                       float scale) {
  const int lane = threadIdx.x % 32;
  float s = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int d = lane + 32 * r;
    if (d < head_dim) s = fmaf(q[r], k_row[d], s);
  }
  return WarpSum(s) * scale;
}

// Where (query i, head h) reads and writes.
struct QueryHead {
  int i;
  int h;
  int first;       // the first KV row it sees (0 without a window)
  int len;         // the end of the KV rows it sees: kv_len0 + i
  long row;        // i * n_heads + h
  const float* k;  // [kv_stride, head_dim] of its KV head
  const float* v;  // same
  const uint16_t* k_half;  // the same in fp16 (AttentionKernelParams)
  const uint16_t* v_half;
};

__device__ QueryHead Locate(const AttentionKernelParams& p, long row) {
  QueryHead r;
  r.row = row;
  r.i = static_cast<int>(row / p.n_heads);
  r.h = static_cast<int>(row % p.n_heads);
  r.len = p.kv_len0 + r.i;
  r.first = p.window > 0 ? max(0, r.len - p.window) : 0;
  const int g = r.h / (p.n_heads / p.n_kv_heads);
  const long head_offset = static_cast<long>(g) * p.kv_stride * p.head_dim;
  r.k = p.k != nullptr ? p.k + head_offset : nullptr;
  r.v = p.v != nullptr ? p.v + head_offset : nullptr;
  r.k_half = p.k_half != nullptr ? p.k_half + head_offset : nullptr;
  r.v_half = p.v_half != nullptr ? p.v_half + head_offset : nullptr;
  return r;
}

// prob_sums[h][t] += exp(score_t - max) * inv_sum for t in [begin, end), one
// warp per row.
template <int R>
__device__ void AddProbabilities(const AttentionKernelParams& p,
                                 const QueryHead& qh, const float (&q)[R],
                                 int begin, int end, float max, float inv_sum) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int kv_max = p.kv_len0 + p.n - 1;
  float* acc = p.prob_sums + static_cast<long>(qh.h) * kv_max;
  for (int t = begin + warp; t < end; t += kWarps) {
    const float s =
        Score(q, qh.k + static_cast<long>(t) * p.head_dim, p.head_dim, p.scale);
    if (lane == 0) atomicAdd(acc + t, expf(s - max) * inv_sum);
  }
}

// The K and V rows of one query head's KV head, fp32, head_dim apart.
struct FloatRows {
  const float* k;
  const float* v;
  int head_dim;
  __device__ const float* K(int t) const {
    return k + static_cast<long>(t) * head_dim;
  }
  __device__ const float* V(int t) const {
    return v + static_cast<long>(t) * head_dim;
  }
};

// One fp16 row (a local cache kept in fp16): row[d] as a float, exact.
struct HalfRow {
  const uint16_t* values;
  __device__ float operator[](int d) const { return HalfValue(values[d]); }
};

// The K and V rows of one query head's KV head, fp16, head_dim apart.
struct HalfRows {
  const uint16_t* k;
  const uint16_t* v;
  int head_dim;
  __device__ HalfRow K(int t) const {
    return HalfRow{k + static_cast<long>(t) * head_dim};
  }
  __device__ HalfRow V(int t) const {
    return HalfRow{v + static_cast<long>(t) * head_dim};
  }
};

// A KV head's fetched rows as staged (`count` of them, row_width values
// apart: fp16, or int4 in groups of `group`), then the new token's exact
// row as row `count`.
struct StagedRows {
  const uint16_t* k;  // [count, row_width]
  const uint16_t* v;
  const float* k_new;  // [head_dim]
  const float* v_new;
  int count;
  int row_width;
  int group;     // 0: fp16
  int n_groups;
  __device__ MixedRow Row(const uint16_t* rows, const float* exact,
                          int t) const {
    return t < count
               ? MixedRow{rows + static_cast<long>(t) * row_width, nullptr,
                          group, n_groups}
               : MixedRow{nullptr, exact, 0, 0};
  }
  __device__ MixedRow K(int t) const { return Row(k, k_new, t); }
  __device__ MixedRow V(int t) const { return Row(v, v_new, t); }
};

// The same with a row cache's slots: row t is the head's plan row t, at
// slots[t] of the slot arrays where >= 0, else at -1 - slots[t] of the
// staged misses; then the new token's exact row as row `count`.
struct SlottedRows {
  const uint16_t* k;  // the staged misses [*, row_width]
  const uint16_t* v;
  const uint16_t* slot_k;  // [slot rows, row_width]
  const uint16_t* slot_v;
  const int32_t* slots;  // this head's plan rows
  const float* k_new;  // [head_dim]
  const float* v_new;
  int count;
  int row_width;
  int group;     // 0: fp16
  int n_groups;
  __device__ MixedRow Row(const uint16_t* staged, const uint16_t* held,
                          const float* exact, int t) const {
    if (t >= count) return MixedRow{nullptr, exact, 0, 0};
    const int s = slots[t];
    const uint16_t* row =
        s >= 0 ? held + static_cast<long>(s) * row_width
               : staged + static_cast<long>(-1 - s) * row_width;
    return MixedRow{row, nullptr, group, n_groups};
  }
  __device__ MixedRow K(int t) const { return Row(k, slot_k, k_new, t); }
  __device__ MixedRow V(int t) const { return Row(v, slot_v, v_new, t); }
};

// One warp's online softmax over its keys of [begin, end) (every kWarps-th
// group of kKeysPerStep) of `rows` (FloatRows or StagedRows): m the max
// score seen, l the sum of exp(score - m), acc this lane's dims of the sum
// of exp(score - m) * v.
template <int R, typename Rows>
__device__ void WarpOnlineSoftmax(const Rows& rows, int head_dim, float scale,
                                  const float (&q)[R], int begin, int end,
                                  int warp, float& m, float& l,
                                  float (&acc)[R]) {
  m = -CUDART_INF_F;
  l = 0.0f;
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int t0 = begin + warp * kKeysPerStep; t0 < end;
       t0 += kWarps * kKeysPerStep) {
    float s[kKeysPerStep];
    float m_new = m;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const int t = min(t0 + u, end - 1);  // past the end: a repeat, unused
      s[u] = Score(q, rows.K(t), head_dim, scale);
      if (t0 + u < end) m_new = fmaxf(m_new, s[u]);
    }
    // exp(-inf) = 0 on the first step, when l and acc are still 0.
    const float rescale = expf(m - m_new);
    l *= rescale;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] *= rescale;
#pragma unroll
    for (int u = 0; u < kKeysPerStep; ++u) {
      const int t = t0 + u;
      if (t < end) {
        const float e = expf(s[u] - m_new);
        l += e;
        float v[R];
        LoadLaneDims(rows.V(t), head_dim, v);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fmaf(e, v[r], acc[r]);
      }
    }
    m = m_new;
  }
}

// The block's warps' (m, l, acc) merged: warp w's terms are scaled by
// exp(m_w - max). With one split, writes the row's output (out [rows,
// head_dim]) and returns true with the final max and 1 / sum; else writes
// this split's partial result to the workspace (AttentionMergeKernel's
// layout, rows = n * n_heads) and returns false.
template <int R>
__device__ bool MergeWarps(float m, float l, const float (&acc)[R],
                           int head_dim, int kv_splits, long row, int split,
                           int n, int n_heads, float* out, float* workspace,
                           float& max, float& inv_sum) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  __shared__ float warp_m[kWarps];
  __shared__ float warp_l[kWarps];
  __shared__ float warp_acc[kWarps][32 * R];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) warp_acc[warp][lane + 32 * r] = acc[r];
  __syncthreads();
  max = -CUDART_INF_F;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) max = fmaxf(max, warp_m[w]);
  float weight[kWarps];
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    // A warp (or a whole split) that saw no row has m = -inf.
    weight[w] = warp_m[w] == -CUDART_INF_F ? 0.0f : expf(warp_m[w] - max);
    sum += weight[w] * warp_l[w];
  }

  if (kv_splits == 1) {
    inv_sum = 1.0f / sum;
    for (int d = threadIdx.x; d < head_dim; d += kThreads) {
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) o = fmaf(weight[w], warp_acc[w][d], o);
      out[row * head_dim + d] = o * inv_sum;
    }
    return true;
  }
  const long rows = static_cast<long>(n) * n_heads;
  const long part = row * kv_splits + split;
  float* part_acc = workspace;  // [rows, splits, dim]
  float* part_ml = part_acc + rows * kv_splits * head_dim;  // [.., 2]
  for (int d = threadIdx.x; d < head_dim; d += kThreads) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o = fmaf(weight[w], warp_acc[w][d], o);
    part_acc[part * head_dim + d] = o;
  }
  if (threadIdx.x == 0) {
    part_ml[2 * part] = max;
    part_ml[2 * part + 1] = sum;
  }
  return false;
}

// blockIdx.x = (i * kv_splits + split) * n_heads + h: the query heads of a
// KV group are neighbours, so their reads of the same rows meet in L2.
template <int R>
__global__ void __launch_bounds__(kThreads)
    AttentionKernel(AttentionKernelParams p) {
  const int warp = threadIdx.x / 32;
  const int h = blockIdx.x % p.n_heads;
  const int split = (blockIdx.x / p.n_heads) % p.kv_splits;
  const int i = blockIdx.x / p.n_heads / p.kv_splits;
  const QueryHead qh = Locate(p, static_cast<long>(i) * p.n_heads + h);
  const int seen = qh.len - qh.first;
  const int chunk = (seen + p.kv_splits - 1) / p.kv_splits;
  const int begin = min(qh.len, qh.first + split * chunk);
  const int end = min(qh.len, begin + chunk);

  float q[R];
  LoadLaneDims(p.q + qh.row * p.head_dim, p.head_dim, q);

  float m = -CUDART_INF_F;  // max score so far
  float l = 0.0f;           // sum of exp(score - m)
  float acc[R];             // sum of exp(score - m) * v, this lane's dims
  if (qh.k_half != nullptr) {
    WarpOnlineSoftmax(HalfRows{qh.k_half, qh.v_half, p.head_dim}, p.head_dim,
                      p.scale, q, begin, end, warp, m, l, acc);
  } else {
    WarpOnlineSoftmax(FloatRows{qh.k, qh.v, p.head_dim}, p.head_dim, p.scale,
                      q, begin, end, warp, m, l, acc);
  }
  float max, inv_sum;
  if (MergeWarps(m, l, acc, p.head_dim, p.kv_splits, qh.row, split, p.n,
                 p.n_heads, p.out, p.workspace, max, inv_sum) &&
      p.prob_sums != nullptr) {
    AddProbabilities(p, qh, q, qh.first, qh.len, max, inv_sum);
  }
}

// One block per (query, head): merges its kv_splits partial results and
// keeps the final (max, 1 / sum) for the probability pass.
__global__ void __launch_bounds__(kThreads)
    AttentionMergeKernel(AttentionKernelParams p) {
  const long row = blockIdx.x;
  const int splits = p.kv_splits;
  const long rows = static_cast<long>(p.n) * p.n_heads;
  const float* part_acc = p.workspace + row * splits * p.head_dim;
  const float* part_ml =
      p.workspace + rows * splits * p.head_dim + row * splits * 2;
  float* stats = p.workspace + rows * splits * (p.head_dim + 2);  // [rows, 2]
  float max = -CUDART_INF_F;
  for (int s = 0; s < splits; ++s) max = fmaxf(max, part_ml[2 * s]);
  float sum = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float m = part_ml[2 * s];
    if (m != -CUDART_INF_F) sum += expf(m - max) * part_ml[2 * s + 1];
  }
  const float inv_sum = 1.0f / sum;
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float m = part_ml[2 * s];
      if (m != -CUDART_INF_F) {
        o = fmaf(expf(m - max), part_acc[static_cast<long>(s) * p.head_dim + d],
                 o);
      }
    }
    p.out[row * p.head_dim + d] = o * inv_sum;
  }
  if (threadIdx.x == 0) {
    stats[2 * row] = max;
    stats[2 * row + 1] = inv_sum;
  }
}

// After the merge: blockIdx.x = row * chunks + chunk, kProbRowsPerBlock KV
// rows per block.
template <int R>
__global__ void __launch_bounds__(kThreads)
    AttentionProbsKernel(AttentionKernelParams p, int chunks) {
  const QueryHead qh = Locate(p, blockIdx.x / chunks);
  const int begin = (blockIdx.x % chunks) * kProbRowsPerBlock;
  if (begin >= qh.len) return;
  if (begin + kProbRowsPerBlock <= qh.first) return;  // before the window
  const int end = min(qh.len, begin + kProbRowsPerBlock);
  const long rows = static_cast<long>(p.n) * p.n_heads;
  const float* stats =
      p.workspace + rows * p.kv_splits * (p.head_dim + 2) + 2 * qh.row;
  float q[R];
  LoadLaneDims(p.q + qh.row * p.head_dim, p.head_dim, q);
  AddProbabilities(p, qh, q, max(begin, qh.first), end, stats[0], stats[1]);
}

// blockIdx.x = split * n_heads + h; head h's KV head's staged rows, then
// the new token's as row `count`.
template <int R>
__global__ void __launch_bounds__(kThreads)
    StagedAttentionKernel(StagedAttentionParams p) {
  const int warp = threadIdx.x / 32;
  const int h = blockIdx.x % p.n_heads;
  const int split = blockIdx.x / p.n_heads;
  const int g = h / (p.n_heads / p.n_kv_heads);
  const int first = p.head_offsets[g];
  const int count = p.head_offsets[g + 1] - first;
  const int seen = count + 1;
  const int chunk = (seen + p.kv_splits - 1) / p.kv_splits;
  const int begin = min(seen, split * chunk);
  const int end = min(seen, begin + chunk);
  float q[R];
  LoadLaneDims(p.q + static_cast<long>(h) * p.head_dim, p.head_dim, q);
  float m = -CUDART_INF_F;
  float l = 0.0f;
  float acc[R];
  const int n_groups = p.int4_group > 0 ? p.head_dim / p.int4_group : 0;
  if (p.slots != nullptr) {
    const SlottedRows rows{p.k_rows,
                           p.v_rows,
                           p.slot_k,
                           p.slot_v,
                           p.slots + first,
                           p.k_new + static_cast<long>(g) * p.head_dim,
                           p.v_new + static_cast<long>(g) * p.head_dim,
                           count,
                           p.row_width,
                           p.int4_group,
                           n_groups};
    WarpOnlineSoftmax(rows, p.head_dim, p.scale, q, begin, end, warp, m, l,
                      acc);
  } else {
    const long at = static_cast<long>(first) * p.row_width;
    const StagedRows rows{p.k_rows + at,
                          p.v_rows + at,
                          p.k_new + static_cast<long>(g) * p.head_dim,
                          p.v_new + static_cast<long>(g) * p.head_dim,
                          count,
                          p.row_width,
                          p.int4_group,
                          n_groups};
    WarpOnlineSoftmax(rows, p.head_dim, p.scale, q, begin, end, warp, m, l,
                      acc);
  }
  float max, inv_sum;
  MergeWarps(m, l, acc, p.head_dim, p.kv_splits, h, split, 1, p.n_heads,
             p.out, p.workspace, max, inv_sum);
}

template <int R>
int LaunchStagedWithLaneDims(const StagedAttentionParams& p,
                             cudaStream_t stream) {
  StagedAttentionKernel<R>
      <<<static_cast<unsigned>(p.n_heads * p.kv_splits), kThreads, 0,
         stream>>>(p);
  if (p.kv_splits > 1) {
    // The splits merged as LaunchAttention's are (one query).
    AttentionKernelParams merge;
    merge.out = p.out;
    merge.n = 1;
    merge.n_heads = p.n_heads;
    merge.n_kv_heads = p.n_kv_heads;
    merge.head_dim = p.head_dim;
    merge.kv_splits = p.kv_splits;
    merge.workspace = p.workspace;
    AttentionMergeKernel<<<static_cast<unsigned>(p.n_heads), kThreads, 0,
                           stream>>>(merge);
  }
  return static_cast<int>(cudaGetLastError());
}

int ProbChunks(const AttentionKernelParams& p) {
  const int kv_max = p.kv_len0 + p.n - 1;
  return (kv_max + kProbRowsPerBlock - 1) / kProbRowsPerBlock;
}

template <int R>
int LaunchWithLaneDims(const AttentionKernelParams& p, cudaStream_t stream) {
  const long rows = static_cast<long>(p.n) * p.n_heads;
  AttentionKernel<R>
      <<<static_cast<unsigned>(rows * p.kv_splits), kThreads, 0, stream>>>(p);
  if (p.kv_splits > 1) {
    AttentionMergeKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        p);
    if (p.prob_sums != nullptr) {
      const int chunks = ProbChunks(p);
      AttentionProbsKernel<R>
          <<<static_cast<unsigned>(rows * chunks), kThreads, 0, stream>>>(
              p, chunks);
    }
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchAttention(const AttentionKernelParams& p, void* stream) {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  if (!p.q || !p.out) return invalid;
  // fp32 K and V, or fp16 ones without probability sums.
  if (p.k_half != nullptr
          ? !p.v_half || p.k || p.v || p.prob_sums
          : !p.k || !p.v || p.v_half) {
    return invalid;
  }
  if (p.n <= 0 || p.n_heads <= 0 || p.n_kv_heads <= 0 ||
      p.n_heads % p.n_kv_heads != 0 || p.head_dim <= 0 ||
      p.head_dim > kMaxHeadDim || p.kv_len0 <= 0 || p.kv_splits <= 0) {
    return invalid;
  }
  if (static_cast<long>(p.kv_stride) < static_cast<long>(p.kv_len0) + p.n - 1) {
    return invalid;
  }
  if (p.kv_splits > 1 && p.workspace == nullptr) return invalid;
  const long blocks = static_cast<long>(p.n) * p.n_heads * p.kv_splits;
  const long kv_max = static_cast<long>(p.kv_len0) + p.n - 1;
  if (blocks > 0x7fffffffL || kv_max > 0x7fffffffL) return invalid;
  if (p.kv_splits > 1 && p.prob_sums != nullptr &&
      static_cast<long>(p.n) * p.n_heads * ProbChunks(p) > 0x7fffffffL) {
    return invalid;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int lane_dims = (p.head_dim + 31) / 32;
  if (lane_dims <= 1) return LaunchWithLaneDims<1>(p, s);
  if (lane_dims <= 2) return LaunchWithLaneDims<2>(p, s);
  if (lane_dims <= 4) return LaunchWithLaneDims<4>(p, s);
  return LaunchWithLaneDims<8>(p, s);
}

int LaunchStagedAttention(const StagedAttentionParams& p, void* stream) {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  if (!p.q || !p.k_rows || !p.v_rows || !p.head_offsets || !p.k_new ||
      !p.v_new || !p.out) {
    return invalid;
  }
  if (p.n_heads <= 0 || p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      p.head_dim <= 0 || p.head_dim > kMaxHeadDim || p.kv_splits <= 0 ||
      static_cast<long>(p.n_heads) * p.kv_splits > 0x7fffffffL) {
    return invalid;
  }
  // fp16 rows of head_dim values, or int4 rows of whole groups.
  if (p.int4_group == 0 ? p.row_width != p.head_dim
                        : (p.int4_group < 0 || p.head_dim % p.int4_group != 0 ||
                           p.int4_group % 2 != 0 ||
                           p.row_width != 2 * (p.head_dim / p.int4_group) +
                                              p.head_dim / 4)) {
    return invalid;
  }
  if (p.kv_splits > 1 && p.workspace == nullptr) return invalid;
  if (p.slots != nullptr && (p.slot_k == nullptr || p.slot_v == nullptr)) {
    return invalid;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int lane_dims = (p.head_dim + 31) / 32;
  if (lane_dims <= 1) return LaunchStagedWithLaneDims<1>(p, s);
  if (lane_dims <= 2) return LaunchStagedWithLaneDims<2>(p, s);
  if (lane_dims <= 4) return LaunchStagedWithLaneDims<4>(p, s);
  return LaunchStagedWithLaneDims<8>(p, s);
}

}  // namespace infinigen::gpu_worker::cuda
