#include "speculator/speculator.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::speculator {

namespace {

// Singular values of a row-major [rows, cols] matrix, descending; `vt`
// (cols x cols, row-major V^T) is filled when non-null. LAPACK destroys its
// input, so the caller's matrix is copied.
absl::Status SingularValues(const float* m, int rows, int cols,
                            std::vector<float>& s, float* vt) {
  std::vector<float> work(m, m + static_cast<size_t>(rows) * cols);
  s.assign(cols, 0.0f);
  std::vector<float> superb(std::max(1, cols - 1));
  // sgesvd (not sgesdd) because it can return V^T without U: U would be a
  // [rows, cols] matrix for thousands of calibration rows, never used.
  const lapack_int info = LAPACKE_sgesvd(
      LAPACK_ROW_MAJOR, 'N', vt != nullptr ? 'A' : 'N', rows, cols, work.data(),
      cols, s.data(), /*u=*/nullptr, /*ldu=*/1, vt,
      /*ldvt=*/cols, superb.data());
  if (info > 0) {
    return absl::InternalError(absl::StrFormat(
        "SVD of a [%d, %d] matrix did not converge (%d superdiagonals)", rows,
        cols, static_cast<int>(info)));
  }
  if (info < 0) {
    return absl::InternalError(absl::StrFormat(
        "LAPACKE_sgesvd rejected argument %d", static_cast<int>(-info)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<float>> ComputeSkew(const float* q, int q_rows,
                                               const float* k, int k_rows,
                                               int d) {
  if (d <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("head dimension %d must be positive", d));
  }
  // Fewer rows than d leave V underdetermined (and the singular values
  // beyond the rank meaningless), so the ordering would be arbitrary.
  if (q_rows < d || k_rows < d) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "skew needs at least d = %d query and key rows, got %d and %d", d,
        q_rows, k_rows));
  }
  std::vector<float> s_q, s_k;
  std::vector<float> vt(static_cast<size_t>(d) * d);
  IG_RETURN_IF_ERROR(SingularValues(q, q_rows, d, s_q, vt.data()));
  IG_RETURN_IF_ERROR(SingularValues(k, k_rows, d, s_k, nullptr));

  // Both spectra come sorted, so the product is usually already descending;
  // the sort only matters for ties and degenerate (zero) values, and being
  // stable it keeps LAPACK's order there.
  std::vector<int> order(d);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int i, int j) {
    return s_q[i] * s_k[i] > s_q[j] * s_k[j];
  });

  // Column c of A is right singular vector order[c] of q, i.e. row
  // order[c] of V^T.
  std::vector<float> a(static_cast<size_t>(d) * d);
  for (int c = 0; c < d; ++c) {
    const float* v = vt.data() + static_cast<size_t>(order[c]) * d;
    for (int r = 0; r < d; ++r) a[static_cast<size_t>(r) * d + c] = v[r];
  }
  return a;
}

void ApplySkew(const float* x, int n, const float* a, int d, float* y) {
  ApplySkew(x, n, d, a, d, y, d);
}

void ApplySkew(const float* x, int n, int x_stride, const float* a, int d,
               float* y, int y_stride) {
  if (n <= 0 || d <= 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, d, 1.0f, x,
              x_stride, a, d, 0.0f, y, y_stride);
}

void AddSkewedColumnSums(const float* x, int n, int heads, int per_kv, int d,
                         const float* skew_t, float* sums) {
  if (n <= 0 || heads <= 0 || d <= 0) return;
  constexpr int kBlock = 256;
  const int width = heads * d;
  std::vector<float> skewed(static_cast<size_t>(std::min(n, kBlock)) * width);
  for (int i0 = 0; i0 < n; i0 += kBlock) {
    const int bn = std::min(kBlock, n - i0);
    for (int h = 0; h < heads; ++h) {
      // y = x . A, with A read as skew_t's transpose.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bn, d, d, 1.0f,
                  x + static_cast<size_t>(i0) * width + h * d, width,
                  skew_t + static_cast<size_t>(h / per_kv) * d * d, d, 0.0f,
                  skewed.data() + h * d, width);
    }
    for (int i = 0; i < bn; ++i) {
      for (int h = 0; h < heads; ++h) {
        const float* row =
            skewed.data() + (static_cast<size_t>(i) * heads + h) * d;
        float* out = sums + static_cast<size_t>(h / per_kv) * d;
        for (int c = 0; c < d; ++c) out[c] += std::fabs(row[c]);
      }
    }
  }
}

int PartialColumnCount(int d, double ratio) {
  // int() truncation as in the reference's int(head_dim * ratio).
  return std::clamp(static_cast<int>(d * ratio), 1, std::max(1, d));
}

void SelectPartialColumns(const float* q_skewed, int n_tokens, int n_heads,
                          int n_kv_heads, int d, int n_cols, int32_t* cols) {
  const int group = n_heads / n_kv_heads;
  // Double sums: a prompt of thousands of tokens would otherwise lose the
  // low bits that separate close columns.
  std::vector<double> energy(static_cast<size_t>(n_kv_heads) * d, 0.0);
  for (int t = 0; t < n_tokens; ++t) {
    for (int h = 0; h < n_heads; ++h) {
      const float* row = q_skewed + (static_cast<size_t>(t) * n_heads + h) * d;
      double* e = energy.data() + static_cast<size_t>(h / group) * d;
      for (int c = 0; c < d; ++c) e[c] += std::fabs(row[c]);
    }
  }
  std::vector<int32_t> order(d);
  for (int g = 0; g < n_kv_heads; ++g) {
    const double* e = energy.data() + static_cast<size_t>(g) * d;
    std::iota(order.begin(), order.end(), 0);
    // Ties go to the lower column so the choice is reproducible.
    std::partial_sort(order.begin(), order.begin() + n_cols, order.end(),
                      [e](int32_t i, int32_t j) {
                        return e[i] > e[j] || (e[i] == e[j] && i < j);
                      });
    std::sort(order.begin(), order.begin() + n_cols);
    std::copy(order.begin(), order.begin() + n_cols,
              cols + static_cast<size_t>(g) * n_cols);
  }
}

}  // namespace infinigen::speculator
