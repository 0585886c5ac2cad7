#include "gpu_worker/serving/sampler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace infinigen::gpu_worker {

absl::StatusOr<Sampler> Sampler::Create(const SamplerOptions& options) {
  if (!(options.temperature >= 0.0f) || !std::isfinite(options.temperature)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "temperature must be >= 0, got %g", options.temperature));
  }
  if (!(options.top_p > 0.0f && options.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("top_p must be in (0, 1], got %g", options.top_p));
  }
  return Sampler(options);
}

int Argmax(absl::Span<const float> values) {
  int best = 0;
  for (int i = 1; i < static_cast<int>(values.size()); ++i) {
    if (values[i] > values[best]) best = i;
  }
  return best;
}

double LogProb(absl::Span<const float> logits, int target) {
  float mx = logits[0];
  for (float v : logits) mx = std::max(mx, v);
  double sum = 0.0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  return static_cast<double>(logits[target]) - mx - std::log(sum);
}

TokenLogProb ScoreToken(absl::Span<const float> logits, int token,
                       int top_k) {
  const int n = static_cast<int>(logits.size());
  float mx = logits[0];
  for (float v : logits) mx = std::max(mx, v);
  double sum = 0.0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  const double log_z = mx + std::log(sum);
  TokenLogProb out;
  out.token = token;
  out.logprob = static_cast<float>(logits[token] - log_z);
  top_k = std::clamp(top_k, 0, n);
  if (top_k == 0) return out;
  // Reused per thread: a decode step asks this of every token it scores.
  thread_local std::vector<int> ids;
  ids.resize(n);
  for (int i = 0; i < n; ++i) ids[i] = i;
  const auto more_likely = [&logits](int a, int b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + top_k, ids.end(), more_likely);
  out.top.reserve(top_k);
  for (int i = 0; i < top_k; ++i) {
    out.top.emplace_back(ids[i], static_cast<float>(logits[ids[i]] - log_z));
  }
  return out;
}

void Penalties::Add(int token) {
  if (!active()) return;
  auto it = std::lower_bound(counts_.begin(), counts_.end(),
                             std::make_pair(token, 0));
  if (it != counts_.end() && it->first == token) {
    ++it->second;
  } else {
    counts_.insert(it, {token, 1});
  }
}

absl::Span<const float> Penalties::Apply(absl::Span<const float> logits) {
  if (!active() || counts_.empty()) return logits;
  scratch_.assign(logits.begin(), logits.end());
  for (const auto& [token, times] : counts_) {
    scratch_[token] -= static_cast<float>(times) * frequency_ + presence_;
  }
  return scratch_;
}

int Sampler::Sample(absl::Span<const float> logits) {
  if (options_.temperature == 0.0f) return Argmax(logits);
  const int n = static_cast<int>(logits.size());
  float mx = logits[0];
  for (float v : logits) mx = std::max(mx, v);
  probs_.resize(n);
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    const float p = std::exp((logits[i] - mx) / options_.temperature);
    probs_[i] = {p, i};
    sum += p;
  }
  int count = n;
  if (options_.top_p < 1.0f) {
    // Only the head of the distribution matters: sort it descending and cut
    // where the cumulative mass first reaches top_p.
    std::sort(probs_.begin(), probs_.end(),
              [](const auto& a, const auto& b) {
                return a.first > b.first || (a.first == b.first && a.second < b.second);
              });
    double cum = 0.0;
    const double target = options_.top_p * sum;
    for (int i = 0; i < n; ++i) {
      cum += probs_[i].first;
      if (cum >= target) {
        count = i + 1;
        break;
      }
    }
    sum = cum;
  }
  std::uniform_real_distribution<double> uniform(0.0, sum);
  const double r = uniform(rng_);
  double cum = 0.0;
  for (int i = 0; i < count; ++i) {
    cum += probs_[i].first;
    if (r < cum) return probs_[i].second;
  }
  return probs_[count - 1].second;
}

}  // namespace infinigen::gpu_worker
