#include "gpu_worker/backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "gpu_worker/backend/cuda/cuda_backend_impl.h"
#include "gpu_worker/backend/cuda/kernels.h"
#include "speculator/partial_keys.h"

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

// Decode attention splits a (query, head)'s rows over more blocks while
// there are fewer than kBlocksPerSm blocks per SM, in chunks of at least
// kMinRowsPerSplit rows.
constexpr long kBlocksPerSm = 4;
constexpr long kMinRowsPerSplit = 256;
constexpr int kMaxHeadDim = 256;  // the attention kernel's limit
// Offset of the weight's fp16 copy in the Linear scratch, when it has one.
constexpr size_t kScratchAlign = 256;

class CudaBackend final : public Backend {
 public:
  // Takes ownership of the streams, the events and the cuBLAS handle.
  CudaBackend(int device, const cudaDeviceProp& prop,
              const CudaBackendOptions& options, cudaStream_t stream,
              cudaStream_t copy_stream, std::vector<cudaEvent_t> marks,
              cudaEvent_t copied, cublasHandle_t cublas)
      : device_(device),
        name_(std::string("cuda:") + prop.name),
        sm_count_(prop.multiProcessorCount),
        device_bytes_(prop.totalGlobalMem),
        options_(options),
        stream_(stream),
        copy_stream_(copy_stream),
        marks_(std::move(marks)),
        copied_(copied),
        cublas_(cublas) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(copy_stream_);
    cudaStreamSynchronize(stream_);
    if (touch_stream_ != nullptr) {
      cudaStreamSynchronize(touch_stream_);
      cudaStreamDestroy(touch_stream_);
      cudaFree(touch_sink_);
    }
    for (auto& [begin, range] : pinned_) {
      cudaHostUnregister(reinterpret_cast<void*>(begin));
    }
    for (auto& [begin, range] : constants_) cudaFree(range.device);
    for (auto& [key, half] : half_weights_) cudaFree(half);
    cublasDestroy(cublas_);
    for (cudaEvent_t e : marks_) cudaEventDestroy(e);
    cudaEventDestroy(copied_);
    cudaStreamDestroy(copy_stream_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return name_; }

