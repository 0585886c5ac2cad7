#include "speculator/speculator.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace infinigen::speculator {

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

}  // namespace infinigen::speculator
