#include <memory>

#include "gpu_worker/kv/policies/policy_util.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

// FlexGen: every row, fp16 (KvPolicy's default plan: every present row).
class FullPolicy final : public KvPolicy {
 public:
  explicit FullPolicy(const Context& c) : KvPolicy(c) {}

  static absl::StatusOr<std::unique_ptr<KvPolicy>> Make(
      const PolicyOptions&, const Context& c) {
    return std::unique_ptr<KvPolicy>(new FullPolicy(c));
  }
};

}  // namespace

// extern: registry.cc lists it.
extern const PolicyEntry kFullPolicy = {
    PolicyKind::kFull, "full",
    "offload; every cached row of every layer fetched each step (FlexGen)",
    PolicyTraits(),
    /*set_target_fetch=*/nullptr, &FullPolicy::Make, &NoStateBytes,
    /*validate=*/nullptr, /*flags=*/{},
};

}  // namespace infinigen::gpu_worker
