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

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_SERVING_SAMPLER_H_
