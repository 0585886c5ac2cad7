// Norms, RoPE, pointwise operations and conversions (kernels.h).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;
// Grid-stride loops cover any count with at most this many blocks.
constexpr long kMaxBlocks = 8192;

int Invalid() { return static_cast<int>(cudaErrorInvalidValue); }
int LastError() { return static_cast<int>(cudaGetLastError()); }
cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }

int BlocksFor(long count) {
  const long blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024),
// returned to every thread. `scratch` holds 33 floats; consecutive calls
// may reuse it.
__device__ float BlockSum(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1)
    v += __shfl_xor_sync(kFullMask, v, off);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  __syncthreads();  // a previous call's readers of scratch[32] are done
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? scratch[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) {
      v += __shfl_xor_sync(kFullMask, v, off);
    }
    if (lane == 0) scratch[32] = v;
  }
  __syncthreads();
  return scratch[32];
}

__global__ void RmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[33];
  const float* x = p.x + static_cast<long>(blockIdx.x) * p.dim;
  float* y = p.y + static_cast<long>(blockIdx.x) * p.dim;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(BlockSum(ss, scratch) / p.dim + p.eps);
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    y[i] = x[i] * inv * p.gain[i];
  }
}

__global__ void LayerNormKernel(LayerNormParams p) {
  __shared__ float scratch[33];
  const float* x = p.x + static_cast<long>(blockIdx.x) * p.dim;
  float* y = p.y + static_cast<long>(blockIdx.x) * p.dim;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) sum += x[i];
  const float mean = BlockSum(sum, scratch) / p.dim;
  float sq = 0.0f;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    const float c = x[i] - mean;
    sq += c * c;
  }
  const float inv = 1.0f / sqrtf(BlockSum(sq, scratch) / p.dim + p.eps);
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    y[i] = (x[i] - mean) * inv * p.gain[i] + p.bias[i];
  }
}

// One thread per (row, rotated pair j); it rotates pair j of every head.
__global__ void RopeKernel(RopeParams p) {
  const int half = p.head_dim / 2;
  const long pairs = static_cast<long>(p.n) * half;
  for (long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
       idx < pairs; idx += static_cast<long>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx / half);
    const int j = static_cast<int>(idx % half);
    // The exponent as the CPU forms it (a float quotient).
    const float e = static_cast<float>(2 * j) / p.head_dim;
    const float freq = static_cast<float>(
        1.0 / pow(static_cast<double>(p.theta), static_cast<double>(e)));
    const float angle = p.positions[i] * freq;
    float s, c;
    sincosf(angle, &s, &c);
    float* row = p.x + static_cast<long>(i) * p.n_heads * p.head_dim;
    for (int h = 0; h < p.n_heads; ++h) {
      float* v = row + h * p.head_dim;
      const float a = v[j], b = v[j + half];
      v[j] = a * c - b * s;
      v[j + half] = a * s + b * c;
    }
  }
}

#define IG_GRID_STRIDE(i, count)                                          \
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; \
       i < (count); i += static_cast<long>(gridDim.x) * blockDim.x)

__global__ void SwiGluKernel(SwiGluParams p) {
  IG_GRID_STRIDE(i, p.count) {
    const float g = p.gate[i];
    p.gate[i] = g / (1.0f + expf(-g)) * p.up[i];
  }
}

__global__ void GeluTanhGateKernel(SwiGluParams p) {
  IG_GRID_STRIDE(i, p.count) {
    const float g = p.gate[i];
    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    p.gate[i] = 0.5f * g * (1.0f + tanhf(inner)) * p.up[i];
  }
}

__global__ void ScaleKernel(ScaleParams p) {
  IG_GRID_STRIDE(i, p.count) p.x[i] *= p.s;
}

__global__ void ReluKernel(ReluParams p) {
  // std::max(x, 0.0f) of the CPU: NaN stays NaN, -0 stays -0.
  IG_GRID_STRIDE(i, p.count) p.x[i] = p.x[i] < 0.0f ? 0.0f : p.x[i];
}

__global__ void AddKernel(AddParams p) {
  IG_GRID_STRIDE(i, p.count) p.x[i] += p.y[i];
}

__global__ void BiasAddKernel(BiasAddParams p) {
  IG_GRID_STRIDE(i, static_cast<long>(p.n) * p.out) p.y[i] += p.bias[i % p.out];
}

__global__ void FloatToHalfKernel(FloatToHalfParams p) {
  IG_GRID_STRIDE(i, p.count) {
    p.y[i] = __half_as_ushort(__float2half_rn(p.x[i]));
  }
}

__global__ void FloatRowsToHalfKernel(FloatRowsToHalfParams p) {
  IG_GRID_STRIDE(i, p.rows * p.width) {
    const long r = i / p.width, c = i % p.width;
    p.y[r * p.y_stride + c] =
        __half_as_ushort(__float2half_rn(p.x[r * p.x_stride + c]));
  }
}

