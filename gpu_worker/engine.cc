#include "gpu_worker/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

using kv_memory_service::AppendBlock;
using kv_memory_service::AppendResult;
using kv_memory_service::SequenceGeometry;
using model::Architecture;
using model::LayerWeights;
using model::ModelConfig;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const model::Weights& weights, std::unique_ptr<Backend> backend,
    const EngineOptions& options) {
  IG_RETURN_IF_ERROR(weights.Validate());
  if (backend == nullptr) {
    return absl::InvalidArgumentError("engine: no backend");
  }
  const ModelConfig& c = weights.config;
  const int max_seq = options.max_seq_len > 0 ? options.max_seq_len
                                              : c.max_seq_len;
  if (c.arch == Architecture::kOpt && max_seq > c.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "engine: max_seq_len %d exceeds OPT's %d learned positions", max_seq,
        c.max_seq_len));
  }
  if (options.max_chunk <= 0) {
    return absl::InvalidArgumentError("engine: max_chunk must be positive");
  }
  IG_RETURN_IF_ERROR(options.policy.Validate());
  if (options.policy.kind != PolicyKind::kIdeal &&
      options.kv_client == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("engine: policy %s needs a KV memory node",
                        PolicyName(options.policy.kind)));
  }
  if (!(options.kv_capacity > 0.0 && options.kv_capacity <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "engine: kv_capacity must be in (0, 1], got %g", options.kv_capacity));
  }
  if (options.attention_skew != nullptr) {
    IG_RETURN_IF_ERROR(options.attention_skew->CheckShape(
        c.n_layers, c.n_kv_heads, c.head_dim));
  }
  std::unique_ptr<Engine> engine(new Engine(
      weights, std::move(backend), options, max_seq,
      std::min(options.max_chunk, max_seq)));
  IG_RETURN_IF_ERROR(engine->Init());
  return engine;
}

Engine::Engine(const model::Weights& weights, std::unique_ptr<Backend> backend,
               const EngineOptions& options, int max_seq_len, int max_chunk)
    : weights_(weights),
      backend_(std::move(backend)),
      options_(options),
      max_seq_len_(max_seq_len),
      max_chunk_(max_chunk) {}

absl::Status Engine::Init() {
  const ModelConfig& c = weights_.config;
  layer_cache_size_ = static_cast<size_t>(c.n_kv_heads) * max_seq_len_ *
                      c.head_dim;
  k_cache_.assign(layer_cache_size_ * c.n_layers, 0.0f);
  v_cache_.assign(layer_cache_size_ * c.n_layers, 0.0f);
  const size_t n = max_chunk_;
  x_.resize(n * c.dim);
  xb_.resize(n * c.dim);
  q_.resize(n * c.q_dim());
  k_.resize(n * c.kv_dim());
  v_.resize(n * c.kv_dim());
  att_.resize(n * c.q_dim());
  proj_.resize(n * c.dim);
  h1_.resize(n * c.hidden_dim);
  h3_.resize(n * c.hidden_dim);
  skew_row_.resize(c.head_dim);
  positions_.resize(n);
  logits_.resize(n * c.vocab_size);
  if (options_.policy.kind == PolicyKind::kIdeal) return absl::OkStatus();

  KvPolicy::Context ctx;
  ctx.weights = &weights_;
  ctx.backend = backend_.get();
  ctx.max_seq_len = max_seq_len_;
  IG_ASSIGN_OR_RETURN(policy_, KvPolicy::Create(options_.policy, ctx));
  row_width_ = policy_->RowWidth();
  const size_t rows = static_cast<size_t>(c.n_kv_heads) * max_seq_len_;
  for (auto& buffer : buffers_) {
    IG_ASSIGN_OR_RETURN(buffer, options_.kv_client->NewFetchBuffer(
                                    2 * rows * row_width_));
  }
  const size_t stage = static_cast<size_t>(c.n_layers) * n * c.n_kv_heads *
                       row_width_;
  k_stage_.resize(stage);
  v_stage_.resize(stage);
  present_.assign(static_cast<size_t>(c.n_layers) * rows, 0);
  present_count_.assign(c.n_layers, 0);
  xb_prev_.resize(c.dim);
  kf_.resize((rows + c.n_kv_heads) * c.head_dim);
  vf_.resize((rows + c.n_kv_heads) * c.head_dim);
  fetched_.resize(2 * rows * c.head_dim);
  probs_.resize(static_cast<size_t>(c.n_heads) * (max_seq_len_ + 1));
  if (policy_->WantsPrefillProbs()) {
    prefill_probs_.resize(static_cast<size_t>(c.n_heads) * max_seq_len_);
  }
  return absl::OkStatus();
}

