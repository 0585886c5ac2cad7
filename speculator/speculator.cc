#include "speculator/speculator.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"
#include "speculator/partial_keys.h"

// The hand-vectorized scoring kernel needs AVX2 and FMA (the project builds
// for x86-64-v3); INFINIGEN_SPECULATOR_PORTABLE forces the portable loop so
// that a test can check it too.
#if defined(__AVX2__) && defined(__FMA__) && \
    !defined(INFINIGEN_SPECULATOR_PORTABLE)
#define INFINIGEN_SPECULATOR_AVX2 1
#include <immintrin.h>
#else
#define INFINIGEN_SPECULATOR_AVX2 0
#endif

namespace infinigen::speculator {
namespace {

constexpr char kSkewMagic[8] = {'I', 'G', 'S', 'K', 'E', 'W', '0', '1'};
constexpr size_t kSkewHeaderBytes = sizeof(kSkewMagic) + 3 * sizeof(int32_t);
// The optional profile section after the matrices: magic, int32 n_layers,
// n_kv_heads, n_fractions, float partial_ratio, then the fractions, the
// errors and the speculated errors (floats).
constexpr char kProfileMagic[8] = {'I', 'G', 'P', 'R', 'O', 'F', '0', '1'};
constexpr size_t kProfileHeaderBytes =
    sizeof(kProfileMagic) + 3 * sizeof(int32_t) + sizeof(float);

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

// SpeculateScores runs per layer per decode step over thousands of cached
// rows of only n_cols (e.g. 19) floats each, so it is written for that shape.
constexpr int kLanes = 8;

int PaddedColumns(int n_cols) {
  return (n_cols + kLanes - 1) / kLanes * kLanes;
}

// row . q over n columns. Eight independent partial sums, so the compiler
// vectorizes it without being allowed to reassociate float additions.
inline float Dot(const float* row, const float* q, int n) {
  float lanes[kLanes] = {};
  int c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int i = 0; i < kLanes; ++i) lanes[i] += row[c + i] * q[c + i];
  }
  float dot = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
              ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; c < n; ++c) dot += row[c] * q[c];
  return dot;
}

#if INFINIGEN_SPECULATOR_AVX2
// Lane i of the result is the horizontal sum of a[i].
inline __m256 HorizontalSums(const __m256 a[kLanes]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  // s0123's low half holds rows 0-3's sums over lanes 0-3, its high half
  // their sums over lanes 4-7; likewise s4567 for rows 4-7.
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Scores of 8 consecutive cached rows ([8][n_cols], contiguous): for each
// query head, one accumulator per row across the columns, then a
// transposing reduction gives the 8 dot products in one vector, so the
// horizontal-sum cost is shared by 8 rows instead of paid per row. The
// column tail is a masked load, never a read past the last row. Writes the
// max over the group's heads to out[0, 8).
void ScoreBlockAvx2(const float* rows, int n_cols, const float* qg,
                    int q_stride, int group, float* out) {
  const int full = n_cols / kLanes * kLanes;
  const int tail = n_cols - full;
  const __m256i tail_mask = _mm256_cmpgt_epi32(
      _mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < group; ++j) {
    const float* q = qg + static_cast<size_t>(j) * q_stride;
    __m256 acc[kLanes];
#pragma GCC unroll 8
    for (int i = 0; i < kLanes; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < full; c += kLanes) {
      const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
      for (int i = 0; i < kLanes; ++i) {
        acc[i] =
            _mm256_fmadd_ps(_mm256_loadu_ps(rows + i * n_cols + c), qv, acc[i]);
      }
    }
    if (tail != 0) {
      // q is zero-padded, so masked-out columns add 0 * 0.
      const __m256 qv = _mm256_loadu_ps(q + full);
#pragma GCC unroll 8
      for (int i = 0; i < kLanes; ++i) {
        acc[i] = _mm256_fmadd_ps(
            _mm256_maskload_ps(rows + i * n_cols + full, tail_mask), qv,
            acc[i]);
      }
    }
    best = _mm256_max_ps(best, HorizontalSums(acc));
  }
  _mm256_storeu_ps(out, best);
}
#endif  // INFINIGEN_SPECULATOR_AVX2

struct HeadStats {
  int n_present = 0;
  int count = 0;       // Present tokens with score >= floor.
  float floor = 0.0f;  // The head's max present score - alpha.
};

// kMasked: whether `present` is consulted; the unmasked copy has no
// per-token test at all. Branch-free, with kLanes independent maxima so
// that the compiler can vectorize without reassociating anything. NaN
// scores (a broken input) fail every comparison, so they neither raise the
// max nor count.
template <bool kMasked>
HeadStats CountWithinAlpha(const float* s, const uint8_t* present, int n,
                           float alpha) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, kNone);
  int t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int i = 0; i < kLanes; ++i) {
      const float v = !kMasked || present[t + i] != 0 ? s[t + i] : kNone;
      lanes[i] = lanes[i] < v ? v : lanes[i];
    }
  }
  float max_score = kNone;
  for (; t < n; ++t) {
    const float v = !kMasked || present[t] != 0 ? s[t] : kNone;
    max_score = max_score < v ? v : max_score;
  }
  for (int i = 0; i < kLanes; ++i) max_score = std::max(max_score, lanes[i]);

  HeadStats stats;
  stats.floor = max_score - alpha;
  stats.n_present = kMasked ? 0 : n;
  for (t = 0; t < n; ++t) {
    const int here = !kMasked || present[t] != 0;
    if (kMasked) stats.n_present += here;
    stats.count += here & (s[t] >= stats.floor);
  }
  return stats;
}

