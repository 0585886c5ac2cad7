// CudaBackend's memory (cuda_backend_class.h): managed and device
// allocations, host ranges pinned and mapped for the device (advised to
// transparent huge pages, their pages touched ahead), and rows gathered
// from those ranges in place.
#include "gpu_worker/backend/cuda/cuda_backend_class.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

// A transparent huge page: the least range PinHost advises to huge pages
// and touches from the device.
constexpr size_t kHugePage = size_t{2} << 20;

// madvise(MADV_HUGEPAGE) over the pages [p, p + bytes) lies on, for a
// range of a huge page or more; where the kernel refuses (no transparent
// huge pages), nothing changes.
void AdviseHugePages(void* p, size_t bytes) {
  if (bytes < kHugePage) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace

void* CudaBackend::AllocateShared(size_t bytes) {
  cudaSetDevice(device_);
  const size_t size = std::max<size_t>(bytes, 1);
  // More managed memory than the card has is refused here, not asked for:
  // on some drivers such a request can hang the GPU rather than fail.
  if (size > device_bytes_) return nullptr;
  void* p = nullptr;
  if (cudaMallocManaged(&p, size) != cudaSuccess) {
    cudaGetLastError();  // not sticky: later launches must not see it
    return nullptr;
  }
  shared_[reinterpret_cast<uintptr_t>(p)] = size;
  return p;
}

void* CudaBackend::AllocateDevice(size_t bytes) {
  cudaSetDevice(device_);
  const size_t size = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  if (cudaMalloc(&p, size) != cudaSuccess) {
    cudaGetLastError();  // not sticky: later launches must not see it
    return nullptr;
  }
  shared_[reinterpret_cast<uintptr_t>(p)] = size;
  return p;
}

void CudaBackend::FreeShared(void* p) {
  if (p == nullptr) return;
  cudaSetDevice(device_);
  // Operations and copies still queued may use the buffer.
  cudaError_t err = cudaStreamSynchronize(copy_stream_);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
  if (err != cudaSuccess) {
    Fail(absl::InternalError("CUDA: " + CudaError(err)));
  }
  shared_.erase(reinterpret_cast<uintptr_t>(p));
  cudaFree(p);
}

absl::Status CudaBackend::PinHost(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("PinHost: empty range");
  }
  cudaSetDevice(device_);
  // Transparent huge pages where the kernel gives them (its madvise
  // mode): memory not touched yet, such as a memory node's rows pinned
  // before they are written, is then pinned, mapped for the device and
  // read by it in 2 MiB pages instead of 4 KiB ones (far fewer to pin and
  // to map). Pages already there stay as they are; the registration
  // touches every page anyway, so this takes no more memory.
  AdviseHugePages(p, bytes);
  // Mapped as well, so that kernels can read it in place (GatherRows).
  cudaError_t err = cudaHostRegister(p, bytes, cudaHostRegisterMapped);
  if (err == cudaErrorInvalidValue) {
    // Read-only memory (a memory node's rows mapped over shm) registers
    // only as such.
    cudaGetLastError();
    err = cudaHostRegister(p, bytes,
                           cudaHostRegisterMapped | cudaHostRegisterReadOnly);
  }
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    // Pinned already (the shm and RDMA data planes pin their slots, and
    // the shm client the node's rows it maps, kept from one sequence to
    // the next): usable as is, and not ours to unpin. Where it was mapped
    // for the device too, kernels read it in place.
    cudaGetLastError();
    void* device = nullptr;
    if (cudaHostGetDevicePointer(&device, p, 0) != cudaSuccess) {
      cudaGetLastError();
      device = nullptr;
    }
    pinned_[reinterpret_cast<uintptr_t>(p)] =
        PinnedRange{bytes, static_cast<char*>(device), false};
    return absl::OkStatus();
  }
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: the memory stays pageable
    return absl::UnavailableError(absl::StrFormat(
        "cudaHostRegister of %zu bytes at %p: %s", bytes, p,
        CudaError(err)));
  }
  void* device = nullptr;
  err = cudaHostGetDevicePointer(&device, p, 0);
  if (err != cudaSuccess) {
    cudaGetLastError();
    device = nullptr;  // pinned for copies; kernels do not read it
  }
  pinned_[reinterpret_cast<uintptr_t>(p)] =
      PinnedRange{bytes, static_cast<char*>(device), true};
  if (device != nullptr) TouchPages(device, bytes);
  return absl::OkStatus();
}

