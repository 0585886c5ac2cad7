#include <algorithm>
#include <memory>
#include <vector>

#include "gpu_worker/kv/policies/policy_util.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

using kv_memory_service::FetchPlan;
using kv_memory_service::OwnedFetchPlan;

// H2O: per (layer, KV head), the recent budget/2 of the positions plus the
// budget/2 with the largest accumulated attention (summed over the group's
// query heads, prefill included); anything else is dropped for good.
class H2OPolicy final : public KvPolicy {
 public:
  H2OPolicy(const Context& c, float budget)
      : KvPolicy(c),
        budget_(budget),
        slab_(static_cast<size_t>(c.weights->config.n_kv_heads) *
              c.max_seq_len) {}

  absl::Status Init() override {
    const size_t n = slab_ * config().n_layers;
    acc_.assign(n, 0.0f);
    kept_.assign(n, 1);
    pending_new_.assign(
        static_cast<size_t>(config().n_layers) * config().n_heads, 0.0f);
    candidates_.reserve(ctx_.max_seq_len);
    return absl::OkStatus();
  }

  static absl::StatusOr<std::unique_ptr<KvPolicy>> Make(
      const PolicyOptions& o, const Context& c) {
    return std::make_unique<H2OPolicy>(c, o.selection.budget);
  }

  // The budget is the kept fraction: what a target fetch sets.
  static absl::Status SetTargetFetch(double fraction, int,
                                     PolicyOptions& options) {
    options.selection.budget = static_cast<float>(fraction);
    return absl::OkStatus();
  }

  static absl::StatusOr<int64_t> StateBytes(const PolicyOptions&,
                                            const Context& c) {
    const model::ModelConfig& m = c.weights->config;
    const int64_t slots = int64_t{m.n_layers} * m.n_kv_heads * c.max_seq_len;
    return slots * (sizeof(float) + sizeof(uint8_t)) +
           int64_t{m.n_layers} * m.n_heads * sizeof(float) +
           int64_t{c.max_seq_len} * sizeof(int);
  }

  int MaxPlanRows(int p) const override {
    return std::min(p, 2 * std::max(1, static_cast<int>(p * budget_ / 2)));
  }

  void Reset() override {
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill(kept_.begin(), kept_.end(), 1);
  }

  void ObservePrefill(int layer, const float* q, const float* k, int n,
                      int first_pos, const float* prob_sums) override {
    const int kv_len = first_pos + n;
    const int group = config().n_heads / config().n_kv_heads;
    for (int h = 0; h < config().n_heads; ++h) {
      float* acc = Acc(layer, h / group);
      const float* s = prob_sums + static_cast<size_t>(h) * kv_len;
      for (int t = 0; t < kv_len; ++t) acc[t] += s[t];
    }
  }

  absl::StatusOr<PlanMade> Plan(const PlanRequest& request,
                                OwnedFetchPlan& plan) override {
    const int layer = request.layer, p = request.p;
    const uint8_t* present = request.present;
    const int n_kv = config().n_kv_heads;
    const int half = std::max(1, static_cast<int>(p * budget_ / 2));
    const int recent_start = std::max(0, p - half);
    plan.indices.clear();
    plan.head_offsets.resize(n_kv + 1);
    plan.head_offsets[0] = 0;
    for (int g = 0; g < n_kv; ++g) {
      uint8_t* kept = Kept(layer, g);
      const uint8_t* pr = present + static_cast<size_t>(g) * ctx_.max_seq_len;
      const float* acc = Acc(layer, g);
      // Heavy hitters among the older tokens still kept.
      candidates_.clear();
      for (int t = 0; t < recent_start; ++t) {
        if (kept[t] && pr[t]) candidates_.push_back(t);
      }
      const int heavy = std::min<int>(half, candidates_.size());
      std::nth_element(candidates_.begin(), candidates_.begin() + heavy,
                       candidates_.end(), [acc](int a, int b) {
                         return acc[a] > acc[b] || (acc[a] == acc[b] && a < b);
                       });
      for (int i = heavy; i < static_cast<int>(candidates_.size()); ++i) {
        kept[candidates_[i]] = 0;  // evicted for good
      }
      for (int t = 0; t < p; ++t) {
        if (kept[t] && pr[t]) plan.indices.push_back(t);
      }
      plan.head_offsets[g + 1] = static_cast<int32_t>(plan.indices.size());
    }
    return PlanMade::kIndices;
  }

  void ObserveAttention(int layer, const FetchPlan& plan, const float* probs,
                        int stride) override {
    const int group = config().n_heads / config().n_kv_heads;
    for (int h = 0; h < config().n_heads; ++h) {
      const int g = h / group;
      float* acc = Acc(layer, g);
      const int begin = plan.head_offsets[g], end = plan.head_offsets[g + 1];
      const float* pr = probs + static_cast<size_t>(h) * stride;
      for (int j = begin; j < end; ++j) acc[plan.indices[j]] += pr[j - begin];
      // The new token's own probability; it is cached from the next step.
      pending_new_[static_cast<size_t>(layer) * config().n_heads + h] =
          pr[end - begin];
    }
  }

  void OnDecodeAppend(int layer, int p, const float* key) override {
    const int group = config().n_heads / config().n_kv_heads;
    for (int h = 0; h < config().n_heads; ++h) {
      Acc(layer, h / group)[p] +=
          pending_new_[static_cast<size_t>(layer) * config().n_heads + h];
    }
  }

 private:
  float* Acc(int layer, int g) {
    return acc_.data() + layer * slab_ + static_cast<size_t>(g) * ctx_.max_seq_len;
  }
  uint8_t* Kept(int layer, int g) {
    return kept_.data() + layer * slab_ + static_cast<size_t>(g) * ctx_.max_seq_len;
  }

  const float budget_;
  const size_t slab_;              // n_kv_heads * max_seq_len
  std::vector<float> acc_;         // [layer][kv_head][pos] accumulated attention
  std::vector<uint8_t> kept_;      // [layer][kv_head][pos] not yet evicted
  std::vector<int> candidates_;    // scratch
  std::vector<float> pending_new_;  // [layer][head]: the new token's prob
};

}  // namespace

constexpr const char* kH2OFlags[] = {"budget", "target_fetch"};

// extern: registry.cc lists it.
extern const PolicyEntry kH2OPolicy = {
    PolicyKind::kH2O, "h2o",
    "heavy hitters plus a recent window, a budget of the sequence, evicted "
    "for good",
    // Heavy hitters rank by the prompt's own attention: no reuse.
    PolicyTraits().AttentionProbs().NoPrefixReuse(),
    &H2OPolicy::SetTargetFetch, &H2OPolicy::Make, &H2OPolicy::StateBytes,
    &ValidateSelection, kH2OFlags,
};

}  // namespace infinigen::gpu_worker