// Writes to out[0, k) the ascending positions of the k highest present
// scores (ties: lower position; NaN ranks below every number), 1 <= k <=
// number present. The caller passes floor = the alpha threshold when at
// least k present scores reach it (then the top k are all among those, and
// only they are ranked), else -inf. `values` and `positions` are scratch of
// n + 1 elements.
template <bool kMasked>
void EmitTopK(const float* s, const uint8_t* present, int n, int k, float floor,
              float* values, int32_t* positions, int32_t* out) {
  // The candidates: present, >= floor, and so never NaN, which keeps
  // std::nth_element's order strict.
  int m = 0;
  for (int t = 0; t < n; ++t) {
    values[m] = s[t];
    m += (!kMasked || present[t] != 0) & (s[t] >= floor);
  }
  if (m < k) {
    // Only with NaN scores: every number, then the first NaNs.
    int nan_slots = k - m;
    int taken = 0;
    for (int t = 0; t < n && taken < k; ++t) {
      if (kMasked && present[t] == 0) continue;
      if (s[t] >= floor || nan_slots-- > 0) out[taken++] = t;
    }
    return;
  }
  // With k == m the candidates are exactly the top k.
  float threshold = floor;
  bool tie_at_cut = false;
  if (k < m) {
    // Afterwards values[0, k) are >= threshold and values[k, m) <= it.
    std::nth_element(values, values + (k - 1), values + m,
                     std::greater<float>());
    threshold = values[k - 1];
    int equal = 0;
    for (int i = k; i < m; ++i) equal += values[i] == threshold;
    tie_at_cut = equal != 0;
  }
  if (!tie_at_cut) {
    // Exactly k present scores are >= threshold. Branch-free: every token
    // writes positions[taken], which advances only when the token is taken
    // (so positions needs one spare slot).
    int taken = 0;
    for (int t = 0; t < n; ++t) {
      positions[taken] = t;
      taken += (!kMasked || present[t] != 0) & (s[t] >= threshold);
    }
    std::copy(positions, positions + k, out);
    return;
  }
  // Rare: more scores equal the threshold than there are slots left, so
  // take those above it and the lowest-positioned equal ones.
  int above = 0;
  for (int i = 0; i < k - 1; ++i) above += values[i] > threshold;
  int ties = k - above;
  int taken = 0;
  for (int t = 0; t < n && taken < k; ++t) {
    if (kMasked && present[t] == 0) continue;
    if (s[t] > threshold || (s[t] == threshold && ties-- > 0)) {
      out[taken++] = t;
    }
  }
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
  if (!profile.empty() &&
      (profile.n_layers != n_layers || profile.n_kv_heads != n_kv_heads ||
       profile.error.size() != static_cast<size_t>(n_layers) * n_kv_heads *
                                   profile.fractions.size() ||
       profile.speculated_error.size() != profile.error.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the head profile [%d, %d] x %d fractions holds %d errors and does "
        "not match the skew's %d layers x %d KV heads, not saving %s",
        profile.n_layers, profile.n_kv_heads, profile.fractions.size(),
        profile.error.size(), n_layers, n_kv_heads, path));
  }
  // Write a sibling file and rename it over `path`, so a reader never maps a
  // half-written file and a failed save leaves the old one intact.
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrFormat("cannot create %s: %s", tmp, std::strerror(errno)));
  }
  const int32_t dims[3] = {n_layers, n_kv_heads, head_dim};
  bool ok = std::fwrite(kSkewMagic, sizeof(kSkewMagic), 1, f) == 1 &&
            std::fwrite(dims, sizeof(dims), 1, f) == 1 &&
            (a.empty() ||
             std::fwrite(a.data(), sizeof(float), a.size(), f) == a.size());
  if (ok && !profile.empty()) {
    const int32_t pdims[3] = {profile.n_layers, profile.n_kv_heads,
                              static_cast<int32_t>(profile.fractions.size())};
    ok = std::fwrite(kProfileMagic, sizeof(kProfileMagic), 1, f) == 1 &&
         std::fwrite(pdims, sizeof(pdims), 1, f) == 1 &&
         std::fwrite(&profile.partial_ratio, sizeof(float), 1, f) == 1 &&
         std::fwrite(profile.fractions.data(), sizeof(float),
                     profile.fractions.size(),
                     f) == profile.fractions.size() &&
         std::fwrite(profile.error.data(), sizeof(float),
                     profile.error.size(), f) == profile.error.size() &&
         std::fwrite(profile.speculated_error.data(), sizeof(float),
                     profile.speculated_error.size(),
                     f) == profile.speculated_error.size();
  }
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
  const unsigned __int128 floats =
      static_cast<unsigned __int128>(dims[0]) * dims[1] * dims[2] * dims[2];
  const unsigned __int128 payload = size - kSkewHeaderBytes;
  const size_t rest = payload > floats * sizeof(float)
                          ? static_cast<size_t>(payload - floats * sizeof(float))
                          : 0;
  const uint8_t* section =
      rest > 0 ? p + kSkewHeaderBytes +
                     static_cast<size_t>(floats * sizeof(float))
               : nullptr;
  const bool has_profile =
      rest >= sizeof(kProfileMagic) &&
      std::memcmp(section, kProfileMagic, sizeof(kProfileMagic)) == 0;
  if (payload != floats * sizeof(float) && !has_profile) {
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
  if (!has_profile) return m;
  int32_t pdims[3] = {0, 0, 0};
  if (rest >= kProfileHeaderBytes) {
    std::memcpy(pdims, section + sizeof(kProfileMagic), sizeof(pdims));
  }
  if (rest < kProfileHeaderBytes || pdims[0] != m.n_layers ||
      pdims[1] != m.n_kv_heads || pdims[2] < 1 || pdims[2] > 4096) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the head profile section is for [%d, %d] x %d fractions, the "
        "skew is %d layers x %d KV heads", path, pdims[0], pdims[1], pdims[2],
        m.n_layers, m.n_kv_heads));
  }
  const size_t n_f = static_cast<size_t>(pdims[2]);
  const size_t n_err = static_cast<size_t>(m.n_layers) * m.n_kv_heads * n_f;
  if (rest != kProfileHeaderBytes + (n_f + 2 * n_err) * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the head profile section has %d bytes, [%d, %d] x %d fractions "
        "need %d", path, rest, pdims[0], pdims[1], pdims[2],
        kProfileHeaderBytes + (n_f + 2 * n_err) * sizeof(float)));
  }
  m.profile.n_layers = m.n_layers;
  m.profile.n_kv_heads = m.n_kv_heads;
  std::memcpy(&m.profile.partial_ratio,
              section + sizeof(kProfileMagic) + sizeof(pdims), sizeof(float));
  m.profile.fractions.resize(n_f);
  m.profile.error.resize(n_err);
  m.profile.speculated_error.resize(n_err);
  const uint8_t* floats_at = section + kProfileHeaderBytes;
  std::memcpy(m.profile.fractions.data(), floats_at, n_f * sizeof(float));
  std::memcpy(m.profile.error.data(), floats_at + n_f * sizeof(float),
              n_err * sizeof(float));
  std::memcpy(m.profile.speculated_error.data(),
              floats_at + (n_f + n_err) * sizeof(float),
              n_err * sizeof(float));
  for (size_t i = 0; i < n_err; ++i) {
    if (!(m.profile.error[i] >= 0.0f) ||
        !(m.profile.speculated_error[i] >= 0.0f) ||
        !std::isfinite(m.profile.error[i]) ||
        !std::isfinite(m.profile.speculated_error[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the head profile holds a negative or non-finite error",
          path));
    }
  }
  for (size_t i = 0; i < n_f; ++i) {
    const float fr = m.profile.fractions[i];
    if (!(fr > 0.0f && fr <= 1.0f) ||
        (i > 0 && !(fr > m.profile.fractions[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the head profile's fractions must ascend in (0, 1]", path));
    }
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
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, d, 1.0f, x, d, a,
              d, 0.0f, y, d);
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

namespace {

// SpeculateScores over fp32 rows [n_kv_heads][k_stride][n_cols].
void SpeculateFloatScores(const float* q_skewed, int n_heads, int n_kv_heads,
                          int d, const float* partial_k, int k_stride,
                          int n_tokens, const int32_t* cols, int n_cols,
                          float* scores) {
  const int group = n_heads / n_kv_heads;
  const int q_stride = PaddedColumns(n_cols);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // The group's queries gathered to the partial columns, pre-scaled, and
  // zero-padded to whole vectors: [group][q_stride]. Gathered once per KV
  // head; each block of kLanes cached rows is then scored for all of them
  // while it is in cache.
  thread_local std::vector<float> qg;
  qg.assign(static_cast<size_t>(group) * q_stride, 0.0f);
  for (int g = 0; g < n_kv_heads; ++g) {
    const int32_t* cg = cols + static_cast<size_t>(g) * n_cols;
    for (int j = 0; j < group; ++j) {
      const float* qh = q_skewed + static_cast<size_t>(g * group + j) * d;
      for (int c = 0; c < n_cols; ++c) {
        qg[static_cast<size_t>(j) * q_stride + c] = qh[cg[c]] * scale;
      }
    }
    const float* kg = partial_k + static_cast<size_t>(g) * k_stride * n_cols;
    float* out = scores + static_cast<size_t>(g) * group * n_tokens;
    int t = 0;
#if INFINIGEN_SPECULATOR_AVX2
    for (; t + kLanes <= n_tokens; t += kLanes) {
      for (int j = 0; j < group; ++j) {
        ScoreBlockAvx2(kg + static_cast<size_t>(t) * n_cols, n_cols,
                       qg.data() + static_cast<size_t>(j) * q_stride, q_stride,
                       1, out + static_cast<size_t>(j) * n_tokens + t);
      }
    }
#endif
    for (; t < n_tokens; ++t) {
      const float* row = kg + static_cast<size_t>(t) * n_cols;
      for (int j = 0; j < group; ++j) {
        out[static_cast<size_t>(j) * n_tokens + t] =
            Dot(row, qg.data() + static_cast<size_t>(j) * q_stride, n_cols);
      }
    }
  }
}

}  // namespace

void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                         uint8_t* rows) {
  const int bytes = PartialKeyRowBytes(n_cols);
  for (int r = 0; r < n_rows; ++r) {
    const float* v = keys + static_cast<size_t>(r) * n_cols;
    uint8_t* row = rows + static_cast<size_t>(r) * bytes;
    float lo = v[0], hi = v[0];
    for (int c = 1; c < n_cols; ++c) {
      lo = std::min(lo, v[c]);
      hi = std::max(hi, v[c]);
    }
    const float scale = (hi - lo) / 15.0f;
    std::memcpy(row, &lo, sizeof(float));
    std::memcpy(row + sizeof(float), &scale, sizeof(float));
    uint8_t* codes = row + 2 * sizeof(float);
    std::memset(codes, 0, bytes - 2 * sizeof(float));
    if (!(scale > 0.0f)) continue;
    for (int c = 0; c < n_cols; ++c) {
      const int code = std::clamp(
          static_cast<int>(std::nearbyint((v[c] - lo) / scale)), 0, 15);
      codes[c / 2] |= static_cast<uint8_t>(code << (4 * (c & 1)));
    }
  }
}

namespace {

// A 4-bit row's range: its min and scale.
inline void ReadPartialKeyRange(const uint8_t* row, float* lo, float* scale) {
  std::memcpy(lo, row, sizeof(float));
  std::memcpy(scale, row + sizeof(float), sizeof(float));
}

// Row r's range and its codes as floats.
inline void ReadPartialKeyRow(const uint8_t* row, int n_cols, float* lo,
                              float* scale, float* codes) {
  ReadPartialKeyRange(row, lo, scale);
  const uint8_t* packed = row + 2 * sizeof(float);
  for (int c = 0; c < n_cols; ++c) {
    codes[c] = static_cast<float>((packed[c / 2] >> (4 * (c & 1))) & 0xF);
  }
}

}  // namespace

void DequantizePartialKeys(const uint8_t* rows, int n_rows, int n_cols,
                           float* keys) {
  const int bytes = PartialKeyRowBytes(n_cols);
  for (int r = 0; r < n_rows; ++r) {
    float lo, scale;
    float* v = keys + static_cast<size_t>(r) * n_cols;
    ReadPartialKeyRow(rows + static_cast<size_t>(r) * bytes, n_cols, &lo,
                      &scale, v);
    for (int c = 0; c < n_cols; ++c) v[c] = lo + scale * v[c];
  }
}

namespace {

// A 4-bit row's codes as floats in chunk order: each chunk of 8 code bytes
// (16 columns; the last chunk may have 4) gives the 8 low nibbles (columns
// 16k, 16k + 2, ...) then the 8 high nibbles (16k + 1, 16k + 3, ...), zeros
// past the row's bytes. The queries are gathered in the same order, so a
// dot product needs no shuffles. out: ChunkedColumns(code_bytes) floats.
int ChunkedColumns(int code_bytes) { return (code_bytes + 7) / 8 * 16; }

// The column a chunk-order position holds.
int ChunkedColumn(int position) {
  const int k = position / 16, w = position % 16;
  return 16 * k + (w < 8 ? 2 * w : 2 * (w - 8) + 1);
}

inline void DecodeCodesChunked(const uint8_t* codes, int code_bytes,
                               float* out) {
  for (int at = 0; at < code_bytes; at += 8) {
    // code_bytes is a multiple of 4: a chunk has 8 bytes or the last 4.
    uint8_t chunk[8] = {};
    std::memcpy(chunk, codes + at, std::min(8, code_bytes - at));
#if INFINIGEN_SPECULATOR_AVX2
    uint64_t word;
    std::memcpy(&word, chunk, 8);
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(word)));
    _mm256_storeu_ps(out + 2 * at, _mm256_cvtepi32_ps(_mm256_and_si256(
                                       v, _mm256_set1_epi32(0xF))));
    _mm256_storeu_ps(out + 2 * at + 8,
                     _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
#else
    for (int i = 0; i < 8; ++i) {
      out[2 * at + i] = static_cast<float>(chunk[i] & 0xF);
      out[2 * at + 8 + i] = static_cast<float>(chunk[i] >> 4);
    }
#endif
  }
}

}  // namespace

void SpeculateScores(const float* q_skewed, int n_heads, int n_kv_heads, int d,
                     const uint8_t* partial_k, int k_stride, int n_tokens,
                     const int32_t* cols, int n_cols, float* scores,
                     PartialKeyFormat format) {
  if (n_tokens <= 0) return;
  if (format == PartialKeyFormat::kFloat) {
    SpeculateFloatScores(q_skewed, n_heads, n_kv_heads, d,
                         reinterpret_cast<const float*>(partial_k), k_stride,
                         n_tokens, cols, n_cols, scores);
    return;
  }
  const int group = n_heads / n_kv_heads;
  const int row_bytes = PartialKeyRowBytes(n_cols);
  const int code_bytes = row_bytes - 2 * static_cast<int>(sizeof(float));
  const int width = ChunkedColumns(code_bytes);  // a multiple of kLanes
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // The group's queries gathered to the partial columns in chunk order
  // (DecodeCodesChunked), pre-scaled, zero past n_cols: [group][width],
  // with each one's sum over the columns in column order (what a row's min
  // multiplies). Gathered once per KV head; then each block of kLanes
  // cached rows is decoded once for all of them: a row's score for head j
  // is min * sum(q_j) + scale * (q_j . codes).
  thread_local std::vector<float> qg, q_sums, codes;
  qg.assign(static_cast<size_t>(group) * width, 0.0f);
  q_sums.assign(group, 0.0f);
  codes.resize(static_cast<size_t>(kLanes) * width);
  for (int g = 0; g < n_kv_heads; ++g) {
    const int32_t* cg = cols + static_cast<size_t>(g) * n_cols;
    for (int j = 0; j < group; ++j) {
      const float* qh = q_skewed + static_cast<size_t>(g * group + j) * d;
      float* qj = qg.data() + static_cast<size_t>(j) * width;
      for (int at = 0; at < width; ++at) {
        const int c = ChunkedColumn(at);
        qj[at] = c < n_cols ? qh[cg[c]] * scale : 0.0f;
      }
      float sum = 0.0f;
      for (int c = 0; c < n_cols; ++c) sum += qh[cg[c]] * scale;
      q_sums[j] = sum;
    }
    const uint8_t* kg =
        partial_k + static_cast<size_t>(g) * k_stride * row_bytes;
    float* out = scores + static_cast<size_t>(g) * group * n_tokens;
    for (int t0 = 0; t0 < n_tokens; t0 += kLanes) {
      const int m = std::min(kLanes, n_tokens - t0);
      float lo[kLanes], row_scale[kLanes], dots[kLanes];
      for (int i = 0; i < m; ++i) {
        const uint8_t* row = kg + static_cast<size_t>(t0 + i) * row_bytes;
        ReadPartialKeyRange(row, &lo[i], &row_scale[i]);
        DecodeCodesChunked(row + 2 * sizeof(float), code_bytes,
                           codes.data() + static_cast<size_t>(i) * width);
      }
      for (int j = 0; j < group; ++j) {
        const float* qj = qg.data() + static_cast<size_t>(j) * width;
#if INFINIGEN_SPECULATOR_AVX2
        if (m == kLanes) {
          ScoreBlockAvx2(codes.data(), width, qj, width, 1, dots);
        } else
#endif
        {
          for (int i = 0; i < m; ++i) {
            dots[i] = Dot(codes.data() + static_cast<size_t>(i) * width, qj,
                          width);
          }
        }
        float* out_j = out + static_cast<size_t>(j) * n_tokens + t0;
        for (int i = 0; i < m; ++i) {
          out_j[i] = lo[i] * q_sums[j] + row_scale[i] * dots[i];
        }
      }
    }
  }
}

void CombineHeadScores(const float* head_scores, int n_heads, int n_kv_heads,
                       int n_tokens, const uint8_t* present, float* scores) {
  if (n_tokens <= 0 || n_kv_heads <= 0) return;
  const int group = n_heads / n_kv_heads;
  const float none = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < n_kv_heads; ++g) {
    const uint8_t* pr =
        present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                           : nullptr;
    float* out = scores + static_cast<size_t>(g) * n_tokens;
    std::fill(out, out + n_tokens, none);
    for (int j = 0; j < group; ++j) {
      const float* s =
          head_scores + static_cast<size_t>(g * group + j) * n_tokens;
      float top = none;
      for (int t = 0; t < n_tokens; ++t) {
        if (pr == nullptr || pr[t]) top = std::max(top, s[t]);
      }
      if (top == none) continue;
      float sum = 0.0f;
      for (int t = 0; t < n_tokens; ++t) {
        if (pr == nullptr || pr[t]) sum += std::exp(s[t] - top);
      }
      const float lse = top + std::log(sum);
      for (int t = 0; t < n_tokens; ++t) {
        if (pr == nullptr || pr[t]) out[t] = std::max(out[t], s[t] - lse);
      }
    }
  }
}

