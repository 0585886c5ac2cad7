#include <memory>

#include "gpu_worker/kv/policies/infinigen.h"
#include "gpu_worker/kv/policies/policy_util.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

// The upper bound of top-k selection. The oracle is InfiniGen's machinery with every column, no alpha cut and
// an identity skew (a rotation changes no score), on each layer's own
// input: the speculated scores are the exact ones.
PolicyOptions OracleOptions(PolicyOptions o) {
  o.partial_ratio = 1.0f;
  o.alpha = 1e30f;
  o.same_layer_input = true;
  o.rank_columns_by_keys = false;
  return o;
}

}  // namespace

const PolicyEntry kOraclePolicy = {
    PolicyKind::kOracle, "oracle",
    "the exact top budget of each layer's own attention per KV head (a "
    "diagnostic: the fetch cannot leave early)",
    {/*offloads=*/true, /*selects=*/true, /*own_input=*/true,
     /*speculates=*/false, /*adaptive_budgets=*/true},
    SetSelectedLayersTargetFetch,
    [](const PolicyOptions& options, const KvPolicy::Context& context)
        -> absl::StatusOr<std::unique_ptr<KvPolicy>> {
      const model::ModelConfig& m = context.weights->config;
      return NewInfiniGenPolicy(
          context, OracleOptions(options),
          std::make_unique<const speculator::SkewMatrices>(
              speculator::SkewMatrices::Identity(m.n_layers, m.n_kv_heads,
                                                 m.head_dim)));
    },
    [](const PolicyOptions& options, const KvPolicy::Context& context)
        -> absl::StatusOr<int64_t> {
      return InfiniGenStateBytes(context, OracleOptions(options));
    },
};

}  // namespace infinigen::gpu_worker
