// Causal prefill attention on tensor cores (kernels.h, LaunchFlashAttention):
// the tiling of FlashAttention (Dao et al., 2022) with WMMA fragments.
//
// One block of kWarps warps per (tile of kTileQ queries, query head). The
// block converts its queries to fp16 in shared memory once, then walks the
// KV rows its last query sees in tiles of kTileK: it loads the tile's K and
// V rows (fp32 in global memory) as fp16 into shared memory, and each warp,
// for its own kRowsPerWarp queries,
//   1. computes the scores S = Q K^T on tensor cores (fp16 in, fp32 out),
//   2. runs the online softmax over S's rows in fp32 (scale, causal mask,
//      running max m and sum l; P = exp(S - m) as fp16; the output rows so
//      far scaled by exp(m_old - m)),
//   3. adds P V to its output rows on tensor cores (fp32 accumulators kept
//      in shared memory, since the online softmax rescales them by row).
// Tiles past a warp's last visible row are skipped by that warp. At the end
// each output row is divided by its sum and written as fp32. Shared memory
// holds Q, K, V and P in fp16 and S and O in fp32, each row padded by a few
// elements against bank conflicts.
//
// For head_dim 64 and 128 (llama's and most models') a second kernel keeps
// S, P and O in registers, as FlashAttention-2 does, with the PTX
// mma.sync.m16n8k16 instruction, whose fragments have a documented layout
// (WMMA's do not, so the first kernel passes S and O through shared memory
// to rescale them by row). Each warp holds its 16 queries' Q fragments for
// the whole walk; per tile of 64 KV rows it computes S = Q K^T (K fragments
// by ldmatrix), masks and scales S, updates the running max and sum of its
// two rows per thread (a quad of lanes shares a row), rescales O, and adds
// P V with P taken from S's accumulators as they lie (V fragments by
// ldmatrix.trans). Fragment layouts (PTX ISA, m16n8k16 with fp16 inputs),
// for lane = 4 * group + quad:
//   A (16x16): a0 (row group, cols 2quad, 2quad+1), a1 (row group+8, same
//      cols), a2 (row group, cols 2quad+8, +9), a3 (row group+8, same);
//   B (16x8):  b0 (rows 2quad, 2quad+1; col group), b1 (rows 2quad+8, +9);
//   C (16x8):  c0, c1 (row group, cols 2quad, +1), c2, c3 (row group+8).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <mma.h>

#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;                  // one WMMA tile of rows
constexpr int kTileQ = kWarps * kRowsPerWarp;     // queries per block
constexpr int kTileK = 64;                        // KV rows per tile
constexpr int kFrag = 16;                         // WMMA m = n = k
constexpr int kHalfPad = 8;                       // fp16 row padding
constexpr int kFloatPad = 4;                      // fp32 row padding
constexpr unsigned kFullMask = 0xffffffffu;

// Shared-memory layout for head_dim d (a multiple of 16).
struct Layout {
  int ldh;      // fp16 row stride of Q, K, V: d + kHalfPad
  int lds;      // fp32 row stride of S: kTileK + kFloatPad
  int ldp;      // fp16 row stride of P: kTileK + kHalfPad
  int ldo;      // fp32 row stride of O: d + kFloatPad
  size_t q, k, v, s, p, o, m, l, bytes;  // byte offsets, total
};

__host__ __device__ inline Layout MakeLayout(int d) {
  Layout L;
  L.ldh = d + kHalfPad;
  L.lds = kTileK + kFloatPad;
  L.ldp = kTileK + kHalfPad;
  L.ldo = d + kFloatPad;
  // Every region starts 32-byte aligned (WMMA loads need 256-bit alignment
  // of each fragment's first element; the strides keep the rest aligned).
  auto align = [](size_t b) { return (b + 31) / 32 * 32; };
  size_t at = 0;
  L.q = at;
  at = align(at + sizeof(__half) * kTileQ * L.ldh);
  L.k = at;
  at = align(at + sizeof(__half) * kTileK * L.ldh);
  L.v = at;
  at = align(at + sizeof(__half) * kTileK * L.ldh);
  L.s = at;
  at = align(at + sizeof(float) * kTileQ * L.lds);
  L.p = at;
  at = align(at + sizeof(__half) * kTileQ * L.ldp);
  L.o = at;
  at = align(at + sizeof(float) * kTileQ * L.ldo);
  L.m = at;
  at = align(at + sizeof(float) * kTileQ);
  L.l = at;
  at = align(at + sizeof(float) * kTileQ);
  L.bytes = at;
  return L;
}

