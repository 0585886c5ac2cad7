#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "common/half.h"
#include "common/status.h"
#include "gpu_worker/kv/policies/policy_util.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

using kv_memory_service::FetchPlan;
using kv_memory_service::OwnedFetchPlan;

// Quest (Tang et al., ICML 2024): each layer's cached keys in pages of
// page_tokens positions, each page summarized by the element-wise minimum
// and maximum of its keys per KV head. A layer's query (from its own input)
// bounds every page's best score from above, sum_j max(q_j min_j,
// q_j max_j); a page ranks by the largest of the KV head's query heads'
// log-softmax of those bounds over the pages, and the top budget of the
// pages per KV head are fetched whole. The first dense_layers fetch
// everything (2, as in the paper). The budget is a fraction of
// the pages (the newest page may be partly filled). The bounds live on the
// host: a prefill layer's keys and each decode step's new key are copied there.
class QuestPolicy final : public KvPolicy {
 public:
  QuestPolicy(const Context& c, const PolicyOptions& o)
      : KvPolicy(c),
        budget_(o.selection.budget),
        sink_tokens_(o.selection.sink_tokens),
        recent_tokens_(o.selection.recent_tokens),
        page_(o.quest.page_tokens),
        dense_layers_(o.selection.dense_layers),
        max_pages_((c.max_seq_len + o.quest.page_tokens - 1) /
                   o.quest.page_tokens) {}

  static absl::StatusOr<std::unique_ptr<KvPolicy>> Make(
      const PolicyOptions& o, const Context& c) {
    return std::make_unique<QuestPolicy>(c, o);
  }

  static absl::StatusOr<int64_t> StateBytes(const PolicyOptions& o,
                                            const Context& c) {
    const model::ModelConfig& m = c.weights->config;
    const int64_t pages =
        (c.max_seq_len + o.quest.page_tokens - 1) / o.quest.page_tokens;
    return 2 * int64_t{m.n_layers} * m.n_kv_heads * pages * m.head_dim *
               int64_t{sizeof(float)} +                    // min_, max_
           2 * int64_t{m.q_dim()} * int64_t{sizeof(float)} +  // q_, q_host_
           int64_t{m.n_kv_heads} * c.max_seq_len * int64_t{sizeof(float)} +
           int64_t{m.kv_dim()} * int64_t{sizeof(float)} + int64_t{sizeof(int)};
  }

  absl::Status Init() override {
    const model::ModelConfig& m = config();
    const size_t bounds = static_cast<size_t>(m.n_layers) * m.n_kv_heads *
                          max_pages_ * m.head_dim;
    min_.assign(bounds, 0.0f);
    max_.assign(bounds, 0.0f);
    Backend* b = ctx_.backend;
    IG_ASSIGN_OR_RETURN(q_, DeviceBuffer<float>::Make(b, m.q_dim(),
                                                      "Quest's queries"));
    IG_ASSIGN_OR_RETURN(position_,
                        DeviceBuffer<int>::Make(b, 1, "Quest's position"));
    q_host_.resize(m.q_dim());
    key_host_.resize(m.kv_dim());
    page_scores_.reserve(max_pages_);
    order_.reserve(max_pages_);
    taken_.reserve(max_pages_);
    return absl::OkStatus();
  }

  // Quest's bounds come from the keys themselves (FinishPrefillLayer sees
  // a reused prefix's keys too).
  absl::Status FinishPrefillLayer(int layer, int n_tokens, const float* keys,
                                  int key_stride) override {
    const model::ModelConfig& m = config();
    const size_t d = m.head_dim;
    prefill_keys_.resize(static_cast<size_t>(n_tokens) * d);
    for (int g = 0; g < m.n_kv_heads; ++g) {
      IG_RETURN_IF_ERROR(ctx_.backend->CopyToHost(
          prefill_keys_.data(), keys + static_cast<size_t>(g) * key_stride * d,
          prefill_keys_.size() * sizeof(float)));
      for (int t = 0; t < n_tokens; ++t) {
        AddKey(layer, g, t, prefill_keys_.data() + static_cast<size_t>(t) * d);
      }
    }
    return absl::OkStatus();
  }

  void OnDecodeAppend(int layer, int p, const float* key) override {
    // Errors of the copy surface at the next Plan's copy.
    if (!ctx_.backend->CopyToHost(key_host_.data(), key,
                                  key_host_.size() * sizeof(float))
             .ok()) {
      return;
    }
    const int d = config().head_dim;
    for (int g = 0; g < config().n_kv_heads; ++g) {
      AddKey(layer, g, p, key_host_.data() + static_cast<size_t>(g) * d);
    }
  }

