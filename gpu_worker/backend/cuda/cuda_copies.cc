// CudaBackend's streams, marks and copies (cuda_backend_class.h): the
// compute stream and the copy stream, the marks a copy may wait for, and
// the copies between host and device and on the device.
#include "gpu_worker/backend/cuda/cuda_backend_class.h"

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {

absl::Status CudaBackend::Synchronize() {
  cudaSetDevice(device_);
  // The compute stream may wait on copies: they finish first.
  cudaError_t err = cudaStreamSynchronize(copy_stream_);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
  if (err != cudaSuccess) {
    Fail(absl::InternalError("CUDA: " + CudaError(err)));
  }
  return error_;
}

CudaBackend::Mark CudaBackend::MarkIssued() {
  if (!Begin()) return 0;
  cudaEvent_t event = marks_[mark_count_ % kMarkEvents];
  if (!CheckCuda(cudaEventRecord(event, stream_), "MarkIssued")) return 0;
  return ++mark_count_;
}

void CudaBackend::CopyFromHost(void* dst, const void* src, size_t bytes,
                               Mark after) {
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

absl::Status CudaBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
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

void CudaBackend::QueueCopyToHost(void* dst, const void* src, size_t bytes) {
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

absl::Status CudaBackend::WaitCopies() {
  cudaSetDevice(device_);
  const cudaError_t err = cudaStreamSynchronize(copy_stream_);
  if (err != cudaSuccess) {
    Fail(absl::InternalError("CUDA: " + CudaError(err)));
  }
  return error_;
}

template <typename T>
bool CudaBackend::StridedRows(const char* op, T*& dst, long dst_stride,
                              const float*& src, long src_stride, int rows,
                              long width) {
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

void CudaBackend::Copy(float* dst, const float* src, long count) {
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

void CudaBackend::CopyRows(float* dst, long dst_stride, const float* src,
                           long src_stride, int rows, long width) {
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

void CudaBackend::CopyRowsToHalf(uint16_t* dst, long dst_stride,
                                 const float* src, long src_stride, int rows,
                                 long width) {
  constexpr const char* kOp = "CopyRowsToHalf";
  uint16_t* d = dst;
  const float* s = src;
  if (!StridedRows(kOp, d, dst_stride, s, src_stride, rows, width)) return;
  Launched(LaunchFloatRowsToHalf({s, src_stride, d, dst_stride, rows, width},
                                 stream_),
           kOp);
}

}  // namespace infinigen::gpu_worker::cuda