int SelectTokens(const float* scores, int n_kv_heads, int n_tokens,
                 const uint8_t* present, const SelectionOptions& options,
                 std::vector<int32_t>& indices,
                 std::vector<int32_t>& head_offsets) {
  head_offsets.assign(std::max(0, n_kv_heads) + 1, 0);
  if (n_kv_heads <= 0 || n_tokens <= 0) {
    indices.clear();
    return 0;
  }
  auto head_present = [&](int g) -> const uint8_t* {
    return present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                              : nullptr;
  };

  // Pass 1, per head: the max over present tokens, then the count within
  // alpha of it.
  thread_local std::vector<HeadStats> stats;
  stats.resize(n_kv_heads);
  int64_t total_count = 0;
  int min_present = n_tokens;
  for (int g = 0; g < n_kv_heads; ++g) {
    const float* s = scores + static_cast<size_t>(g) * n_tokens;
    const uint8_t* p = head_present(g);
    stats[g] = p != nullptr
                   ? CountWithinAlpha<true>(s, p, n_tokens, options.alpha)
                   : CountWithinAlpha<false>(s, p, n_tokens, options.alpha);
    if (stats[g].n_present == 0) {
      indices.clear();
      return 0;
    }
    total_count += stats[g].count;
    min_present = std::min(min_present, stats[g].n_present);
  }

  // Float product, as the budget is a float: 10 * 0.7f is 7 in float but
  // 6.99... in double, and the budget means 7.
  const int cap = std::max(
      1, static_cast<int>(static_cast<float>(n_tokens) * options.max_fraction));
  const double mean = static_cast<double>(total_count) / n_kv_heads;
  int k = static_cast<int>(std::lround(mean));
  k = std::clamp(k, 1, cap);
  k = std::min(k, min_present);

  // Pass 2, per head: the k-th largest present score by selection on a
  // scratch copy, then one ascending scan emits the chosen positions, so
  // they come out sorted without sorting them. resize() keeps the capacity
  // (and, at an unchanged size, touches nothing), so a caller that reuses
  // the vectors does not allocate after the first step.
  indices.resize(static_cast<size_t>(n_kv_heads) * k);
  thread_local std::vector<float> values;
  thread_local std::vector<int32_t> positions;
  if (values.size() <= static_cast<size_t>(n_tokens)) {
    values.resize(n_tokens + 1);
    positions.resize(n_tokens + 1);
  }
  for (int g = 0; g < n_kv_heads; ++g) {
    const float* s = scores + static_cast<size_t>(g) * n_tokens;
    const uint8_t* p = head_present(g);
    int32_t* out = indices.data() + static_cast<size_t>(g) * k;
    head_offsets[g + 1] = (g + 1) * k;
    // Attention is sparse: usually few tokens are within alpha, and when k
    // of them are, only they need ranking.
    const float floor = stats[g].count >= k
                            ? stats[g].floor
                            : -std::numeric_limits<float>::infinity();
    if (p != nullptr) {
      EmitTopK<true>(s, p, n_tokens, k, floor, values.data(), positions.data(),
                     out);
    } else {
      EmitTopK<false>(s, p, n_tokens, k, floor, values.data(), positions.data(),
                      out);
    }
  }
  return k;
}

