#include "gpu_worker/kv_policy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/half.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

using kv_memory_service::FetchPlan;
using kv_memory_service::OwnedFetchPlan;

absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name) {
  if (name == "ideal") return PolicyKind::kIdeal;
  if (name == "full") return PolicyKind::kFull;
  if (name == "infinigen") return PolicyKind::kInfiniGen;
  if (name == "h2o") return PolicyKind::kH2O;
  if (name == "int4") return PolicyKind::kInt4;
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown policy '%s' (ideal, full, infinigen, h2o, int4)", name));
}

const char* PolicyName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kIdeal:
      return "ideal";
    case PolicyKind::kFull:
      return "full";
    case PolicyKind::kInfiniGen:
      return "infinigen";
    case PolicyKind::kH2O:
      return "h2o";
    case PolicyKind::kInt4:
      return "int4";
  }
  return "unknown";
}

absl::Status PolicyOptions::Validate() const {
  if (!(alpha >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("alpha must be >= 0, got %g", alpha));
  }
  if (!(partial_ratio > 0.0f && partial_ratio <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "partial_ratio must be in (0, 1], got %g", partial_ratio));
  }
  if (!(budget > 0.0f && budget <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("budget must be in (0, 1], got %g", budget));
  }
  if (kind == PolicyKind::kInfiniGen && skew == nullptr) {
    return absl::InvalidArgumentError("the infinigen policy needs a skew");
  }
  return absl::OkStatus();
}

int KvPolicy::RowWidth() const {
  return KvRowWidth(row_format(), config().head_dim);
}

void KvPolicy::EncodeRows(const float* rows, int n_rows, uint16_t* out) const {
  EncodeKvRows(row_format(), rows, n_rows, config().head_dim, out);
}

void KvPolicy::DecodeRows(const uint16_t* in, int n_rows, float* rows) const {
  DecodeKvRows(row_format(), in, n_rows, config().head_dim, rows);
}

void KvPolicy::PlanAllPresent(int p, const uint8_t* present,
                              OwnedFetchPlan& plan) const {
  const int n_kv = config().n_kv_heads;
  plan.indices.clear();
  plan.head_offsets.resize(n_kv + 1);
  plan.head_offsets[0] = 0;
  for (int g = 0; g < n_kv; ++g) {
    const uint8_t* pr = present + static_cast<size_t>(g) * ctx_.max_seq_len;
    for (int t = 0; t < p; ++t) {
      if (pr[t]) plan.indices.push_back(t);
    }
    plan.head_offsets[g + 1] = static_cast<int32_t>(plan.indices.size());
  }
}

namespace {

// FlexGen: every row, fp16.
class FullPolicy final : public KvPolicy {
 public:
  using KvPolicy::KvPolicy;
  void PlanFetch(int layer, int p, const float* xb_prev,
                 const uint8_t* present, OwnedFetchPlan& plan) override {
    PlanAllPresent(p, present, plan);
  }
};

// FlexGen's group-wise asymmetric 4-bit quantization of K and V
// (KvRowFormat::kInt4); every row fetched.
class Int4Policy final : public KvPolicy {
 public:
  using KvPolicy::KvPolicy;
  KvRowFormat row_format() const override { return KvRowFormat::kInt4; }

  void PlanFetch(int layer, int p, const float* xb_prev,
                 const uint8_t* present, OwnedFetchPlan& plan) override {
    PlanAllPresent(p, present, plan);
  }
};

// H2O: per (layer, KV head), the recent budget/2 of the positions plus the
// budget/2 with the largest accumulated attention (summed over the group's
// query heads, prefill included); anything else is dropped for good.
class H2OPolicy final : public KvPolicy {
 public:
  H2OPolicy(const Context& c, float budget)
      : KvPolicy(c),
        budget_(budget),
        slab_(static_cast<size_t>(c.weights->config.n_kv_heads) *
              c.max_seq_len) {
    const size_t n = slab_ * c.weights->config.n_layers;
    acc_.assign(n, 0.0f);
    kept_.assign(n, 1);
    pending_new_.assign(
        static_cast<size_t>(c.weights->config.n_layers) * c.weights->config.n_heads,
        0.0f);
  }

  void Reset() override {
    std::fill(acc_.begin(), acc_.end(), 0.0f);
    std::fill(kept_.begin(), kept_.end(), 1);
  }

  bool WantsPrefillProbs() const override { return true; }
  bool WantsAttentionProbs() const override { return true; }

  void ObservePrefill(int layer, const float* q, int n, int first_pos,
                      const float* prob_sums) override {
    const int kv_len = first_pos + n;
    const int group = config().n_heads / config().n_kv_heads;
    for (int h = 0; h < config().n_heads; ++h) {
      float* acc = Acc(layer, h / group);
      const float* s = prob_sums + static_cast<size_t>(h) * kv_len;
      for (int t = 0; t < kv_len; ++t) acc[t] += s[t];
    }
  }

