#include "speculator/speculator.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>

#include "speculator/internal.h"

namespace infinigen::speculator {

using internal::kLanes;

namespace {

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

// A floor under the k-th highest present score, so that EmitTopK ranks
// only the scores at or above it (about k of them) rather than all n: the
// present finite scores in kBins equal bins over [min, max], the lower edge
// of the bin where the count from the top reaches k, checked by counting
// the scores at or above it (rounding at a bin edge, or -inf and NaN
// scores, can leave fewer than k there: then -inf, every score ranked).
template <bool kMasked>
float TopKFloor(const float* s, const uint8_t* present, int n, int k) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  constexpr int kBins = 1024;
  // Few scores: ranking them all costs less than the bins.
  if (n < 4 * kBins || k >= n / 2) return kNone;
  // Only finite present scores (NaN fails both tests).
  auto counted = [&](int t) {
    return (!kMasked || present[t] != 0) &&
           s[t] >= std::numeric_limits<float>::lowest() &&
           s[t] <= std::numeric_limits<float>::max();
  };
  float lanes_lo[kLanes], lanes_hi[kLanes];
  std::fill(lanes_lo, lanes_lo + kLanes, std::numeric_limits<float>::max());
  std::fill(lanes_hi, lanes_hi + kLanes, std::numeric_limits<float>::lowest());
  int t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int i = 0; i < kLanes; ++i) {
      const float v = s[t + i];
      const bool use = counted(t + i);
      lanes_lo[i] = use && v < lanes_lo[i] ? v : lanes_lo[i];
      lanes_hi[i] = use && v > lanes_hi[i] ? v : lanes_hi[i];
    }
  }
  for (; t < n; ++t) {
    const int i = t % kLanes;
    if (!counted(t)) continue;
    lanes_lo[i] = std::min(lanes_lo[i], s[t]);
    lanes_hi[i] = std::max(lanes_hi[i], s[t]);
  }
  const float lo = *std::min_element(lanes_lo, lanes_lo + kLanes);
  const float hi = *std::max_element(lanes_hi, lanes_hi + kLanes);
  if (!(hi > lo)) return kNone;
  const float scale = static_cast<float>(kBins) / (hi - lo);
  if (!(scale <= std::numeric_limits<float>::max())) return kNone;
  int counts[kBins] = {};
  for (t = 0; t < n; ++t) {
    const float v = s[t];
    if ((kMasked && present[t] == 0) || !(v >= lo && v <= hi)) continue;
    const int b = static_cast<int>((v - lo) * scale);
    ++counts[std::min(b, kBins - 1)];
  }
  int bin = kBins - 1, above = counts[bin];
  while (above < k && bin > 0) above += counts[--bin];
  if (bin == 0) return kNone;
  const float floor = lo + static_cast<float>(bin) / scale;
  int at_or_above = 0;
  for (t = 0; t < n; ++t) {
    at_or_above += (!kMasked || present[t] != 0) & (s[t] >= floor);
  }
  return at_or_above >= k ? floor : kNone;
}

// EmitTopK's scratch of n + 1 values and positions, one per thread (the
// heads of one call may run on several), kept for its capacity.
struct TopKScratch {
  std::vector<float> values;
  std::vector<int32_t> positions;
};
TopKScratch& ScratchFor(int n_tokens) {
  thread_local TopKScratch scratch;
  if (scratch.values.size() <= static_cast<size_t>(n_tokens)) {
    scratch.values.resize(n_tokens + 1);
    scratch.positions.resize(n_tokens + 1);
  }
  return scratch;
}

// EmitTopK over the head's present tokens (`present` null: all), above
// `floor` where the caller knows one, else above TopKFloor's.
template <bool kMasked>
void EmitHeadTopK(const float* s, const uint8_t* p, int n_tokens, int k,
                  const float* known_floor, int32_t* out) {
  TopKScratch& scratch = ScratchFor(n_tokens);
  const float floor = known_floor != nullptr
                          ? *known_floor
                          : TopKFloor<kMasked>(s, p, n_tokens, k);
  EmitTopK<kMasked>(s, p, n_tokens, k, floor, scratch.values.data(),
                    scratch.positions.data(), out);
}
void EmitHeadTopK(const float* s, const uint8_t* p, int n_tokens, int k,
                  const float* known_floor, int32_t* out) {
  if (p != nullptr) {
    EmitHeadTopK<true>(s, p, n_tokens, k, known_floor, out);
  } else {
    EmitHeadTopK<false>(s, p, n_tokens, k, known_floor, out);
  }
}

}  // namespace

int SelectTokens(const float* scores, int n_kv_heads, int n_tokens,
                 const uint8_t* present, const SelectionOptions& options,
                 std::vector<int32_t>& indices,
                 std::vector<int32_t>& head_offsets, const TaskRunner* run) {
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
  HeadStats* head_stats = stats.data();
  internal::RunTasks(run, n_kv_heads, [&](int g) {
    const float* s = scores + static_cast<size_t>(g) * n_tokens;
    const uint8_t* p = head_present(g);
    head_stats[g] =
        p != nullptr ? CountWithinAlpha<true>(s, p, n_tokens, options.alpha)
                     : CountWithinAlpha<false>(s, p, n_tokens, options.alpha);
  });
  int64_t total_count = 0;
  int min_present = n_tokens;
  for (int g = 0; g < n_kv_heads; ++g) {
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
  for (int g = 0; g < n_kv_heads; ++g) head_offsets[g + 1] = (g + 1) * k;
  int32_t* chosen = indices.data();
  internal::RunTasks(run, n_kv_heads, [&](int g) {
    // Attention is sparse: usually few tokens are within alpha, and when k
    // of them are, only they need ranking.
    const float* floor =
        head_stats[g].count >= k ? &head_stats[g].floor : nullptr;
    EmitHeadTopK(scores + static_cast<size_t>(g) * n_tokens, head_present(g),
                 n_tokens, k, floor, chosen + static_cast<size_t>(g) * k);
  });
  return k;
}

int SelectTopKPerHead(const float* scores, int n_kv_heads, int n_tokens,
                      const uint8_t* present, const int* k,
                      std::vector<int32_t>& indices,
                      std::vector<int32_t>& head_offsets,
                      const TaskRunner* run) {
  head_offsets.assign(std::max(0, n_kv_heads) + 1, 0);
  indices.clear();
  if (n_kv_heads <= 0 || n_tokens <= 0) return 0;
  auto head_present = [&](int g) -> const uint8_t* {
    return present != nullptr ? present + static_cast<size_t>(g) * n_tokens
                              : nullptr;
  };
  // Each head's k, clamped to its present count, then its place.
  int32_t* offsets = head_offsets.data();
  internal::RunTasks(run, n_kv_heads, [&](int g) {
    const uint8_t* p = head_present(g);
    int n_present = n_tokens;
    if (p != nullptr) {
      n_present = 0;
      for (int t = 0; t < n_tokens; ++t) n_present += p[t] != 0;
    }
    offsets[g + 1] = std::clamp(k[g], 0, n_present);
  });
  for (int g = 0; g < n_kv_heads; ++g) head_offsets[g + 1] += head_offsets[g];
  indices.resize(head_offsets[n_kv_heads]);
  int32_t* chosen = indices.data();
  internal::RunTasks(run, n_kv_heads, [&](int g) {
    const int kg = offsets[g + 1] - offsets[g];
    if (kg == 0) return;
    EmitHeadTopK(scores + static_cast<size_t>(g) * n_tokens, head_present(g),
                 n_tokens, kg, nullptr, chosen + offsets[g]);
  });
  return static_cast<int>(indices.size());
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
