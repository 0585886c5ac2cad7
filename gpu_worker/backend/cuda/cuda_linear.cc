// CudaBackend's weights and matrix products (cuda_backend_class.h):
// registered constants copied to the device, their fp16 copies made on
// first use, and Linear (cuBLAS, fp16 or fp32) and LinearBatched.
#include "gpu_worker/backend/cuda/cuda_backend_class.h"

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/backend/cuda/kernels.h"

namespace infinigen::gpu_worker::cuda {
namespace {

// Offset of the weight's fp16 copy in the Linear scratch, when it has one.
constexpr size_t kScratchAlign = 256;

}  // namespace

absl::Status CudaBackend::RegisterConstant(const float* p, size_t count) {
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

void CudaBackend::Linear(const float* x, int n, int in, const float* w,
                         const float* bias, int out, float* y) {
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

void CudaBackend::LinearBatched(const float* x, long x_stride, int n, int in,
                                const float* w, long w_stride, int out,
                                float* y, long y_stride, int batch) {
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

const uint16_t* CudaBackend::HalfWeights(const float* w, long count) {
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

}  // namespace infinigen::gpu_worker::cuda