  void PlanFetch(int layer, int p, const float* xb_prev,
                 const uint8_t* present, OwnedFetchPlan& plan) override {
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

  void OnDecodeAppend(int layer, int p, const float* k) override {
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

// InfiniGen (ALGORITHM.md): layers 0 and 1 read everything; for layer
// l >= 2 the plan comes from speculation with layer l - 1's attention input,
// layer l's query weight, its skew and its partial key cache.
class InfiniGenPolicy final : public KvPolicy {
 public:
  InfiniGenPolicy(const Context& c, const PolicyOptions& o)
      : KvPolicy(c),
        options_(o),
        skew_(*o.skew),
        n_cols_(speculator::PartialColumnCount(c.weights->config.head_dim,
                                               o.partial_ratio)) {
    const model::ModelConfig& m = c.weights->config;
    const int d = m.head_dim;
    col_sums_.assign(static_cast<size_t>(m.n_layers) * m.n_kv_heads * d, 0.0f);
    cols_.n_layers = m.n_layers;
    cols_.n_kv_heads = m.n_kv_heads;
    cols_.n_cols = n_cols_;
    cols_.cols.assign(static_cast<size_t>(m.n_layers) * m.n_kv_heads * n_cols_, 0);
    partial_k_.assign(static_cast<size_t>(m.n_layers) * m.n_kv_heads *
                          c.max_seq_len * n_cols_,
                      0.0f);
    q_.resize(m.q_dim());
    q_skewed_.resize(m.q_dim());
    scores_.resize(static_cast<size_t>(m.n_kv_heads) * c.max_seq_len);
    row_.resize(d);
    k_sums_.resize(d);
  }

  void Reset() override {
    std::fill(col_sums_.begin(), col_sums_.end(), 0.0f);
  }

  void ObservePrefill(int layer, const float* q, int n, int first_pos,
                      const float* prob_sums) override {
    // Partial columns rank by the summed |q A| over the prompt.
    const model::ModelConfig& m = config();
    const int d = m.head_dim, group = m.n_heads / m.n_kv_heads;
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < m.n_heads; ++h) {
        const int g = h / group;
        speculator::ApplySkew(q + (static_cast<size_t>(i) * m.n_heads + h) * d,
                              1, skew_.at(layer, g), d, row_.data());
        float* sums = ColSums(layer, g);
        for (int c = 0; c < d; ++c) sums[c] += std::fabs(row_[c]);
      }
    }
  }

  void FinishPrefill(int n_tokens,
                     const std::function<const float*(int)>& key_cache) override {
    const model::ModelConfig& m = config();
    const int d = m.head_dim;
    for (int l = 0; l < m.n_layers; ++l) {
      if (options_.rank_columns_by_keys) {
        for (int g = 0; g < m.n_kv_heads; ++g) {
          std::fill(k_sums_.begin(), k_sums_.end(), 0.0f);
          const float* keys =
              key_cache(l) + static_cast<size_t>(g) * ctx_.max_seq_len * d;
          for (int t = 0; t < n_tokens; ++t) {
            speculator::ApplySkew(keys + static_cast<size_t>(t) * d, 1,
                                  skew_.at(l, g), d, row_.data());
            for (int c = 0; c < d; ++c) k_sums_[c] += std::fabs(row_[c]);
          }
          float* sums = ColSums(l, g);
          for (int c = 0; c < d; ++c) sums[c] *= k_sums_[c];
        }
      }
      // Each KV head's column sums as one "token" whose heads are the KV
      // heads: SelectPartialColumns then ranks each head's columns alone.
      speculator::SelectPartialColumns(ColSums(l, 0), 1, m.n_kv_heads,
                                       m.n_kv_heads, d, n_cols_,
                                       cols_.cols.data() +
                                           static_cast<size_t>(l) *
                                               m.n_kv_heads * n_cols_);
      const float* keys = key_cache(l);
      for (int g = 0; g < m.n_kv_heads; ++g) {
        for (int t = 0; t < n_tokens; ++t) {
          AppendPartialKey(
              l, g, t,
              keys + (static_cast<size_t>(g) * ctx_.max_seq_len + t) * d);
        }
      }
    }
  }

  bool PlansFromInput() const override { return true; }

  void PlanFetch(int layer, int p, const float* xb_prev,
                 const uint8_t* present, OwnedFetchPlan& plan) override {
    if (layer < 2 || xb_prev == nullptr) {
      PlanAllPresent(p, present, plan);
      return;
    }
    const model::ModelConfig& m = config();
    const model::LayerWeights& w = ctx_.weights->layers[layer];
    const int d = m.head_dim, group = m.n_heads / m.n_kv_heads;
    // The approximate query of `layer` from the previous layer's input.
    ctx_.backend->Linear(xb_prev, 1, m.dim, w.wq.data(),
                         w.bq.empty() ? nullptr : w.bq.data(), m.q_dim(),
                         q_.data());
    if (m.arch == model::Architecture::kLlama) {
      ctx_.backend->Rope(q_.data(), 1, m.n_heads, d, &p, m.rope_theta);
    }
    for (int h = 0; h < m.n_heads; ++h) {
      speculator::ApplySkew(q_.data() + h * d, 1, skew_.at(layer, h / group), d,
                            q_skewed_.data() + h * d);
    }
    speculator::SpeculateScores(
        q_skewed_.data(), m.n_heads, m.n_kv_heads, d, PartialK(layer, 0),
        ctx_.max_seq_len, p, cols_.at(layer, 0), n_cols_, scores_.data());
    // SpeculateScores writes [n_kv_heads][p]; present is strided by
    // max_seq_len, so compact it for SelectTokens.
    present_.resize(static_cast<size_t>(m.n_kv_heads) * p);
    for (int g = 0; g < m.n_kv_heads; ++g) {
      std::memcpy(present_.data() + static_cast<size_t>(g) * p,
                  present + static_cast<size_t>(g) * ctx_.max_seq_len, p);
    }
    speculator::SelectionOptions sel;
    sel.alpha = options_.alpha;
    sel.max_fraction = options_.budget;
    speculator::SelectTokens(scores_.data(), m.n_kv_heads, p, present_.data(),
                             sel, plan.indices, plan.head_offsets);
  }

  void OnDecodeAppend(int layer, int p, const float* k) override {
    for (int g = 0; g < config().n_kv_heads; ++g) {
      AppendPartialKey(layer, g, p, k + static_cast<size_t>(g) * config().head_dim);
    }
  }

 private:
  float* ColSums(int layer, int g) {
    return col_sums_.data() +
           (static_cast<size_t>(layer) * config().n_kv_heads + g) *
               config().head_dim;
  }
  float* PartialK(int layer, int g) {
    return partial_k_.data() +
           (static_cast<size_t>(layer) * config().n_kv_heads + g) *
               ctx_.max_seq_len * n_cols_;
  }
  // partial_k[layer][g][t] = (k A)[cols]
  void AppendPartialKey(int layer, int g, int t, const float* k) {
    const int d = config().head_dim;
    speculator::ApplySkew(k, 1, skew_.at(layer, g), d, row_.data());
    const int32_t* cols = cols_.at(layer, g);
    float* out = PartialK(layer, g) + static_cast<size_t>(t) * n_cols_;
    for (int c = 0; c < n_cols_; ++c) out[c] = row_[cols[c]];
  }

  const PolicyOptions options_;
  const speculator::SkewMatrices& skew_;
  const int n_cols_;
  std::vector<float> col_sums_;          // [layer][kv_head][d]
  speculator::PartialColumns cols_;      // [layer][kv_head][n_cols]
  std::vector<float> partial_k_;         // [layer][kv_head][max_seq][n_cols]
  std::vector<float> q_, q_skewed_;      // [n_heads * d]
  std::vector<float> scores_;            // [kv_head][p]
  std::vector<uint8_t> present_;         // [kv_head][p]
  std::vector<float> row_;               // [d]
  std::vector<float> k_sums_;            // [d]
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvPolicy>> KvPolicy::Create(
    const PolicyOptions& options, const Context& context) {
  IG_RETURN_IF_ERROR(options.Validate());
  const model::ModelConfig& m = context.weights->config;
  switch (options.kind) {
    case PolicyKind::kIdeal:
      return absl::InvalidArgumentError("ideal has no KvPolicy: it stays local");
    case PolicyKind::kFull:
      return std::unique_ptr<KvPolicy>(new FullPolicy(context));
    case PolicyKind::kInt4:
      if (m.head_dim % 4 != 0 || m.head_dim % std::min(64, m.head_dim) != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "int4 needs a head_dim divisible by 4 and by its group, got %d",
            m.head_dim));
      }
      return std::unique_ptr<KvPolicy>(new Int4Policy(context));
    case PolicyKind::kH2O:
      return std::unique_ptr<KvPolicy>(new H2OPolicy(context, options.budget));
    case PolicyKind::kInfiniGen:
      IG_RETURN_IF_ERROR(
          options.skew->CheckShape(m.n_layers, m.n_kv_heads, m.head_dim));
      return std::unique_ptr<KvPolicy>(new InfiniGenPolicy(context, options));
  }
  return absl::InvalidArgumentError("unknown policy");
}

}  // namespace infinigen::gpu_worker
