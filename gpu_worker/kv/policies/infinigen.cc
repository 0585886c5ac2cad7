#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/half.h"
#include "common/status.h"
#include "gpu_worker/kv/policies/infinigen.h"
#include "gpu_worker/kv/policies/policy_util.h"
#include "speculator/partial_keys.h"
#include "gpu_worker/kv/policies/registry.h"

namespace infinigen::gpu_worker {
namespace {

using kv_memory_service::FetchPlan;
using kv_memory_service::OwnedFetchPlan;

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
// its memory. Where each head takes its top k (the cap alone, alpha off, as
// --target_fetch sets it; or adaptive budgets) the selection runs there too
// (PlanFetchOnBackend: nothing comes back to the host); the alpha rule,
// score mass, sinks and recent tokens, and evicted positions select on the
// host from the scores copied back. Choosing the partial columns (once per
// prompt, where fewer than every column are kept) runs on the host.
class InfiniGenPolicy final : public KvPolicy, private PrefixSummary {
 public:
  // `owned_skew`: the skew to use instead of o.skew (the oracle's identity).
  InfiniGenPolicy(
      const Context& c, const PolicyOptions& o,
      std::unique_ptr<const speculator::SkewMatrices> owned_skew = nullptr)
      : KvPolicy(c),
        owned_skew_(std::move(owned_skew)),
        options_(o),
        skew_(owned_skew_ != nullptr ? *owned_skew_ : *o.infinigen.skew),
        n_cols_(speculator::PartialColumnCount(c.weights->config.head_dim,
                                               o.infinigen.partial_ratio)),
        format_(KeyFormat(o)),
        row_bytes_(speculator::PartialKeyRowBytes(n_cols_, format_)) {
    // Where every column is kept the prompt chooses none: nothing to
    // observe or to summarize.
    set_observes_prefill(SelectsColumns());
    set_prefix_summary(SelectsColumns() ? this : nullptr);
  }

  // The exact diagnostics (the oracle, same_layer_input,
  // exact_partial_keys) rank by fp32 partial keys; infinigen keeps 4-bit
  // rows (speculator/partial_keys.h).
  static speculator::PartialKeyFormat KeyFormat(const PolicyOptions& o) {
    return o.SpeculatesFromOwnInput() || o.infinigen.exact_partial_keys
               ? speculator::PartialKeyFormat::kFloat
               : speculator::PartialKeyFormat::kInt4;
  }

