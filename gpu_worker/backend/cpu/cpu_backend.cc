// The CPU reference backend. Reads top to bottom like llama2.c's run.c:
// every operation is the textbook formula; matrix products go to OpenBLAS
// (which threads them).
#include "gpu_worker/backend/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/half.h"

namespace infinigen::gpu_worker {
namespace {

// s[0, len) = softmax(s[0, len)).
void Softmax(float* s, int len) {
  float mx = s[0];
  for (int t = 1; t < len; ++t) mx = std::max(mx, s[t]);
  float sum = 0.0f;
  for (int t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.0f / sum;
  for (int t = 0; t < len; ++t) s[t] *= inv;
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  bool OperatesOnHostMemory() const override { return true; }

  void Linear(const float* x, int n, int in, const float* w,
              const float* bias, int out, float* y) override {
    if (n == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, w, in, x, 1,
                  0.0f, y, 1);
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f,
                  x, in, w, in, 0.0f, y, out);
    }
    if (bias != nullptr) {
      for (int i = 0; i < n; ++i) {
        float* row = y + static_cast<long>(i) * out;
        for (int j = 0; j < out; ++j) row[j] += bias[j];
      }
    }
  }

  void RmsNorm(const float* x, int n, int dim, const float* gain, float eps,
               float* y) override {
    for (int i = 0; i < n; ++i) {
      const float* xi = x + static_cast<long>(i) * dim;
      float* yi = y + static_cast<long>(i) * dim;
      float ss = 0.0f;
      for (int j = 0; j < dim; ++j) ss += xi[j] * xi[j];
      const float inv = 1.0f / std::sqrt(ss / dim + eps);
      for (int j = 0; j < dim; ++j) yi[j] = xi[j] * inv * gain[j];
    }
  }

  void LayerNorm(const float* x, int n, int dim, const float* gain,
                 const float* bias, float eps, float* y) override {
    for (int i = 0; i < n; ++i) {
      const float* xi = x + static_cast<long>(i) * dim;
      float* yi = y + static_cast<long>(i) * dim;
      float mean = 0.0f;
      for (int j = 0; j < dim; ++j) mean += xi[j];
      mean /= dim;
      float var = 0.0f;
      for (int j = 0; j < dim; ++j) var += (xi[j] - mean) * (xi[j] - mean);
      var /= dim;
      const float inv = 1.0f / std::sqrt(var + eps);
      for (int j = 0; j < dim; ++j) {
        yi[j] = (xi[j] - mean) * inv * gain[j] + bias[j];
      }
    }
  }

