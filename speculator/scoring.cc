#include "speculator/speculator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "speculator/internal.h"
#include "speculator/partial_keys.h"

namespace infinigen::speculator {

using internal::kLanes;
using internal::ReadPartialKeyRange;

namespace {

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

}  // namespace

namespace {

// Tokens per task of SpeculateScores: a multiple of kLanes, so that a
// range's blocks are the blocks a single pass would make (the same sums).
constexpr int kScoreTaskTokens = 1024;

// fn(g, t0, t1) for every KV head g and range [t0, t1) of at most
// kScoreTaskTokens of its tokens (t0 a multiple of kLanes), a task each.
template <typename Fn>
void RunHeadRanges(const TaskRunner* run, int n_kv_heads, int n_tokens,
                   Fn&& fn) {
  const int ranges = (n_tokens + kScoreTaskTokens - 1) / kScoreTaskTokens;
  internal::RunTasks(run, n_kv_heads * ranges, [&](int task) {
    const int t0 = (task % ranges) * kScoreTaskTokens;
    fn(task / ranges, t0, std::min(n_tokens, t0 + kScoreTaskTokens));
  });
}

// SpeculateScores over fp32 rows [n_kv_heads][k_stride][n_cols], KV head
// g's tokens [t0, t1) (t0 a multiple of kLanes).
void SpeculateFloatRange(const float* q_skewed, int group, int d,
                         const float* partial_k, int k_stride, int n_tokens,
                         const int32_t* cols, int n_cols, float* scores,
                         int g, int t0, int t1) {
  const int q_stride = PaddedColumns(n_cols);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // The group's queries gathered to the partial columns, pre-scaled, and
  // zero-padded to whole vectors: [group][q_stride]; each block of kLanes
  // cached rows is then scored for all of them while it is in cache.
  thread_local std::vector<float> qg;
  qg.assign(static_cast<size_t>(group) * q_stride, 0.0f);
  const int32_t* cg = cols + static_cast<size_t>(g) * n_cols;
  for (int j = 0; j < group; ++j) {
    const float* qh = q_skewed + static_cast<size_t>(g * group + j) * d;
    for (int c = 0; c < n_cols; ++c) {
      qg[static_cast<size_t>(j) * q_stride + c] = qh[cg[c]] * scale;
    }
  }
  const float* kg = partial_k + static_cast<size_t>(g) * k_stride * n_cols;
  float* out = scores + static_cast<size_t>(g) * group * n_tokens;
  int t = t0;
#if INFINIGEN_SPECULATOR_AVX2
  for (; t + kLanes <= t1; t += kLanes) {
    for (int j = 0; j < group; ++j) {
      ScoreBlockAvx2(kg + static_cast<size_t>(t) * n_cols, n_cols,
                     qg.data() + static_cast<size_t>(j) * q_stride, q_stride,
                     1, out + static_cast<size_t>(j) * n_tokens + t);
    }
  }
#endif
  for (; t < t1; ++t) {
    const float* row = kg + static_cast<size_t>(t) * n_cols;
    for (int j = 0; j < group; ++j) {
      out[static_cast<size_t>(j) * n_tokens + t] =
          Dot(row, qg.data() + static_cast<size_t>(j) * q_stride, n_cols);
    }
  }
}

}  // namespace

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
#if INFINIGEN_SPECULATOR_AVX2
    // Loaded straight from the row (a fixed-size load each, never through
    // a staging copy, which would stall the load on its stores).
    __m128i bytes;
    if (code_bytes - at >= 8) {
      bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + at));
    } else {
      int32_t word;
      std::memcpy(&word, codes + at, sizeof(word));
      bytes = _mm_cvtsi32_si128(word);
    }
    const __m256i v = _mm256_cvtepu8_epi32(bytes);
    _mm256_storeu_ps(out + 2 * at, _mm256_cvtepi32_ps(_mm256_and_si256(
                                       v, _mm256_set1_epi32(0xF))));
    _mm256_storeu_ps(out + 2 * at + 8,
                     _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
#else
    uint8_t chunk[8] = {};
    std::memcpy(chunk, codes + at, std::min(8, code_bytes - at));
    for (int i = 0; i < 8; ++i) {
      out[2 * at + i] = static_cast<float>(chunk[i] & 0xF);
      out[2 * at + 8 + i] = static_cast<float>(chunk[i] >> 4);
    }
#endif
  }
}

}  // namespace