  // Every buffer below, in bytes, for StateBytes and Init alike.
  struct Sizes {
    size_t heads, d, n_cols, max_seq, q_dim, n_kv, n_heads;
    speculator::PartialKeyFormat format;
    bool combined;  // GQA heads' rank combined on the backend
    int64_t Bytes() const {
      return static_cast<int64_t>(
          2 * heads * d * sizeof(float) +             // col_sums_, k_col_sums_
          3 * 2 * n_kv * d * sizeof(float) +          // prompt_sums_ (+host),
                                                      // summary_sums_
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
          (combined ? n_kv * max_seq * sizeof(float) : 0) +
                                                      // combined_
          n_kv * max_seq * (sizeof(float) + 1) +      // scores_host_, present_
          sizeof(int));                               // position_
    }
  };
  static Sizes SizesFor(const Context& c, const PolicyOptions& o) {
    const model::ModelConfig& m = c.weights->config;
    Sizes z;
    z.heads = static_cast<size_t>(m.n_layers) * m.n_kv_heads;
    z.d = m.head_dim;
    z.n_cols =
        speculator::PartialColumnCount(m.head_dim, o.infinigen.partial_ratio);
    z.max_seq = c.max_seq_len;
    z.q_dim = m.q_dim();
    z.n_kv = m.n_kv_heads;
    z.n_heads = m.n_heads;
    z.format = KeyFormat(o);
    z.combined = m.n_heads > m.n_kv_heads && SelectsOnBackend(o);
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
    // The prompt's sums of one layer: [n_kv_heads][d] of |q A|, then as
    // many of |k A|.
    const size_t sum_floats = 2 * z.n_kv * d;
    prompt_sums_host_.assign(sum_floats, 0.0f);
    IG_ASSIGN_OR_RETURN(prompt_sums_, DeviceBuffer<float>::Make(
                                          b, sum_floats, "prompt sums"));
    IG_ASSIGN_OR_RETURN(summary_sums_, DeviceBuffer<float>::Make(
                                           b, sum_floats, "prompt sums"));
    ZeroPromptSums();
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
    if (z.combined) {
      IG_ASSIGN_OR_RETURN(combined_, DeviceBuffer<float>::Make(
                                         b, z.n_kv * z.max_seq,
                                         "combined scores"));
    }
    head_scores_host_.assign(z.n_heads * z.max_seq, 0.0f);
    scores_host_.assign(z.n_kv * z.max_seq, 0.0f);
    IG_ASSIGN_OR_RETURN(position_,
                        DeviceBuffer<int>::Make(b, 1, "speculated position"));
    present_.reserve(z.n_kv * z.max_seq);
    if (options_.infinigen.adaptive_budgets) {
      const speculator::HeadProfile& pr = *options_.infinigen.profile;
      if (pr.n_layers != m.n_layers || pr.n_kv_heads != m.n_kv_heads) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the head profile is for %d layers x %d KV heads, the model has "
            "%d x %d", pr.n_layers, pr.n_kv_heads, m.n_layers,
            m.n_kv_heads));
      }
      // InfiniGen's selection is judged by the errors of its own ranking;
      // the oracle's (and a same-layer diagnostic's) by the exact one.
      const bool exact = options_.kind == PolicyKind::kOracle ||
                         options_.infinigen.same_layer_input;
      head_budgets_ = speculator::AllocateBudgets(
          pr, exact ? pr.error : pr.speculated_error, options_.selection.budget,
          options_.selection.dense_layers,
          options_.infinigen.budget_floor * options_.selection.budget);
    }
    return absl::OkStatus();
  }

  void Reset() override {
    std::fill(col_sums_.begin(), col_sums_.end(), 0.0f);
    std::fill(k_col_sums_.begin(), k_col_sums_.end(), 0.0f);
    if (SelectsColumns()) ZeroPromptSums();
  }

  // The prompt's column sums choose each head's partial columns; where
  // every column is kept (partial_ratio 1, as --target_fetch sets it) they
  // choose nothing, and the prompt is not observed at all.
  bool SelectsColumns() const { return n_cols_ < config().head_dim; }

  void ObservePrefill(int layer, const float* q, const float* k, int n,
                      int first_pos, const float* prob_sums) override {
    if (!SelectsColumns()) return;
    AddColumnSums(layer, q, k, n, prompt_sums_.data());
  }

  // Per layer: the summed |q A| of each KV head's columns, then (with
  // rank_columns_by_keys) the summed |k A|.
  int floats() const override {
    if (!SelectsColumns()) return 0;
    const model::ModelConfig& m = config();
    return m.n_kv_heads * m.head_dim *
           (options_.infinigen.rank_columns_by_keys ? 2 : 1);
  }
  absl::Status Summarize(int layer, const float* q, const float* k, int n,
                         float* out) override {
    // out on the host: through the device's scratch and back, the same
    // sums in the same order as on the host.
    Backend& b = *ctx_.backend;
    const size_t bytes = floats() * sizeof(float);
    b.CopyFromHost(summary_sums_.data(), out, bytes, b.MarkIssued());
    AddColumnSums(layer, q, k, n, summary_sums_.data());
    return b.CopyToHost(out, summary_sums_.data(), bytes);
  }
  void Add(int layer, const float* state) override {
    const model::ModelConfig& m = config();
    const size_t n = static_cast<size_t>(m.n_kv_heads) * m.head_dim;
    float* q_sums = ColSums(layer, 0);
    for (size_t i = 0; i < n; ++i) q_sums[i] += state[i];
    if (!options_.infinigen.rank_columns_by_keys) return;
    float* k_sums = k_col_sums_.data() + Head(layer, 0) * m.head_dim;
    for (size_t i = 0; i < n; ++i) k_sums[i] += state[n + i];
  }

  // Partial columns rank by the summed |q A| over the prompt (times the
  // summed |k A| with rank_columns_by_keys): adds n prefill tokens'
  // magnitudes (q [n, n_heads, d], k [n, n_kv_heads, d], backend memory)
  // to sums [floats()] in backend memory, the queries' per KV head, then
  // the keys'. The backend computes them where the rows are.
  void AddColumnSums(int layer, const float* q, const float* k, int n,
                     float* sums) {
    const model::ModelConfig& m = config();
    const int d = m.head_dim, group = m.n_heads / m.n_kv_heads;
    Backend& b = *ctx_.backend;
    b.AddSkewedColumnSums(q, n, m.n_heads, group, d, SkewT(layer, 0), sums);
    if (options_.infinigen.rank_columns_by_keys) {
      b.AddSkewedColumnSums(k, n, m.n_kv_heads, 1, d, SkewT(layer, 0),
                            sums + static_cast<size_t>(m.n_kv_heads) * d);
    }
  }

  // The layer's prompt sums, added up on the backend over its chunks, join
  // the host's (which hold a reused prefix's), and the backend's start
  // again from zero for the next layer.
  absl::Status TakePromptSums(int l) {
    if (!SelectsColumns()) return absl::OkStatus();
    const model::ModelConfig& m = config();
    const size_t n = static_cast<size_t>(m.n_kv_heads) * m.head_dim;
    Backend& b = *ctx_.backend;
    IG_RETURN_IF_ERROR(b.CopyToHost(prompt_sums_host_.data(),
                                    prompt_sums_.data(),
                                    prompt_sums_host_.size() * sizeof(float)));
    float* q_sums = ColSums(l, 0);
    for (size_t i = 0; i < n; ++i) q_sums[i] += prompt_sums_host_[i];
    if (options_.infinigen.rank_columns_by_keys) {
      float* k_sums = k_col_sums_.data() + Head(l, 0) * m.head_dim;
      for (size_t i = 0; i < n; ++i) k_sums[i] += prompt_sums_host_[n + i];
    }
    ZeroPromptSums();
    return absl::OkStatus();
  }
  // The backend's sums start from the host side's zeros (which stay until
  // the next TakePromptSums, whose CopyToHost waits for this copy).
  void ZeroPromptSums() {
    Backend& b = *ctx_.backend;
    std::fill(prompt_sums_host_.begin(), prompt_sums_host_.end(), 0.0f);
    b.CopyFromHost(prompt_sums_.data(), prompt_sums_host_.data(),
                   prompt_sums_host_.size() * sizeof(float), b.MarkIssued());
  }

  absl::Status FinishPrefillLayer(int l, int n_tokens, const float* keys,
                                  int key_stride) override {
    const model::ModelConfig& m = config();
    const int d = m.head_dim;
    IG_RETURN_IF_ERROR(TakePromptSums(l));
    if (options_.infinigen.rank_columns_by_keys) {
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
    // The prompt's partial keys (the KV heads' products batched), then
    // their 4-bit rows.
    AppendPartialKeys(keys, static_cast<long>(key_stride) * d, n_tokens, l,
                      0);
    return absl::OkStatus();
  }

  absl::StatusOr<PlanMade> Plan(const PlanRequest& r,
                                OwnedFetchPlan& plan) override {
    if (PlansEveryRow(r.layer, r.input)) return PlanEveryRow(r, plan);
    if (r.backend_indices != nullptr) {
      IG_ASSIGN_OR_RETURN(const bool made,
                          PlanOnBackend(r.layer, r.p, r.input,
                                        r.backend_indices, plan.head_offsets));
      if (made) return PlanMade::kOnBackend;
    }
    IG_RETURN_IF_ERROR(PlanOnHost(r.layer, r.p, r.input, r.present, plan));
    return PlanMade::kIndices;
  }

  // Dense layers, and layer 0 before its input is known, read every row.
  bool PlansEveryRow(int layer, const float* xb_prev) const {
    return layer < options_.selection.dense_layers || xb_prev == nullptr;
  }

  // The speculated plan on the host.
  absl::Status PlanOnHost(int layer, int p, const float* xb_prev,
                          const uint8_t* present, OwnedFetchPlan& plan) {
    if (PlansEveryRow(layer, xb_prev)) {
      PlanAllPresent(p, present, plan);
      return absl::OkStatus();
    }
    const model::ModelConfig& m = config();
    const int group = m.n_heads / m.n_kv_heads;
    Backend& b = *ctx_.backend;
    IG_RETURN_IF_ERROR(Speculate(layer, p, xb_prev));
    IG_RETURN_IF_ERROR(b.CopyToHost(
        head_scores_host_.data(), scores_.data(),
        static_cast<size_t>(m.n_heads) * p * sizeof(float)));
    // present is strided by max_seq_len; compact it to [n_kv_heads][p].
    present_.resize(static_cast<size_t>(m.n_kv_heads) * p);
    for (int g = 0; g < m.n_kv_heads; ++g) {
      std::memcpy(present_.data() + static_cast<size_t>(g) * p,
                  present + static_cast<size_t>(g) * ctx_.max_seq_len, p);
    }
    // A KV head of one query head ranks its own logits: the log-softmax
    // would shift them by a constant, and every selection below depends on
    // differences only (top k, within alpha of the max, softmax mass).
    const speculator::TaskRunner* run =
        speculator::HostTasks(static_cast<size_t>(m.n_heads) * p);
    const float* scores = head_scores_host_.data();
    if (group > 1) {
      speculator::CombineHeadScores(head_scores_host_.data(), m.n_heads,
                                    m.n_kv_heads, p, present_.data(),
                                    scores_host_.data(), run);
      scores = scores_host_.data();
    }
    if (RanksTopK()) {
      HeadCounts(layer, p, head_k_);
      speculator::SelectTopKPerHead(scores, m.n_kv_heads, p,
                                    present_.data(), head_k_.data(),
                                    plan.indices, plan.head_offsets, run);
    } else if (options_.infinigen.score_mass > 0.0f) {
      speculator::SelectByMass(scores, m.n_kv_heads, p, present_.data(),
                               options_.infinigen.score_mass,
                               options_.selection.budget, plan.indices,
                               plan.head_offsets);
    } else {
      speculator::SelectionOptions sel;
      sel.alpha = options_.infinigen.alpha;
      sel.max_fraction = options_.selection.budget;
      speculator::SelectTokens(scores, m.n_kv_heads, p,
                               present_.data(), sel, plan.indices,
                               plan.head_offsets, run);
    }
    if (options_.selection.sink_tokens > 0 ||
        options_.selection.recent_tokens > 0) {
      AddSinksAndRecent(p, plan);
    }
    return absl::OkStatus();
  }

  // Each head takes its top k: adaptive budgets, or the cap alone (alpha
  // off, kAlphaOff: SelectTokens' k would be the cap), with no score mass.
  static bool RanksTopK(const PolicyOptions& o) {
    return o.infinigen.adaptive_budgets ||
           (o.infinigen.score_mass == 0.0f && o.infinigen.alpha >= kAlphaOff);
  }
  bool RanksTopK() const { return RanksTopK(options_); }
  // Whether the backend selects (PlanFetchOnBackend): top k, no sink or
  // recent tokens to add.
  static bool SelectsOnBackend(const PolicyOptions& o) {
    return RanksTopK(o) && o.selection.sink_tokens == 0 &&
           o.selection.recent_tokens == 0;
  }

  // Each KV head's k at `layer` with positions [0, p) cached (RanksTopK;
  // at most p).
  void HeadCounts(int layer, int p, std::vector<int>& k) const {
    const int n_kv = config().n_kv_heads;
    k.resize(n_kv);
    for (int g = 0; g < n_kv; ++g) {
      const float budget = head_budgets_.empty()
                               ? options_.selection.budget
                               : head_budgets_[Head(layer, g)];
      k[g] = std::min(
          p, std::max(1, static_cast<int>(static_cast<float>(p) * budget)));
    }
  }

  int MaxBackendPlanRows(int p) const override {
    if (!SelectsOnBackend(options_)) return 0;
    float budget = options_.selection.budget;
    for (float b : head_budgets_) budget = std::max(budget, b);
    return std::min(
        p, std::max(1, static_cast<int>(static_cast<float>(p) * budget)));
  }

  // The speculated plan made on the backend: its indices to `indices`,
  // its head offsets here; false, having done nothing, where the policy
  // cannot (the alpha rule, score mass, sink or recent tokens).
  absl::StatusOr<bool> PlanOnBackend(int layer, int p, const float* xb_prev,
                                     int32_t* indices,
                                     std::vector<int32_t>& head_offsets) {
    if (PlansEveryRow(layer, xb_prev) || p <= 0 ||
        !SelectsOnBackend(options_)) {
      return false;
    }
    const model::ModelConfig& m = config();
    IG_RETURN_IF_ERROR(Speculate(layer, p, xb_prev));
    HeadCounts(layer, p, head_k_);
    head_offsets.assign(m.n_kv_heads + 1, 0);
    for (int g = 0; g < m.n_kv_heads; ++g) {
      head_offsets[g + 1] = head_offsets[g] + head_k_[g];
    }
    TopKParams t;
    t.scores = scores_.data();
    t.n_heads = m.n_heads;
    t.n_kv_heads = m.n_kv_heads;
    t.n_tokens = p;
    t.head_offsets = head_offsets.data();
    t.indices = indices;
    t.combined = combined_.data();
    t.run = speculator::HostTasks(static_cast<size_t>(m.n_heads) * p);
    ctx_.backend->SelectTopK(t);
    return true;
  }

  // The speculated logits of `layer`'s query heads over positions [0, p)
  // into scores_ [n_heads][p]: the approximate query from the previous
  // layer's input, rotated, skewed per KV head, against the partial keys.
  absl::Status Speculate(int layer, int p, const float* xb_prev) {
    const model::ModelConfig& m = config();
    const model::LayerWeights& w = ctx_.weights->layers[layer];
    const int d = m.head_dim, group = m.n_heads / m.n_kv_heads;
    Backend& b = *ctx_.backend;
    // The last copy from position_host_ must have read it.
    IG_RETURN_IF_ERROR(b.WaitCopies());
    ProjectQuery(b, m, w, xb_prev, p, &position_host_, position_.data(),
                 q_.data());
    const long head_q = static_cast<long>(group) * d;
    b.LinearBatched(q_.data(), head_q, group, d, SkewT(layer, 0),
                    static_cast<long>(d) * d, d, q_skewed_.data(), head_q,
                    m.n_kv_heads);
    // Each query head's speculated logits over its KV head's partial keys
    // [n_heads][p] (each row read once for its group).
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
    return absl::OkStatus();
  }

  // Adds the present sink and recent positions each head's selection
  // lacks (present_ is [kv_head][p]).
  void AddSinksAndRecent(int p, OwnedFetchPlan& plan) {
    const int n_kv = config().n_kv_heads;
    const int sinks = std::min(options_.selection.sink_tokens, p);
    const int recent_from =
        std::max(sinks, p - options_.selection.recent_tokens);
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
    AppendPartialKeys(key, config().head_dim, 1, layer, p);
  }

  // The partial key rows of n keys of every KV head of `layer` at
  // positions [first, first + n), head g's keys [n, head_dim] at keys + g *
  // key_stride: their partial columns (the heads' products as one batched
  // operation, as many heads at a time as new_partial_k_ holds), then
  // (4-bit) their rows.
  void AppendPartialKeys(const float* keys, long key_stride, int n, int layer,
                         int first) {
    Backend& b = *ctx_.backend;
    const int d = config().head_dim, n_kv = config().n_kv_heads;
    const long w_stride = static_cast<long>(n_cols_) * d;
    const long head_bytes = static_cast<long>(ctx_.max_seq_len) * row_bytes_;
    const size_t at = static_cast<size_t>(first) * row_bytes_;
    if (format_ == speculator::PartialKeyFormat::kFloat) {
      b.LinearBatched(keys, key_stride, n, d, PartialW(layer, 0), w_stride,
                      n_cols_, reinterpret_cast<float*>(PartialK(layer, 0) + at),
                      head_bytes / static_cast<long>(sizeof(float)), n_kv);
      return;
    }
    const int per = std::max(1, std::min(n_kv, ctx_.max_seq_len / n));
    for (int g0 = 0; g0 < n_kv; g0 += per) {
      const int heads = std::min(per, n_kv - g0);
      b.LinearBatched(keys + g0 * key_stride, key_stride, n, d,
                      PartialW(layer, g0), w_stride, n_cols_,
                      new_partial_k_.data(), static_cast<long>(n) * n_cols_,
                      heads);
      if (n == 1) {
        // One row per head: every head's row in one call, a head apart.
        b.QuantizePartialKeys(new_partial_k_.data(), heads, n_cols_,
                              PartialK(layer, g0) + at, head_bytes);
        continue;
      }
      for (int g = g0; g < g0 + heads; ++g) {
        b.QuantizePartialKeys(
            new_partial_k_.data() + static_cast<size_t>(g - g0) * n * n_cols_,
            n, n_cols_, PartialK(layer, g) + at, row_bytes_);
      }
    }
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
  std::vector<float> partial_w_host_;    // partial_w_, built here
  std::vector<float> prompt_sums_host_;  // prompt_sums_, read here
  std::vector<float> head_scores_host_;  // scores_, read here
  std::vector<float> scores_host_;       // [kv_head][p]: combined
  int position_host_ = 0;                // position_, written here
  // The backend's device memory:
  DeviceBuffer<int32_t> cols_dev_;   // cols_ for SpeculateScores
  DeviceBuffer<float> skew_t_;       // [layer][kv_head][d][d]: A^T
  // A layer's prompt sums as its chunks add them, and a prefix block's
  // ([2][n_kv_heads][d] each).
  DeviceBuffer<float> prompt_sums_, summary_sums_;
  DeviceBuffer<float> partial_w_;    // [layer][kv_head][n_cols][d]
  // [layer][kv_head][max_seq] 4-bit rows (speculator/partial_keys.h)
  DeviceBuffer<uint8_t> partial_k_;
  DeviceBuffer<float> new_partial_k_;  // [max_seq][n_cols]: before rows
  DeviceBuffer<float> q_, q_skewed_;  // [n_heads * d]
  DeviceBuffer<float> scores_;       // [head][p]: speculated logits
  DeviceBuffer<float> combined_;     // [kv_head][p]: GQA's combined rank
  DeviceBuffer<int> position_;       // [1]: the speculated query's position
};

}  // namespace