__global__ void HalfToFloatKernel(HalfToFloatParams p) {
  IG_GRID_STRIDE(i, p.count) {
    p.y[i] = __half2float(__ushort_as_half(p.x[i]));
  }
}

// One thread per output value.
__global__ void Int4DequantKernel(Int4DequantParams p, int group, int width) {
  const int n_groups = p.head_dim / group;
  IG_GRID_STRIDE(idx, static_cast<long>(p.n_rows) * p.head_dim) {
    const long r = idx / p.head_dim;
    const int d = static_cast<int>(idx % p.head_dim);
    const uint16_t* row = p.in + r * width;
    const int gi = d / group;
    const float scale = __half2float(__ushort_as_half(row[2 * gi]));
    const float mn = __half2float(__ushort_as_half(row[2 * gi + 1]));
    const uint8_t byte =
        reinterpret_cast<const uint8_t*>(row + 2 * n_groups)[d / 2];
    const int q = (byte >> (4 * (d % 2))) & 0xF;
    // q * scale is exact (4 bits times 11), so a fused multiply-add rounds
    // the same as the CPU's multiply then add.
    p.rows[idx] = q * scale + mn;
  }
}

#undef IG_GRID_STRIDE

}  // namespace

int LaunchRmsNorm(const RmsNormParams& p, void* stream) {
  if (p.n <= 0 || p.dim <= 0 || !p.x || !p.gain || !p.y) return Invalid();
  RmsNormKernel<<<p.n, kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchLayerNorm(const LayerNormParams& p, void* stream) {
  if (p.n <= 0 || p.dim <= 0 || !p.x || !p.gain || !p.bias || !p.y) {
    return Invalid();
  }
  LayerNormKernel<<<p.n, kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchRope(const RopeParams& p, void* stream) {
  if (p.n <= 0 || p.n_heads <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 ||
      !(p.theta > 0.0f) || !p.x || !p.positions) {
    return Invalid();
  }
  const long pairs = static_cast<long>(p.n) * (p.head_dim / 2);
  RopeKernel<<<BlocksFor(pairs), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchSwiGlu(const SwiGluParams& p, void* stream) {
  if (p.count <= 0 || !p.gate || !p.up) return Invalid();
  SwiGluKernel<<<BlocksFor(p.count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchGeluTanhGate(const SwiGluParams& p, void* stream) {
  if (p.count <= 0 || !p.gate || !p.up) return Invalid();
  GeluTanhGateKernel<<<BlocksFor(p.count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchScale(const ScaleParams& p, void* stream) {
  if (p.count <= 0 || !p.x) return Invalid();
  ScaleKernel<<<BlocksFor(p.count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchRelu(const ReluParams& p, void* stream) {
  if (p.count <= 0 || !p.x) return Invalid();
  ReluKernel<<<BlocksFor(p.count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchAdd(const AddParams& p, void* stream) {
  if (p.count <= 0 || !p.x || !p.y) return Invalid();
  AddKernel<<<BlocksFor(p.count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchBiasAdd(const BiasAddParams& p, void* stream) {
  if (p.n <= 0 || p.out <= 0 || !p.y || !p.bias) return Invalid();
  const long count = static_cast<long>(p.n) * p.out;
  BiasAddKernel<<<BlocksFor(count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchFloatToHalf(const FloatToHalfParams& p, void* stream) {
  if (p.count <= 0 || !p.x || !p.y) return Invalid();
  FloatToHalfKernel<<<BlocksFor(p.count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchFloatRowsToHalf(const FloatRowsToHalfParams& p, void* stream) {
  if (p.rows <= 0 || p.width <= 0 || p.x_stride < p.width ||
      p.y_stride < p.width || !p.x || !p.y) {
    return Invalid();
  }
  const long count = p.rows * p.width;
  FloatRowsToHalfKernel<<<BlocksFor(count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchHalfToFloat(const HalfToFloatParams& p, void* stream) {
  if (p.count <= 0 || !p.x || !p.y) return Invalid();
  HalfToFloatKernel<<<BlocksFor(p.count), kThreads, 0, Stream(stream)>>>(p);
  return LastError();
}

int LaunchInt4Dequant(const Int4DequantParams& p, void* stream) {
  if (p.n_rows <= 0 || p.head_dim <= 0 || !p.in || !p.rows) return Invalid();
  const int group = p.head_dim < 64 ? p.head_dim : 64;
  if (p.head_dim % 4 != 0 || p.head_dim % group != 0) return Invalid();
  const long count = static_cast<long>(p.n_rows) * p.head_dim;
  Int4DequantKernel<<<BlocksFor(count), kThreads, 0, Stream(stream)>>>(
      p, group, KvRowWidth(KvRowFormat::kInt4, p.head_dim));
  return LastError();
}

}  // namespace infinigen::gpu_worker::cuda