void CudaBackend::TouchPages(void* device, size_t bytes) {
  if (bytes < kHugePage) return;
  if (touch_stream_ == nullptr) {
    if (cudaStreamCreateWithFlags(&touch_stream_, cudaStreamNonBlocking) !=
            cudaSuccess ||
        cudaMalloc(&touch_sink_, sizeof(unsigned)) != cudaSuccess) {
      cudaGetLastError();  // not sticky: an optimization, not a failure
      if (touch_stream_ != nullptr) cudaStreamDestroy(touch_stream_);
      touch_stream_ = nullptr;
      touch_sink_ = nullptr;
      return;
    }
  }
  TouchPagesParams t;
  t.data = device;
  t.bytes = bytes / 4 * 4;
  t.page_bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  t.sink = touch_sink_;
  if (LaunchTouchPages(t, touch_stream_) != 0) cudaGetLastError();
}

void CudaBackend::UnpinHost(void* p) {
  auto it = pinned_.find(reinterpret_cast<uintptr_t>(p));
  if (it == pinned_.end()) return;
  cudaSetDevice(device_);
  // A copy or a kernel (GatherRows, TouchPages) still queued may read it.
  cudaStreamSynchronize(copy_stream_);
  cudaStreamSynchronize(stream_);
  if (touch_stream_ != nullptr) cudaStreamSynchronize(touch_stream_);
  if (it->second.owned && cudaHostUnregister(p) != cudaSuccess) {
    cudaGetLastError();
  }
  pinned_.erase(it);
}

bool CudaBackend::GatherRows(const GatherRowsParams& g) {
  constexpr const char* kOp = "GatherRows";
  // The rows must lie in one range PinHost mapped; else the caller
  // gathers through the node.
  const long span = static_cast<long>(g.n_heads) * g.head_stride *
                    g.row_bytes;
  auto mapped = [&](const void* rows) -> const char* {
    const uintptr_t a = reinterpret_cast<uintptr_t>(rows);
    auto it = FindRange(pinned_, a);
    if (it == pinned_.end() || it->second.device == nullptr ||
        a + span > it->first + it->second.bytes) {
      return nullptr;
    }
    return it->second.device + (a - it->first);
  };
  const char* k = mapped(g.k_rows);
  const char* v = mapped(g.v_rows);
  if (k == nullptr || v == nullptr || g.n_rows <= 0) return false;
  if (!Begin()) return true;  // an earlier error: skipped, and sticky
  if (g.indices == nullptr) {
    // A leading plan: each head's first rows lie one after another, a
    // block of n_heads strided runs for the copy engine, K then V.
    if (g.n_heads <= 0 || g.n_rows % g.n_heads != 0 ||
        g.n_rows / g.n_heads > g.head_stride || g.row_bytes <= 0) {
      FailShape(kOp, absl::StrFormat(
                         "leading rows=%d heads=%d head_stride=%d",
                         g.n_rows, g.n_heads, g.head_stride));
      return true;
    }
    const size_t width =
        static_cast<size_t>(g.n_rows / g.n_heads) * g.row_bytes;
    const size_t pitch = static_cast<size_t>(g.head_stride) * g.row_bytes;
    char* out = Out(static_cast<char*>(g.out), 2 * g.n_rows * g.row_bytes,
                    kOp, "out");
    if (!ok()) return true;
    const size_t half = static_cast<size_t>(g.n_rows) * g.row_bytes;
    // On the compute stream, as the kernel would be: after every
    // operation issued so far.
    if (CheckCuda(cudaMemcpy2DAsync(out, width, g.k_rows, pitch, width,
                                    g.n_heads, cudaMemcpyDefault, stream_),
                  kOp)) {
      CheckCuda(cudaMemcpy2DAsync(out + half, width, g.v_rows, pitch, width,
                                  g.n_heads, cudaMemcpyDefault, stream_),
                kOp);
    }
    return true;
  }
  GatherRowsParams p = g;
  p.k_rows = k;
  p.v_rows = v;
  p.indices = In(g.indices, g.n_rows, kOp, "indices");
  p.head_offsets = In(g.head_offsets, g.n_heads + 1L, kOp, "head_offsets");
  p.out = Out(static_cast<char*>(g.out), 2 * g.n_rows * g.row_bytes, kOp,
              "out");
  if (ok()) Launched(LaunchGatherRows(p, stream_), kOp);
  return true;
}

}  // namespace infinigen::gpu_worker::cuda