Engine::~Engine() {
  if (seq_ != 0) options_.kv_client->Close(seq_).IgnoreError();
}

absl::Status Engine::Reset() {
  position_ = 0;
  decoding_ = false;
  stats_ = FetchStats();
  if (policy_ == nullptr) return absl::OkStatus();
  policy_->Reset();
  std::fill(present_.begin(), present_.end(), 0);
  std::fill(present_count_.begin(), present_count_.end(), 0);
  if (seq_ != 0) {
    const kv_memory_service::SequenceId seq = seq_;
    seq_ = 0;
    IG_RETURN_IF_ERROR(options_.kv_client->Close(seq));
  }
  return absl::OkStatus();
}

absl::Status Engine::OpenSequence() {
  const ModelConfig& c = weights_.config;
  SequenceGeometry g;
  g.n_layers = c.n_layers;
  g.n_kv_heads = c.n_kv_heads;
  g.head_dim = row_width_;
  g.max_tokens = std::max(
      1, static_cast<int>(options_.kv_capacity * max_seq_len_));
  IG_ASSIGN_OR_RETURN(seq_, options_.kv_client->Open(g));
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const float>> Engine::Forward(
    absl::Span<const int> tokens, bool all_logits) {
  const ModelConfig& c = weights_.config;
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("forward: no tokens");
  if (all_logits && n > max_chunk_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: all_logits for %d tokens exceeds max_chunk %d", n,
        max_chunk_));
  }
  if (position_ + n > max_seq_len_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: sequence of %d tokens exceeds the cache's %d positions",
        position_ + n, max_seq_len_));
  }
  for (int t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "forward: token %d outside the vocabulary of %d", t, c.vocab_size));
    }
  }
  const bool offloaded = policy_ != nullptr;
  if (offloaded && position_ > 0 && n == 1) {
    IG_RETURN_IF_ERROR(DecodeStep(tokens[0], logits_.data()));
    return absl::Span<const float>(logits_.data(), c.vocab_size);
  }
  if (offloaded && decoding_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "forward: policy %s decodes one token at a time after the prefill",
        PolicyName(options_.policy.kind)));
  }
  if (offloaded && seq_ == 0) IG_RETURN_IF_ERROR(OpenSequence());
  for (int start = 0; start < n; start += max_chunk_) {
    const int len = std::min(max_chunk_, n - start);
    const bool last_chunk = start + len == n;
    IG_RETURN_IF_ERROR(
        ForwardChunk(tokens.data() + start, len, all_logits,
                     last_chunk || all_logits ? logits_.data() : nullptr));
  }
  if (all_logits) {
    return absl::Span<const float>(logits_.data(),
                                   static_cast<size_t>(n) * c.vocab_size);
  }
  return absl::Span<const float>(logits_.data(), c.vocab_size);
}

void Engine::Embed(const int* tokens, int n) {
  const ModelConfig& c = weights_.config;
  const int dim = c.dim;
  for (int i = 0; i < n; ++i) {
    positions_[i] = position_ + i;
    std::memcpy(&x_[static_cast<size_t>(i) * dim],
                &weights_.token_embedding[static_cast<size_t>(tokens[i]) * dim],
                dim * sizeof(float));
    if (c.arch == Architecture::kOpt) {
      const float* pos = &weights_.position_embedding[
          static_cast<size_t>(positions_[i] + ModelConfig::kOptPositionOffset) *
          dim];
      backend_->Add(&x_[static_cast<size_t>(i) * dim], pos, dim);
    }
  }
}

