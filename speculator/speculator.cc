#include "speculator/speculator.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"

namespace infinigen::speculator {
namespace {

constexpr char kSkewMagic[8] = {'I', 'G', 'S', 'K', 'E', 'W', '0', '1'};
constexpr size_t kSkewHeaderBytes = sizeof(kSkewMagic) + 3 * sizeof(int32_t);

size_t SkewFloatCount(int n_layers, int n_kv_heads, int head_dim) {
  return static_cast<size_t>(n_layers) * n_kv_heads * head_dim * head_dim;
}

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
      LAPACK_ROW_MAJOR, 'N', vt != nullptr ? 'A' : 'N', rows, cols,
      work.data(), cols, s.data(), /*u=*/nullptr, /*ldu=*/1, vt,
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

// Strict total order for top-k: higher score first, then lower position, so
// selection is deterministic whatever std::nth_element does with ties.
struct ScoredToken {
  float score;
  int32_t pos;
};

inline bool Before(const ScoredToken& a, const ScoredToken& b) {
  return a.score > b.score || (a.score == b.score && a.pos < b.pos);
}

}  // namespace

SkewMatrices SkewMatrices::Identity(int n_layers, int n_kv_heads,
                                    int head_dim) {
  SkewMatrices m;
  m.n_layers = n_layers;
  m.n_kv_heads = n_kv_heads;
  m.head_dim = head_dim;
  m.a.assign(SkewFloatCount(n_layers, n_kv_heads, head_dim), 0.0f);
  for (int l = 0; l < n_layers; ++l) {
    for (int g = 0; g < n_kv_heads; ++g) {
      float* a = m.at(l, g);
      for (int i = 0; i < head_dim; ++i) a[i * head_dim + i] = 1.0f;
    }
  }
  return m;
}

absl::Status SkewMatrices::Save(const std::string& path) const {
  if (n_layers < 0 || n_kv_heads < 0 || head_dim < 0 ||
      a.size() != SkewFloatCount(n_layers, n_kv_heads, head_dim)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "skew matrices [%d, %d, %d, %d] hold %d floats, not saving %s",
        n_layers, n_kv_heads, head_dim, head_dim, a.size(), path));
  }
  // Write a sibling file and rename it over `path`, so a reader never maps a
  // half-written file and a failed save leaves the old one intact.
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(absl::StrFormat(
        "cannot create %s: %s", tmp, std::strerror(errno)));
  }
  const int32_t dims[3] = {n_layers, n_kv_heads, head_dim};
  bool ok = std::fwrite(kSkewMagic, sizeof(kSkewMagic), 1, f) == 1 &&
            std::fwrite(dims, sizeof(dims), 1, f) == 1 &&
            (a.empty() ||
             std::fwrite(a.data(), sizeof(float), a.size(), f) == a.size());
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrFormat("cannot write %s: %s", path, std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<SkewMatrices> SkewMatrices::Load(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  const uint8_t* p = file.data();
  const size_t size = file.size();
  if (size < kSkewHeaderBytes ||
      std::memcmp(p, kSkewMagic, sizeof(kSkewMagic)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is not a skew matrix file (no IGSKEW01 header)", path));
  }
  int32_t dims[3];
  std::memcpy(dims, p + sizeof(kSkewMagic), sizeof(dims));
  if (dims[0] < 0 || dims[1] < 0 || dims[2] < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: negative dimensions [%d, %d, %d]", path, dims[0],
                        dims[1], dims[2]));
  }
  // Products of int32 dimensions fit in 128 bits; comparing there means a
  // corrupt header cannot overflow into a plausible size.
  const unsigned __int128 floats = static_cast<unsigned __int128>(dims[0]) *
                                   dims[1] * dims[2] * dims[2];
  const unsigned __int128 payload = size - kSkewHeaderBytes;
  if (payload != floats * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: [%d, %d, %d, %d] skew matrices need %d bytes of floats, the file "
        "has %d (%s)",
        path, dims[0], dims[1], dims[2], dims[2],
        static_cast<uint64_t>(std::min<unsigned __int128>(
            floats * sizeof(float), std::numeric_limits<uint64_t>::max())),
        static_cast<uint64_t>(payload),
        payload < floats * sizeof(float) ? "truncated" : "trailing bytes"));
  }
  SkewMatrices m;
  m.n_layers = dims[0];
  m.n_kv_heads = dims[1];
  m.head_dim = dims[2];
  m.a.resize(static_cast<size_t>(floats));
  if (!m.a.empty()) {
    std::memcpy(m.a.data(), p + kSkewHeaderBytes, m.a.size() * sizeof(float));
  }
  return m;
}

