#include "gpu_worker/calibrate.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "gpu_worker/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"

namespace infinigen::gpu_worker {

absl::StatusOr<speculator::SkewMatrices> CalibrateSkew(
    const model::Weights& weights, absl::Span<const int> tokens) {
  const model::ModelConfig& c = weights.config;
  const int n = static_cast<int>(tokens.size());
  const int d = c.head_dim, group = c.n_heads / c.n_kv_heads;
  if (n < d) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "calibration needs at least head_dim = %d tokens, got %d", d, n));
  }
  // Per layer and KV head: the group's query rows [n * group, d] and the
  // head's key rows [n, d], filled as the prefill runs.
  const size_t heads = static_cast<size_t>(c.n_layers) * c.n_kv_heads;
  std::vector<std::vector<float>> q(heads), k(heads);
  for (size_t i = 0; i < heads; ++i) {
    q[i].reserve(static_cast<size_t>(n) * group * d);
    k[i].reserve(static_cast<size_t>(n) * d);
  }
  EngineOptions options;
  options.max_seq_len = n;
  options.observer = [&](int layer, const float* qs, const float* ks, int m) {
    for (int t = 0; t < m; ++t) {
      for (int h = 0; h < c.n_heads; ++h) {
        const float* row = qs + (static_cast<size_t>(t) * c.n_heads + h) * d;
        auto& dst = q[static_cast<size_t>(layer) * c.n_kv_heads + h / group];
        dst.insert(dst.end(), row, row + d);
      }
      for (int g = 0; g < c.n_kv_heads; ++g) {
        const float* row = ks + (static_cast<size_t>(t) * c.n_kv_heads + g) * d;
        auto& dst = k[static_cast<size_t>(layer) * c.n_kv_heads + g];
        dst.insert(dst.end(), row, row + d);
      }
    }
  };
  IG_ASSIGN_OR_RETURN(auto engine,
                      Engine::Create(weights, NewCpuBackend(), options));
  IG_RETURN_IF_ERROR(engine->Forward(tokens, false).status());

  speculator::SkewMatrices skew;
  skew.n_layers = c.n_layers;
  skew.n_kv_heads = c.n_kv_heads;
  skew.head_dim = d;
  skew.a.resize(heads * d * d);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int g = 0; g < c.n_kv_heads; ++g) {
      const size_t i = static_cast<size_t>(l) * c.n_kv_heads + g;
      IG_ASSIGN_OR_RETURN(
          std::vector<float> a,
          speculator::ComputeSkew(q[i].data(), n * group, k[i].data(), n, d));
      std::memcpy(skew.at(l, g), a.data(), a.size() * sizeof(float));
    }
  }
  return skew;
}

}  // namespace infinigen::gpu_worker
