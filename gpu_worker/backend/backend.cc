// Backend defaults: shared memory is aligned host memory and the
// operations run on the host.
#include "gpu_worker/backend/backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/half.h"
#include "common/status.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

void* Backend::AllocateShared(size_t bytes) {
  // 64-byte alignment for AVX-512 loads and cache lines.
  const size_t rounded = (bytes + 63) / 64 * 64;
  return std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
}

void Backend::FreeShared(void* p) { std::free(p); }

void PolicyOps::DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                             KvRowFormat format, float* rows) {
  gpu_worker::DecodeKvRows(format, in, n_rows, head_dim, rows);
}

bool PolicyOps::EncodeKvRows(const float* rows, int n_rows, int head_dim,
                             KvRowFormat format, uint16_t* out) {
  gpu_worker::EncodeKvRows(format, rows, n_rows, head_dim, out);
  return true;
}

void PolicyOps::SpeculateScores(const SpeculationParams& p) {
  speculator::SpeculateScores(p.q_skewed, p.n_heads, p.n_kv_heads, p.d,
                              p.partial_k, p.k_stride, p.n_tokens, p.cols,
                              p.n_cols, p.scores, p.format,
                              speculator::HostTasks(
                                  static_cast<size_t>(p.n_heads) * p.n_tokens));
}

void PolicyOps::AddSkewedColumnSums(const float* x, int n, int heads,
                                    int per_kv, int d, const float* skew_t,
                                    float* sums) {
  speculator::AddSkewedColumnSums(x, n, heads, per_kv, d, skew_t, sums);
}

void PolicyOps::QuantizePartialKeys(const float* keys, int n_rows,
                                    int n_cols, uint8_t* rows,
                                    size_t row_stride) {
  const size_t row_bytes = speculator::PartialKeyRowBytes(n_cols);
  if (row_stride == row_bytes) {
    speculator::QuantizePartialKeys(keys, n_rows, n_cols, rows);
    return;
  }
  for (int r = 0; r < n_rows; ++r) {
    speculator::QuantizePartialKeys(keys + static_cast<size_t>(r) * n_cols, 1,
                                    n_cols, rows + r * row_stride);
  }
}

void Backend::LinearBatched(const float* x, long x_stride, int n, int in,
                            const float* w, long w_stride, int out, float* y,
                            long y_stride, int batch) {
  for (int b = 0; b < batch; ++b) {
    Linear(x + b * x_stride, n, in, w + b * w_stride, nullptr, out,
           y + b * y_stride);
  }
}

void PolicyOps::SelectTopK(const TopKParams& p) {
  if (p.n_kv_heads <= 0 || p.n_tokens <= 0) return;
  const float* rank = p.scores;
  if (p.n_heads != p.n_kv_heads) {
    speculator::CombineHeadScores(p.scores, p.n_heads, p.n_kv_heads,
                                  p.n_tokens, nullptr, p.combined, p.run);
    rank = p.combined;
  }
  thread_local std::vector<int> k;
  thread_local std::vector<int32_t> indices, offsets;
  k.resize(p.n_kv_heads);
  for (int g = 0; g < p.n_kv_heads; ++g) {
    k[g] = p.head_offsets[g + 1] - p.head_offsets[g];
  }
  speculator::SelectTopKPerHead(rank, p.n_kv_heads, p.n_tokens, nullptr,
                                k.data(), indices, offsets, p.run);
  std::copy(indices.begin(), indices.end(), p.indices);
}

void PolicyOps::ScatterRows(const ScatterRowsParams& p) {
  const size_t bytes = static_cast<size_t>(p.row_width) * sizeof(uint16_t);
  for (long i = 0; i < p.n_rows; ++i) {
    const int32_t s = p.slots[i];
    if (s < 0) continue;
    std::memcpy(p.slot_k + static_cast<size_t>(s) * p.row_width,
                p.k_rows + static_cast<size_t>(i) * p.row_width, bytes);
    std::memcpy(p.slot_v + static_cast<size_t>(s) * p.row_width,
                p.v_rows + static_cast<size_t>(i) * p.row_width, bytes);
  }
}

