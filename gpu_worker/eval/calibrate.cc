#include "gpu_worker/eval/calibrate.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "speculator/partial_keys.h"

namespace infinigen::gpu_worker {

namespace {

// InfiniGen's speculation of layer l over every calibration token at once,
// for the profile: the query from layer l - 1's input (its attention norm;
// own_norm: layer l's attention norm, of the residual after layer l - 1's
// attention, or of layer 0's own input), then layer l's query projection
// and rotation, skewed, with the columns outside layer l's partial columns
// zeroed, and the skewed keys with their partial columns as the 4-bit
// partial key cache reads them back (unless exact_keys), so that q() . k()
// is the speculated score. Partial columns as the policy chooses them: the
// largest summed |q A| of layer l's own queries.
class SpeculatedRanking {
 public:
  SpeculatedRanking(const model::Weights& weights,
                    const speculator::SkewMatrices& skew, int n,
                    double partial_ratio, bool exact_keys)
      : weights_(weights),
        skew_(skew),
        n_(n),
        n_cols_(speculator::PartialColumnCount(weights.config.head_dim,
                                               partial_ratio)),
        exact_keys_(exact_keys),
        cpu_(NewCpuBackend()),
        positions_(n),
        xb_(static_cast<size_t>(n) * weights.config.dim),
        q_(static_cast<size_t>(n) * weights.config.q_dim()),
        q_own_(q_.size()),
        q_skewed_(q_.size()),
        k_(static_cast<size_t>(n) * weights.config.kv_dim()),
        cols_(static_cast<size_t>(weights.config.n_kv_heads) * n_cols_) {
    for (int t = 0; t < n; ++t) positions_[t] = t;
  }

  // x_prev [n, dim]: layer l - 1's input, or with own_norm the residual
  // after its attention (layer 0: its own input); q [n, q_dim], k [n,
  // kv_dim]: layer l's post-RoPE queries and keys.
  void Compute(int l, const float* x_prev, bool own_norm, const float* q,
               const float* k) {
    const model::ModelConfig& c = weights_.config;
    const model::LayerWeights& pw = weights_.layers[own_norm ? l : l - 1];
    const model::LayerWeights& w = weights_.layers[l];
    const int d = c.head_dim, group = c.n_heads / c.n_kv_heads;
    const bool opt = c.arch == model::Architecture::kOpt;
    if (opt) {
      cpu_->LayerNorm(x_prev, n_, c.dim, pw.attn_norm.data(),
                      pw.attn_norm_bias.data(), c.norm_eps, xb_.data());
    } else {
      cpu_->RmsNorm(x_prev, n_, c.dim, pw.attn_norm.data(), c.norm_eps,
                    xb_.data());
    }
    cpu_->Linear(xb_.data(), n_, c.dim, w.wq.data(),
                 opt ? w.bq.data() : nullptr, c.q_dim(), q_.data());
    if (!opt) {
      cpu_->Rope(q_.data(), n_, c.n_heads, d, positions_.data(),
                 c.rope_theta);
    }
    // Each head's rows skewed by its KV head's A, one product per head.
    const size_t q_rows = static_cast<size_t>(n_) * c.n_heads;
    const int q_width = c.q_dim(), k_width = c.kv_dim();
    for (int h = 0; h < c.n_heads; ++h) {
      const float* a = skew_.at(l, h / group);
      speculator::ApplySkew(q_.data() + h * d, n_, q_width, a, d,
                            q_skewed_.data() + h * d, q_width);
      speculator::ApplySkew(q + h * d, n_, q_width, a, d,
                            q_own_.data() + h * d, q_width);
    }
    q_.swap(q_skewed_);
    speculator::SelectPartialColumns(q_own_.data(), n_, c.n_heads,
                                     c.n_kv_heads, d, n_cols_, cols_.data());
    std::vector<uint8_t> keep(static_cast<size_t>(c.n_kv_heads) * d, 0);
    for (int g = 0; g < c.n_kv_heads; ++g) {
      for (int j = 0; j < n_cols_; ++j) keep[g * d + cols_[g * n_cols_ + j]] = 1;
    }
    for (size_t r = 0; r < q_rows; ++r) {
      const uint8_t* kg = keep.data() + (r % c.n_heads) / group * d;
      for (int j = 0; j < d; ++j) {
        if (!kg[j]) q_[r * d + j] = 0.0f;
      }
    }
    // The skewed keys, their partial columns as the partial key cache
    // reads them back (4-bit rows).
    const size_t k_rows = static_cast<size_t>(n_) * c.n_kv_heads;
    std::vector<float> partial(n_cols_);
    std::vector<uint8_t> quantized(speculator::PartialKeyRowBytes(n_cols_));
    for (int g = 0; g < c.n_kv_heads; ++g) {
      speculator::ApplySkew(k + g * d, n_, k_width, skew_.at(l, g), d,
                            k_.data() + g * d, k_width);
    }
    if (exact_keys_) return;
    for (size_t r = 0; r < k_rows; ++r) {
      const int g = static_cast<int>(r % c.n_kv_heads);
      float* kr = k_.data() + r * d;
      const int32_t* cols = cols_.data() + static_cast<size_t>(g) * n_cols_;
      for (int j = 0; j < n_cols_; ++j) partial[j] = kr[cols[j]];
      speculator::QuantizePartialKeys(partial.data(), 1, n_cols_,
                                      quantized.data());
      speculator::DequantizePartialKeys(quantized.data(), 1, n_cols_,
                                        partial.data());
      for (int j = 0; j < n_cols_; ++j) kr[cols[j]] = partial[j];
    }
  }
  const float* q() const { return q_.data(); }
  const float* k() const { return k_.data(); }