  void Rope(float* x, int n, int n_heads, int head_dim, const int* positions,
            float theta) override {
    const int half = head_dim / 2;
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < half; ++j) {
        const float freq =
            1.0f / std::pow(theta, static_cast<float>(2 * j) / head_dim);
        const float angle = positions[i] * freq;
        const float c = std::cos(angle), s = std::sin(angle);
        for (int h = 0; h < n_heads; ++h) {
          float* v = x + (static_cast<long>(i) * n_heads + h) * head_dim;
          const float a = v[j], b = v[j + half];
          v[j] = a * c - b * s;
          v[j + half] = a * s + b * c;
        }
      }
    }
  }

  void Attention(const AttentionParams& p) override {
    if (p.k_half != nullptr) {
      // fp16 rows: each KV head's visible rows decoded once, then the fp32
      // arithmetic below (the reference a device's fp16 cache is held to).
      const int kv_max = p.kv_len0 + p.n - 1;
      const size_t values = static_cast<size_t>(kv_max) * p.head_dim;
      kv_half_.resize(2 * values * p.n_kv_heads);
      float* k = kv_half_.data();
      float* v = k + values * p.n_kv_heads;
      for (int g = 0; g < p.n_kv_heads; ++g) {
        const size_t at = static_cast<size_t>(g) * p.kv_stride * p.head_dim;
        HalfToFloat(p.k_half + at, values, k + g * values);
        HalfToFloat(p.v_half + at, values, v + g * values);
      }
      AttentionParams f = p;
      f.k = k;
      f.v = v;
      f.k_half = f.v_half = nullptr;
      f.kv_stride = kv_max;
      return Attention(f);
    }
    const int group = p.n_heads / p.n_kv_heads;
    const int q_stride = p.n_heads * p.head_dim;
    const int kv_max = p.kv_len0 + p.n - 1;  // rows seen by the last query
    // Rows before `first` are outside every query's window: the scores
    // cover [first, kv_max) only.
    const int first = p.window > 0 ? std::max(0, p.kv_len0 - p.window) : 0;
    const int cols = kv_max - first;
    if (p.n == 1) return AttendOneQuery(p, group, first, cols);
    scores_.resize(static_cast<size_t>(p.n) * cols);
    for (int h = 0; h < p.n_heads; ++h) {
      const int g = h / group;
      const float* k = p.k + (static_cast<long>(g) * p.kv_stride + first) *
                                 p.head_dim;
      const float* v = p.v + (static_cast<long>(g) * p.kv_stride + first) *
                                 p.head_dim;
      // scores[n, cols] = scale * q_h[n, d] . k[first..kv_max, d]^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p.n, cols,
                  p.head_dim, p.scale, p.q + h * p.head_dim, q_stride, k,
                  p.head_dim, 0.0f, scores_.data(), cols);
      for (int i = 0; i < p.n; ++i) {
        float* s = scores_.data() + static_cast<long>(i) * cols;
        const int len = p.kv_len0 + i;  // absolute end of its rows
        const int lo = p.window > 0 ? std::max(0, len - p.window) : 0;
        for (int t = 0; t < lo - first; ++t) s[t] = 0.0f;  // the window
        Softmax(s + (lo - first), len - lo);
        for (int t = len - first; t < cols; ++t) s[t] = 0.0f;  // causal mask
        if (p.prob_sums != nullptr) {
          float* acc = p.prob_sums + static_cast<long>(h) * kv_max + first;
          for (int t = lo - first; t < len - first; ++t) acc[t] += s[t];
        }
      }
      // out_h[n, d] = probs[n, cols] . v[first..kv_max, d]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, p.n, p.head_dim,
                  cols, 1.0f, scores_.data(), cols, v, p.head_dim, 0.0f,
                  p.out + h * p.head_dim, q_stride);
    }
  }

  // One query row (a decode step): the query heads of a KV head are
  // contiguous, so each KV head's rows are read once for its whole group
  // (GQA), in one product each way, where a product per query head would
  // read them group times. Every row in [first, first + cols) is visible.
  void AttendOneQuery(const AttentionParams& p, int group, int first,
                      int cols) {
    const int d = p.head_dim;
    const int kv_max = p.kv_len0;
    scores_.resize(static_cast<size_t>(group) * cols);
    for (int g = 0; g < p.n_kv_heads; ++g) {
      const long at = (static_cast<long>(g) * p.kv_stride + first) * d;
      const float* q = p.q + static_cast<long>(g) * group * d;
      // scores[group, cols] = scale * q_g[group, d] . k[first.., d]^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, group, cols, d,
                  p.scale, q, d, p.k + at, d, 0.0f, scores_.data(), cols);
      for (int r = 0; r < group; ++r) {
        float* s = scores_.data() + static_cast<long>(r) * cols;
        Softmax(s, cols);
        if (p.prob_sums != nullptr) {
          float* acc = p.prob_sums +
                       static_cast<long>(g * group + r) * kv_max + first;
          for (int t = 0; t < cols; ++t) acc[t] += s[t];
        }
      }
      // out_g[group, d] = probs[group, cols] . v[first.., d]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, group, d, cols,
                  1.0f, scores_.data(), cols, p.v + at, d, 0.0f,
                  p.out + static_cast<long>(g) * group * d, d);
    }
  }

  // fp16 rows: each K row is converted once (eight values an instruction)
  // and dotted with every query head of the group, then each V row once
  // into every head's sum: one read of the fetched bytes, no decoded copy.
  bool AttendStoredRows(const StoredRowsAttention& p) override {
    if (p.format != KvRowFormat::kHalf) return false;
    const int d = p.head_dim, g_n = p.group, n = p.count + 1;
    row_.resize(d);
    scores_.resize(static_cast<size_t>(g_n) * n);
    acc_.assign(static_cast<size_t>(g_n) * d, 0.0f);
    const auto dot = [d](const float* a, const float* b) {
      float s = 0.0f;
      for (int j = 0; j < d; ++j) s += a[j] * b[j];
      return s;
    };
    // Row t of K or V in fp32: a stored row decoded into row_, or the new
    // token's own.
    const auto row = [&](const uint16_t* stored, const float* last, int t) {
      if (t == p.count) return last;
      const size_t at = p.indices != nullptr ? p.indices[t] : t;
      HalfToFloat(stored + at * p.row_width, d, row_.data());
      return static_cast<const float*>(row_.data());
    };
    for (int t = 0; t < n; ++t) {
      const float* k = row(p.k, p.k_new, t);
      for (int g = 0; g < g_n; ++g) {
        scores_[static_cast<size_t>(g) * n + t] = p.scale * dot(p.q + g * d, k);
      }
    }
    for (int g = 0; g < g_n; ++g) {
      float* s = scores_.data() + static_cast<size_t>(g) * n;
      Softmax(s, n);
      if (p.prob_sums != nullptr) {
        float* a = p.prob_sums + static_cast<size_t>(g) * p.prob_stride;
        for (int t = 0; t < n; ++t) a[t] += s[t];
      }
    }
    for (int t = 0; t < n; ++t) {
      const float* v = row(p.v, p.v_new, t);
      for (int g = 0; g < g_n; ++g) {
        const float w = scores_[static_cast<size_t>(g) * n + t];
        float* a = acc_.data() + static_cast<size_t>(g) * d;
        for (int j = 0; j < d; ++j) a[j] += w * v[j];
      }
    }
    std::memcpy(p.out, acc_.data(), acc_.size() * sizeof(float));
    return true;
  }

  void SwiGlu(float* gate, const float* up, long count) override {
    for (long i = 0; i < count; ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  }

  void GeluTanhGate(float* gate, const float* up, long count) override {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    for (long i = 0; i < count; ++i) {
      const float g = gate[i];
      const float inner = kSqrt2OverPi * (g + 0.044715f * g * g * g);
      gate[i] = 0.5f * g * (1.0f + std::tanh(inner)) * up[i];
    }
  }

  void Scale(float* x, long count, float s) override {
    for (long i = 0; i < count; ++i) x[i] *= s;
  }

  void Relu(float* x, long count) override {
    for (long i = 0; i < count; ++i) x[i] = std::max(x[i], 0.0f);
  }

  void Copy(float* dst, const float* src, long count) override {
    std::memcpy(dst, src, count * sizeof(float));
  }

  void Add(float* x, const float* y, long count) override {
    for (long i = 0; i < count; ++i) x[i] += y[i];
  }

 private:
  std::vector<float> scores_;  // [n, kv_max], grows to the largest call
  std::vector<float> kv_half_;  // Attention over fp16 rows: K, V decoded
  std::vector<float> row_;     // AttendStoredRows: one decoded row
  std::vector<float> acc_;     // AttendStoredRows: [group, head_dim] sums
};

}  // namespace

std::unique_ptr<Backend> NewCpuBackend() {
  return std::make_unique<CpuBackend>();
}

}  // namespace infinigen::gpu_worker