int SelectTopKPerHead(const float* scores, int n_kv_heads, int n_tokens,
                      const uint8_t* present, const int* k,
                      std::vector<int32_t>& indices,
                      std::vector<int32_t>& head_offsets) {
  head_offsets.assign(std::max(0, n_kv_heads) + 1, 0);
  indices.clear();
  if (n_kv_heads <= 0 || n_tokens <= 0) return 0;
  thread_local std::vector<float> values;
  thread_local std::vector<int32_t> positions;
  if (values.size() <= static_cast<size_t>(n_tokens)) {
    values.resize(n_tokens + 1);
    positions.resize(n_tokens + 1);
  }
  const float none = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < n_kv_heads; ++g) {
    const float* s = scores + static_cast<size_t>(g) * n_tokens;
    const uint8_t* p =
        present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                           : nullptr;
    int n_present = n_tokens;
    if (p != nullptr) {
      n_present = 0;
      for (int t = 0; t < n_tokens; ++t) n_present += p[t] != 0;
    }
    const int kg = std::clamp(k[g], 0, n_present);
    const size_t first = indices.size();
    indices.resize(first + kg);
    if (kg > 0) {
      if (p != nullptr) {
        EmitTopK<true>(s, p, n_tokens, kg, none, values.data(),
                       positions.data(), indices.data() + first);
      } else {
        EmitTopK<false>(s, p, n_tokens, kg, none, values.data(),
                        positions.data(), indices.data() + first);
      }
    }
    head_offsets[g + 1] = static_cast<int32_t>(indices.size());
  }
  return static_cast<int>(indices.size());
}