void Engine::Mlp(const LayerWeights& w, int n) {
  const ModelConfig& c = weights_.config;
  Backend& b = *backend_;
  const int dim = c.dim;
  if (c.arch == Architecture::kOpt) {
    b.LayerNorm(x_.data(), n, dim, w.ffn_norm.data(), w.ffn_norm_bias.data(),
                c.norm_eps, xb_.data());
    b.Linear(xb_.data(), n, dim, w.w1.data(), w.b1.data(), c.hidden_dim,
             h1_.data());
    b.Relu(h1_.data(), static_cast<long>(n) * c.hidden_dim);
    b.Linear(h1_.data(), n, c.hidden_dim, w.w2.data(), w.b2.data(), dim,
             proj_.data());
  } else {
    b.RmsNorm(x_.data(), n, dim, w.ffn_norm.data(), c.norm_eps, xb_.data());
    b.Linear(xb_.data(), n, dim, w.w1.data(), nullptr, c.hidden_dim,
             h1_.data());
    b.Linear(xb_.data(), n, dim, w.w3.data(), nullptr, c.hidden_dim,
             h3_.data());
    b.SwiGlu(h1_.data(), h3_.data(), static_cast<long>(n) * c.hidden_dim);
    b.Linear(h1_.data(), n, c.hidden_dim, w.w2.data(), nullptr, dim,
             proj_.data());
  }
  b.Add(x_.data(), proj_.data(), static_cast<long>(n) * dim);
}

void Engine::Logits(int first, int rows, float* logits) {
  const ModelConfig& c = weights_.config;
  const float* xr = &x_[static_cast<size_t>(first) * c.dim];
  if (c.arch == Architecture::kOpt) {
    backend_->LayerNorm(xr, rows, c.dim, weights_.final_norm.data(),
                        weights_.final_norm_bias.data(), c.norm_eps,
                        xb_.data());
  } else {
    backend_->RmsNorm(xr, rows, c.dim, weights_.final_norm.data(), c.norm_eps,
                      xb_.data());
  }
  backend_->Linear(xb_.data(), rows, c.dim, weights_.classifier(), nullptr,
                   c.vocab_size, logits);
}