  void* AllocateShared(size_t bytes) override {
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

  void* AllocateDevice(size_t bytes) override {
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

  void FreeDevice(void* p) override { FreeShared(p); }

  void FreeShared(void* p) override {
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

  absl::Status RegisterConstant(const float* p, size_t count) override {
    if (count == 0) return absl::OkStatus();
    if (p == nullptr) {
      return absl::InvalidArgumentError("RegisterConstant: null pointer");
    }
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    const size_t bytes = count * sizeof(float);
    // Managed memory is already visible to the device: nothing to copy.
    if (FindRange(shared_, begin) != shared_.end()) {
      return absl::OkStatus();
    }
    // The last range starting before our end must end before our start.
    auto it = constants_.lower_bound(begin + bytes);
    if (it != constants_.begin()) {
      --it;
      if (it->first == begin && it->second.bytes == bytes) {
        return absl::OkStatus();  // registered before
      }
      if (it->first + it->second.bytes > begin) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "RegisterConstant: [%p, +%zu bytes) overlaps the registered range "
            "[%#x, +%zu bytes)",
            p, bytes, it->first, it->second.bytes));
      }
    }
    cudaSetDevice(device_);
    void* device = nullptr;
    cudaError_t err = cudaMalloc(&device, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrFormat("RegisterConstant: cudaMalloc of %zu bytes: %s",
                          bytes, CudaError(err)));
    }
    // From pageable memory this returns once the source has been read.
    err = cudaMemcpyAsync(device, p, bytes, cudaMemcpyHostToDevice, stream_);
    if (err != cudaSuccess) {
      cudaGetLastError();
      cudaFree(device);
      return absl::InternalError(absl::StrFormat(
          "RegisterConstant: copy of %zu bytes: %s", bytes, CudaError(err)));
    }
    constants_[begin] = ConstantRange{bytes, static_cast<char*>(device)};
    return absl::OkStatus();
  }

  absl::Status Synchronize() override {
    cudaSetDevice(device_);
    // The compute stream may wait on copies: they finish first.
    cudaError_t err = cudaStreamSynchronize(copy_stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
    if (err != cudaSuccess) {
      Fail(absl::InternalError("CUDA: " + CudaError(err)));
    }
    return error_;
  }

  Mark MarkIssued() override {
    if (!Begin()) return 0;
    cudaEvent_t event = marks_[mark_count_ % kMarkEvents];
    if (!CheckCuda(cudaEventRecord(event, stream_), "MarkIssued")) return 0;
    return ++mark_count_;
  }

  void CopyFromHost(void* dst, const void* src, size_t bytes,
                    Mark after) override {
    constexpr const char* kOp = "CopyFromHost";
    if (!Begin() || bytes == 0) return;
    if (src == nullptr) {
      return Fail(absl::InvalidArgumentError("CopyFromHost: src is null"));
    }
    if (after > mark_count_) {
      return Fail(absl::InvalidArgumentError(absl::StrFormat(
          "CopyFromHost: mark %d was never issued (last %d)", after,
          mark_count_)));
    }
    char* d = Out(static_cast<char*>(dst), static_cast<long>(bytes), kOp,
                  "dst");
    if (!ok()) return;
    // Events are reused round-robin, so the newest record of the mark's
    // event is at or after the mark: waiting on it is never too early.
    if (after > 0 &&
        !CheckCuda(cudaStreamWaitEvent(copy_stream_,
                                       marks_[(after - 1) % kMarkEvents], 0),
                   kOp)) {
      return;
    }
    if (!CheckCuda(cudaMemcpyAsync(d, src, bytes, cudaMemcpyDefault,
                                   copy_stream_),
                   kOp) ||
        !CheckCuda(cudaEventRecord(copied_, copy_stream_), kOp)) {
      return;
    }
    CheckCuda(cudaStreamWaitEvent(stream_, copied_, 0), kOp);
  }

  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    constexpr const char* kOp = "CopyToHost";
    if (!Begin()) return error_;
    if (bytes > 0) {
      if (dst == nullptr) {
        Fail(absl::InvalidArgumentError("CopyToHost: dst is null"));
        return error_;
      }
      const char* s = In(static_cast<const char*>(src),
                         static_cast<long>(bytes), kOp, "src");
      if (!ok()) return error_;
      // On the compute stream: after every operation issued so far, and
      // after the copies they wait for.
      if (!CheckCuda(cudaMemcpyAsync(dst, s, bytes, cudaMemcpyDefault,
                                     stream_),
                     kOp)) {
        return error_;
      }
    }
    return Synchronize();
  }

  void QueueCopyToHost(void* dst, const void* src, size_t bytes) override {
    constexpr const char* kOp = "QueueCopyToHost";
    if (!Begin() || bytes == 0) return;
    if (dst == nullptr) {
      return Fail(absl::InvalidArgumentError("QueueCopyToHost: dst is null"));
    }
    const char* s = In(static_cast<const char*>(src),
                       static_cast<long>(bytes), kOp, "src");
    if (!ok()) return;
    // On the compute stream, after every operation issued so far; the next
    // Synchronize waits for it.
    CheckCuda(cudaMemcpyAsync(dst, s, bytes, cudaMemcpyDefault, stream_), kOp);
  }

  absl::Status WaitCopies() override {
    cudaSetDevice(device_);
    const cudaError_t err = cudaStreamSynchronize(copy_stream_);
    if (err != cudaSuccess) {
      Fail(absl::InternalError("CUDA: " + CudaError(err)));
    }
    return error_;
  }

  absl::Status PinHost(void* p, size_t bytes) override {
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
      // Pinned already (the shm and RDMA data planes pin their slots):
      // usable as is, and not ours to unpin.
      cudaGetLastError();
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
        PinnedRange{bytes, static_cast<char*>(device)};
    if (device != nullptr) TouchPages(device, bytes);
    return absl::OkStatus();
  }

  // On an H200 the first decode step after a prompt took about 50 ms per
  // GB of the memory node's rows longer than the next ones, in proportion
  // to the pages of the rows it read (InfiniGen's 10% of the rows touch
  // about 80% of the pages, and cost about 80% of full's), which points at
  // the device's first access to each page of newly registered memory. A
  // kernel on a stream of its own reads one word of every page here,
  // beside whatever the device does next (a prompt's prefill), so that
  // cost is paid there. Ranges under a huge page (plans, small fetch
  // buffers) are left alone.
  void TouchPages(void* device, size_t bytes) {
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

  void UnpinHost(void* p) override {
    auto it = pinned_.find(reinterpret_cast<uintptr_t>(p));
    if (it == pinned_.end()) return;
    cudaSetDevice(device_);
    // A copy or a kernel (GatherRows, TouchPages) still queued may read it.
    cudaStreamSynchronize(copy_stream_);
    cudaStreamSynchronize(stream_);
    if (touch_stream_ != nullptr) cudaStreamSynchronize(touch_stream_);
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
    pinned_.erase(it);
  }

  bool GatherRows(const GatherRowsParams& g) override {
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

  void Linear(const float* x, int n, int in, const float* w, const float* bias,
              int out, float* y) override {
    constexpr const char* kOp = "Linear";
    if (!Begin() || n == 0 || out == 0) return;
    if (n < 0 || in <= 0 || out < 0) {
      return FailShape(kOp, absl::StrFormat("n=%d in=%d out=%d", n, in, out));
    }
    const long x_count = static_cast<long>(n) * in;
    const long w_count = static_cast<long>(out) * in;
    bool w_constant = false;
    const float* xd = In(x, x_count, kOp, "x");
    const float* wd = In(w, w_count, kOp, "w", &w_constant);
    const float* bd = bias == nullptr ? nullptr : In(bias, out, kOp, "bias");
    float* yd = Out(y, static_cast<long>(n) * out, kOp, "y");
    if (!ok()) return;
    const float one = 1.0f, zero = 0.0f;
    // Row-major y[n, out] = x[n, in] . w[out, in]^T is, column-major,
    // y^T[out, n] = w^T . x^T with w read as a column-major [in, out].
    cublasStatus_t status;
    if (options_.half_precision) {
      const size_t w_offset = (x_count * sizeof(uint16_t) + kScratchAlign - 1) /
                              kScratchAlign * kScratchAlign;
      const size_t need =
          w_offset + (w_constant ? 0 : w_count * sizeof(uint16_t));
      if (!CheckCuda(linear_scratch_.Reserve(need, stream_), kOp)) return;
      auto* x16 = reinterpret_cast<uint16_t*>(linear_scratch_.data());
      if (!Launched(LaunchFloatToHalf({xd, x16, x_count}, stream_), kOp))
        return;
      const uint16_t* w16 = nullptr;
      if (w_constant) {
        w16 = HalfWeights(wd, w_count);
        if (w16 == nullptr) return;
      } else {
        // Not a registered constant: it may change, so convert each call.
        auto* w16_scratch =
            reinterpret_cast<uint16_t*>(linear_scratch_.data() + w_offset);
        if (!Launched(LaunchFloatToHalf({wd, w16_scratch, w_count}, stream_),
                      kOp)) {
          return;
        }
        w16 = w16_scratch;
      }
      status = cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one,
                            w16, CUDA_R_16F, in, x16, CUDA_R_16F, in, &zero, yd,
                            CUDA_R_32F, out, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT);
    } else {
      status = cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one,
                           wd, in, xd, in, &zero, yd, out);
    }
    if (status != CUBLAS_STATUS_SUCCESS) {
      return Fail(absl::InternalError(
          absl::StrFormat("Linear: cuBLAS: %s (n=%d in=%d out=%d)",
                          cublasGetStatusString(status), n, in, out)));
    }
    if (bd != nullptr) {
      Launched(LaunchBiasAdd({yd, bd, n, out}, stream_), kOp);
    }
  }

  // cuBLAS's strided batched SGEMM, fp32 whatever half_precision says (the
  // policies' products are small and ranked by their last bits).
  void LinearBatched(const float* x, long x_stride, int n, int in,
                     const float* w, long w_stride, int out, float* y,
                     long y_stride, int batch) override {
    constexpr const char* kOp = "LinearBatched";
    if (!Begin() || n == 0 || out == 0 || batch == 0) return;
    if (n < 0 || in <= 0 || out < 0 || batch < 0 || x_stride < 0 ||
        w_stride < 0 || y_stride < static_cast<long>(n) * out) {
      return FailShape(kOp, absl::StrFormat(
                                "n=%d in=%d out=%d batch=%d x_stride=%d "
                                "w_stride=%d y_stride=%d",
                                n, in, out, batch, x_stride, w_stride,
                                y_stride));
    }
    const long last = batch - 1L;
    const float* xd =
        In(x, last * x_stride + static_cast<long>(n) * in, kOp, "x");
    const float* wd =
        In(w, last * w_stride + static_cast<long>(out) * in, kOp, "w");
    float* yd = Out(y, last * y_stride + static_cast<long>(n) * out, kOp, "y");
    if (!ok()) return;
    const float one = 1.0f, zero = 0.0f;
    // As Linear: column-major y_b^T[out, n] = w_b^T . x_b^T.
    const cublasStatus_t status = cublasSgemmStridedBatched(
        cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, wd, in, w_stride,
        xd, in, x_stride, &zero, yd, out, y_stride, batch);
    if (status != CUBLAS_STATUS_SUCCESS) {
      Fail(absl::InternalError(absl::StrFormat(
          "LinearBatched: cuBLAS: %s (n=%d in=%d out=%d batch=%d)",
          cublasGetStatusString(status), n, in, out, batch)));
    }
  }

  void RmsNorm(const float* x, int n, int dim, const float* gain, float eps,
               float* y) override {
    constexpr const char* kOp = "RmsNorm";
    if (!Begin() || n == 0) return;
    if (n < 0 || dim <= 0) {
      return FailShape(kOp, absl::StrFormat("n=%d dim=%d", n, dim));
    }
    const long count = static_cast<long>(n) * dim;
    RmsNormParams p;
    p.x = In(x, count, kOp, "x");
    p.gain = In(gain, dim, kOp, "gain");
    p.y = Out(y, count, kOp, "y");
    p.n = n;
    p.dim = dim;
    p.eps = eps;
    if (ok()) Launched(LaunchRmsNorm(p, stream_), kOp);
  }

  void LayerNorm(const float* x, int n, int dim, const float* gain,
                 const float* bias, float eps, float* y) override {
    constexpr const char* kOp = "LayerNorm";
    if (!Begin() || n == 0) return;
    if (n < 0 || dim <= 0) {
      return FailShape(kOp, absl::StrFormat("n=%d dim=%d", n, dim));
    }
    const long count = static_cast<long>(n) * dim;
    LayerNormParams p;
    p.x = In(x, count, kOp, "x");
    p.gain = In(gain, dim, kOp, "gain");
    p.bias = In(bias, dim, kOp, "bias");
    p.y = Out(y, count, kOp, "y");
    p.n = n;
    p.dim = dim;
    p.eps = eps;
    if (ok()) Launched(LaunchLayerNorm(p, stream_), kOp);
  }

  void Rope(float* x, int n, int n_heads, int head_dim, const int* positions,
            float theta) override {
    constexpr const char* kOp = "Rope";
    if (!Begin() || n == 0) return;
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 ||
        !(theta > 0.0f)) {
      return FailShape(kOp, absl::StrFormat("n=%d n_heads=%d head_dim=%d "
                                            "(even) theta=%g",
                                            n, n_heads, head_dim, theta));
    }
    RopeParams p;
    p.x = Out(x, static_cast<long>(n) * n_heads * head_dim, kOp, "x");
    p.positions = In(positions, n, kOp, "positions");
    p.n = n;
    p.n_heads = n_heads;
    p.head_dim = head_dim;
    p.theta = theta;
    if (ok()) Launched(LaunchRope(p, stream_), kOp);
  }

  void Attention(const AttentionParams& a) override {
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

  void SwiGlu(float* gate, const float* up, long count) override {
    Gate("SwiGlu", LaunchSwiGlu, gate, up, count);
  }

  void GeluTanhGate(float* gate, const float* up, long count) override {
    Gate("GeluTanhGate", LaunchGeluTanhGate, gate, up, count);
  }

  // gate = act(gate) * up by `launch` (the gated MLPs' one shape).
  void Gate(const char* op, int (*launch)(const SwiGluParams&, void*),
            float* gate, const float* up, long count) {
    if (!Begin() || count == 0) return;
    if (count < 0) return FailShape(op, absl::StrFormat("count=%d", count));
    SwiGluParams p;
    p.gate = Out(gate, count, op, "gate");
    p.up = In(up, count, op, "up");
    p.count = count;
    if (ok()) Launched(launch(p, stream_), op);
  }

  void Scale(float* x, long count, float s) override {
    constexpr const char* kOp = "Scale";
    if (!Begin() || count == 0) return;
    if (count < 0) return FailShape(kOp, absl::StrFormat("count=%d", count));
    ScaleParams p;
    p.x = Out(x, count, kOp, "x");
    p.count = count;
    p.s = s;
    if (ok()) Launched(LaunchScale(p, stream_), kOp);
  }

  void Relu(float* x, long count) override {
    constexpr const char* kOp = "Relu";
    if (!Begin() || count == 0) return;
    if (count < 0) return FailShape(kOp, absl::StrFormat("count=%d", count));
    ReluParams p;
    p.x = Out(x, count, kOp, "x");
    p.count = count;
    if (ok()) Launched(LaunchRelu(p, stream_), kOp);
  }

  void Add(float* x, const float* y, long count) override {
    constexpr const char* kOp = "Add";
    if (!Begin() || count == 0) return;
    if (count < 0) return FailShape(kOp, absl::StrFormat("count=%d", count));
    AddParams p;
    p.x = Out(x, count, kOp, "x");
    p.y = In(y, count, kOp, "y");
    p.count = count;
    if (ok()) Launched(LaunchAdd(p, stream_), kOp);
  }

  void DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                    KvRowFormat format, float* rows) override {
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

  // One launch for every head (LaunchStagedAttention), the counts read on
  // the device, fp16 and int4 rows decoded as they are read.
  bool AttendStagedRows(const StagedRowsAttention& a) override {
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
    const long row_count = std::max(1L, a.rows) * row_width;
    StagedAttentionParams p;
    p.q = In(a.q, q_count, kOp, "q");
    p.k_rows = In(a.k_rows, row_count, kOp, "k_rows");
    p.v_rows = In(a.v_rows, row_count, kOp, "v_rows");
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

  // fp16 rows on the device (FloatToHalf, common/half.h's bits); int4 rows
  // are encoded on the host.
  bool EncodeKvRows(const float* rows, int n_rows, int head_dim,
                    KvRowFormat format, uint16_t* out) override {
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

  void SpeculateScores(const SpeculationParams& a) override {
    constexpr const char* kOp = "SpeculateScores";
    if (!Begin() || a.n_tokens == 0) return;
    if (a.n_tokens < 0 || a.n_heads <= 0 || a.n_kv_heads <= 0 ||
        a.n_heads % a.n_kv_heads != 0 || a.d <= 0 || a.n_cols < 1 ||
        a.n_cols > a.d || a.k_stride < a.n_tokens) {
      return FailShape(
          kOp, absl::StrFormat("n_heads=%d n_kv_heads=%d (must divide) d=%d "
                               "n_cols=%d (1..d) n_tokens=%d k_stride=%d "
                               "(>= n_tokens)",
                               a.n_heads, a.n_kv_heads, a.d, a.n_cols,
                               a.n_tokens, a.k_stride));
    }
    SpeculationParams p = a;  // the shape; pointers resolved below
    p.q_skewed = In(a.q_skewed, static_cast<long>(a.n_heads) * a.d, kOp,
                    "q_skewed");
    p.partial_k =
        In(a.partial_k,
           (static_cast<long>(a.n_kv_heads - 1) * a.k_stride + a.n_tokens) *
               speculator::PartialKeyRowBytes(a.n_cols, a.format),
           kOp, "partial_k");
    p.cols = In(a.cols, static_cast<long>(a.n_kv_heads) * a.n_cols, kOp,
                "cols");
    p.scores = Out(a.scores, static_cast<long>(a.n_heads) * a.n_tokens, kOp,
                   "scores");
    if (!ok()) return;
    Launched(LaunchSpeculateScores(p, stream_), kOp);
  }

  void SelectTopK(const TopKParams& a) override {
    constexpr const char* kOp = "SelectTopK";
    if (!Begin() || a.n_tokens == 0) return;
    const bool combine = a.n_heads != a.n_kv_heads;
    bool shape_ok = a.n_tokens > 0 && a.n_kv_heads > 0 &&
                    a.n_heads >= a.n_kv_heads &&
                    a.n_heads % a.n_kv_heads == 0 &&
                    a.head_offsets != nullptr && a.head_offsets[0] == 0;
    for (int g = 0; shape_ok && g < a.n_kv_heads; ++g) {
      const int32_t k = a.head_offsets[g + 1] - a.head_offsets[g];
      shape_ok = k >= 0 && k <= a.n_tokens;
    }
    if (!shape_ok) {
      return FailShape(
          kOp, absl::StrFormat("n_heads=%d n_kv_heads=%d (must divide) "
                               "n_tokens=%d, head offsets from 0 ascending "
                               "by at most n_tokens",
                               a.n_heads, a.n_kv_heads, a.n_tokens));
    }
    const long total = a.head_offsets[a.n_kv_heads];
    if (total == 0) return;
    const long n = static_cast<long>(a.n_kv_heads) * a.n_tokens;
    SelectTopKParams p;
    p.scores = In(a.scores, static_cast<long>(a.n_heads) * a.n_tokens, kOp,
                  "scores");
    p.indices = Out(a.indices, total, kOp, "indices");
    float* combined =
        combine ? Out(a.combined, n, kOp, "combined") : nullptr;
    if (!ok()) return;
    // The head offsets reach the device through the scratch: a small copy
    // from pageable memory, staged before cudaMemcpyAsync returns.
    const size_t offset_bytes = (a.n_kv_heads + 1) * sizeof(int32_t);
    if (!CheckCuda(select_scratch_.Reserve(offset_bytes, stream_), kOp) ||
        !CheckCuda(cudaMemcpyAsync(select_scratch_.data(), a.head_offsets,
                                   offset_bytes, cudaMemcpyHostToDevice,
                                   stream_),
                   kOp)) {
      return;
    }
    if (combine) {
      CombineHeadScoresParams c;
      c.head_scores = p.scores;
      c.scores = combined;
      c.n_heads = a.n_heads;
      c.n_kv_heads = a.n_kv_heads;
      c.n_tokens = a.n_tokens;
      if (!Launched(LaunchCombineHeadScores(c, stream_), kOp)) return;
      p.scores = combined;
    }
    p.n_kv_heads = a.n_kv_heads;
    p.n_tokens = a.n_tokens;
    p.head_offsets = reinterpret_cast<const int32_t*>(select_scratch_.data());
    Launched(LaunchSelectTopK(p, stream_), kOp);
  }

  void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                           uint8_t* rows, size_t row_stride) override {
    constexpr const char* kOp = "QuantizePartialKeys";
    if (!Begin() || n_rows == 0) return;
    const long row_bytes = speculator::PartialKeyRowBytes(n_cols);
    if (n_rows < 0 || n_cols <= 0 ||
        static_cast<long>(row_stride) < row_bytes) {
      return FailShape(kOp, absl::StrFormat(
                                "n_rows=%d n_cols=%d row_stride=%d (>= %d)",
                                n_rows, n_cols, row_stride, row_bytes));
    }
    QuantizePartialKeysParams p;
    p.keys = In(keys, static_cast<long>(n_rows) * n_cols, kOp, "keys");
    p.rows = Out(rows, (n_rows - 1L) * static_cast<long>(row_stride) + row_bytes,
                 kOp, "rows");
    p.n_rows = n_rows;
    p.n_cols = n_cols;
    p.row_stride = static_cast<long>(row_stride);
    if (!ok()) return;
    Launched(LaunchQuantizePartialKeys(p, stream_), kOp);
  }

  void Copy(float* dst, const float* src, long count) override {
    constexpr const char* kOp = "Copy";
    if (!Begin() || count == 0) return;
    if (count < 0) return FailShape(kOp, absl::StrFormat("count=%d", count));
    float* d = Out(dst, count, kOp, "dst");
    const float* s = In(src, count, kOp, "src");
    if (!ok()) return;
    CheckCuda(cudaMemcpyAsync(d, s, count * sizeof(float), cudaMemcpyDefault,
                              stream_),
              kOp);
  }

  void CopyRows(float* dst, long dst_stride, const float* src,
                long src_stride, int rows, long width) override {
    constexpr const char* kOp = "CopyRows";
    float* d = dst;
    const float* s = src;
    if (!StridedRows(kOp, d, dst_stride, s, src_stride, rows, width)) return;
    CheckCuda(cudaMemcpy2DAsync(d, dst_stride * sizeof(float), s,
                                src_stride * sizeof(float),
                                width * sizeof(float), rows,
                                cudaMemcpyDefault, stream_),
              kOp);
  }

  void CopyRowsToHalf(uint16_t* dst, long dst_stride, const float* src,
                      long src_stride, int rows, long width) override {
    constexpr const char* kOp = "CopyRowsToHalf";
    uint16_t* d = dst;
    const float* s = src;
    if (!StridedRows(kOp, d, dst_stride, s, src_stride, rows, width)) return;
    Launched(LaunchFloatRowsToHalf({s, src_stride, d, dst_stride, rows, width},
                                   stream_),
             kOp);
  }

  // The local cache in fp16 where the layers compute in fp16: the prefill
  // kernel converts K and V to fp16 anyway.
  bool HalfKvCache() const override { return options_.half_precision; }

 private:
  bool ok() const { return error_.ok(); }

  // A strided copy's shape checked and its two ranges resolved in place
  // (every row lies in the span from the first row's start to the last
  // row's end): false where there is nothing to do or an error.
  template <typename T>
  bool StridedRows(const char* op, T*& dst, long dst_stride, const float*& src,
                   long src_stride, int rows, long width) {
    if (!Begin() || rows == 0 || width == 0) return false;
    if (rows < 0 || width < 0 || dst_stride < width || src_stride < width) {
      FailShape(op, absl::StrFormat(
                        "rows=%d width=%d dst_stride=%d src_stride=%d", rows,
                        width, dst_stride, src_stride));
      return false;
    }
    dst = Out(dst, (rows - 1L) * dst_stride + width, op, "dst");
    src = In(src, (rows - 1L) * src_stride + width, op, "src");
    return ok();
  }

  // Records the first error; later ones are consequences of it or wait.
  void Fail(absl::Status status) {
    if (!error_.ok()) return;
    IG_LOG(ERROR) << name_ << ": " << status.message();
    error_ = std::move(status);
  }

  void FailShape(const char* op, const std::string& shape) {
    Fail(absl::InvalidArgumentError(
        absl::StrFormat("%s: invalid shape: %s", op, shape)));
  }

  // False (skip the operation) once an error is recorded.
  bool Begin() {
    if (!ok()) return false;
    cudaSetDevice(device_);
    return true;
  }

  bool CheckCuda(cudaError_t err, const char* op) {
    if (err == cudaSuccess) return true;
    cudaGetLastError();
    Fail(absl::InternalError(absl::StrFormat("%s: %s", op, CudaError(err))));
    return false;
  }

  // A launcher's result: the launchers reject bad arguments with
  // cudaErrorInvalidValue before launching anything.
  bool Launched(int code, const char* op) {
    if (code == 0) return true;
    const auto err = static_cast<cudaError_t>(code);
    if (err == cudaErrorInvalidValue) {
      Fail(absl::InvalidArgumentError(absl::StrFormat(
          "%s: the kernel rejected its arguments: %s", op, CudaError(err))));
    } else {
      Fail(absl::InternalError(
          absl::StrFormat("%s: launch: %s", op, CudaError(err))));
    }
    return false;
  }

  // The device address of `bytes` at p, which `op` reads (or writes): the
  // device copy when p lies in a registered constant (read only), p itself
  // for managed or device memory. Records InvalidArgument and returns null
  // for anything else.
  const void* Resolve(const void* p, size_t bytes, bool write, const char* op,
                      const char* arg, bool* constant) {
    if (p == nullptr) {
      Fail(absl::InvalidArgumentError(
          absl::StrFormat("%s: %s is null", op, arg)));
      return nullptr;
    }
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto c = FindRange(constants_, a);
    if (c != constants_.end()) {
      if (write) {
        Fail(absl::InvalidArgumentError(absl::StrFormat(
            "%s: %s (%p) would write into a registered constant", op, arg, p)));
        return nullptr;
      }
      if (a + bytes > c->first + c->second.bytes) {
        Fail(absl::InvalidArgumentError(absl::StrFormat(
            "%s: %s (%p, %zu bytes) runs past the end of its registered range",
            op, arg, p, bytes)));
        return nullptr;
      }
      if (constant != nullptr) *constant = true;
      return c->second.device + (a - c->first);
    }
    auto s = FindRange(shared_, a);
    if (s != shared_.end()) {
      if (a + bytes > s->first + s->second) {
        Fail(absl::InvalidArgumentError(absl::StrFormat(
            "%s: %s (%p, %zu bytes) runs past the end of its AllocateShared "
            "buffer",
            op, arg, p, bytes)));
        return nullptr;
      }
      return p;
    }
    // Memory the caller allocated with CUDA itself.
    cudaPointerAttributes attributes;
    const cudaError_t err = cudaPointerGetAttributes(&attributes, p);
    if (err != cudaSuccess) cudaGetLastError();
    if (err == cudaSuccess && (attributes.type == cudaMemoryTypeManaged ||
                               (attributes.type == cudaMemoryTypeDevice &&
                                attributes.device == device_))) {
      return p;
    }
    Fail(absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s (%p) is neither managed or device memory nor inside a range "
        "given to RegisterConstant",
        op, arg, p)));
    return nullptr;
  }

  template <typename T>
  const T* In(const T* p, long count, const char* op, const char* arg,
              bool* constant = nullptr) {
    return static_cast<const T*>(
        Resolve(p, count * sizeof(T), /*write=*/false, op, arg, constant));
  }
  template <typename T>
  T* Out(T* p, long count, const char* op, const char* arg) {
    return static_cast<T*>(const_cast<void*>(
        Resolve(p, count * sizeof(T), /*write=*/true, op, arg, nullptr)));
  }

  // The fp16 copy of the registered matrix at device address w (count
  // floats), made on first use. Null (error recorded) on failure.
  const uint16_t* HalfWeights(const float* w, long count) {
    const auto key = std::make_pair(w, count);
    auto it = half_weights_.find(key);
    if (it != half_weights_.end()) return it->second;
    void* half = nullptr;
    if (!CheckCuda(cudaMalloc(&half, count * sizeof(uint16_t)), "Linear")) {
      return nullptr;
    }
    auto* h = static_cast<uint16_t*>(half);
    if (!Launched(LaunchFloatToHalf({w, h, count}, stream_), "Linear")) {
      cudaFree(half);
      return nullptr;
    }
    half_weights_[key] = h;
    return h;
  }

  const int device_;
  const std::string name_;
  const int sm_count_;
  const size_t device_bytes_;  // the card's memory
  const CudaBackendOptions options_;
  cudaStream_t stream_;       // every operation
  cudaStream_t copy_stream_;  // CopyFromHost
  const std::vector<cudaEvent_t> marks_;  // [kMarkEvents], on stream_
  cudaEvent_t copied_;        // the last copy, on copy_stream_
  Mark mark_count_ = 0;       // marks issued
  cublasHandle_t cublas_;
  absl::Status error_;  // the first error; sticky

  std::map<uintptr_t, ConstantRange> constants_;  // by host address
  // AllocateShared (managed) and AllocateDevice (device): bytes.
  std::map<uintptr_t, size_t> shared_;
  std::map<uintptr_t, PinnedRange> pinned_;       // PinHost
  cudaStream_t touch_stream_ = nullptr;  // TouchPages; made on first use
  unsigned* touch_sink_ = nullptr;       // TouchPages' word
  // fp16 copies of registered matrices, by (device address, floats).
  std::map<std::pair<const float*, long>, uint16_t*> half_weights_;
  DeviceScratch linear_scratch_;     // fp16 x, and w when not registered
  DeviceScratch attention_scratch_;  // split-KV partial results
  DeviceScratch select_scratch_;     // SelectTopK's head offsets
};

}  // namespace

std::unique_ptr<Backend> NewCudaBackendOver(
    int device, const cudaDeviceProp& prop, const CudaBackendOptions& options,
    cudaStream_t stream, cudaStream_t copy_stream,
    std::vector<cudaEvent_t> marks, cudaEvent_t copied,
    cublasHandle_t cublas) {
  return std::make_unique<CudaBackend>(device, prop, options, stream,
                                       copy_stream, std::move(marks), copied,
                                       cublas);
}

}  // namespace infinigen::gpu_worker::cuda
