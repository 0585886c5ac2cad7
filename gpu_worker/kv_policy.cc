#include "gpu_worker/kv_policy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/half.h"
#include "common/status.h"
#include "speculator/partial_keys.h"

namespace infinigen::gpu_worker {

using kv_memory_service::FetchPlan;
using kv_memory_service::OwnedFetchPlan;

absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name) {
  if (name == "ideal") return PolicyKind::kIdeal;
  if (name == "full") return PolicyKind::kFull;
  if (name == "infinigen") return PolicyKind::kInfiniGen;
  if (name == "h2o") return PolicyKind::kH2O;
  if (name == "int4") return PolicyKind::kInt4;
  if (name == "oracle") return PolicyKind::kOracle;
  if (name == "quest") return PolicyKind::kQuest;
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown policy '%s' (ideal, full, infinigen, h2o, int4, oracle, quest)",
      name));
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
    case PolicyKind::kOracle:
      return "oracle";
    case PolicyKind::kQuest:
      return "quest";
  }
  return "unknown";
}

absl::Status SetTargetFetch(double fraction, int n_layers,
                            PolicyOptions& options) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the target fetch fraction must be in (0, 1], got %g", fraction));
  }
  switch (options.kind) {
    case PolicyKind::kH2O:
      options.budget = static_cast<float>(fraction);
      return absl::OkStatus();
    case PolicyKind::kInfiniGen:
    case PolicyKind::kOracle:
    case PolicyKind::kQuest: {
      const int dense_layers = options.dense_layers;  // read whole
      const double dense = static_cast<double>(dense_layers) / n_layers;
      if (dense_layers >= n_layers || fraction <= dense) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "a target fetch of %g is not reachable with %s on %d layers: "
            "its %d dense layers alone fetch %g of the rows",
            fraction, PolicyName(options.kind), n_layers, dense_layers,
            std::min(1.0, dense)));
      }
      options.budget = static_cast<float>((fraction - dense) / (1.0 - dense));
      options.alpha = 1e9f;
      options.score_mass = 0.0f;
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "a target fetch applies to infinigen, oracle, quest and h2o, not "
          "%s", PolicyName(options.kind)));
  }
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
  if (!(score_mass >= 0.0f && score_mass <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "score_mass must be in [0, 1] (0: the alpha rule), got %g",
        score_mass));
  }
  if (adaptive_budgets) {
    if (kind != PolicyKind::kInfiniGen && kind != PolicyKind::kOracle) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "adaptive budgets apply to infinigen and oracle, not %s",
          PolicyName(kind)));
    }
    if (profile == nullptr || profile->empty()) {
      return absl::InvalidArgumentError(
          "adaptive budgets need a head profile (written by 'infinigen "
          "skew' since the profile was added)");
    }
    if (!(budget_floor >= 0.0f && budget_floor <= 1.0f)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "budget_floor must be in [0, 1], got %g", budget_floor));
    }
  }
  if (page_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("page_tokens must be >= 1, got %d", page_tokens));
  }
  if (dense_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("dense_layers must be >= 0, got %d", dense_layers));
  }
  if (sink_tokens < 0 || recent_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sink_tokens and recent_tokens must be >= 0, got %d and %d",
        sink_tokens, recent_tokens));
  }
  return absl::OkStatus();
}

int KvPolicy::RowWidth() const {
  return KvRowWidth(row_format(), config().head_dim);
}