std::unique_ptr<KvPolicy> NewInfiniGenPolicy(
    const KvPolicy::Context& context, const PolicyOptions& o,
    std::unique_ptr<const speculator::SkewMatrices> owned_skew) {
  return std::make_unique<InfiniGenPolicy>(context, o, std::move(owned_skew));
}

int64_t InfiniGenStateBytes(const KvPolicy::Context& context,
                            const PolicyOptions& o) {
  return InfiniGenPolicy::SizesFor(context, o).Bytes();
}

namespace {

absl::StatusOr<std::unique_ptr<KvPolicy>> MakeInfiniGen(
    const PolicyOptions& o, const KvPolicy::Context& c) {
  const model::ModelConfig& m = c.weights->config;
  IG_RETURN_IF_ERROR(
      o.infinigen.skew->CheckShape(m.n_layers, m.n_kv_heads, m.head_dim));
  return NewInfiniGenPolicy(c, o);
}

absl::StatusOr<int64_t> InfiniGenBytes(const PolicyOptions& o,
                                       const KvPolicy::Context& c) {
  return InfiniGenStateBytes(c, o);
}

}  // namespace

constexpr const char* kInfiniGenFlags[] = {
    "budget", "target_fetch", "dense_layers", "sink_tokens", "recent_tokens",
    "alpha", "partial_ratio", "partial_key_bits", "speculate_from",
    "partial_rank", "same_layer_input", "score_mass", "head_budgets",
    "budget_floor", "skew", "calibration_tokens",
};

// extern: registry.cc lists it.
extern const PolicyEntry kInfiniGenPolicy = {
    PolicyKind::kInfiniGen, "infinigen",
    "layer i speculates which tokens layer i + 1 needs (partial query "
    "weight and partial keys after an SVD skew); only those are fetched",
    PolicyTraits().Selects().Speculates().AdaptiveBudgets(),
    &SetSelectedLayersTargetFetch, &MakeInfiniGen, &InfiniGenBytes,
    &ValidateSelectionAndInfiniGen, kInfiniGenFlags,
};

}  // namespace infinigen::gpu_worker
