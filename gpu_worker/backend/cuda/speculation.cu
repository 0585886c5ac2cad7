// InfiniGen's speculation on the device: approximate scores from the
// partial key cache, then each KV head's top-k positions (kernels.h).
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cmath>

#include "gpu_worker/backend/cuda/kernels.h"
#include "speculator/partial_keys.h"

namespace infinigen::gpu_worker::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kScoreThreads = 256;
constexpr int kTopKThreads = 512;
// The group's gathered queries live in shared memory: [group][n_cols].
constexpr int kMaxGatheredQuery = 12 * 1024;

// grid (token blocks, KV heads); one thread per cached token, whose 4-bit
// row (speculator/partial_keys.h) scores min * sum(q) + scale * (q . codes)
// for each query head of the group, as the CPU does (an fp32 row: q . k).
__global__ void SpeculateScoresKernel(SpeculationParams p, float scale) {
  // [group][n_cols]: the gathered queries, pre-scaled as the CPU does; then
  // [group]: each one's sum, in the CPU's order.
  extern __shared__ float qg[];
  const int g = blockIdx.y;
  const int group = p.n_heads / p.n_kv_heads;
  const int32_t* cols = p.cols + static_cast<long>(g) * p.n_cols;
  float* q_sums = qg + group * p.n_cols;
  for (int idx = threadIdx.x; idx < group * p.n_cols; idx += blockDim.x) {
    const int j = idx / p.n_cols;
    const int c = idx % p.n_cols;
    qg[idx] =
        p.q_skewed[static_cast<long>(g * group + j) * p.d + cols[c]] * scale;
  }
  __syncthreads();
  if (threadIdx.x < group) {
    float sum = 0.0f;
    const float* q = qg + threadIdx.x * p.n_cols;
    for (int c = 0; c < p.n_cols; ++c) sum = __fadd_rn(sum, q[c]);
    q_sums[threadIdx.x] = sum;
  }
  __syncthreads();
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= p.n_tokens) return;
  const uint8_t* row =
      p.partial_k + (static_cast<long>(g) * p.k_stride + t) *
                        speculator::PartialKeyRowBytes(p.n_cols, p.format);
  float* out = p.scores + static_cast<long>(g) * group * p.n_tokens + t;
  if (p.format == speculator::PartialKeyFormat::kFloat) {
    const float* k = reinterpret_cast<const float*>(row);
    for (int j = 0; j < group; ++j) {
      const float* q = qg + j * p.n_cols;
      float dot = 0.0f;
      for (int c = 0; c < p.n_cols; ++c) dot = fmaf(k[c], q[c], dot);
      out[static_cast<long>(j) * p.n_tokens] = dot;
    }
    return;
  }
  const float lo = reinterpret_cast<const float*>(row)[0];
  const float row_scale = reinterpret_cast<const float*>(row)[1];
  const uint8_t* codes = row + 2 * sizeof(float);
  for (int j = 0; j < group; ++j) {
    const float* q = qg + j * p.n_cols;
    float dot = 0.0f;
    for (int c = 0; c < p.n_cols; ++c) {
      const float code =
          static_cast<float>((codes[c >> 1] >> (4 * (c & 1))) & 0xF);
      dot = fmaf(code, q[c], dot);
    }
    out[static_cast<long>(j) * p.n_tokens] =
        __fadd_rn(__fmul_rn(lo, q_sums[j]), __fmul_rn(row_scale, dot));
  }
}

// One thread per row: its range, then its codes, byte by byte.
__global__ void QuantizePartialKeysKernel(QuantizePartialKeysParams p) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= p.n_rows) return;
  const float* v = p.keys + static_cast<long>(r) * p.n_cols;
  const int row_bytes = speculator::PartialKeyRowBytes(p.n_cols);
  uint8_t* row =
      p.rows + static_cast<long>(r) * (p.row_stride > 0 ? p.row_stride
                                                         : row_bytes);
  float lo = v[0], hi = v[0];
  for (int c = 1; c < p.n_cols; ++c) {  // std::min and std::max, exactly
    lo = v[c] < lo ? v[c] : lo;
    hi = hi < v[c] ? v[c] : hi;
  }
  const float scale = __fdiv_rn(__fsub_rn(hi, lo), 15.0f);
  reinterpret_cast<float*>(row)[0] = lo;
  reinterpret_cast<float*>(row)[1] = scale;
  uint8_t* codes = row + 2 * sizeof(float);
  for (int b = 0; b < row_bytes - 2 * static_cast<int>(sizeof(float)); ++b) {
    unsigned byte = 0;
    for (int h = 0; h < 2 && scale > 0.0f; ++h) {
      const int c = 2 * b + h;
      if (c >= p.n_cols) break;
      int code = static_cast<int>(rintf(__fdiv_rn(__fsub_rn(v[c], lo), scale)));
      code = min(max(code, 0), 15);
      byte |= static_cast<unsigned>(code) << (4 * h);
    }
    codes[b] = static_cast<uint8_t>(byte);
  }
}

