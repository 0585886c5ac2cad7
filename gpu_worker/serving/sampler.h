// Sampler: picks the next token from a row of logits.
//
// temperature 0 is greedy (argmax, lowest id on ties); otherwise softmax at
// that temperature, restricted to the smallest set of tokens whose
// probability reaches top_p (nucleus sampling) when 0 < top_p < 1. Owns its
// random state and scratch; not thread-safe.
#ifndef INFINIGEN_GPU_WORKER_SERVING_SAMPLER_H_
#define INFINIGEN_GPU_WORKER_SERVING_SAMPLER_H_

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace infinigen::gpu_worker {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

class Sampler {
 public:
  // InvalidArgument for a negative temperature or top_p outside (0, 1].
  static absl::StatusOr<Sampler> Create(const SamplerOptions& options);

  int Sample(absl::Span<const float> logits);

 private:
  explicit Sampler(const SamplerOptions& options)
      : options_(options), rng_(options.seed) {}
  SamplerOptions options_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int>> probs_;  // scratch
};

// Index of the largest value (lowest index on ties).
int Argmax(absl::Span<const float> values);

// log softmax(logits)[target], computed stably.
double LogProb(absl::Span<const float> logits, int target);

// A token's log-probability under the model (the log softmax of its row of
// logits, before temperature, top_p and penalties) and the most likely
// tokens of that row: what the OpenAI API's logprobs report.
struct TokenLogProb {
  int token = -1;
  float logprob = 0;
  // The row's top tokens, most likely first (lowest id on ties).
  std::vector<std::pair<int, float>> top;
};

// `token`'s log-probability in `logits` and the row's `top_k` most likely
// tokens (top_k clipped to the vocabulary; 0: none).
TokenLogProb ScoreToken(absl::Span<const float> logits, int token, int top_k);

// OpenAI's frequency and presence penalties over the tokens generated so
// far: logits[t] -= count[t] * frequency + (count[t] > 0) * presence.
// Owns the counts of one sequence; not thread-safe.
class Penalties {
 public:
  Penalties(float frequency, float presence)
      : frequency_(frequency), presence_(presence) {}
  bool active() const { return frequency_ != 0.0f || presence_ != 0.0f; }
  // A generated token.
  void Add(int token);
  // `logits` with the penalties applied, in scratch owned by this object
  // (valid until the next call); `logits` itself when none is active.
  absl::Span<const float> Apply(absl::Span<const float> logits);

 private:
  const float frequency_, presence_;
  std::vector<std::pair<int, int>> counts_;  // (token, times), sorted
  std::vector<float> scratch_;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_SAMPLER_H_