__device__ float WarpMax(float v) {
  for (int off = 16; off > 0; off >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

__device__ float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1)
    v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// rows [count, d] of fp32 global memory (consecutive rows `stride` floats
// apart) into fp16 shared memory rows of ldh; rows past `count` are zero.
__device__ void LoadRowsAsHalf(const float* src, long stride, int count,
                               int rows, int d, __half* dst, int ldh) {
  const int per_row = d / 4;  // float4 per row (d is a multiple of 16)
  for (int e = threadIdx.x; e < rows * per_row; e += kThreads) {
    const int r = e / per_row, c = (e % per_row) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < count) {
      x = *reinterpret_cast<const float4*>(src + r * stride + c);
    }
    __half2* out = reinterpret_cast<__half2*>(dst + r * ldh + c);
    out[0] = __floats2half2_rn(x.x, x.y);
    out[1] = __floats2half2_rn(x.z, x.w);
  }
}

// The same from fp16 global memory (a local cache kept in fp16): copied,
// four values (8 bytes) at a time.
__device__ void LoadRowsAsHalf(const uint16_t* src, long stride, int count,
                               int rows, int d, __half* dst, int ldh) {
  const int per_row = d / 4;
  for (int e = threadIdx.x; e < rows * per_row; e += kThreads) {
    const int r = e / per_row, c = (e % per_row) * 4;
    uint2 x = make_uint2(0u, 0u);
    if (r < count) {
      x = *reinterpret_cast<const uint2*>(src + r * stride + c);
    }
    *reinterpret_cast<uint2*>(dst + r * ldh + c) = x;
  }
}