// Unsigned keys in the order of the floats; -0 and +0 share one, NaN takes
// 0, below every number (-inf's key is 0x007FFFFF).
__device__ uint32_t OrderedKey(float f) {
  if (f != f) return 0u;
  const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The number of threads below this one whose flag is set, and the block's
// total in *total. `scratch` holds 32 ints; consecutive calls may reuse it.
__device__ int BlockCountBefore(bool flag, int* scratch, int* total) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  const unsigned ballot = __ballot_sync(kFullMask, flag);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  __syncthreads();  // a previous call's readers are done
  if (lane == 0) scratch[warp] = __popc(ballot);
  __syncthreads();
  if (warp == 0) {
    // Inclusive scan of the warps' counts.
    int v = lane < n_warps ? scratch[lane] : 0;
    for (int off = 1; off < 32; off <<= 1) {
      const int u = __shfl_up_sync(kFullMask, v, off);
      if (lane >= off) v += u;
    }
    scratch[lane] = v;
  }
  __syncthreads();
  *total = scratch[n_warps - 1];
  return (warp == 0 ? 0 : scratch[warp - 1]) + in_warp;
}

// One block per KV head. A four-pass radix select (8 bits per pass, most
// significant first) finds the key T of the k-th largest score and how many
// of the scores equal to T are taken; one ordered scan then emits every
// position above T and the first of those at T, ascending.
__global__ void __launch_bounds__(kTopKThreads)
    SelectTopKKernel(SelectTopKParams p) {
  __shared__ int histogram[256];
  __shared__ uint32_t chosen_prefix;
  __shared__ int chosen_remaining;
  __shared__ int scan_scratch[32];
  const float* scores = p.scores + static_cast<long>(blockIdx.x) * p.n_tokens;
  const long first = p.head_offsets != nullptr
                         ? p.head_offsets[blockIdx.x]
                         : static_cast<long>(blockIdx.x) * p.k;
  const int k = p.head_offsets != nullptr
                    ? p.head_offsets[blockIdx.x + 1] - p.head_offsets[blockIdx.x]
                    : p.k;
  if (k <= 0) return;  // the whole block alike
  int32_t* out = p.indices + first;

  // Invariant: `remaining` of the keys matching `prefix` on `mask` are
  // still to be taken, and exactly k - remaining keys lie above them.
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) histogram[b] = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < p.n_tokens; t += blockDim.x) {
      const uint32_t key = OrderedKey(scores[t]);
      if ((key & mask) == prefix)
        atomicAdd(&histogram[(key >> shift) & 0xFF], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0;
      int b = 255;
      for (; b > 0; --b) {
        if (above + histogram[b] >= remaining) break;
        above += histogram[b];
      }
      chosen_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      chosen_remaining = remaining - above;
    }
    __syncthreads();
    prefix = chosen_prefix;
    remaining = chosen_remaining;
    mask |= 0xFFu << shift;
    __syncthreads();  // everyone has read chosen_* before the next pass
  }

  const uint32_t threshold = prefix;
  const int take_equal = remaining;
  int equal_before_chunk = 0, taken_before_chunk = 0;
  for (int base = 0; base < p.n_tokens && taken_before_chunk < k;
       base += blockDim.x) {
    const int t = base + threadIdx.x;
    const bool valid = t < p.n_tokens;
    const uint32_t key = valid ? OrderedKey(scores[t]) : 0u;
    const bool equal = valid && key == threshold;
    int equal_total, taken_total;
    const int equal_rank = equal_before_chunk +
                           BlockCountBefore(equal, scan_scratch, &equal_total);
    const bool take =
        valid && (key > threshold || (equal && equal_rank < take_equal));
    const int slot =
        taken_before_chunk + BlockCountBefore(take, scan_scratch, &taken_total);
    if (take) out[slot] = t;
    equal_before_chunk += equal_total;
    taken_before_chunk += taken_total;
  }
}

// The block's largest of v (every thread's), or its sum: one value per
// thread in, the result to every thread. `scratch` holds 32 floats.
template <bool kSum>
__device__ float BlockReduce(float v, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int n_warps = blockDim.x / 32;
  for (int off = 16; off > 0; off >>= 1) {
    const float u = __shfl_xor_sync(kFullMask, v, off);
    v = kSum ? v + u : fmaxf(v, u);
  }
  __syncthreads();  // a previous call's readers are done
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : (kSum ? 0.0f : -CUDART_INF_F);
  for (int off = 16; off > 0; off >>= 1) {
    const float u = __shfl_xor_sync(kFullMask, v, off);
    v = kSum ? v + u : fmaxf(v, u);
  }
  return v;
}

