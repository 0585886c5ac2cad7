#include <algorithm>
#include <memory>

#include "absl/strings/str_format.h"
#include "gpu_worker/kv/policies/policy_util.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

// FlexGen's group-wise asymmetric 4-bit quantization of K and V
// (KvRowFormat::kInt4); every row fetched (KvPolicy's default plan).
class Int4Policy final : public KvPolicy {
 public:
  explicit Int4Policy(const Context& c) : KvPolicy(c) {}

  static absl::StatusOr<std::unique_ptr<KvPolicy>> Make(
      const PolicyOptions&, const Context& c) {
    const int d = c.weights->config.head_dim;
    if (d % 4 != 0 || d % std::min(64, d) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "int4 needs a head_dim divisible by 4 and by its group, got %d", d));
    }
    return std::unique_ptr<KvPolicy>(new Int4Policy(c));
  }
};

}  // namespace

// extern: registry.cc lists it.
extern const PolicyEntry kInt4Policy = {
    PolicyKind::kInt4, "int4",
    "rows stored group-wise 4-bit (asymmetric, group 64); every row fetched",
    // No prefix reuse: a reused prefix's rows come back quantized, and a
    // prefill that gives the same answer with and without reuse must then
    // attend over quantized rows too (+3.9% perplexity on stories260K,
    // against FlexGen's prefill over the exact rows); int4 keeps the exact
    // prefill and computes every prompt.
    PolicyTraits().Rows(KvRowFormat::kInt4).NoPrefixReuse(),
    /*set_target_fetch=*/nullptr, &Int4Policy::Make, &NoStateBytes,
    /*validate=*/nullptr, /*flags=*/{},
};

}  // namespace infinigen::gpu_worker