absl::Status Engine::ForwardChunk(const int* tokens, int n, bool all_logits,
                                  float* logits) {
  const ModelConfig& c = weights_.config;
  const bool opt = c.arch == Architecture::kOpt;
  const int dim = c.dim, hd = c.head_dim, qd = c.q_dim(), kvd = c.kv_dim();
  Backend& b = *backend_;
  Embed(tokens, n);

  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    auto bias = [opt](const std::vector<float>& v) {
      return opt ? v.data() : nullptr;
    };
    // Attention block.
    if (opt) {
      b.LayerNorm(x_.data(), n, dim, w.attn_norm.data(),
                  w.attn_norm_bias.data(), c.norm_eps, xb_.data());
    } else {
      b.RmsNorm(x_.data(), n, dim, w.attn_norm.data(), c.norm_eps,
                xb_.data());
    }
    b.Linear(xb_.data(), n, dim, w.wq.data(), bias(w.bq), qd, q_.data());
    b.Linear(xb_.data(), n, dim, w.wk.data(), bias(w.bk), kvd, k_.data());
    b.Linear(xb_.data(), n, dim, w.wv.data(), bias(w.bv), kvd, v_.data());
    if (!opt) {
      b.Rope(q_.data(), n, c.n_heads, hd, positions_.data(), c.rope_theta);
      b.Rope(k_.data(), n, c.n_kv_heads, hd, positions_.data(), c.rope_theta);
    }
    if (options_.attention_skew != nullptr) {
      const int group = c.n_heads / c.n_kv_heads;
      for (int i = 0; i < n; ++i) {
        for (int h = 0; h < c.n_heads; ++h) {
          float* row = &q_[(static_cast<size_t>(i) * c.n_heads + h) * hd];
          speculator::ApplySkew(row, 1, options_.attention_skew->at(l, h / group),
                                hd, skew_row_.data());
          std::memcpy(row, skew_row_.data(), hd * sizeof(float));
        }
        for (int g = 0; g < c.n_kv_heads; ++g) {
          float* row = &k_[(static_cast<size_t>(i) * c.n_kv_heads + g) * hd];
          speculator::ApplySkew(row, 1, options_.attention_skew->at(l, g), hd,
                                skew_row_.data());
          std::memcpy(row, skew_row_.data(), hd * sizeof(float));
        }
      }
    }
    if (options_.observer) options_.observer(l, q_.data(), k_.data(), n);
    // Append this chunk's keys and values: [pos][kv_head][d] -> cache layout.
    float* kc = KeyCache(l);
    float* vc = ValueCache(l);
    for (int i = 0; i < n; ++i) {
      for (int g = 0; g < c.n_kv_heads; ++g) {
        const size_t dst =
            (static_cast<size_t>(g) * max_seq_len_ + positions_[i]) * hd;
        const size_t src = static_cast<size_t>(i) * kvd + g * hd;
        std::memcpy(kc + dst, &k_[src], hd * sizeof(float));
        std::memcpy(vc + dst, &v_[src], hd * sizeof(float));
      }
    }
    if (policy_ != nullptr) {
      // Rows for the memory node: [layer][token][kv_head][row_width].
      const size_t at = static_cast<size_t>(l) * n * c.n_kv_heads * row_width_;
      policy_->EncodeRows(k_.data(), n * c.n_kv_heads, &k_stage_[at]);
      policy_->EncodeRows(v_.data(), n * c.n_kv_heads, &v_stage_[at]);
    }
    AttentionParams p;
    p.q = q_.data();
    p.k = kc;
    p.v = vc;
    p.out = att_.data();
    p.n = n;
    p.n_heads = c.n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.head_dim = hd;
    p.kv_stride = max_seq_len_;
    p.kv_len0 = position_ + 1;
    p.scale = scale;
    const bool probs = policy_ != nullptr && policy_->WantsPrefillProbs();
    if (probs) {
      std::fill(prefill_probs_.begin(),
                prefill_probs_.begin() +
                    static_cast<size_t>(c.n_heads) * (position_ + n),
                0.0f);
      p.prob_sums = prefill_probs_.data();
    }
    b.Attention(p);
    if (policy_ != nullptr) {
      policy_->ObservePrefill(l, q_.data(), n, position_,
                              probs ? prefill_probs_.data() : nullptr);
    }
    b.Linear(att_.data(), n, qd, w.wo.data(), bias(w.bo), dim, proj_.data());
    b.Add(x_.data(), proj_.data(), static_cast<long>(n) * dim);
    Mlp(w, n);
  }
  if (policy_ != nullptr) IG_RETURN_IF_ERROR(AppendToMemoryNode(n));
  position_ += n;

  if (logits == nullptr) return absl::OkStatus();
  // Final norm and classifier: every row, or just the last one.
  const int first = all_logits ? 0 : n - 1;
  Logits(first, n - first, logits);
  return absl::OkStatus();
}

