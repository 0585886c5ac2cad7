// ModelIdentity: names what a model's stored K and V rows depend on, for
// prefix reuse (kv_cache.h): two workers may share a memory node's prefix
// blocks only when their identities match.
#ifndef INFINIGEN_GPU_WORKER_KV_MODEL_IDENTITY_H_
#define INFINIGEN_GPU_WORKER_KV_MODEL_IDENTITY_H_

#include <string>

#include "model/weights.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

// A 128-bit XXH3 hash (hex) of the configuration and every weight as
// loaded (after dequantization), and of the skew matrices when given
// (InfiniGen's policy summaries depend on them). Reads every weight once:
// about as long as a memcpy of the model.
std::string ModelIdentity(const model::Weights& weights,
                          const speculator::SkewMatrices* skew);

// The same in two parts, for a caller that needs the weights' part alone
// too (reading every weight once): WeightsIdentity(weights), then
// ModelIdentity(that, skew) == ModelIdentity(weights, skew).
std::string WeightsIdentity(const model::Weights& weights);
std::string ModelIdentity(const std::string& weights_identity,
                          const speculator::SkewMatrices* skew);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_MODEL_IDENTITY_H_