void KvPolicy::EncodeRows(const float* rows, int n_rows, uint16_t* out) const {
  EncodeKvRows(row_format(), rows, n_rows, config().head_dim, out);
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

// One token's query of layer `w` from x (that layer's input, or the previous
// layer's as InfiniGen speculates): x Wq (+ bq), rotated at position p on
// Llama. *position_host is the source of an asynchronous copy: the caller
// must not change it again before a call that waits for copies (CopyToHost).
void ProjectQuery(Backend& b, const model::ModelConfig& m,
                  const model::LayerWeights& w, const float* x, int p,
                  int* position_host, int* position_device, float* q) {
  b.Linear(x, 1, m.dim, w.wq.data(), w.bq.empty() ? nullptr : w.bq.data(),
           m.q_dim(), q);
  if (m.arch == model::Architecture::kLlama) {
    *position_host = p;
    b.CopyFromHost(position_device, position_host, sizeof(int),
                   b.MarkIssued());
    b.Rope(q, 1, m.n_heads, m.head_dim, position_device, m.rope_theta);
  }
}

// FlexGen: every row, fp16.
class FullPolicy final : public KvPolicy {
 public:
  using KvPolicy::KvPolicy;
  absl::Status PlanFetch(int layer, int p, const float* xb_prev,
                         const uint8_t* present,
                         OwnedFetchPlan& plan) override {
    PlanAllPresent(p, present, plan);
    return absl::OkStatus();
  }
};

// FlexGen's group-wise asymmetric 4-bit quantization of K and V
// (KvRowFormat::kInt4); every row fetched.
class Int4Policy final : public KvPolicy {
 public:
  using KvPolicy::KvPolicy;
  KvRowFormat row_format() const override { return KvRowFormat::kInt4; }

  absl::Status PlanFetch(int layer, int p, const float* xb_prev,
                         const uint8_t* present,
                         OwnedFetchPlan& plan) override {
    PlanAllPresent(p, present, plan);
    return absl::OkStatus();
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

  static int64_t StateBytes(const Context& c) {
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

  bool WantsPrefillProbs() const override { return true; }
  // Heavy hitters rank by the prompt's own attention: no reuse.
  bool ReusesPrefix() const override { return false; }
  bool WantsAttentionProbs() const override { return true; }

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

  absl::Status PlanFetch(int layer, int p, const float* xb_prev,
                         const uint8_t* present,
                         OwnedFetchPlan& plan) override {
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
    return absl::OkStatus();
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

// InfiniGen (Lee et al., OSDI 2024): layers 0 and 1 read everything (dense_layers);
// for layer l >= 2 the plan comes from speculation with layer l - 1's
// attention input (or the residual after its attention, for layer l's
// norm), layer l's query weight, its skew and its partial key cache; a
// selecting layer 0 speculates from its own attention input.
//
// The speculation's arithmetic runs on the engine's backend, next to the
// activations: the partial key cache [layer][kv_head][max_seq][n_cols] (its
// device memory), the partial key weights (the partial columns of each
// skew, so that a key's partial row is one product) and the scores live in
// its memory; only
// the scores come back to the host, where the threshold-and-cap selection
// runs. Choosing the partial columns (once per prompt) runs on the host.
// The oracle is InfiniGen's machinery with every column, no alpha cut and
// an identity skew (a rotation changes no score), on each layer's own
// input: the speculated scores are the exact ones.
PolicyOptions OracleOptions(PolicyOptions o) {
  o.partial_ratio = 1.0f;
  o.alpha = 1e30f;
  o.same_layer_input = true;
  o.rank_columns_by_keys = false;
  return o;
}

class InfiniGenPolicy final : public KvPolicy {
 public:
  // `owned_skew`: the skew to use instead of o.skew (the oracle's identity).
  InfiniGenPolicy(const Context& c, const PolicyOptions& o,
                  std::unique_ptr<const speculator::SkewMatrices> owned_skew =
                      nullptr)
      : KvPolicy(c),
        owned_skew_(std::move(owned_skew)),
        options_(o),
        skew_(owned_skew_ != nullptr ? *owned_skew_ : *o.skew),
        n_cols_(speculator::PartialColumnCount(c.weights->config.head_dim,
                                               o.partial_ratio)),
        format_(KeyFormat(o)),
        row_bytes_(speculator::PartialKeyRowBytes(n_cols_, format_)) {}

  // The exact diagnostics (the oracle, same_layer_input,
  // exact_partial_keys) rank by fp32 partial keys; infinigen keeps 4-bit
  // rows (speculator/partial_keys.h).
  static speculator::PartialKeyFormat KeyFormat(const PolicyOptions& o) {
    return o.SpeculatesFromOwnInput() || o.exact_partial_keys
               ? speculator::PartialKeyFormat::kFloat
               : speculator::PartialKeyFormat::kInt4;
  }

  // Every buffer below, in bytes, for StateBytes and Init alike.
  struct Sizes {
    size_t heads, d, n_cols, max_seq, q_dim, n_kv, n_heads;
    speculator::PartialKeyFormat format;
    int64_t Bytes() const {
      return static_cast<int64_t>(
          2 * heads * d * sizeof(float) +             // col_sums_, k_col_sums_
          2 * heads * n_cols * sizeof(int32_t) +      // cols_, cols_dev_
          heads * d * d * sizeof(float) +             // skew_t_
          2 * heads * n_cols * d * sizeof(float) +    // partial_w_, its host
          heads * max_seq * speculator::PartialKeyRowBytes(n_cols, format) +
                                                      // partial_k_
          (format == speculator::PartialKeyFormat::kFloat
               ? 0
               : max_seq * n_cols * sizeof(float)) +
                                                      // new_partial_k_
          2 * q_dim * sizeof(float) +                 // q_, q_skewed_
          2 * n_heads * max_seq * sizeof(float) +     // scores_ (+host)
          n_kv * max_seq * (sizeof(float) + 1) +      // scores_host_, present_
          2 * d * sizeof(float) + sizeof(int));       // row_, k_sums_, position_
    }
  };
  static Sizes SizesFor(const Context& c, const PolicyOptions& o) {
    const model::ModelConfig& m = c.weights->config;
    Sizes z;
    z.heads = static_cast<size_t>(m.n_layers) * m.n_kv_heads;
    z.d = m.head_dim;
    z.n_cols = speculator::PartialColumnCount(m.head_dim, o.partial_ratio);
    z.max_seq = c.max_seq_len;
    z.q_dim = m.q_dim();
    z.n_kv = m.n_kv_heads;
    z.n_heads = m.n_heads;
    z.format = KeyFormat(o);
    return z;
  }

  absl::Status Init() override {
    const model::ModelConfig& m = config();
    const Sizes z = SizesFor(ctx_, options_);
    const size_t heads = z.heads, d = z.d;
    col_sums_.assign(heads * d, 0.0f);
    k_col_sums_.assign(heads * d, 0.0f);
    cols_.n_layers = m.n_layers;
    cols_.n_kv_heads = m.n_kv_heads;
    cols_.n_cols = n_cols_;
    cols_.cols.assign(heads * n_cols_, 0);
    Backend* b = ctx_.backend;
    IG_ASSIGN_OR_RETURN(cols_dev_, DeviceBuffer<int32_t>::Make(
                                       b, heads * n_cols_, "partial columns"));
    // Linear(x, w) is x . w^T: the transposed skews turn q into q A.
    IG_ASSIGN_OR_RETURN(skew_t_, DeviceBuffer<float>::Make(b, heads * d * d,
                                                           "skew matrices"));
    {
      std::vector<float> t(heads * d * d);
      for (size_t hd = 0; hd < heads; ++hd) {
        const float* a = skew_.a.data() + hd * d * d;
        float* th = t.data() + hd * d * d;
        for (size_t r = 0; r < d; ++r) {
          for (size_t col = 0; col < d; ++col) th[col * d + r] = a[r * d + col];
        }
      }
      b->CopyFromHost(skew_t_.data(), t.data(), t.size() * sizeof(float),
                      b->MarkIssued());
      IG_RETURN_IF_ERROR(b->WaitCopies());  // before t goes
    }
    partial_w_host_.assign(heads * n_cols_ * d, 0.0f);
    IG_ASSIGN_OR_RETURN(partial_w_, DeviceBuffer<float>::Make(
                                        b, heads * n_cols_ * d,
                                        "partial key weights"));
    IG_ASSIGN_OR_RETURN(
        partial_k_,
        DeviceBuffer<uint8_t>::Make(
            b, heads * z.max_seq * row_bytes_, "the partial key cache"));
    if (format_ == speculator::PartialKeyFormat::kInt4) {
      IG_ASSIGN_OR_RETURN(new_partial_k_,
                          DeviceBuffer<float>::Make(b, z.max_seq * n_cols_,
                                                    "new partial keys"));
    }
    IG_ASSIGN_OR_RETURN(q_, DeviceBuffer<float>::Make(b, z.q_dim,
                                                      "speculated queries"));
    IG_ASSIGN_OR_RETURN(q_skewed_, DeviceBuffer<float>::Make(
                                       b, z.q_dim, "speculated queries"));
    IG_ASSIGN_OR_RETURN(scores_, DeviceBuffer<float>::Make(
                                     b, z.n_heads * z.max_seq,
                                     "speculated scores"));
    head_scores_host_.assign(z.n_heads * z.max_seq, 0.0f);
    scores_host_.assign(z.n_kv * z.max_seq, 0.0f);
    IG_ASSIGN_OR_RETURN(position_,
                        DeviceBuffer<int>::Make(b, 1, "speculated position"));
    present_.reserve(z.n_kv * z.max_seq);
    if (options_.adaptive_budgets) {
      const speculator::HeadProfile& pr = *options_.profile;
      if (pr.n_layers != m.n_layers || pr.n_kv_heads != m.n_kv_heads) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the head profile is for %d layers x %d KV heads, the model has "
            "%d x %d", pr.n_layers, pr.n_kv_heads, m.n_layers,
            m.n_kv_heads));
      }
      // InfiniGen's selection is judged by the errors of its own ranking;
      // the oracle's (and a same-layer diagnostic's) by the exact one.
      const bool exact = options_.kind == PolicyKind::kOracle ||
                         options_.same_layer_input;
      head_budgets_ = speculator::AllocateBudgets(
          pr, exact ? pr.error : pr.speculated_error, options_.budget,
          options_.dense_layers, options_.budget_floor * options_.budget);
    }
    row_.resize(d);
    k_sums_.resize(d);
    return absl::OkStatus();
  }

  void Reset() override {
    std::fill(col_sums_.begin(), col_sums_.end(), 0.0f);
    std::fill(k_col_sums_.begin(), k_col_sums_.end(), 0.0f);
  }

  void ObservePrefill(int layer, const float* q, const float* k, int n,
                      int first_pos, const float* prob_sums) override {
    const model::ModelConfig& m = config();
    const size_t d = m.head_dim;
    Accumulate(layer, q, k, n, ColSums(layer, 0),
               k_col_sums_.data() + Head(layer, 0) * d, row_.data());
  }

  // Per layer: the summed |q A| of each KV head's columns, then (with
  // rank_columns_by_keys) the summed |k A|.
  int PrefixStateFloats() const override {
    const model::ModelConfig& m = config();
    return m.n_kv_heads * m.head_dim * (options_.rank_columns_by_keys ? 2 : 1);
  }
  void SummarizePrefill(int layer, const float* q, const float* k, int n,
                        float* out) const override {
    const model::ModelConfig& m = config();
    std::vector<float> row(m.head_dim);
    Accumulate(layer, q, k, n, out,
               out + static_cast<size_t>(m.n_kv_heads) * m.head_dim,
               row.data());
  }
  void AddPrefixState(int layer, const float* state) override {
    const model::ModelConfig& m = config();
    const size_t n = static_cast<size_t>(m.n_kv_heads) * m.head_dim;
    float* q_sums = ColSums(layer, 0);
    for (size_t i = 0; i < n; ++i) q_sums[i] += state[i];
    if (!options_.rank_columns_by_keys) return;
    float* k_sums = k_col_sums_.data() + Head(layer, 0) * m.head_dim;
    for (size_t i = 0; i < n; ++i) k_sums[i] += state[n + i];
  }

  // Partial columns rank by the summed |q A| over the prompt (times the
  // summed |k A| with rank_columns_by_keys): adds n tokens' magnitudes to
  // q_sums [n_kv_heads][d] and k_sums (the same), using row [d].
  void Accumulate(int layer, const float* q, const float* k, int n,
                  float* q_sums, float* k_sums, float* row) const {
    const model::ModelConfig& m = config();
    const int d = m.head_dim, group = m.n_heads / m.n_kv_heads;
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < m.n_heads; ++h) {
        const int g = h / group;
        speculator::ApplySkew(q + (static_cast<size_t>(i) * m.n_heads + h) * d,
                              1, skew_.at(layer, g), d, row);
        float* sums = q_sums + static_cast<size_t>(g) * d;
        for (int c = 0; c < d; ++c) sums[c] += std::fabs(row[c]);
      }
    }
    if (!options_.rank_columns_by_keys) return;
    for (int g = 0; g < m.n_kv_heads; ++g) {
      float* sums = k_sums + static_cast<size_t>(g) * d;
      for (int i = 0; i < n; ++i) {
        speculator::ApplySkew(
            k + (static_cast<size_t>(i) * m.n_kv_heads + g) * d, 1,
            skew_.at(layer, g), d, row);
        for (int c = 0; c < d; ++c) sums[c] += std::fabs(row[c]);
      }
    }
  }

  absl::Status FinishPrefillLayer(int l, int n_tokens, const float* keys,
                                  int key_stride) override {
    const model::ModelConfig& m = config();
    const int d = m.head_dim;
    if (options_.rank_columns_by_keys) {
      for (int g = 0; g < m.n_kv_heads; ++g) {
        const float* k_sums = k_col_sums_.data() + Head(l, g) * d;
        float* sums = ColSums(l, g);
        for (int c = 0; c < d; ++c) sums[c] *= k_sums[c];
      }
    }
    // Each KV head's column sums as one "token" whose heads are the KV
    // heads: SelectPartialColumns then ranks each head's columns alone.
    speculator::SelectPartialColumns(
        ColSums(l, 0), 1, m.n_kv_heads, m.n_kv_heads, d, n_cols_,
        cols_.cols.data() + Head(l, 0) * n_cols_);
    for (int g = 0; g < m.n_kv_heads; ++g) {
      // Partial key weight rows: w[c][j] = A[j][cols[c]].
      const int32_t* cols = cols_.at(l, g);
      const float* a = skew_.at(l, g);
      float* w = partial_w_host_.data() + Head(l, g) * n_cols_ * d;
      for (int c = 0; c < n_cols_; ++c) {
        for (int j = 0; j < d; ++j) w[c * d + j] = a[j * d + cols[c]];
      }
    }
    // This layer's slices of the host arrays are not written again before
    // the next prefill, which waits for these copies.
    Backend& b = *ctx_.backend;
    const size_t first = Head(l, 0), heads = m.n_kv_heads;
    b.CopyFromHost(cols_dev_.data() + first * n_cols_,
                   cols_.cols.data() + first * n_cols_,
                   heads * n_cols_ * sizeof(int32_t), b.MarkIssued());
    b.CopyFromHost(partial_w_.data() + first * n_cols_ * d,
                   partial_w_host_.data() + first * n_cols_ * d,
                   heads * n_cols_ * d * sizeof(float), b.MarkIssued());
    // The prompt's partial keys, one product per KV head, then their
    // 4-bit rows.
    for (int g = 0; g < m.n_kv_heads; ++g) {
      AppendPartialKeys(keys + static_cast<size_t>(g) * key_stride * d,
                        n_tokens, l, g, 0);
    }
    return absl::OkStatus();
  }

  absl::Status PlanFetch(int layer, int p, const float* xb_prev,
                         const uint8_t* present,
                         OwnedFetchPlan& plan) override {
    if (layer < options_.dense_layers || xb_prev == nullptr) {
      PlanAllPresent(p, present, plan);
      return absl::OkStatus();
    }
    const model::ModelConfig& m = config();
    const model::LayerWeights& w = ctx_.weights->layers[layer];
    const int d = m.head_dim, group = m.n_heads / m.n_kv_heads;
    Backend& b = *ctx_.backend;
    // The approximate query of `layer` from the previous layer's input,
    // rotated, then skewed per group. The last copy from position_host_
    // finished: the previous PlanFetch ended with CopyToHost, which waits.
    ProjectQuery(b, m, w, xb_prev, p, &position_host_, position_.data(),
                 q_.data());
    for (int g = 0; g < m.n_kv_heads; ++g) {
      const size_t at = static_cast<size_t>(g) * group * d;
      b.Linear(q_.data() + at, group, d, SkewT(layer, g), nullptr, d,
               q_skewed_.data() + at);
    }
    // Each query head's speculated logits over its KV head's partial keys
    // [n_heads][p] (each row read once for its group), then per KV head the
    // largest of its heads' log-softmax (speculator::CombineHeadScores).
    SpeculationParams sp;
    sp.q_skewed = q_skewed_.data();
    sp.partial_k = PartialK(layer, 0);
    sp.cols = cols_dev_.data() + Head(layer, 0) * n_cols_;
    sp.scores = scores_.data();
    sp.n_heads = m.n_heads;
    sp.n_kv_heads = m.n_kv_heads;
    sp.d = d;
    sp.k_stride = ctx_.max_seq_len;
    sp.n_tokens = p;
    sp.n_cols = n_cols_;
    sp.format = format_;
    b.SpeculateScores(sp);
    IG_RETURN_IF_ERROR(b.CopyToHost(
        head_scores_host_.data(), scores_.data(),
        static_cast<size_t>(m.n_heads) * p * sizeof(float)));
    // present is strided by max_seq_len; compact it to [n_kv_heads][p].
    present_.resize(static_cast<size_t>(m.n_kv_heads) * p);
    for (int g = 0; g < m.n_kv_heads; ++g) {
      std::memcpy(present_.data() + static_cast<size_t>(g) * p,
                  present + static_cast<size_t>(g) * ctx_.max_seq_len, p);
    }
    speculator::CombineHeadScores(head_scores_host_.data(), m.n_heads,
                                  m.n_kv_heads, p, present_.data(),
                                  scores_host_.data());
    if (!head_budgets_.empty()) {
      head_k_.resize(m.n_kv_heads);
      for (int g = 0; g < m.n_kv_heads; ++g) {
        head_k_[g] = std::max(
            1, static_cast<int>(static_cast<float>(p) *
                                head_budgets_[Head(layer, g)]));
      }
      speculator::SelectTopKPerHead(scores_host_.data(), m.n_kv_heads, p,
                                    present_.data(), head_k_.data(),
                                    plan.indices, plan.head_offsets);
    } else if (options_.score_mass > 0.0f) {
      speculator::SelectByMass(scores_host_.data(), m.n_kv_heads, p,
                               present_.data(), options_.score_mass,
                               options_.budget, plan.indices,
                               plan.head_offsets);
    } else {
      speculator::SelectionOptions sel;
      sel.alpha = options_.alpha;
      sel.max_fraction = options_.budget;
      speculator::SelectTokens(scores_host_.data(), m.n_kv_heads, p,
                               present_.data(), sel, plan.indices,
                               plan.head_offsets);
    }
    if (options_.sink_tokens > 0 || options_.recent_tokens > 0) {
      AddSinksAndRecent(p, plan);
    }
    return absl::OkStatus();
  }

  // Adds the present sink and recent positions each head's selection
  // lacks (present_ is [kv_head][p]).
  void AddSinksAndRecent(int p, OwnedFetchPlan& plan) {
    const int n_kv = config().n_kv_heads;
    const int sinks = std::min(options_.sink_tokens, p);
    const int recent_from = std::max(sinks, p - options_.recent_tokens);
    std::vector<int32_t> indices;
    std::vector<int32_t> offsets(1, 0);
    indices.reserve(plan.indices.size() +
                    static_cast<size_t>(n_kv) * (sinks + p - recent_from));
    chosen_.assign(p, 0);
    for (int g = 0; g < n_kv; ++g) {
      const uint8_t* present = present_.data() + static_cast<size_t>(g) * p;
      for (int j = plan.head_offsets[g]; j < plan.head_offsets[g + 1]; ++j) {
        indices.push_back(plan.indices[j]);
        chosen_[plan.indices[j]] = 1;
      }
      auto add = [&](int pos) {
        if (present[pos] && !chosen_[pos]) indices.push_back(pos);
      };
      for (int pos = 0; pos < sinks; ++pos) add(pos);
      for (int pos = recent_from; pos < p; ++pos) add(pos);
      for (int j = plan.head_offsets[g]; j < plan.head_offsets[g + 1]; ++j) {
        chosen_[plan.indices[j]] = 0;
      }
      offsets.push_back(static_cast<int32_t>(indices.size()));
    }
    plan.indices.swap(indices);
    plan.head_offsets.swap(offsets);
  }

  void OnDecodeAppend(int layer, int p, const float* key) override {
    const int d = config().head_dim;
    for (int g = 0; g < config().n_kv_heads; ++g) {
      AppendPartialKeys(key + static_cast<size_t>(g) * d, 1, layer, g, p);
    }
  }

  // The partial key rows of n keys [n, head_dim] (KV head g of `layer`) at
  // positions [first, first + n): their partial columns, then (4-bit) their
  // rows.
  void AppendPartialKeys(const float* keys, int n, int layer, int g,
                         int first) {
    Backend& b = *ctx_.backend;
    const int d = config().head_dim;
    uint8_t* rows =
        PartialK(layer, g) + static_cast<size_t>(first) * row_bytes_;
    if (format_ == speculator::PartialKeyFormat::kFloat) {
      b.Linear(keys, n, d, PartialW(layer, g), nullptr, n_cols_,
               reinterpret_cast<float*>(rows));
      return;
    }
    b.Linear(keys, n, d, PartialW(layer, g), nullptr, n_cols_,
             new_partial_k_.data());
    b.QuantizePartialKeys(new_partial_k_.data(), n, n_cols_, rows);
  }

 private:
  size_t Head(int layer, int g) const {
    return static_cast<size_t>(layer) * config().n_kv_heads + g;
  }
  float* ColSums(int layer, int g) {
    return col_sums_.data() + Head(layer, g) * config().head_dim;
  }
  const float* SkewT(int layer, int g) const {
    const size_t d = config().head_dim;
    return skew_t_.data() + Head(layer, g) * d * d;
  }
  float* PartialW(int layer, int g) {
    return partial_w_.data() + Head(layer, g) * n_cols_ * config().head_dim;
  }
  uint8_t* PartialK(int layer, int g) {
    return partial_k_.data() + Head(layer, g) * ctx_.max_seq_len * row_bytes_;
  }

  const std::unique_ptr<const speculator::SkewMatrices> owned_skew_;
  const PolicyOptions options_;
  const speculator::SkewMatrices& skew_;
  const int n_cols_;
  const speculator::PartialKeyFormat format_;
  const int row_bytes_;  // of a partial key row
  // Host:
  std::vector<float> col_sums_;          // [layer][kv_head][d]
  std::vector<float> k_col_sums_;        // [layer][kv_head][d]: sum |k A|
  speculator::PartialColumns cols_;      // [layer][kv_head][n_cols]
  std::vector<uint8_t> present_;         // [kv_head][p]
  std::vector<uint8_t> chosen_;          // [p]: AddSinksAndRecent's marks
  // adaptive_budgets: [layer][kv_head] fractions (AllocateBudgets), and
  // each head's k of the current step.
  std::vector<float> head_budgets_;
  std::vector<int> head_k_;
  std::vector<float> row_;               // [d]
  std::vector<float> k_sums_;            // [d]
  std::vector<float> partial_w_host_;    // partial_w_, built here
  std::vector<float> head_scores_host_;  // scores_, read here
  std::vector<float> scores_host_;       // [kv_head][p]: combined
  int position_host_ = 0;                // position_, written here
  // The backend's device memory:
  DeviceBuffer<int32_t> cols_dev_;   // cols_ for SpeculateScores
  DeviceBuffer<float> skew_t_;       // [layer][kv_head][d][d]: A^T
  DeviceBuffer<float> partial_w_;    // [layer][kv_head][n_cols][d]
  // [layer][kv_head][max_seq] 4-bit rows (speculator/partial_keys.h)
  DeviceBuffer<uint8_t> partial_k_;
  DeviceBuffer<float> new_partial_k_;  // [max_seq][n_cols]: before rows
  DeviceBuffer<float> q_, q_skewed_;  // [n_heads * d]
  DeviceBuffer<float> scores_;       // [head][p]: speculated logits
  DeviceBuffer<int> position_;       // [1]: the speculated query's position
};

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
        budget_(o.budget),
        sink_tokens_(o.sink_tokens),
        recent_tokens_(o.recent_tokens),
        page_(o.page_tokens),
        dense_layers_(o.dense_layers),
        max_pages_((c.max_seq_len + o.page_tokens - 1) / o.page_tokens) {}

  static int64_t StateBytes(const Context& c, const PolicyOptions& o) {
    const model::ModelConfig& m = c.weights->config;
    const int64_t pages = (c.max_seq_len + o.page_tokens - 1) / o.page_tokens;
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
    // Errors of the copy surface at the next PlanFetch's copy.
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

  absl::Status PlanFetch(int layer, int p, const float* x,
                         const uint8_t* present,
                         OwnedFetchPlan& plan) override {
    if (layer < dense_layers_ || x == nullptr) {
      PlanAllPresent(p, present, plan);
      return absl::OkStatus();
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
    return absl::OkStatus();
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

absl::StatusOr<int64_t> KvPolicy::StateBytes(const PolicyOptions& options,
                                              const Context& context) {
  IG_RETURN_IF_ERROR(options.Validate());
  switch (options.kind) {
    case PolicyKind::kIdeal:
      return absl::InvalidArgumentError("ideal has no KvPolicy: it stays local");
    case PolicyKind::kFull:
    case PolicyKind::kInt4:
      return int64_t{0};
    case PolicyKind::kH2O:
      return H2OPolicy::StateBytes(context);
    case PolicyKind::kInfiniGen:
      return InfiniGenPolicy::SizesFor(context, options).Bytes();
    case PolicyKind::kOracle:
      return InfiniGenPolicy::SizesFor(context, OracleOptions(options)).Bytes();
    case PolicyKind::kQuest:
      return QuestPolicy::StateBytes(context, options);
  }
  return absl::InvalidArgumentError("unknown policy");
}

absl::StatusOr<std::unique_ptr<KvPolicy>> KvPolicy::Create(
    const PolicyOptions& options, const Context& context) {
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvPolicy> policy,
                      CreateUninitialized(options, context));
  IG_RETURN_IF_ERROR(policy->Init());
  return policy;
}

absl::StatusOr<std::unique_ptr<KvPolicy>> KvPolicy::CreateUninitialized(
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
    case PolicyKind::kOracle:
      return std::unique_ptr<KvPolicy>(new InfiniGenPolicy(
          context, OracleOptions(options),
          std::make_unique<const speculator::SkewMatrices>(
              speculator::SkewMatrices::Identity(m.n_layers, m.n_kv_heads,
                                                 m.head_dim))));
    case PolicyKind::kQuest:
      return std::unique_ptr<KvPolicy>(new QuestPolicy(context, options));
  }
  return absl::InvalidArgumentError("unknown policy");
}

}  // namespace infinigen::gpu_worker