absl::Status Engine::AppendToMemoryNode(int n) {
  const ModelConfig& c = weights_.config;
  AppendBlock block;
  block.first_layer = 0;
  block.n_layers = c.n_layers;
  block.n_tokens = n;
  const size_t size =
      static_cast<size_t>(c.n_layers) * n * c.n_kv_heads * row_width_;
  block.k = absl::MakeConstSpan(k_stage_.data(), size);
  block.v = absl::MakeConstSpan(v_stage_.data(), size);
  IG_ASSIGN_OR_RETURN(AppendResult result,
                      options_.kv_client->Append(seq_, block));
  // The new positions are present; then drop what the pool evicted.
  for (int l = 0; l < c.n_layers; ++l) {
    for (int g = 0; g < c.n_kv_heads; ++g) {
      uint8_t* pr = &present_[(static_cast<size_t>(l) * c.n_kv_heads + g) *
                              max_seq_len_];
      std::fill(pr + position_, pr + position_ + n, 1);
    }
    present_count_[l] += static_cast<long>(n) * c.n_kv_heads;
  }
  ApplyEvictions(result);
  return absl::OkStatus();
}

void Engine::ApplyEvictions(const AppendResult& result) {
  const ModelConfig& c = weights_.config;
  for (const auto& e : result.evicted) {
    uint8_t& pr = present_[(static_cast<size_t>(e.layer) * c.n_kv_heads +
                            e.kv_head) *
                               max_seq_len_ +
                           e.position];
    if (pr) {
      pr = 0;
      --present_count_[e.layer];
    }
  }
}

absl::Status Engine::IssueFetch(int layer, const float* xb_prev) {
  const ModelConfig& c = weights_.config;
  kv_memory_service::OwnedFetchPlan& plan = plans_[layer % 2];
  policy_->PlanFetch(
      layer, position_, xb_prev,
      &present_[static_cast<size_t>(layer) * c.n_kv_heads * max_seq_len_],
      plan);
  step_rows_ += static_cast<long>(plan.indices.size());
  stats_.rows_fetched += static_cast<long>(plan.indices.size());
  stats_.bytes_fetched +=
      static_cast<long>(plan.indices.size()) * 2 * row_width_ * 2;
  handles_[layer % 2] = options_.kv_client->FetchAsync(
      seq_, layer, plan.view(), buffers_[layer % 2].get());
  return absl::OkStatus();
}

absl::Status Engine::FetchedAttention(int layer) {
  const ModelConfig& c = weights_.config;
  const int hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
  const int slot = layer % 2;
  IG_RETURN_IF_ERROR(handles_[slot].Wait());
  const kv_memory_service::OwnedFetchPlan& plan = plans_[slot];
  const int total = static_cast<int>(plan.indices.size());
  const uint16_t* rows = buffers_[slot]->data();
  policy_->DecodeRows(rows, total, fetched_.data());
  policy_->DecodeRows(rows + static_cast<size_t>(total) * row_width_, total,
                      fetched_.data() + static_cast<size_t>(total) * hd);
  const int stride = max_seq_len_ + 1;
  const bool want_probs = policy_->WantsAttentionProbs();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int g = 0; g < c.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    const int count = plan.head_offsets[g + 1] - begin;
    float* kg = kf_.data() + static_cast<size_t>(g) * stride * hd;
    float* vg = vf_.data() + static_cast<size_t>(g) * stride * hd;
    std::memcpy(kg, fetched_.data() + static_cast<size_t>(begin) * hd,
                static_cast<size_t>(count) * hd * sizeof(float));
    std::memcpy(vg, fetched_.data() + static_cast<size_t>(total + begin) * hd,
                static_cast<size_t>(count) * hd * sizeof(float));
    // The new token attends to itself with its exact (unstored) row.
    std::memcpy(kg + static_cast<size_t>(count) * hd, &k_[g * hd],
                hd * sizeof(float));
    std::memcpy(vg + static_cast<size_t>(count) * hd, &v_[g * hd],
                hd * sizeof(float));
    for (int h = g * group; h < (g + 1) * group; ++h) {
      AttentionParams p;
      p.q = &q_[h * hd];
      p.k = kg;
      p.v = vg;
      p.out = &att_[h * hd];
      p.n = 1;
      p.n_heads = 1;
      p.n_kv_heads = 1;
      p.head_dim = hd;
      p.kv_stride = stride;
      p.kv_len0 = count + 1;
      p.scale = scale;
      if (want_probs) {
        float* pr = probs_.data() + static_cast<size_t>(h) * stride;
        std::fill(pr, pr + count + 1, 0.0f);
        p.prob_sums = pr;
      }
      backend_->Attention(p);
    }
  }
  if (want_probs) {
    policy_->ObserveAttention(layer, plan.view(), probs_.data(), stride);
  }
  return absl::OkStatus();
}

