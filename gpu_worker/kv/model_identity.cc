#include "gpu_worker/kv/model_identity.h"

#include <xxhash.h>

#include <memory>
#include <vector>

#include "absl/strings/str_format.h"

namespace infinigen::gpu_worker {
namespace {

void Add(XXH3_state_t* state, const std::vector<float>& v) {
  const uint64_t n = v.size();
  XXH3_128bits_update(state, &n, sizeof(n));
  if (!v.empty()) XXH3_128bits_update(state, v.data(), v.size() * sizeof(float));
}

std::string Hex(XXH128_hash_t h) {
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

}  // namespace

std::string WeightsIdentity(const model::Weights& weights) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(
      XXH3_createState(), &XXH3_freeState);
  XXH3_128bits_reset(state.get());
  const std::string config = weights.config.DebugString();
  XXH3_128bits_update(state.get(), config.data(), config.size());
  for (const std::vector<float>* v :
       {&weights.token_embedding, &weights.position_embedding,
        &weights.final_norm, &weights.final_norm_bias, &weights.lm_head}) {
    Add(state.get(), *v);
  }
  for (const model::LayerWeights& w : weights.layers) {
    for (const std::vector<float>* v :
         {&w.attn_norm, &w.attn_norm_bias, &w.wq, &w.wk, &w.wv, &w.wo, &w.bq,
          &w.bk, &w.bv, &w.bo, &w.ffn_norm, &w.ffn_norm_bias, &w.w1, &w.w3,
          &w.w2, &w.b1, &w.b2}) {
      Add(state.get(), *v);
    }
  }
  return "model=" + Hex(XXH3_128bits_digest(state.get()));
}

std::string ModelIdentity(const std::string& weights_identity,
                          const speculator::SkewMatrices* skew) {
  std::string id = weights_identity;
  if (skew != nullptr) {
    id += "|skew=" + Hex(XXH3_128bits(skew->a.data(),
                                      skew->a.size() * sizeof(float)));
  }
  return id;
}

std::string ModelIdentity(const model::Weights& weights,
                          const speculator::SkewMatrices* skew) {
  return ModelIdentity(WeightsIdentity(weights), skew);
}

}  // namespace infinigen::gpu_worker
