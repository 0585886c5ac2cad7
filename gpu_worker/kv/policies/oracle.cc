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
  o.infinigen.partial_ratio = 1.0f;
  o.infinigen.alpha = 1e30f;
  o.infinigen.same_layer_input = true;
  o.infinigen.rank_columns_by_keys = false;
  return o;
}

// With the identity skew every column is the key's own, unrotated.
absl::StatusOr<std::unique_ptr<KvPolicy>> MakeOracle(
    const PolicyOptions& o, const KvPolicy::Context& c) {
  const model::ModelConfig& m = c.weights->config;
  return NewInfiniGenPolicy(c, OracleOptions(o),
                            std::make_unique<const speculator::SkewMatrices>(
                                speculator::SkewMatrices::Identity(
                                    m.n_layers, m.n_kv_heads, m.head_dim)));
}

absl::StatusOr<int64_t> OracleBytes(const PolicyOptions& o,
                                    const KvPolicy::Context& c) {
  return InfiniGenStateBytes(c, OracleOptions(o));
}

}  // namespace

// Its ranking's own settings are fixed (OracleOptions): of InfiniGen's
// flags only those of the budgets apply; the skew file and calibration give
// adaptive budgets their head profile.
constexpr const char* kOracleFlags[] = {
    "budget", "target_fetch", "dense_layers", "sink_tokens", "recent_tokens",
    "score_mass", "head_budgets", "budget_floor", "skew", "calibration_tokens",
};

// extern: registry.cc lists it.
extern const PolicyEntry kOraclePolicy = {
    PolicyKind::kOracle, "oracle",
    "the exact top budget of each layer's own attention per KV head (a "
    "diagnostic: the fetch cannot leave early)",
    PolicyTraits().Selects().OwnInput().AdaptiveBudgets(),
    &SetSelectedLayersTargetFetch, &MakeOracle, &OracleBytes,
    &ValidateSelectionAndInfiniGen, kOracleFlags,
};

}  // namespace infinigen::gpu_worker