absl::Status Engine::DecodeStep(int token, float* logits) {
  const ModelConfig& c = weights_.config;
  const bool opt = c.arch == Architecture::kOpt;
  const int dim = c.dim, hd = c.head_dim, qd = c.q_dim(), kvd = c.kv_dim();
  Backend& b = *backend_;
  if (!decoding_) {
    policy_->FinishPrefill(position_, [this](int l) { return KeyCache(l); });
    decoding_ = true;
  }
  Embed(&token, 1);
  step_rows_ = 0;
  long cached = 0;
  for (long n : present_count_) cached += n;
  IG_RETURN_IF_ERROR(IssueFetch(0, nullptr));
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    auto bias = [opt](const std::vector<float>& v) {
      return opt ? v.data() : nullptr;
    };
    if (opt) {
      b.LayerNorm(x_.data(), 1, dim, w.attn_norm.data(),
                  w.attn_norm_bias.data(), c.norm_eps, xb_.data());
    } else {
      b.RmsNorm(x_.data(), 1, dim, w.attn_norm.data(), c.norm_eps, xb_.data());
    }
    // Layer l + 1's fetch leaves before layer l's attention and MLP run.
    if (l + 1 < c.n_layers) {
      std::memcpy(xb_prev_.data(), xb_.data(), dim * sizeof(float));
      IG_RETURN_IF_ERROR(IssueFetch(l + 1, xb_prev_.data()));
    }
    b.Linear(xb_.data(), 1, dim, w.wq.data(), bias(w.bq), qd, q_.data());
    b.Linear(xb_.data(), 1, dim, w.wk.data(), bias(w.bk), kvd, k_.data());
    b.Linear(xb_.data(), 1, dim, w.wv.data(), bias(w.bv), kvd, v_.data());
    if (!opt) {
      b.Rope(q_.data(), 1, c.n_heads, hd, &position_, c.rope_theta);
      b.Rope(k_.data(), 1, c.n_kv_heads, hd, &position_, c.rope_theta);
    }
    float* kc = KeyCache(l);
    float* vc = ValueCache(l);
    for (int g = 0; g < c.n_kv_heads; ++g) {
      const size_t dst = (static_cast<size_t>(g) * max_seq_len_ + position_) * hd;
      std::memcpy(kc + dst, &k_[g * hd], hd * sizeof(float));
      std::memcpy(vc + dst, &v_[g * hd], hd * sizeof(float));
    }
    const size_t at = static_cast<size_t>(l) * c.n_kv_heads * row_width_;
    policy_->EncodeRows(k_.data(), c.n_kv_heads, &k_stage_[at]);
    policy_->EncodeRows(v_.data(), c.n_kv_heads, &v_stage_[at]);
    IG_RETURN_IF_ERROR(FetchedAttention(l));
    policy_->OnDecodeAppend(l, position_, k_.data());
    b.Linear(att_.data(), 1, qd, w.wo.data(), bias(w.bo), dim, proj_.data());
    b.Add(x_.data(), proj_.data(), dim);
    Mlp(w, 1);
  }
  Logits(0, 1, logits);
  IG_RETURN_IF_ERROR(AppendToMemoryNode(1));
  ++position_;
  const double fraction = cached > 0 ? static_cast<double>(step_rows_) / cached
                                     : 0.0;
  ++stats_.steps;
  stats_.fraction_sum += fraction;
  stats_.fraction_max = std::max(stats_.fraction_max, fraction);
  return absl::OkStatus();
}

}  // namespace infinigen::gpu_worker