absl::Status SkewMatrices::CheckShape(int n_layers, int n_kv_heads,
                                      int head_dim) const {
  if (this->n_layers != n_layers || this->n_kv_heads != n_kv_heads ||
      this->head_dim != head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "skew matrices are for %d layers x %d KV heads x head_dim %d, the "
        "model has %d x %d x %d",
        this->n_layers, this->n_kv_heads, this->head_dim, n_layers, n_kv_heads,
        head_dim));
  }
  if (a.size() != SkewFloatCount(n_layers, n_kv_heads, head_dim)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "skew matrices hold %d floats, [%d, %d, %d, %d] needs %d", a.size(),
        n_layers, n_kv_heads, head_dim, head_dim,
        SkewFloatCount(n_layers, n_kv_heads, head_dim)));
  }
  return absl::OkStatus();
}

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
  if (n <= 0 || d <= 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, d, 1.0f, x, d,
              a, d, 0.0f, y, d);
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

void SpeculateScores(const float* q_skewed, int n_heads, int n_kv_heads,
                     int d, const float* partial_k, int k_stride, int n_tokens,
                     const int32_t* cols, int n_cols, float* scores) {
  const int group = n_heads / n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // The group's queries, gathered to the partial columns and pre-scaled,
  // [group][n_cols]: one pass over the cached rows then serves every head.
  thread_local std::vector<float> qg;
  qg.resize(static_cast<size_t>(group) * n_cols);
  for (int g = 0; g < n_kv_heads; ++g) {
    const int32_t* cg = cols + static_cast<size_t>(g) * n_cols;
    for (int j = 0; j < group; ++j) {
      const float* qh = q_skewed + static_cast<size_t>(g * group + j) * d;
      for (int c = 0; c < n_cols; ++c) qg[j * n_cols + c] = qh[cg[c]] * scale;
    }
    const float* kg = partial_k + static_cast<size_t>(g) * k_stride * n_cols;
    float* out = scores + static_cast<size_t>(g) * n_tokens;
    for (int t = 0; t < n_tokens; ++t) {
      const float* row = kg + static_cast<size_t>(t) * n_cols;
      float best = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < group; ++j) {
        const float* qj = qg.data() + j * n_cols;
        float dot = 0.0f;
        for (int c = 0; c < n_cols; ++c) dot += row[c] * qj[c];
        best = std::max(best, dot);
      }
      out[t] = best;
    }
  }
}

int SelectTokens(const float* scores, int n_kv_heads, int n_tokens,
                 const uint8_t* present, const SelectionOptions& options,
                 std::vector<int32_t>& indices,
                 std::vector<int32_t>& head_offsets) {
  head_offsets.assign(n_kv_heads + 1, 0);
  indices.clear();
  if (n_kv_heads <= 0 || n_tokens <= 0) return 0;

  // Pass 1, per head: the max over present tokens, then the count within
  // alpha of it and the number present.
  int64_t total_count = 0;
  int min_present = n_tokens;
  for (int g = 0; g < n_kv_heads; ++g) {
    const float* s = scores + static_cast<size_t>(g) * n_tokens;
    const uint8_t* p =
        present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                           : nullptr;
    float max_score = -std::numeric_limits<float>::infinity();
    int n_present = 0;
    for (int t = 0; t < n_tokens; ++t) {
      if (p != nullptr && p[t] == 0) continue;
      max_score = std::max(max_score, s[t]);
      ++n_present;
    }
    if (n_present == 0) return 0;
    const float threshold = max_score - options.alpha;
    int count = 0;
    for (int t = 0; t < n_tokens; ++t) {
      if (p != nullptr && p[t] == 0) continue;
      count += s[t] >= threshold ? 1 : 0;
    }
    total_count += count;
    min_present = std::min(min_present, n_present);
  }

  // Float product, as the budget is a float: 10 * 0.7f is 7 in float but
  // 6.99... in double, and the budget means 7.
  const int cap = std::max(
      1, static_cast<int>(static_cast<float>(n_tokens) * options.max_fraction));
  const double mean = static_cast<double>(total_count) / n_kv_heads;
  int k = static_cast<int>(std::lround(mean));
  k = std::clamp(k, 1, cap);
  k = std::min(k, min_present);

  // Pass 2, per head: top-k present tokens. resize() keeps the capacity, so
  // a caller that reuses the vectors does not allocate after the first step.
  indices.resize(static_cast<size_t>(n_kv_heads) * k);
  thread_local std::vector<ScoredToken> scratch;
  for (int g = 0; g < n_kv_heads; ++g) {
    const float* s = scores + static_cast<size_t>(g) * n_tokens;
    const uint8_t* p =
        present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                           : nullptr;
    int32_t* out = indices.data() + static_cast<size_t>(g) * k;
    head_offsets[g + 1] = (g + 1) * k;
    scratch.clear();
    for (int t = 0; t < n_tokens; ++t) {
      if (p != nullptr && p[t] == 0) continue;
      scratch.push_back({s[t], t});
    }
    if (k < static_cast<int>(scratch.size())) {
      std::nth_element(scratch.begin(), scratch.begin() + (k - 1),
                       scratch.end(), Before);
    }
    // The first k are the chosen ones, in any order; positions are unique,
    // so sorting them alone gives the ascending output.
    for (int i = 0; i < k; ++i) out[i] = scratch[i].pos;
    std::sort(out, out + k);
  }
  return k;
}

}  // namespace infinigen::speculator
