#include <memory>

#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

using kv_memory_service::FetchPlan;
using kv_memory_service::OwnedFetchPlan;

// FlexGen: every row, fp16.
class FullPolicy final : public KvPolicy {
 public:
  explicit FullPolicy(const Context& c) : KvPolicy(c) {}
  absl::Status PlanFetch(int layer, int p, const float* xb_prev,
                         const uint8_t* present,
                         OwnedFetchPlan& plan) override {
    PlanAllPresent(p, present, plan);
    return absl::OkStatus();
  }
};

}  // namespace

const PolicyEntry kFullPolicy = {
    PolicyKind::kFull, "full",
    "offload; every cached row of every layer fetched each step (FlexGen)",
    {/*offloads=*/true, /*selects=*/false, /*own_input=*/false,
     /*speculates=*/false, /*adaptive_budgets=*/false},
    /*set_target_fetch=*/nullptr,
    [](const PolicyOptions&, const KvPolicy::Context& context)
        -> absl::StatusOr<std::unique_ptr<KvPolicy>> {
      return std::unique_ptr<KvPolicy>(new FullPolicy(context));
    },
    [](const PolicyOptions&, const KvPolicy::Context&)
        -> absl::StatusOr<int64_t> { return int64_t{0}; },
};

}  // namespace infinigen::gpu_worker