std::vector<float> HeadProfile::DefaultFractions() {
  return {0.005f, 0.01f, 0.015f, 0.02f, 0.03f, 0.04f, 0.05f, 0.06f,
          0.08f,  0.1f,  0.125f, 0.15f, 0.2f,  0.25f, 0.3f,  0.4f,
          0.5f,   0.6f,  0.8f,   1.0f};
}

void ProfileLayer(const float* q, const float* k, const float* v,
                  const float* x, const float* rank_q, const float* rank_k,
                  int n, int n_heads, int n_kv_heads, int d,
                  const float* wo, int dim,
                  const std::vector<float>& fractions, int first_query,
                  int query_stride, float* error, float* speculated_error) {
  const int group = n_heads / n_kv_heads;
  const size_t n_f = fractions.size();
  const int q_dim = n_heads * d;
  const bool speculated =
      rank_q != nullptr && rank_k != nullptr && speculated_error != nullptr;
  std::fill(error, error + static_cast<size_t>(n_kv_heads) * n_f, 0.0f);
  if (speculated) {
    std::fill(speculated_error,
              speculated_error + static_cast<size_t>(n_kv_heads) * n_f, 0.0f);
  }
  // G_h = W_o,h^T W_o,h [d][d]: |W_o,h e|^2 = e^T G_h e.
  std::vector<double> gram(static_cast<size_t>(n_heads) * d * d, 0.0);
  for (int h = 0; h < n_heads; ++h) {
    double* gh = gram.data() + static_cast<size_t>(h) * d * d;
    for (int r = 0; r < dim; ++r) {
      const float* row = wo + static_cast<size_t>(r) * q_dim + h * d;
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j < d; ++j) gh[i * d + j] += double{row[i]} * row[j];
      }
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // Per query of the group's heads: exact logits, softmax weights
  // exp(logit - top) and their total, and the full output o.
  std::vector<double> logits(static_cast<size_t>(group) * n),
      weights(logits.size()), totals(group),
      outs(static_cast<size_t>(group) * d);
  std::vector<float> rank(n), head_ranks(static_cast<size_t>(group) * n);
  std::vector<int32_t> order(n);
  std::vector<double> acc(d), e(d);
  int queries = 0;
  for (int t = std::max(0, first_query); t < n;
       t += std::max(1, query_stride)) {
    ++queries;
    const int m = t + 1;  // causal: tokens [0, t]
    double x_sq = 1.0;
    if (x != nullptr) {
      x_sq = 0.0;
      const float* xt = x + static_cast<size_t>(t) * dim;
      for (int c = 0; c < dim; ++c) x_sq += double{xt[c]} * xt[c];
      if (!(x_sq > 0.0)) x_sq = 1.0;
    }
    for (int g = 0; g < n_kv_heads; ++g) {
      for (int j = 0; j < group; ++j) {
        const float* qh =
            q + (static_cast<size_t>(t) * n_heads + g * group + j) * d;
        double* lj = logits.data() + static_cast<size_t>(j) * n;
        for (int s = 0; s < m; ++s) {
          const float* ks = k + (static_cast<size_t>(s) * n_kv_heads + g) * d;
          float dot = 0.0f;
          for (int c = 0; c < d; ++c) dot += qh[c] * ks[c];
          lj[s] = double{dot} * scale;
        }
        double top = lj[0];
        for (int s = 1; s < m; ++s) top = std::max(top, lj[s]);
        double* wj = weights.data() + static_cast<size_t>(j) * n;
        double* out = outs.data() + static_cast<size_t>(j) * d;
        std::fill(out, out + d, 0.0);
        totals[j] = 0;
        for (int s = 0; s < m; ++s) {
          wj[s] = std::exp(lj[s] - top);
          totals[j] += wj[s];
          const float* vs = v + (static_cast<size_t>(s) * n_kv_heads + g) * d;
          for (int c = 0; c < d; ++c) out[c] += wj[s] * vs[c];
        }
        for (int c = 0; c < d; ++c) out[c] /= totals[j];
      }
      // `order`: the tokens by the largest over the group's heads of the
      // head's log-softmax (CombineHeadScores), of the exact logits or of
      // the speculated ones (rank_q . rank_k / sqrt(d)).
      auto rank_tokens = [&](bool by_speculation) {
        // head_ranks [group][m]: each head's logits over the m tokens.
        for (int j = 0; j < group; ++j) {
          float* hr = head_ranks.data() + static_cast<size_t>(j) * m;
          if (!by_speculation) {
            const double* lj = logits.data() + static_cast<size_t>(j) * n;
            for (int s = 0; s < m; ++s) hr[s] = static_cast<float>(lj[s]);
            continue;
          }
          const float* qh =
              rank_q + (static_cast<size_t>(t) * n_heads + g * group + j) * d;
          for (int s = 0; s < m; ++s) {
            const float* ks =
                rank_k + (static_cast<size_t>(s) * n_kv_heads + g) * d;
            float dot = 0.0f;
            for (int c = 0; c < d; ++c) dot += qh[c] * ks[c];
            hr[s] = dot * scale;
          }
        }
        CombineHeadScores(head_ranks.data(), group, 1, m, nullptr,
                          rank.data());
        std::iota(order.begin(), order.begin() + m, 0);
        std::sort(order.begin(), order.begin() + m, [&](int32_t a, int32_t b) {
          return rank[a] > rank[b] || (rank[a] == rank[b] && a < b);
        });
      };
      // Adds each fraction's error of reading the prefixes of `order` to
      // err [n_f].
      auto add_errors = [&](float* err) {
        for (int j = 0; j < group; ++j) {
          const double* wj = weights.data() + static_cast<size_t>(j) * n;
          const double* out = outs.data() + static_cast<size_t>(j) * d;
          const double* gh =
              gram.data() + static_cast<size_t>(g * group + j) * d * d;
          std::fill(acc.begin(), acc.end(), 0.0);
          double mass = 0;
          int taken = 0;
          for (size_t fi = 0; fi < n_f; ++fi) {
            const int want = std::clamp(
                static_cast<int>(static_cast<float>(m) * fractions[fi]), 1, m);
            for (; taken < want; ++taken) {
              const int s = order[taken];
              mass += wj[s];
              const float* vs =
                  v + (static_cast<size_t>(s) * n_kv_heads + g) * d;
              for (int c = 0; c < d; ++c) acc[c] += wj[s] * vs[c];
            }
            for (int c = 0; c < d; ++c) e[c] = acc[c] / mass - out[c];
            double sq = 0;
            for (int a = 0; a < d; ++a) {
              double row = 0;
              for (int b = 0; b < d; ++b) row += gh[a * d + b] * e[b];
              sq += e[a] * row;
            }
            err[fi] += static_cast<float>(sq / x_sq);
          }
        }
      };
      rank_tokens(false);
      add_errors(error + static_cast<size_t>(g) * n_f);
      if (speculated) {
        rank_tokens(true);
        add_errors(speculated_error + static_cast<size_t>(g) * n_f);
      }
    }
  }
  if (queries > 0) {
    for (size_t i = 0; i < static_cast<size_t>(n_kv_heads) * n_f; ++i) {
      error[i] /= static_cast<float>(queries);
      if (speculated) speculated_error[i] /= static_cast<float>(queries);
    }
  }
}