__global__ void __launch_bounds__(kThreads)
    FlashAttentionKernel(AttentionKernelParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int d = p.head_dim;
  const Layout L = MakeLayout(d);
  __half* qs = reinterpret_cast<__half*>(smem + L.q);
  __half* ks = reinterpret_cast<__half*>(smem + L.k);
  __half* vs = reinterpret_cast<__half*>(smem + L.v);
  float* ss = reinterpret_cast<float*>(smem + L.s);
  __half* ps = reinterpret_cast<__half*>(smem + L.p);
  float* os = reinterpret_cast<float*>(smem + L.o);
  float* ms = reinterpret_cast<float*>(smem + L.m);
  float* ls = reinterpret_cast<float*>(smem + L.l);

  const int q0 = blockIdx.x * kTileQ;
  const int h = blockIdx.y;
  const int g = h / (p.n_heads / p.n_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q_count = min(kTileQ, p.n - q0);
  const long q_stride = static_cast<long>(p.n_heads) * d;
  const long kv_head = static_cast<long>(g) * p.kv_stride * d;
  const bool half_kv = p.k_half != nullptr;

  LoadRowsAsHalf(p.q + q0 * q_stride + static_cast<long>(h) * d, q_stride,
                 q_count, kTileQ, d, qs, L.ldh);
  for (int e = threadIdx.x; e < kTileQ * L.ldo; e += kThreads) os[e] = 0.0f;
  for (int r = threadIdx.x; r < kTileQ; r += kThreads) {
    ms[r] = -CUDART_INF_F;
    ls[r] = 0.0f;
  }
  __syncthreads();

  // Query i sees rows [0, kv_len0 + i); the block's last query sees the
  // most, the warp's last query the most of the warp's.
  const int block_rows = p.kv_len0 + q0 + q_count - 1;
  const int warp_first = q0 + warp * kRowsPerWarp;
  const int warp_rows =
      warp_first < p.n
          ? p.kv_len0 + min(warp_first + kRowsPerWarp, p.n) - 1
          : 0;
  const int row0 = warp * kRowsPerWarp;  // the warp's first row in the tile
  float* s_w = ss + row0 * L.lds;
  __half* p_w = ps + row0 * L.ldp;
  float* o_w = os + row0 * L.ldo;
  const int d_frags = d / kFrag;

  for (int t0 = 0; t0 < block_rows; t0 += kTileK) {
    const int t_count = min(kTileK, block_rows - t0);
    const long tile = kv_head + static_cast<long>(t0) * d;
    if (half_kv) {
      LoadRowsAsHalf(p.k_half + tile, d, t_count, kTileK, d, ks, L.ldh);
      LoadRowsAsHalf(p.v_half + tile, d, t_count, kTileK, d, vs, L.ldh);
    } else {
      LoadRowsAsHalf(p.k + tile, d, t_count, kTileK, d, ks, L.ldh);
      LoadRowsAsHalf(p.v + tile, d, t_count, kTileK, d, vs, L.ldh);
    }
    __syncthreads();
    if (t0 < warp_rows) {
      // 1. S[16, kTileK] = Q_w[16, d] . K^T.
      for (int j = 0; j < kTileK / kFrag; ++j) {
        wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int kk = 0; kk < d_frags; ++kk) {
          wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, __half,
                         wmma::row_major>
              a;
          wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, __half,
                         wmma::col_major>
              b;
          wmma::load_matrix_sync(a, qs + row0 * L.ldh + kk * kFrag, L.ldh);
          wmma::load_matrix_sync(b, ks + j * kFrag * L.ldh + kk * kFrag,
                                 L.ldh);
          wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(s_w + j * kFrag, acc, L.lds,
                                wmma::mem_row_major);
      }
      __syncwarp();
      // 2. The online softmax, one row at a time, lanes over its columns.
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int i = warp_first + r;  // the query
        const int visible = i < p.n ? p.kv_len0 + i : 0;
        float s[kTileK / 32];
        float row_max = -CUDART_INF_F;
#pragma unroll
        for (int u = 0; u < kTileK / 32; ++u) {
          const int c = lane + 32 * u;
          s[u] = t0 + c < visible ? s_w[r * L.lds + c] * p.scale
                                  : -CUDART_INF_F;
          row_max = fmaxf(row_max, s[u]);
        }
        row_max = WarpMax(row_max);
        const float m_old = ms[row0 + r];
        const float m_new = fmaxf(m_old, row_max);
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < kTileK / 32; ++u) {
          const float e =
              s[u] == -CUDART_INF_F ? 0.0f : __expf(s[u] - m_new);
          sum += e;
          p_w[r * L.ldp + lane + 32 * u] = __float2half_rn(e);
        }
        sum = WarpSum(sum);
        const float alpha =
            m_old == -CUDART_INF_F ? 0.0f : __expf(m_old - m_new);
        for (int c = lane; c < d; c += 32) o_w[r * L.ldo + c] *= alpha;
        __syncwarp();
        if (lane == 0) {
          ms[row0 + r] = m_new;
          ls[row0 + r] = ls[row0 + r] * alpha + sum;
        }
      }
      __syncwarp();
      // 3. O_w[16, d] += P_w[16, kTileK] . V[kTileK, d].
      for (int j = 0; j < d_frags; ++j) {
        wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc;
        wmma::load_matrix_sync(acc, o_w + j * kFrag, L.ldo,
                               wmma::mem_row_major);
        for (int kk = 0; kk < kTileK / kFrag; ++kk) {
          wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, __half,
                         wmma::row_major>
              a;
          wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, __half,
                         wmma::row_major>
              b;
          wmma::load_matrix_sync(a, p_w + kk * kFrag, L.ldp);
          wmma::load_matrix_sync(b, vs + kk * kFrag * L.ldh + j * kFrag,
                                 L.ldh);
          wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync(o_w + j * kFrag, acc, L.ldo,
                                wmma::mem_row_major);
      }
    }
    __syncthreads();  // K and V are overwritten by the next tile
  }

  // Normalise and write this block's rows.
  const int per_row = d / 4;
  for (int e = threadIdx.x; e < q_count * per_row; e += kThreads) {
    const int r = e / per_row, c = (e % per_row) * 4;
    const float l = ls[r];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const float* o = os + r * L.ldo + c;
    *reinterpret_cast<float4*>(p.out + (q0 + r) * q_stride +
                               static_cast<long>(h) * d + c) =
        make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
  }
}

