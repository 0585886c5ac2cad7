// CudaBackend's speculation (cuda_backend_class.h): InfiniGen's
// speculated scores over the partial keys, the top-k selection per KV
// head, and the partial keys' quantization.
#include "gpu_worker/backend/cuda/cuda_backend_class.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_format.h"
#include "gpu_worker/backend/cuda/kernels.h"
#include "speculator/partial_keys.h"

namespace infinigen::gpu_worker::cuda {

void CudaBackend::SpeculateScores(const SpeculationParams& a) {
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

void CudaBackend::SelectTopK(const TopKParams& a) {
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

void CudaBackend::QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                                      uint8_t* rows, size_t row_stride) {
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

void CudaBackend::AddSkewedColumnSums(const float* x, int n, int heads,
                                      int per_kv, int d, const float* skew_t,
                                      float* sums) {
  constexpr const char* kOp = "AddSkewedColumnSums";
  if (!Begin() || n == 0) return;
  if (n < 0 || heads <= 0 || per_kv <= 0 || heads % per_kv != 0 || d <= 0 ||
      d > 1024) {
    return FailShape(kOp, absl::StrFormat("n=%d heads=%d per_kv=%d (must "
                                          "divide) d=%d (1..1024)",
                                          n, heads, per_kv, d));
  }
  const int groups = heads / per_kv;
  const long width = static_cast<long>(heads) * d;
  const float* xd = In(x, n * width, kOp, "x");
  const float* ad =
      In(skew_t, static_cast<long>(groups) * d * d, kOp, "skew_t");
  float* sd = Out(sums, static_cast<long>(groups) * d, kOp, "sums");
  if (!ok()) return;
  // Blocks of tokens through one scratch: each KV head's query heads'
  // products in one batched GEMM, then their magnitudes summed.
  constexpr int kBlock = 256;
  const int block = std::min(n, kBlock);
  if (!CheckCuda(skew_scratch_.Reserve(block * width * sizeof(float), stream_),
                 kOp)) {
    return;
  }
  auto* skewed = reinterpret_cast<float*>(skew_scratch_.data());
  const float one = 1.0f, zero = 0.0f;
  for (int i0 = 0; i0 < n; i0 += kBlock) {
    const int bn = std::min(kBlock, n - i0);
    for (int g = 0; g < groups; ++g) {
      // Column-major, head h's products S_h^T [d, bn] = A^T . X_h^T: skew_t
      // read column-major is A, transposed by the op; X_h^T's columns are
      // the tokens' rows, width apart.
      const long head0 = static_cast<long>(g) * per_kv * d;
      const cublasStatus_t status = cublasSgemmStridedBatched(
          cublas_, CUBLAS_OP_T, CUBLAS_OP_N, d, bn, d, &one,
          ad + static_cast<long>(g) * d * d, d, 0, xd + i0 * width + head0,
          width, d, &zero, skewed + head0, width, d, per_kv);
      if (status != CUBLAS_STATUS_SUCCESS) {
        return Fail(absl::InternalError(absl::StrFormat(
            "AddSkewedColumnSums: cuBLAS: %s (n=%d heads=%d d=%d)",
            cublasGetStatusString(status), n, heads, d)));
      }
    }
    AbsColumnSumsParams p;
    p.x = skewed;
    p.sums = sd;
    p.n = bn;
    p.heads = heads;
    p.per_kv = per_kv;
    p.d = d;
    if (!Launched(LaunchAbsColumnSums(p, stream_), kOp)) return;
  }
}

}  // namespace infinigen::gpu_worker::cuda
