// CudaBackend: the Backend on one CUDA device, private to
// //gpu_worker/backend/cuda:cuda_backend. One class, its methods defined by
// job: lifetime, the sticky error and argument resolution
// (cuda_backend.cc); device and managed memory, pinned host ranges and
// their huge pages (cuda_memory.cc); registered weights, their fp16 copies
// and the matrix products (cuda_linear.cc); the streams, marks and copies
// (cuda_copies.cc); and the dispatches by family: the layers' elementwise
// and normalization kernels (cuda_layer_ops.cc), attention and KV rows
// (cuda_attention_ops.cc), speculation and selection
// (cuda_speculation_ops.cc).
//
// Every operation is queued on the compute stream; CopyFromHost uses a copy
// stream of its own. The first error is sticky: later operations are
// skipped and Synchronize returns it. Not thread-safe (as Backend).
#ifndef INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_CLASS_H_
#define INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_CLASS_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cuda/cuda_backend.h"
#include "gpu_worker/backend/cuda/cuda_backend_impl.h"
#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {

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

  ~CudaBackend() override;

  std::string name() const override { return name_; }

  // Memory (cuda_memory.cc).
  void* AllocateShared(size_t bytes) override;
  void* AllocateDevice(size_t bytes) override;
  void FreeDevice(void* p) override { FreeShared(p); }
  void FreeShared(void* p) override;
  absl::Status PinHost(void* p, size_t bytes) override;
  void UnpinHost(void* p) override;
  bool GatherRows(const GatherRowsParams& g) override;

  // Weights and products (cuda_linear.cc).
  absl::Status RegisterConstant(const float* p, size_t count) override;
  void Linear(const float* x, int n, int in, const float* w, const float* bias,
              int out, float* y) override;
  // cuBLAS's strided batched SGEMM, fp32 whatever half_precision says (the
  // policies' products are small and ranked by their last bits).
  void LinearBatched(const float* x, long x_stride, int n, int in,
                     const float* w, long w_stride, int out, float* y,
                     long y_stride, int batch) override;

  // Streams, marks and copies (cuda_copies.cc).
  absl::Status Synchronize() override;
  Mark MarkIssued() override;
  void CopyFromHost(void* dst, const void* src, size_t bytes,
                    Mark after) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;
  void QueueCopyToHost(void* dst, const void* src, size_t bytes) override;
  absl::Status WaitCopies() override;
  void Copy(float* dst, const float* src, long count) override;
  void CopyRows(float* dst, long dst_stride, const float* src,
                long src_stride, int rows, long width) override;
  void CopyRowsToHalf(uint16_t* dst, long dst_stride, const float* src,
                      long src_stride, int rows, long width) override;

  // The layers' kernels (cuda_layer_ops.cc).
  void RmsNorm(const float* x, int n, int dim, const float* gain, float eps,
               float* y) override;
  void LayerNorm(const float* x, int n, int dim, const float* gain,
                 const float* bias, float eps, float* y) override;
  void Rope(float* x, int n, int n_heads, int head_dim, const int* positions,
            float theta) override;
  void SwiGlu(float* gate, const float* up, long count) override;
  void GeluTanhGate(float* gate, const float* up, long count) override;
  void Scale(float* x, long count, float s) override;
  void Relu(float* x, long count) override;
  void Add(float* x, const float* y, long count) override;

  // Attention and KV rows (cuda_attention_ops.cc).
  void Attention(const AttentionParams& a) override;
  void DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                    KvRowFormat format, float* rows) override;
  // One launch for every head (LaunchStagedAttention), the counts read on
  // the device, fp16 and int4 rows decoded as they are read.
  bool AttendStagedRows(const StagedRowsAttention& a) override;
  // A row cache's misses into its slots: one warp per row
  // (LaunchScatterRows).
  void ScatterRows(const ScatterRowsParams& a) override;
  // fp16 rows on the device (FloatToHalf, common/half.h's bits); int4 rows
  // are encoded on the host.
  bool EncodeKvRows(const float* rows, int n_rows, int head_dim,
                    KvRowFormat format, uint16_t* out) override;
  // The local cache in fp16 where the layers compute in fp16: the prefill
  // kernel converts K and V to fp16 anyway.
  bool HalfKvCache() const override { return options_.half_precision; }

  // Speculation and selection (cuda_speculation_ops.cc).
  void SpeculateScores(const SpeculationParams& a) override;
  void SelectTopK(const TopKParams& a) override;
  void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                           uint8_t* rows, size_t row_stride) override;
  void AddSkewedColumnSums(const float* x, int n, int heads, int per_kv,
                           int d, const float* skew_t, float* sums) override;

 private:
  bool ok() const { return error_.ok(); }

  // A strided copy's shape checked and its two ranges resolved in place
  // (every row lies in the span from the first row's start to the last
  // row's end): false where there is nothing to do or an error.
  template <typename T>
  bool StridedRows(const char* op, T*& dst, long dst_stride, const float*& src,
                   long src_stride, int rows, long width);

  // On an H200 the first decode step after a prompt took about 50 ms per
  // GB of the memory node's rows longer than the next ones, in proportion
  // to the pages of the rows it read (InfiniGen's 10% of the rows touch
  // about 80% of the pages, and cost about 80% of full's), which points at
  // the device's first access to each page of newly registered memory. A
  // kernel on a stream of its own reads one word of every page here,
  // beside whatever the device does next (a prompt's prefill), so that
  // cost is paid there. Ranges under a huge page (plans, small fetch
  // buffers) are left alone.
  void TouchPages(void* device, size_t bytes);

  // gate = act(gate) * up by `launch` (the gated MLPs' one shape).
  void Gate(const char* op, int (*launch)(const SwiGluParams&, void*),
            float* gate, const float* up, long count);

  // Records the first error; later ones are consequences of it or wait.
  void Fail(absl::Status status);

  void FailShape(const char* op, const std::string& shape);

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
                      const char* arg, bool* constant);

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
  const uint16_t* HalfWeights(const float* w, long count);

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
  DeviceScratch skew_scratch_;       // AddSkewedColumnSums' products
};

}  // namespace infinigen::gpu_worker::cuda

#endif  // INFINIGEN_GPU_WORKER_BACKEND_CUDA_CUDA_BACKEND_CLASS_H_