// --- The register-resident kernel (head_dim 64 and 128).

__device__ inline uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 fp16 matrices from shared memory: lanes 8m..8m+7 give the row
// addresses of matrix m; register m of lane 4 * group + quad receives row
// group, columns 2quad and 2quad+1 of matrix m (transposed: rows 2quad and
// 2quad+1 of column group).
__device__ inline void LoadMatrices(uint32_t (&r)[4], const __half* row) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(SharedAddress(row)));
}

__device__ inline void LoadMatricesTransposed(uint32_t (&r)[4],
                                              const __half* row) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, "
      "[%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(SharedAddress(row)));
}

// c[16x8] += a[16x16] . b[16x8], fp16 inputs, fp32 accumulators.
__device__ inline void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                           uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as an fp16 pair, the first in the low half (the lower column).
__device__ inline uint32_t HalfPair(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ inline float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
  return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}

__device__ inline float QuadSum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  return v + __shfl_xor_sync(kFullMask, v, 2);
}

// Shared memory of the register-resident kernel: Q, K and V tiles of 64
// fp16 rows, each row padded so that ldmatrix's eight row addresses fall in
// different banks (and stay 16-byte aligned).
template <int D>
constexpr int kMmaLd = D + kHalfPad;
template <int D>
constexpr size_t kMmaSharedBytes =
    sizeof(__half) * (kTileQ + 2 * kTileK) * kMmaLd<D>;