// One block per KV head: each query head's max and sum of exponentials
// over the tokens (fmaxf passes NaN over, as std::max does in the CPU's
// loop), then its log-probabilities folded into the head's running max.
__global__ void __launch_bounds__(kTopKThreads)
    CombineHeadScoresKernel(CombineHeadScoresParams p) {
  __shared__ float scratch[32];
  const int group = p.n_heads / p.n_kv_heads;
  float* out = p.scores + static_cast<long>(blockIdx.x) * p.n_tokens;
  for (int t = threadIdx.x; t < p.n_tokens; t += blockDim.x) {
    out[t] = -CUDART_INF_F;
  }
  for (int j = 0; j < group; ++j) {
    const float* s = p.head_scores +
                     static_cast<long>(blockIdx.x * group + j) * p.n_tokens;
    float top = -CUDART_INF_F;
    for (int t = threadIdx.x; t < p.n_tokens; t += blockDim.x) {
      top = fmaxf(top, s[t]);
    }
    top = BlockReduce<false>(top, scratch);
    if (top == -CUDART_INF_F) continue;  // as the CPU: nothing to add
    float sum = 0.0f;
    for (int t = threadIdx.x; t < p.n_tokens; t += blockDim.x) {
      sum += expf(s[t] - top);
    }
    const float lse = top + logf(BlockReduce<true>(sum, scratch));
    // Each thread updates only its own tokens: no barrier needed.
    for (int t = threadIdx.x; t < p.n_tokens; t += blockDim.x) {
      const float v = s[t] - lse;
      out[t] = out[t] < v ? v : out[t];  // std::max(out, v): NaN v passes
    }
  }
}

}  // namespace

int LaunchSpeculateScores(const SpeculationParams& p, void* stream) {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  if (!p.q_skewed || !p.partial_k || !p.cols || !p.scores) return invalid;
  if (p.n_heads <= 0 || p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0 ||
      p.d <= 0 || p.n_tokens <= 0 || p.k_stride < p.n_tokens || p.n_cols <= 0 ||
      p.n_cols > p.d || p.n_kv_heads > 65535) {
    return invalid;
  }
  const int group = p.n_heads / p.n_kv_heads;
  if (static_cast<long>(group) * (p.n_cols + 1) > kMaxGatheredQuery ||
      group > kScoreThreads) {
    return invalid;
  }
  // The CPU's scale, rounded the same way.
  const float scale = 1.0f / std::sqrt(static_cast<float>(p.d));
  const dim3 grid((p.n_tokens + kScoreThreads - 1) / kScoreThreads,
                  p.n_kv_heads);
  const size_t shared = sizeof(float) * group * (p.n_cols + 1);
  SpeculateScoresKernel<<<grid, kScoreThreads, shared,
                          static_cast<cudaStream_t>(stream)>>>(p, scale);
  return static_cast<int>(cudaGetLastError());
}

int LaunchQuantizePartialKeys(const QuantizePartialKeysParams& p,
                              void* stream) {
  if (!p.keys || !p.rows || p.n_rows <= 0 || p.n_cols <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  constexpr int kThreads = 128;
  QuantizePartialKeysKernel<<<(p.n_rows + kThreads - 1) / kThreads, kThreads,
                              0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

// Threads of an AbsColumnSums block: d columns times the token lanes.
constexpr int kAbsSumThreads = 1024;

__global__ void AbsColumnSumsKernel(AbsColumnSumsParams p) {
  extern __shared__ float lane_sums[];  // [lanes][d]
  const int g = blockIdx.x;
  const int lanes = blockDim.x / p.d;
  const int c = threadIdx.x % p.d;
  const int lane = threadIdx.x / p.d;
  float acc = 0.0f;
  if (lane < lanes) {
    const long width = static_cast<long>(p.heads) * p.d;
    for (int t = lane; t < p.n; t += lanes) {
      const float* row = p.x + t * width + static_cast<long>(g) * p.per_kv * p.d;
      for (int h = 0; h < p.per_kv; ++h) acc += fabsf(row[h * p.d + c]);
    }
    lane_sums[lane * p.d + c] = acc;
  }
  __syncthreads();
  if (lane == 0) {
    float total = 0.0f;
    for (int l = 0; l < lanes; ++l) total += lane_sums[l * p.d + c];
    p.sums[static_cast<long>(g) * p.d + c] += total;
  }
}

int LaunchAbsColumnSums(const AbsColumnSumsParams& p, void* stream) {
  if (!p.x || !p.sums || p.n <= 0 || p.heads <= 0 || p.per_kv <= 0 ||
      p.heads % p.per_kv != 0 || p.d <= 0 || p.d > kAbsSumThreads) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int lanes = kAbsSumThreads / p.d;
  const int threads = lanes * p.d;
  AbsColumnSumsKernel<<<p.heads / p.per_kv, threads,
                        threads * sizeof(float),
                        static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int LaunchSelectTopK(const SelectTopKParams& p, void* stream) {
  if (!p.scores || !p.indices || p.n_kv_heads <= 0 || p.n_tokens <= 0 ||
      (p.head_offsets == nullptr && (p.k <= 0 || p.k > p.n_tokens))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  SelectTopKKernel<<<p.n_kv_heads, kTopKThreads, 0,
                     static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int LaunchCombineHeadScores(const CombineHeadScoresParams& p, void* stream) {
  if (!p.head_scores || !p.scores || p.n_kv_heads <= 0 || p.n_tokens <= 0 ||
      p.n_heads < p.n_kv_heads || p.n_heads % p.n_kv_heads != 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  CombineHeadScoresKernel<<<p.n_kv_heads, kTopKThreads, 0,
                            static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace infinigen::gpu_worker::cuda