  absl::StatusOr<PlanMade> Plan(const PlanRequest& request,
                                OwnedFetchPlan& plan) override {
    const int layer = request.layer, p = request.p;
    const float* x = request.input;
    const uint8_t* present = request.present;
    if (layer < dense_layers_ || x == nullptr) {
      return PlanEveryRow(request, plan);
    }
    const model::ModelConfig& m = config();
    const model::LayerWeights& w = ctx_.weights->layers[layer];
    const int d = m.head_dim, group = m.n_heads / m.n_kv_heads;
    Backend& b = *ctx_.backend;
    // position_host_'s last copy finished: CopyToHost below waits for it.
    ProjectQuery(b, m, w, x, p, &position_host_, position_.data(), q_.data());
    IG_RETURN_IF_ERROR(
        b.CopyToHost(q_host_.data(), q_.data(), q_host_.size() * sizeof(float)));
    const int pages = (p + page_ - 1) / page_;
    // The budget's fraction of the pages, as the oracle's cap counts
    // tokens: at page_tokens 1 the bound is the exact score and Quest is
    // the oracle.
    const int want = std::max(
        1, static_cast<int>(static_cast<float>(pages) * budget_));
    // The pages holding the sink and recent positions, taken besides the
    // ranked ones (on top of the budget, as for infinigen).
    const int sink_pages = (std::min(sink_tokens_, p) + page_ - 1) / page_;
    const int recent_from = recent_tokens_ > 0
                                ? std::max(0, p - recent_tokens_) / page_
                                : pages;
    plan.indices.clear();
    plan.head_offsets.resize(m.n_kv_heads + 1);
    plan.head_offsets[0] = 0;
    for (int g = 0; g < m.n_kv_heads; ++g) {
      const uint8_t* pr = present + static_cast<size_t>(g) * ctx_.max_seq_len;
      // Each head's bounds, scaled as attention scales its logits, then
      // per page the largest of the heads' log-softmax over the pages, as
      // the oracle and infinigen rank tokens (CombineHeadScores).
      head_bounds_.resize(static_cast<size_t>(group) * pages);
      const float scale = 1.0f / std::sqrt(static_cast<float>(d));
      for (int j = 0; j < pages; ++j) {
        const float* lo = Min(layer, g, j);
        const float* hi = Max(layer, g, j);
        for (int i = 0; i < group; ++i) {
          const float* q =
              q_host_.data() + static_cast<size_t>(g * group + i) * d;
          float bound = 0.0f;
          for (int c = 0; c < d; ++c) {
            bound += std::max(q[c] * lo[c], q[c] * hi[c]);
          }
          head_bounds_[static_cast<size_t>(i) * pages + j] = bound * scale;
        }
      }
      page_scores_.resize(pages);
      speculator::CombineHeadScores(head_bounds_.data(), group, 1, pages,
                                    nullptr, page_scores_.data());
      order_.resize(pages);
      for (int j = 0; j < pages; ++j) order_[j] = j;
      const int take = std::min(want, pages);
      std::partial_sort(order_.begin(), order_.begin() + take, order_.end(),
                        [this](int a, int c) {
                          return page_scores_[a] > page_scores_[c] ||
                                 (page_scores_[a] == page_scores_[c] && a < c);
                        });
      taken_.assign(pages, 0);
      for (int i = 0; i < take; ++i) taken_[order_[i]] = 1;
      for (int j = 0; j < sink_pages; ++j) taken_[j] = 1;
      for (int j = recent_from; j < pages; ++j) taken_[j] = 1;
      for (int j = 0; j < pages; ++j) {
        if (!taken_[j]) continue;
        const int first = j * page_;
        const int last = std::min(p, first + page_);
        for (int t = first; t < last; ++t) {
          if (pr[t]) plan.indices.push_back(t);
        }
      }
      plan.head_offsets[g + 1] = static_cast<int32_t>(plan.indices.size());
    }
    return PlanMade::kIndices;
  }

 private:
  size_t Page(int layer, int g, int page) const {
    return ((static_cast<size_t>(layer) * config().n_kv_heads + g) *
                max_pages_ + page) * config().head_dim;
  }
  const float* Min(int layer, int g, int page) const {
    return min_.data() + Page(layer, g, page);
  }
  const float* Max(int layer, int g, int page) const {
    return max_.data() + Page(layer, g, page);
  }
  // Widens position t's page bounds by its key (the page's first key sets
  // them).
  void AddKey(int layer, int g, int t, const float* key) {
    const int d = config().head_dim;
    float* lo = min_.data() + Page(layer, g, t / page_);
    float* hi = max_.data() + Page(layer, g, t / page_);
    if (t % page_ == 0) {
      std::memcpy(lo, key, d * sizeof(float));
      std::memcpy(hi, key, d * sizeof(float));
      return;
    }
    for (int c = 0; c < d; ++c) {
      lo[c] = std::min(lo[c], key[c]);
      hi[c] = std::max(hi[c], key[c]);
    }
  }

  const float budget_;
  const int sink_tokens_;
  const int recent_tokens_;
  const int page_;
  const int dense_layers_;
  const int max_pages_;
  std::vector<float> min_, max_;     // [layer][kv_head][page][d]
  std::vector<float> q_host_;        // [n_heads * d]
  std::vector<float> key_host_;      // [n_kv_heads * d]
  std::vector<float> prefill_keys_;  // [n_tokens * d]
  std::vector<float> page_scores_;   // [pages]
  std::vector<float> head_bounds_;   // [group][pages]
  std::vector<int> order_;           // [pages]
  std::vector<char> taken_;          // [pages]: fetched this step
  int position_host_ = 0;
  DeviceBuffer<float> q_;      // [n_heads * d]
  DeviceBuffer<int> position_;  // [1]
};

}  // namespace

constexpr const char* kQuestFlags[] = {
    "budget", "target_fetch", "dense_layers", "sink_tokens", "recent_tokens",
    "page_tokens",
};

// extern: registry.cc lists it.
extern const PolicyEntry kQuestPolicy = {
    PolicyKind::kQuest, "quest",
    "Quest's pages: the top budget of pages per KV head by their key bounds "
    "for the layer's own query",
    PolicyTraits().Selects().OwnInput(),
    &SetSelectedLayersTargetFetch, &QuestPolicy::Make, &QuestPolicy::StateBytes,
    &ValidateSelectionAndQuest, kQuestFlags,
};

}  // namespace infinigen::gpu_worker