 private:
  const model::Weights& weights_;
  const speculator::SkewMatrices& skew_;
  const int n_;
  const int n_cols_;
  const bool exact_keys_;
  std::unique_ptr<Backend> cpu_;
  std::vector<int> positions_;
  std::vector<float> xb_, q_, q_own_, q_skewed_, k_;
  std::vector<int32_t> cols_;
};

}  // namespace

absl::StatusOr<speculator::SkewMatrices> CalibrateSkew(
    const model::Weights& weights, absl::Span<const int> tokens,
    const SpeculationOptions& speculation, std::unique_ptr<Backend> backend,
    const std::function<void(int done, int total)>& progress) {
  const double partial_ratio = speculation.partial_ratio;
  const bool post_attention = speculation.post_attention;
  const model::ModelConfig& c = weights.config;
  const int n = static_cast<int>(tokens.size());
  const int d = c.head_dim, group = c.n_heads / c.n_kv_heads;
  if (n < d) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "calibration needs at least head_dim = %d tokens, got %d", d, n));
  }
  // Per layer, as the engine gives them (prefill chunks appended): queries
  // [n, q_dim], keys and values [n, kv_dim], the residual entering the
  // layer [n, dim], and (post_attention) after its attention.
  class Recorder final : public EngineObserver {
   public:
    Recorder(const model::ModelConfig& c, bool post_attention,
             std::function<void()> layer_done)
        : c_(c),
          post_attention_(post_attention),
          layer_done_(std::move(layer_done)),
          lq(c.n_layers),
          lk(c.n_layers),
          lv(c.n_layers),
          lx(c.n_layers),
          lx_attended(c.n_layers) {}
    void OnLayer(int layer, const float* qs, const float* ks, const float* vs,
                 const float* xs, int m) override {
      // The prefill goes layer by layer, each in chunks: a new layer is a
      // step of the dense pass.
      if (layer != last_layer_) {
        last_layer_ = layer;
        layer_done_();
      }
      Append(lq[layer], qs, m, c_.q_dim());
      Append(lk[layer], ks, m, c_.kv_dim());
      Append(lv[layer], vs, m, c_.kv_dim());
      Append(lx[layer], xs, m, c_.dim);
    }
    bool WantsPostAttention() const override { return post_attention_; }
    void OnPostAttention(int layer, const float* xs, int m) override {
      if (layer + 1 >= c_.n_layers) return;  // no layer to speculate
      Append(lx_attended[layer], xs, m, c_.dim);
    }

   private:
    static void Append(std::vector<float>& to, const float* rows, int m,
                       int width) {
      to.insert(to.end(), rows, rows + static_cast<size_t>(m) * width);
    }
    const model::ModelConfig& c_;
    const bool post_attention_;
    const std::function<void()> layer_done_;
    int last_layer_ = -1;

   public:
    std::vector<std::vector<float>> lq, lk, lv, lx, lx_attended;
  };
  // Steps: each layer of the dense pass, then each layer's skews, then
  // each layer's profile.
  const int steps = 3 * c.n_layers;
  int done = 0;
  auto step = [&] {
    if (progress) progress(++done, steps);
  };
  Recorder recorder(c, post_attention, step);
  const auto& lq = recorder.lq;
  const auto& lk = recorder.lk;
  const auto& lv = recorder.lv;
  const auto& lx = recorder.lx;
  const auto& lx_attended = recorder.lx_attended;
  EngineOptions options;
  options.max_seq_len = n;
  options.observer = &recorder;
  {
    if (backend == nullptr) backend = NewCpuBackend();
    IG_ASSIGN_OR_RETURN(auto engine,
                        Engine::Create(weights, std::move(backend), options));
    IG_RETURN_IF_ERROR(engine->Forward(tokens, false).status());
  }  // the engine and its backend's memory are given back here

  speculator::SkewMatrices skew;
  skew.n_layers = c.n_layers;
  skew.n_kv_heads = c.n_kv_heads;
  skew.head_dim = d;
  const size_t heads = static_cast<size_t>(c.n_layers) * c.n_kv_heads;
  skew.a.resize(heads * d * d);
  // Each KV head's skew from its group's query rows [n * group, d] (every
  // token's group heads, which lie together in the engine's rows) and its
  // key rows [n, d], gathered from the layer's arrays.
  std::vector<float> group_q(static_cast<size_t>(n) * group * d),
      head_k(static_cast<size_t>(n) * d);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int g = 0; g < c.n_kv_heads; ++g) {
      for (int t = 0; t < n; ++t) {
        const float* qs =
            lq[l].data() + (static_cast<size_t>(t) * c.n_heads + g * group) * d;
        std::copy(qs, qs + group * d,
                  group_q.begin() + static_cast<size_t>(t) * group * d);
        const float* ks =
            lk[l].data() + (static_cast<size_t>(t) * c.n_kv_heads + g) * d;
        std::copy(ks, ks + d, head_k.begin() + static_cast<size_t>(t) * d);
      }
      IG_ASSIGN_OR_RETURN(std::vector<float> a,
                          speculator::ComputeSkew(group_q.data(), n * group,
                                                  head_k.data(), n, d));
      std::memcpy(skew.at(l, g), a.data(), a.size() * sizeof(float));
    }
    step();
  }
  // The head profile: queries from the second half of the text, 64 of
  // them, attending causally over everything before them, ranked exactly
  // and as InfiniGen speculates.
  speculator::HeadProfile& profile = skew.profile;
  profile.n_layers = c.n_layers;
  profile.n_kv_heads = c.n_kv_heads;
  profile.partial_ratio = static_cast<float>(partial_ratio);
  profile.fractions = speculator::HeadProfile::DefaultFractions();
  profile.error.assign(heads * profile.fractions.size(), 0.0f);
  profile.speculated_error.assign(profile.error.size(), 0.0f);
  const int first_query = n / 2;
  const int stride = std::max(1, (n - first_query) / 64);
  SpeculatedRanking ranking(weights, skew, n, partial_ratio,
                            speculation.exact_keys);
  const size_t n_f = profile.fractions.size();
  for (int l = 0; l < c.n_layers; ++l) {
    // The dense layers read everything: their speculated error is the
    // exact one (never used). Layer 0 speculates from its own input.
    const bool speculates = l >= speculation.dense_layers;
    if (speculates) {
      const float* from = l == 0           ? lx[0].data()
                          : post_attention ? lx_attended[l - 1].data()
                                           : lx[l - 1].data();
      ranking.Compute(l, from, l == 0 || post_attention, lq[l].data(),
                      lk[l].data());
    }
    speculator::ProfileLayer(
        lq[l].data(), lk[l].data(), lv[l].data(), lx[l].data(),
        speculates ? ranking.q() : nullptr,
        speculates ? ranking.k() : nullptr, n, c.n_heads, c.n_kv_heads, d,
        weights.layers[l].wo.data(), c.dim, profile.fractions, first_query,
        stride, profile.at(l, 0),
        speculates ? profile.speculated_at(l, 0) : nullptr);
    if (!speculates) {
      std::copy(profile.at(l, 0), profile.at(l, 0) + c.n_kv_heads * n_f,
                profile.speculated_at(l, 0));
    }
    step();
  }
  return skew;
}

}  // namespace infinigen::gpu_worker