template <int D>
__global__ void __launch_bounds__(kThreads)
    FlashMmaKernel(AttentionKernelParams p) {
  static_assert(D % 32 == 0, "Q and K fragments are loaded two at a time");
  static_assert(kTileK % 16 == 0 && kRowsPerWarp == 16, "m16n8k16 tiles");
  constexpr int kLd = kMmaLd<D>;
  const float kNone = -CUDART_INF_F;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* qs = reinterpret_cast<__half*>(smem);
  __half* ks = qs + kTileQ * kLd;
  __half* vs = ks + kTileK * kLd;

  const int q0 = blockIdx.x * kTileQ;
  const int h = blockIdx.y;
  const int g = h / (p.n_heads / p.n_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int q_count = min(kTileQ, p.n - q0);
  const long q_stride = static_cast<long>(p.n_heads) * D;
  const long kv_head = static_cast<long>(g) * p.kv_stride * D;
  const bool half_kv = p.k_half != nullptr;

  LoadRowsAsHalf(p.q + q0 * q_stride + static_cast<long>(h) * D, q_stride,
                 q_count, kTileQ, D, qs, kLd);
  __syncthreads();

  // The warp's 16 queries as A fragments, one per 16 columns of Q.
  const int row0 = warp * kRowsPerWarp;
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    LoadMatrices(qf[kk], qs + (row0 + lane % 8 + (lane / 8) % 2 * 8) * kLd +
                             kk * 16 + lane / 16 * 8);
  }
  // This thread's two queries (rows group and group + 8 of the warp's),
  // the rows each sees, its O columns and its share of their running sums.
  const int warp_first = q0 + row0;
  const int i0 = warp_first + group, i1 = i0 + 8;
  const int visible0 = i0 < p.n ? p.kv_len0 + i0 : 0;
  const int visible1 = i1 < p.n ? p.kv_len0 + i1 : 0;
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = kNone, m1 = kNone, l0 = 0.f, l1 = 0.f;

  const int block_rows = p.kv_len0 + q0 + q_count - 1;
  const int warp_rows =
      warp_first < p.n
          ? p.kv_len0 + min(warp_first + kRowsPerWarp, p.n) - 1
          : 0;
  for (int t0 = 0; t0 < block_rows; t0 += kTileK) {
    const int t_count = min(kTileK, block_rows - t0);
    const long tile = kv_head + static_cast<long>(t0) * D;
    __syncthreads();  // every warp is done with the previous tile
    if (half_kv) {
      LoadRowsAsHalf(p.k_half + tile, D, t_count, kTileK, D, ks, kLd);
      LoadRowsAsHalf(p.v_half + tile, D, t_count, kTileK, D, vs, kLd);
    } else {
      LoadRowsAsHalf(p.k + tile, D, t_count, kTileK, D, ks, kLd);
      LoadRowsAsHalf(p.v + tile, D, t_count, kTileK, D, vs, kLd);
    }
    __syncthreads();
    if (t0 >= warp_rows) continue;  // past the warp's last visible row

    // 1. S[16, 64] = Q_w K^T: for each 8 keys, the K fragments of two
    // 16-column steps at a time (rows: keys; columns: dims).
    float s[kTileK / 8][4];
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        uint32_t b[4];
        LoadMatrices(b, ks + (j * 8 + lane % 8) * kLd + kk * 16 + lane / 8 * 8);
        Mma(s[j], qf[kk], b[0], b[1]);
        Mma(s[j], qf[kk + 1], b[2], b[3]);
      }
    }
    // 2. Scale and mask (key c of row i is visible below kv_len0 + i; the
    // zero rows past the tile's end are beyond every row's reach), then
    // the online softmax: the quad's max, P = exp(S - m), O rescaled.
    float max0 = kNone, max1 = kNone;
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
      const int key = t0 + j * 8 + 2 * quad;
      s[j][0] = key < visible0 ? s[j][0] * p.scale : kNone;
      s[j][1] = key + 1 < visible0 ? s[j][1] * p.scale : kNone;
      s[j][2] = key < visible1 ? s[j][2] * p.scale : kNone;
      s[j][3] = key + 1 < visible1 ? s[j][3] * p.scale : kNone;
      max0 = fmaxf(max0, fmaxf(s[j][0], s[j][1]));
      max1 = fmaxf(max1, fmaxf(s[j][2], s[j][3]));
    }
    const float new0 = fmaxf(m0, QuadMax(max0));
    const float new1 = fmaxf(m1, QuadMax(max1));
    const float alpha0 = m0 == kNone ? 0.f : __expf(m0 - new0);
    const float alpha1 = m1 == kNone ? 0.f : __expf(m1 - new1);
    m0 = new0;
    m1 = new1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
      s[j][0] = s[j][0] == kNone ? 0.f : __expf(s[j][0] - new0);
      s[j][1] = s[j][1] == kNone ? 0.f : __expf(s[j][1] - new0);
      s[j][2] = s[j][2] == kNone ? 0.f : __expf(s[j][2] - new1);
      s[j][3] = s[j][3] == kNone ? 0.f : __expf(s[j][3] - new1);
      sum0 += s[j][0] + s[j][1];
      sum1 += s[j][2] + s[j][3];
    }
    // Each lane keeps its columns' share of the sums; the quad's shares
    // are added at the end (they are rescaled alike).
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= alpha0;
      o[j][1] *= alpha0;
      o[j][2] *= alpha1;
      o[j][3] *= alpha1;
    }
    // 3. O_w[16, D] += P[16, 64] V: P's A fragment for 16 keys is the
    // accumulators of their two 8-key steps; V's B fragments come
    // transposed (rows: keys; columns: dims), two 8-dim steps at a time.
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      const uint32_t a[4] = {HalfPair(s[2 * kk][0], s[2 * kk][1]),
                             HalfPair(s[2 * kk][2], s[2 * kk][3]),
                             HalfPair(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             HalfPair(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < D / 8; j += 2) {
        uint32_t b[4];
        LoadMatricesTransposed(
            b, vs + (kk * 16 + lane % 8 + (lane / 8) % 2 * 8) * kLd +
                   (j + lane / 16) * 8);
        Mma(o[j], a, b[0], b[1]);
        Mma(o[j + 1], a, b[2], b[3]);
      }
    }
  }

  // Normalise and write this thread's columns of its two rows.
  const float sum0 = QuadSum(l0), sum1 = QuadSum(l1);
  const float inv0 = sum0 > 0.f ? 1.f / sum0 : 0.f;
  const float inv1 = sum1 > 0.f ? 1.f / sum1 : 0.f;
  const long column = static_cast<long>(h) * D + 2 * quad;
  if (i0 < p.n) {
    float* out = p.out + i0 * q_stride + column;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<float2*>(out + j * 8) =
          make_float2(o[j][0] * inv0, o[j][1] * inv0);
    }
  }
  if (i1 < p.n) {
    float* out = p.out + i1 * q_stride + column;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<float2*>(out + j * 8) =
          make_float2(o[j][2] * inv1, o[j][3] * inv1);
    }
  }
}

