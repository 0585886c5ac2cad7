#include <algorithm>
#include <memory>

#include "absl/strings/str_format.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

using kv_memory_service::FetchPlan;
using kv_memory_service::OwnedFetchPlan;

// FlexGen's group-wise asymmetric 4-bit quantization of K and V
// (KvRowFormat::kInt4); every row fetched.
class Int4Policy final : public KvPolicy {
 public:
  explicit Int4Policy(const Context& c) : KvPolicy(c) {}
  KvRowFormat row_format() const override { return KvRowFormat::kInt4; }

  absl::Status PlanFetch(int layer, int p, const float* xb_prev,
                         const uint8_t* present,
                         OwnedFetchPlan& plan) override {
    PlanAllPresent(p, present, plan);
    return absl::OkStatus();
  }
};

}  // namespace

const PolicyEntry kInt4Policy = {
    PolicyKind::kInt4, "int4",
    "rows stored group-wise 4-bit (asymmetric, group 64); every row fetched",
    {/*offloads=*/true, /*selects=*/false, /*own_input=*/false,
     /*speculates=*/false, /*adaptive_budgets=*/false},
    /*set_target_fetch=*/nullptr,
    [](const PolicyOptions&, const KvPolicy::Context& context)
        -> absl::StatusOr<std::unique_ptr<KvPolicy>> {
      const int d = context.weights->config.head_dim;
      if (d % 4 != 0 || d % std::min(64, d) != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "int4 needs a head_dim divisible by 4 and by its group, got %d",
            d));
      }
      return std::unique_ptr<KvPolicy>(new Int4Policy(context));
    },
    [](const PolicyOptions&, const KvPolicy::Context&)
        -> absl::StatusOr<int64_t> { return int64_t{0}; },
};

}  // namespace infinigen::gpu_worker