std::vector<float> AllocateBudgets(const HeadProfile& profile,
                                   const std::vector<float>& error,
                                   float mean_budget, int first_layer,
                                   float floor) {
  const int n_l = profile.n_layers, n_kv = profile.n_kv_heads;
  std::vector<float> b(static_cast<size_t>(n_l) * n_kv, 1.0f);
  first_layer = std::clamp(first_layer, 0, n_l);
  const int heads = (n_l - first_layer) * n_kv;
  if (heads == 0) return b;
  mean_budget = std::clamp(mean_budget, 0.0f, 1.0f);
  const float lo = std::min(mean_budget, floor);
  // Each curve as points (fraction, error) from lo on: its value at lo
  // (interpolated), then the grid points above; its lower convex hull's
  // segments, with their slopes, compete for the budget above lo.
  struct Segment {
    double slope;  // error change per unit of fraction (<= 0 is a gain)
    double width;
    int head;
  };
  std::vector<Segment> segments;
  const std::vector<float>& f = profile.fractions;
  for (int i = 0; i < heads; ++i) {
    const int l = first_layer + i / n_kv, g = i % n_kv;
    const float* err = error.data() + profile.Offset(l, g);
    std::vector<std::pair<double, double>> pts;
    // The curve at lo: linear between grid points, flat below the first.
    double at_lo = err[0];
    for (size_t j = 0; j + 1 < f.size(); ++j) {
      if (lo >= f[j] && lo <= f[j + 1]) {
        const double u = (lo - f[j]) / std::max(1e-12f, f[j + 1] - f[j]);
        at_lo = err[j] + u * (err[j + 1] - err[j]);
      }
    }
    if (lo >= f.back()) at_lo = err[f.size() - 1];
    pts.emplace_back(lo, at_lo);
    for (size_t j = 0; j < f.size(); ++j) {
      if (f[j] > lo) pts.emplace_back(f[j], err[j]);
    }
    if (pts.back().first < 1.0) pts.emplace_back(1.0, pts.back().second);
    // Lower convex hull (monotone chain).
    std::vector<std::pair<double, double>> hull;
    for (const auto& pt : pts) {
      while (hull.size() >= 2) {
        const auto& a = hull[hull.size() - 2];
        const auto& c = hull.back();
        const double cross = (c.first - a.first) * (pt.second - a.second) -
                             (c.second - a.second) * (pt.first - a.first);
        if (cross > 0) break;  // c is below the chord a-pt: keep it
        hull.pop_back();
      }
      hull.push_back(pt);
    }
    for (size_t j = 0; j + 1 < hull.size(); ++j) {
      const double w = hull[j + 1].first - hull[j].first;
      if (w <= 0) continue;
      segments.push_back({(hull[j + 1].second - hull[j].second) / w, w, i});
    }
  }
  // Steepest descent first; ties to the earlier head (deterministic).
  std::stable_sort(segments.begin(), segments.end(),
                   [](const Segment& a, const Segment& c) {
                     return a.slope < c.slope;
                   });
  std::vector<double> alloc(heads, lo);
  double left = (static_cast<double>(mean_budget) - lo) * heads;
  for (const Segment& s : segments) {
    if (left <= 0) break;
    const double take = std::min(left, s.width);
    alloc[s.head] += take;
    left -= take;
  }
  for (int i = 0; i < heads; ++i) {
    b[static_cast<size_t>(first_layer) * n_kv + i] =
        static_cast<float>(std::min(1.0, alloc[i]));
  }
  return b;
}