namespace {

// SpeculateScores over 4-bit rows, KV head g's tokens [t0, t1) (t0 a
// multiple of kLanes).
void SpeculateInt4Range(const float* q_skewed, int group, int d,
                        const uint8_t* partial_k, int k_stride, int n_tokens,
                        const int32_t* cols, int n_cols, float* scores, int g,
                        int t0, int t1) {
  const int row_bytes = PartialKeyRowBytes(n_cols);
  const int code_bytes = row_bytes - 2 * static_cast<int>(sizeof(float));
  const int width = ChunkedColumns(code_bytes);  // a multiple of kLanes
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // The group's queries gathered to the partial columns in chunk order
  // (DecodeCodesChunked), pre-scaled, zero past n_cols: [group][width],
  // with each one's sum over the columns in column order (what a row's min
  // multiplies). Then each block of kLanes cached rows is decoded once for
  // all of them: a row's score for head j is
  // min * sum(q_j) + scale * (q_j . codes).
  thread_local std::vector<float> qg, q_sums, codes;
  qg.assign(static_cast<size_t>(group) * width, 0.0f);
  q_sums.assign(group, 0.0f);
  codes.resize(static_cast<size_t>(kLanes) * width);
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
  for (int b = t0; b < t1; b += kLanes) {
    const int m = std::min(kLanes, t1 - b);
    float lo[kLanes], row_scale[kLanes], dots[kLanes];
    for (int i = 0; i < m; ++i) {
      const uint8_t* row = kg + static_cast<size_t>(b + i) * row_bytes;
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
      float* out_j = out + static_cast<size_t>(j) * n_tokens + b;
      for (int i = 0; i < m; ++i) {
        out_j[i] = lo[i] * q_sums[j] + row_scale[i] * dots[i];
      }
    }
  }
}

}  // namespace

void SpeculateScores(const float* q_skewed, int n_heads, int n_kv_heads, int d,
                     const uint8_t* partial_k, int k_stride, int n_tokens,
                     const int32_t* cols, int n_cols, float* scores,
                     PartialKeyFormat format, const TaskRunner* run) {
  if (n_tokens <= 0) return;
  const int group = n_heads / n_kv_heads;
  // One task per KV head and range of tokens: every score is its own, so
  // the results are the same however the tasks are spread.
  RunHeadRanges(run, n_kv_heads, n_tokens, [&](int g, int t0, int t1) {
    if (format == PartialKeyFormat::kFloat) {
      SpeculateFloatRange(q_skewed, group, d,
                          reinterpret_cast<const float*>(partial_k), k_stride,
                          n_tokens, cols, n_cols, scores, g, t0, t1);
    } else {
      SpeculateInt4Range(q_skewed, group, d, partial_k, k_stride, n_tokens,
                         cols, n_cols, scores, g, t0, t1);
    }
  });
}

void CombineHeadScores(const float* head_scores, int n_heads, int n_kv_heads,
                       int n_tokens, const uint8_t* present, float* scores,
                       const TaskRunner* run) {
  if (n_tokens <= 0 || n_kv_heads <= 0) return;
  const int group = n_heads / n_kv_heads;
  const float none = -std::numeric_limits<float>::infinity();
  // Each query head's log-sum-exp over its present tokens, one task per
  // head (none where nothing is present), then the max over each group,
  // one task per KV head and range of tokens.
  thread_local std::vector<float> lse;
  lse.assign(n_heads, none);
  float* head_lse = lse.data();
  internal::RunTasks(run, n_heads, [&](int h) {
    const int g = h / group;
    const uint8_t* pr =
        present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                           : nullptr;
    const float* s = head_scores + static_cast<size_t>(h) * n_tokens;
    float top = none;
    for (int t = 0; t < n_tokens; ++t) {
      if (pr == nullptr || pr[t]) top = std::max(top, s[t]);
    }
    if (top == none) return;
    float sum = 0.0f;
    for (int t = 0; t < n_tokens; ++t) {
      if (pr == nullptr || pr[t]) sum += std::exp(s[t] - top);
    }
    head_lse[h] = top + std::log(sum);
  });
  RunHeadRanges(run, n_kv_heads, n_tokens, [&](int g, int t0, int t1) {
    const uint8_t* pr =
        present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                           : nullptr;
    float* out = scores + static_cast<size_t>(g) * n_tokens;
    std::fill(out + t0, out + t1, none);
    for (int j = 0; j < group; ++j) {
      const float l = head_lse[g * group + j];
      if (l == none) continue;
      const float* s =
          head_scores + static_cast<size_t>(g * group + j) * n_tokens;
      for (int t = t0; t < t1; ++t) {
        if (pr == nullptr || pr[t]) out[t] = std::max(out[t], s[t] - l);
      }
    }
  });
}

}  // namespace infinigen::speculator