template <int D>
int LaunchFlashMma(const AttentionKernelParams& p, cudaStream_t stream) {
  constexpr size_t bytes = kMmaSharedBytes<D>;
  cudaError_t err = cudaFuncSetAttribute(
      FlashMmaKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const dim3 grid((p.n + kTileQ - 1) / kTileQ, p.n_heads);
  FlashMmaKernel<D><<<grid, kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool FlashAttentionSupports(const AttentionKernelParams& p) {
  // float4 loads and stores: every row starts 16-byte aligned.
  const auto aligned = [](const void* q) {
    return reinterpret_cast<uintptr_t>(q) % 16 == 0;
  };
  const bool half_kv = p.k_half != nullptr;
  return p.prob_sums == nullptr && p.window <= 0 && p.head_dim > 0 &&
         p.head_dim % 16 == 0 &&
         p.head_dim <= kMaxFlashHeadDim && aligned(p.q) &&
         (half_kv ? p.v_half && !p.k && !p.v && aligned(p.k_half) &&
                        aligned(p.v_half)
                  : p.k && p.v && !p.v_half && aligned(p.k) &&
                        aligned(p.v)) &&
         aligned(p.out);
}

size_t FlashAttentionSharedBytes(int head_dim) {
  if (head_dim == 64) return kMmaSharedBytes<64>;
  if (head_dim == 128) return kMmaSharedBytes<128>;
  return MakeLayout(head_dim).bytes;
}

namespace {

bool FlashShapeOk(const AttentionKernelParams& p) {
  return p.q && p.out && FlashAttentionSupports(p) && p.n > 0 &&
         p.n_heads > 0 && p.n_kv_heads > 0 && p.n_heads % p.n_kv_heads == 0 &&
         p.kv_len0 > 0 &&
         static_cast<long>(p.kv_stride) >=
             static_cast<long>(p.kv_len0) + p.n - 1 &&
         p.n_heads <= 65535;
}

int LaunchWmma(const AttentionKernelParams& p, cudaStream_t stream) {
  const size_t bytes = MakeLayout(p.head_dim).bytes;
  // Above 48 KiB a kernel must opt in; setting it again is cheap.
  cudaError_t err = cudaFuncSetAttribute(
      FlashAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const dim3 grid((p.n + kTileQ - 1) / kTileQ, p.n_heads);
  FlashAttentionKernel<<<grid, kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LaunchFlashAttention(const AttentionKernelParams& p, void* stream) {
  if (!FlashShapeOk(p)) return static_cast<int>(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.head_dim == 64) return LaunchFlashMma<64>(p, s);
  if (p.head_dim == 128) return LaunchFlashMma<128>(p, s);
  return LaunchWmma(p, s);
}

int LaunchFlashAttentionWmma(const AttentionKernelParams& p, void* stream) {
  if (!FlashShapeOk(p)) return static_cast<int>(cudaErrorInvalidValue);
  return LaunchWmma(p, static_cast<cudaStream_t>(stream));
}

}  // namespace infinigen::gpu_worker::cuda