int SelectByMass(const float* scores, int n_kv_heads, int n_tokens,
                 const uint8_t* present, float mass, float max_fraction,
                 std::vector<int32_t>& indices,
                 std::vector<int32_t>& head_offsets) {
  head_offsets.resize(n_kv_heads + 1);
  head_offsets[0] = 0;
  indices.clear();
  const int cap = std::max(
      1, static_cast<int>(static_cast<float>(n_tokens) * max_fraction));
  thread_local std::vector<int32_t> order;
  order.reserve(n_tokens);
  for (int g = 0; g < n_kv_heads; ++g) {
    const float* s = scores + static_cast<size_t>(g) * n_tokens;
    const uint8_t* p =
        present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                           : nullptr;
    order.clear();
    float top = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n_tokens; ++t) {
      if (p != nullptr && !p[t]) continue;
      order.push_back(t);
      top = std::max(top, s[t]);
    }
    if (order.empty()) {
      indices.clear();
      std::fill(head_offsets.begin(), head_offsets.end(), 0);
      return 0;
    }
    double total = 0;
    for (int32_t t : order) total += std::exp(static_cast<double>(s[t] - top));
    const int limit = std::min<int>(cap, static_cast<int>(order.size()));
    // Descending score, ties to the lower position; only the first
    // `limit` can be chosen.
    auto higher = [s](int32_t a, int32_t b) {
      return s[a] > s[b] || (s[a] == s[b] && a < b);
    };
    std::partial_sort(order.begin(), order.begin() + limit, order.end(),
                      higher);
    const double want = static_cast<double>(mass) * total;
    double carried = 0;
    int k = 0;
    // A mass of 1 takes every token up to the cap (the tail's rounding
    // would otherwise end it a few negligible tokens early).
    while (k < limit && (k == 0 || mass >= 1.0f || carried < want)) {
      carried += std::exp(static_cast<double>(s[order[k]] - top));
      ++k;
    }
    const size_t first = indices.size();
    indices.insert(indices.end(), order.begin(), order.begin() + k);
    std::sort(indices.begin() + first, indices.end());
    head_offsets[g + 1] = static_cast<int32_t>(indices.size());
  }
  return static_cast<int>(indices.size());
}

}  // namespace infinigen::speculator
