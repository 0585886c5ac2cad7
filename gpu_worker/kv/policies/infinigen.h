// InfiniGen's speculation machinery, shared by the infinigen policy and the
// oracle (the same machinery with exact scores).
#ifndef INFINIGEN_GPU_WORKER_KV_POLICIES_INFINIGEN_H_
#define INFINIGEN_GPU_WORKER_KV_POLICIES_INFINIGEN_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "gpu_worker/kv/kv_policy.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

// An InfiniGen policy of options `o` (its state not yet allocated);
// `owned_skew`: the skew to use instead of o.skew (the oracle's identity).
std::unique_ptr<KvPolicy> NewInfiniGenPolicy(
    const KvPolicy::Context& context, const PolicyOptions& o,
    std::unique_ptr<const speculator::SkewMatrices> owned_skew = nullptr);
// Bytes of its per-sequence state.
int64_t InfiniGenStateBytes(const KvPolicy::Context& context,
                            const PolicyOptions& o);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_POLICIES_INFINIGEN_H_
