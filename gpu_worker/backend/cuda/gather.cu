// One-sided row reads (kernels.h, LaunchGatherRows): a fetch plan's K and V
// rows read by index straight from the node's row memory (host memory
// mapped for the device, or device memory) into device staging, without a
// gather on the host.
//
// Rows are short (128-512 bytes), so one row is a few vector loads: each
// thread moves one word (16, 8, 4 or 2 bytes, the widest that divides the
// row) of a row, a warp covers whole rows side by side, and every thread
// issues kUnroll independent loads before storing any, so that enough PCIe
// reads are in flight to fill the link. The address arithmetic is
// gather_rows.h's, shared with the host reference.
//
// LaunchTouchPages reads one word of every page of such memory.
#include <cuda_runtime.h>

#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename Word>
__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(GatherRowsParams p) {
  const int words = p.row_bytes / static_cast<int>(sizeof(Word));
  // Work items: (K or V, row, word), K rows first.
  const long items = 2 * p.n_rows * words;
  const long stride = static_cast<long>(gridDim.x) * kThreads;
  const long first = static_cast<long>(blockIdx.x) * kThreads + threadIdx.x;
  Word* out = static_cast<Word*>(p.out);
  for (long base = first; base < items; base += stride * kUnroll) {
    Word w[kUnroll];
    long at[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      at[u] = base + u * stride;
      if (at[u] < items) {
        const long row = at[u] / words;  // in [0, 2 * n_rows)
        const int word = static_cast<int>(at[u] % words);
        const bool v = row >= p.n_rows;
        const long r = v ? row - p.n_rows : row;
        const char* src = static_cast<const char*>(v ? p.v_rows : p.k_rows) +
                          GatherRowSource(p, r);
        w[u] = reinterpret_cast<const Word*>(src)[word];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (at[u] < items) out[at[u]] = w[u];
    }
  }
}

template <typename Word>
int Launch(const GatherRowsParams& p, int sm_count, cudaStream_t stream) {
  const long items = 2 * p.n_rows * (p.row_bytes / sizeof(Word));
  // Enough blocks to keep every SM's loads in flight, no more than items.
  const long want = (items + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  const long blocks = want < 8L * sm_count ? want : 8L * sm_count;
  GatherRowsKernel<Word><<<static_cast<unsigned>(blocks > 0 ? blocks : 1),
                           kThreads, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

__global__ void __launch_bounds__(kThreads)
    TouchPagesKernel(const unsigned* data, size_t pages, size_t page_words,
                     unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
       i < pages; i += stride) {
    acc ^= *reinterpret_cast<const volatile unsigned*>(data + i * page_words);
  }
  atomicXor(sink, acc);
}

// One warp per row of a row cache's misses: its K and V rows, 4-byte
// words (a row is head_dim or the int4 width of uint16_t values: a whole
// number of words only where even, so 2-byte words otherwise), to the
// row's slot.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    ScatterRowsKernel(ScatterRowsParams p) {
  const int lanes = 32;
  const long row = (static_cast<long>(blockIdx.x) * kThreads + threadIdx.x) /
                   lanes;
  const int lane = threadIdx.x % lanes;
  if (row >= p.n_rows) return;
  const int slot = p.slots[row];
  if (slot < 0) return;
  const int words =
      p.row_width * static_cast<int>(sizeof(uint16_t)) / sizeof(Word);
  const Word* k = reinterpret_cast<const Word*>(p.k_rows + row * p.row_width);
  const Word* v = reinterpret_cast<const Word*>(p.v_rows + row * p.row_width);
  Word* dk = reinterpret_cast<Word*>(p.slot_k +
                                     static_cast<long>(slot) * p.row_width);
  Word* dv = reinterpret_cast<Word*>(p.slot_v +
                                     static_cast<long>(slot) * p.row_width);
  for (int w = lane; w < words; w += lanes) {
    dk[w] = k[w];
    dv[w] = v[w];
  }
}

}  // namespace

int LaunchTouchPages(const TouchPagesParams& p, void* stream) {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  if (!p.data || !p.sink || p.bytes == 0 || p.bytes % 4 != 0 ||
      reinterpret_cast<uintptr_t>(p.data) % 4 != 0 || p.page_bytes < 4 ||
      (p.page_bytes & (p.page_bytes - 1)) != 0) {
    return invalid;
  }
  const size_t pages = (p.bytes + p.page_bytes - 1) / p.page_bytes;
  // A few blocks: the loads wait on the link (or on whatever the first
  // access to a page costs), not on the SMs, which other work keeps.
  constexpr size_t kMaxBlocks = 64;
  const size_t want = (pages + kThreads - 1) / kThreads;
  const unsigned blocks =
      static_cast<unsigned>(want < kMaxBlocks ? want : kMaxBlocks);
  TouchPagesKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const unsigned*>(p.data), pages, p.page_bytes / 4, p.sink);
  return static_cast<int>(cudaGetLastError());
}

int LaunchGatherRows(const GatherRowsParams& p, void* stream) {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  if (!p.k_rows || !p.v_rows || !p.out || p.n_heads <= 0 || p.n_rows <= 0 ||
      p.row_bytes <= 0 || p.row_bytes % 2 != 0 || p.head_stride <= 0) {
    return invalid;
  }
  // A plan's indices come with head offsets; a leading plan gives every
  // head the same count, at most a head's slots.
  if (p.indices ? !p.head_offsets
                : p.n_rows % p.n_heads != 0 ||
                      p.n_rows / p.n_heads > p.head_stride) {
    return invalid;
  }
  int device = 0, sm_count = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount,
                                 device);
  }
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The widest word that divides the row and the base addresses.
  const auto fits = [&](int bytes) {
    const auto aligned = [&](const void* q) {
      return reinterpret_cast<uintptr_t>(q) % bytes == 0;
    };
    return p.row_bytes % bytes == 0 && aligned(p.k_rows) &&
           aligned(p.v_rows) && aligned(p.out);
  };
  if (fits(16)) return Launch<uint4>(p, sm_count, s);
  if (fits(8)) return Launch<uint2>(p, sm_count, s);
  if (fits(4)) return Launch<uint32_t>(p, sm_count, s);
  if (fits(2)) return Launch<uint16_t>(p, sm_count, s);
  return invalid;
}

int LaunchScatterRows(const ScatterRowsParams& p, void* stream) {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  if (p.n_rows == 0) return 0;
  if (p.n_rows < 0 || p.row_width <= 0 || !p.k_rows || !p.v_rows ||
      !p.slots || !p.slot_k || !p.slot_v) {
    return invalid;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const long threads = p.n_rows * 32;
  const unsigned blocks =
      static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  if (p.row_width % 2 == 0) {
    ScatterRowsKernel<unsigned><<<blocks, kThreads, 0, s>>>(p);
  } else {
    ScatterRowsKernel<unsigned short><<<blocks, kThreads, 0, s>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace infinigen::gpu_worker::cuda