void AttendStagedRowsOnHost(const StagedRowsAttention& p) {
  const int hd = p.head_dim, group = p.n_heads / p.n_kv_heads;
  const int width = KvRowWidth(p.format, hd);
  std::vector<float> k, v, scores;
  for (int g = 0; g < p.n_kv_heads; ++g) {
    const int first = p.head_offsets[g];
    const int count = p.head_offsets[g + 1] - first;
    // The head's rows decoded, then the new token's.
    k.resize(static_cast<size_t>(count + 1) * hd);
    v.resize(k.size());
    if (p.slots == nullptr) {
      gpu_worker::DecodeKvRows(p.format,
                               p.k_rows + static_cast<size_t>(first) * width,
                               count, hd, k.data());
      gpu_worker::DecodeKvRows(p.format,
                               p.v_rows + static_cast<size_t>(first) * width,
                               count, hd, v.data());
    } else {
      for (int t = 0; t < count; ++t) {
        const int32_t s = p.slots[first + t];
        const size_t at = static_cast<size_t>(s >= 0 ? s : -1 - s) * width;
        gpu_worker::DecodeKvRows(p.format, (s >= 0 ? p.slot_k : p.k_rows) + at,
                                 1, hd, k.data() + static_cast<size_t>(t) * hd);
        gpu_worker::DecodeKvRows(p.format, (s >= 0 ? p.slot_v : p.v_rows) + at,
                                 1, hd, v.data() + static_cast<size_t>(t) * hd);
      }
    }
    std::copy_n(p.k_new + static_cast<size_t>(g) * hd, hd,
                k.data() + static_cast<size_t>(count) * hd);
    std::copy_n(p.v_new + static_cast<size_t>(g) * hd, hd,
                v.data() + static_cast<size_t>(count) * hd);
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const float* q = p.q + static_cast<size_t>(h) * hd;
      scores.resize(count + 1);
      float top = -std::numeric_limits<float>::infinity();
      for (int t = 0; t <= count; ++t) {
        float dot = 0.0f;
        for (int d = 0; d < hd; ++d) dot += q[d] * k[static_cast<size_t>(t) * hd + d];
        scores[t] = dot * p.scale;
        top = std::max(top, scores[t]);
      }
      float sum = 0.0f;
      for (float& s : scores) {
        s = std::exp(s - top);
        sum += s;
      }
      float* out = p.out + static_cast<size_t>(h) * hd;
      std::fill(out, out + hd, 0.0f);
      for (int t = 0; t <= count; ++t) {
        const float w = scores[t] / sum;
        for (int d = 0; d < hd; ++d) out[d] += w * v[static_cast<size_t>(t) * hd + d];
      }
    }
  }
}

void Backend::CopyRows(float* dst, long dst_stride, const float* src,
                       long src_stride, int rows, long width) {
  for (int r = 0; r < rows; ++r) {
    Copy(dst + r * dst_stride, src + r * src_stride, width);
  }
}

void Backend::CopyRowsToHalf(uint16_t* dst, long dst_stride,
                             const float* src, long src_stride, int rows,
                             long width) {
  for (int r = 0; r < rows; ++r) {
    FloatToHalf(src + r * src_stride, static_cast<size_t>(width),
                dst + r * dst_stride);
  }
}

void Backend::CopyFromHost(void* dst, const void* src, size_t bytes,
                           Mark after) {
  std::memcpy(dst, src, bytes);
}

absl::Status Backend::CopyToHost(void* dst, const void* src, size_t bytes) {
  IG_RETURN_IF_ERROR(Synchronize());
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

void Backend::QueueCopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

}  // namespace infinigen::gpu_worker
