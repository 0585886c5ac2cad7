#include "gpu_worker/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

using kv_memory_service::AppendBlock;
using kv_memory_service::AppendResult;
using kv_memory_service::SequenceGeometry;
using model::Architecture;
using model::LayerWeights;
using model::ModelConfig;

void FetchStats::Add(const FetchStats& o) {
  steps += o.steps;
  fraction_sum += o.fraction_sum;
  fraction_max = std::max(fraction_max, o.fraction_max);
  rows_fetched += o.rows_fetched;
  bytes_fetched += o.bytes_fetched;
  wait_seconds += o.wait_seconds;
}

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
  if (options.batch <= 0 || options.batch > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "engine: batch must be in [1, 1024], got %d", options.batch));
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
      max_chunk_(max_chunk),
      rows_(std::max(max_chunk, options.batch)) {}

absl::Status Engine::Init() {
  const ModelConfig& c = weights_.config;
  layer_cache_size_ = static_cast<size_t>(c.n_kv_heads) * max_seq_len_ *
                      c.head_dim;
  IG_RETURN_IF_ERROR(RegisterWeights());
  const SharedAllocator<float> shared(backend_.get());
  auto make = [&shared](size_t count) {
    return SharedVector<float>(count, 0.0f, shared);
  };
  const size_t n = rows_;
  x_ = make(n * c.dim);
  xb_ = make(n * c.dim);
  q_ = make(n * c.q_dim());
  k_ = make(n * c.kv_dim());
  v_ = make(n * c.kv_dim());
  att_ = make(n * c.q_dim());
  proj_ = make(n * c.dim);
  h1_ = make(n * c.hidden_dim);
  h3_ = make(n * c.hidden_dim);
  skew_row_.resize(c.head_dim);
  positions_ = SharedVector<int>(n, 0, SharedAllocator<int>(backend_.get()));
  logits_ = make(n * c.vocab_size);
  slots_.resize(options_.batch);
  for (Slot& s : slots_) {
    s.k_cache = make(layer_cache_size_ * c.n_layers);
    s.v_cache = make(layer_cache_size_ * c.n_layers);
  }
  if (options_.policy.kind == PolicyKind::kIdeal) return absl::OkStatus();

  KvPolicy::Context ctx;
  ctx.weights = &weights_;
  ctx.backend = backend_.get();
  ctx.max_seq_len = max_seq_len_;
  const size_t rows = static_cast<size_t>(c.n_kv_heads) * max_seq_len_;
  bool pin_warned = false;
  for (Slot& s : slots_) {
    IG_ASSIGN_OR_RETURN(s.policy, KvPolicy::Create(options_.policy, ctx));
    row_width_ = s.policy->RowWidth();
    for (int i = 0; i < 2; ++i) {
      IG_ASSIGN_OR_RETURN(s.buffers[i], options_.kv_client->NewFetchBuffer(
                                            2 * rows * row_width_));
      const absl::Status pinned = backend_->PinHost(
          s.buffers[i]->data(), s.buffers[i]->size() * sizeof(uint16_t));
      if (!pinned.ok() && !pin_warned) {
        IG_LOG(WARNING) << "engine: fetch buffers stay pageable (copies run "
                           "slower): "
                        << pinned.message();
        pin_warned = true;
      }
      s.staged[i] = SharedVector<uint16_t>(
          2 * rows * row_width_, 0, SharedAllocator<uint16_t>(backend_.get()));
    }
    s.present.assign(static_cast<size_t>(c.n_layers) * rows, 0);
    s.present_count.assign(c.n_layers, 0);
    s.k_step.resize(static_cast<size_t>(c.n_layers) * c.n_kv_heads *
                    row_width_);
    s.v_step.resize(s.k_step.size());
  }
  const size_t stage = static_cast<size_t>(c.n_layers) * max_chunk_ *
                       c.n_kv_heads * row_width_;
  k_stage_.resize(stage);
  v_stage_.resize(stage);
  kf_ = make((rows + c.n_kv_heads) * c.head_dim);
  vf_ = make((rows + c.n_kv_heads) * c.head_dim);
  probs_ = make(static_cast<size_t>(c.n_heads) * (max_seq_len_ + 1));
  if (slots_[0].policy->WantsPrefillProbs()) {
    prefill_probs_ = make(static_cast<size_t>(c.n_heads) * max_seq_len_);
  }
  {
    absl::MutexLock lock(&append_mu_);
    append_slots_.reserve(slots_.size());
  }
  appender_ = std::thread([this] { AppenderLoop(); });
  return absl::OkStatus();
}

absl::Status Engine::RegisterWeights() {
  auto reg = [this](const std::vector<float>& v) {
    return v.empty() ? absl::OkStatus()
                     : backend_->RegisterConstant(v.data(), v.size());
  };
  IG_RETURN_IF_ERROR(reg(weights_.token_embedding));
  IG_RETURN_IF_ERROR(reg(weights_.position_embedding));
  IG_RETURN_IF_ERROR(reg(weights_.final_norm));
  IG_RETURN_IF_ERROR(reg(weights_.final_norm_bias));
  IG_RETURN_IF_ERROR(reg(weights_.lm_head));
  for (const LayerWeights& w : weights_.layers) {
    for (const std::vector<float>* v :
         {&w.attn_norm, &w.attn_norm_bias, &w.wq, &w.wk, &w.wv, &w.wo, &w.bq,
          &w.bk, &w.bv, &w.bo, &w.ffn_norm, &w.ffn_norm_bias, &w.w1, &w.w3,
          &w.w2, &w.b1, &w.b2}) {
      IG_RETURN_IF_ERROR(reg(*v));
    }
  }
  return absl::OkStatus();
}

Engine::~Engine() {
  if (appender_.joinable()) {
    FinishAppends().IgnoreError();
    {
      absl::MutexLock lock(&append_mu_);
      stopping_ = true;
    }
    appender_.join();
  }
  for (Slot& s : slots_) {
    if (s.seq != 0) options_.kv_client->Close(s.seq).IgnoreError();
  }
  // Copies may still read the fetch buffers; unpin them before they go.
  backend_->WaitCopies().IgnoreError();
  for (Slot& s : slots_) {
    for (int i = 0; i < 2; ++i) {
      s.handles[i].Wait().IgnoreError();
      if (s.buffers[i] != nullptr) backend_->UnpinHost(s.buffers[i]->data());
    }
  }
}

absl::Status Engine::CheckSlot(int slot) const {
  if (slot < 0 || slot >= static_cast<int>(slots_.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "slot %d outside the engine's batch of %d", slot, slots_.size()));
  }
  return absl::OkStatus();
}

absl::Status Engine::Reset(int slot) {
  IG_RETURN_IF_ERROR(CheckSlot(slot));
  IG_RETURN_IF_ERROR(FinishAppends());
  Slot& s = slots_[slot];
  s.position = 0;
  s.decoding = false;
  s.stats = FetchStats();
  if (s.policy == nullptr) return absl::OkStatus();
  s.policy->Reset();
  std::fill(s.present.begin(), s.present.end(), 0);
  std::fill(s.present_count.begin(), s.present_count.end(), 0);
  if (s.seq != 0) {
    const kv_memory_service::SequenceId seq = s.seq;
    s.seq = 0;
    IG_RETURN_IF_ERROR(options_.kv_client->Close(seq));
  }
  return absl::OkStatus();
}

absl::Status Engine::OpenSequence(Slot& s) {
  const ModelConfig& c = weights_.config;
  SequenceGeometry g;
  g.n_layers = c.n_layers;
  g.n_kv_heads = c.n_kv_heads;
  g.head_dim = row_width_;
  g.max_tokens = std::max(
      1, static_cast<int>(options_.kv_capacity * max_seq_len_));
  IG_ASSIGN_OR_RETURN(s.seq, options_.kv_client->Open(g));
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const float>> Engine::Forward(
    int slot, absl::Span<const int> tokens, bool all_logits) {
  IG_RETURN_IF_ERROR(CheckSlot(slot));
  const ModelConfig& c = weights_.config;
  Slot& s = slots_[slot];
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("forward: no tokens");
  if (all_logits && n > max_chunk_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: all_logits for %d tokens exceeds max_chunk %d", n,
        max_chunk_));
  }
  if (s.position + n > max_seq_len_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: sequence of %d tokens exceeds the cache's %d positions",
        s.position + n, max_seq_len_));
  }
  for (int t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "forward: token %d outside the vocabulary of %d", t, c.vocab_size));
    }
  }
  const bool offloaded = s.policy != nullptr;
  if (offloaded && s.position > 0 && n == 1) {
    return DecodeBatch({slot}, tokens);
  }
  if (offloaded && s.decoding) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "forward: policy %s decodes one token at a time after the prefill",
        PolicyName(options_.policy.kind)));
  }
  IG_RETURN_IF_ERROR(FinishAppends());
  if (offloaded && s.seq == 0) IG_RETURN_IF_ERROR(OpenSequence(s));
  for (int start = 0; start < n; start += max_chunk_) {
    const int len = std::min(max_chunk_, n - start);
    const bool last_chunk = start + len == n;
    IG_RETURN_IF_ERROR(
        ForwardChunk(s, tokens.data() + start, len, all_logits,
                     last_chunk || all_logits ? logits_.data() : nullptr));
  }
  if (all_logits) {
    return absl::Span<const float>(logits_.data(),
                                   static_cast<size_t>(n) * c.vocab_size);
  }
  return absl::Span<const float>(logits_.data(), c.vocab_size);
}

void Engine::Embed(const int* tokens, const int* positions, int n) {
  const ModelConfig& c = weights_.config;
  const int dim = c.dim;
  for (int i = 0; i < n; ++i) {
    positions_[i] = positions[i];
    std::memcpy(&x_[static_cast<size_t>(i) * dim],
                &weights_.token_embedding[static_cast<size_t>(tokens[i]) * dim],
                dim * sizeof(float));
  }
  // Every host write to x_ is done before the first asynchronous Add on it.
  for (int i = 0; i < n; ++i) {
    if (c.arch == Architecture::kOpt) {
      const float* pos = &weights_.position_embedding[
          static_cast<size_t>(positions[i] + ModelConfig::kOptPositionOffset) *
          dim];
      backend_->Add(&x_[static_cast<size_t>(i) * dim], pos, dim);
    }
  }
}

void Engine::AttentionNorm(const LayerWeights& w, int n) {
  const ModelConfig& c = weights_.config;
  if (c.arch == Architecture::kOpt) {
    backend_->LayerNorm(x_.data(), n, c.dim, w.attn_norm.data(),
                        w.attn_norm_bias.data(), c.norm_eps, xb_.data());
  } else {
    backend_->RmsNorm(x_.data(), n, c.dim, w.attn_norm.data(), c.norm_eps,
                      xb_.data());
  }
}

void Engine::QueryKeyValue(const LayerWeights& w, int n) {
  const ModelConfig& c = weights_.config;
  Backend& b = *backend_;
  const bool opt = c.arch == Architecture::kOpt;
  auto bias = [opt](const std::vector<float>& v) {
    return opt ? v.data() : nullptr;
  };
  b.Linear(xb_.data(), n, c.dim, w.wq.data(), bias(w.bq), c.q_dim(), q_.data());
  b.Linear(xb_.data(), n, c.dim, w.wk.data(), bias(w.bk), c.kv_dim(),
           k_.data());
  b.Linear(xb_.data(), n, c.dim, w.wv.data(), bias(w.bv), c.kv_dim(),
           v_.data());
  if (!opt) {
    b.Rope(q_.data(), n, c.n_heads, c.head_dim, positions_.data(),
           c.rope_theta);
    b.Rope(k_.data(), n, c.n_kv_heads, c.head_dim, positions_.data(),
           c.rope_theta);
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

void Engine::LocalAttention(Slot& s, int layer, int row, int n, int first_pos,
                            float* prob_sums) {
  const ModelConfig& c = weights_.config;
  AttentionParams p;
  p.q = &q_[static_cast<size_t>(row) * c.q_dim()];
  p.k = KeyCache(s, layer);
  p.v = ValueCache(s, layer);
  p.out = &att_[static_cast<size_t>(row) * c.q_dim()];
  p.n = n;
  p.n_heads = c.n_heads;
  p.n_kv_heads = c.n_kv_heads;
  p.head_dim = c.head_dim;
  p.kv_stride = max_seq_len_;
  p.kv_len0 = first_pos + 1;
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  p.prob_sums = prob_sums;
  backend_->Attention(p);
}

absl::Status Engine::ForwardChunk(Slot& s, const int* tokens, int n,
                                  bool all_logits, float* logits) {
  const ModelConfig& c = weights_.config;
  const bool opt = c.arch == Architecture::kOpt;
  const int dim = c.dim, hd = c.head_dim, qd = c.q_dim(), kvd = c.kv_dim();
  Backend& b = *backend_;
  // The previous chunk's operations may still read x_ and positions_.
  IG_RETURN_IF_ERROR(b.Synchronize());
  for (int i = 0; i < n; ++i) positions_[i] = s.position + i;
  Embed(tokens, positions_.data(), n);

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    auto bias = [opt](const std::vector<float>& v) {
      return opt ? v.data() : nullptr;
    };
    AttentionNorm(w, n);
    QueryKeyValue(w, n);
    // The skew, the observer and the memory node's staging read q_, k_ and
    // v_ on the host; without them the layer stays on the backend.
    if (options_.attention_skew != nullptr || options_.observer ||
        s.policy != nullptr) {
      IG_RETURN_IF_ERROR(b.Synchronize());
    }
    if (options_.attention_skew != nullptr) {
      const int group = c.n_heads / c.n_kv_heads;
      auto skew_rows = [&](float* rows, int count, auto head_to_kv) {
        for (int r = 0; r < count; ++r) {
          float* row = rows + static_cast<size_t>(r) * hd;
          speculator::ApplySkew(
              row, 1, options_.attention_skew->at(l, head_to_kv(r)), hd,
              skew_row_.data());
          std::memcpy(row, skew_row_.data(), hd * sizeof(float));
        }
      };
      skew_rows(q_.data(), n * c.n_heads,
                [&](int r) { return (r % c.n_heads) / group; });
      skew_rows(k_.data(), n * c.n_kv_heads,
                [&](int r) { return r % c.n_kv_heads; });
    }
    if (options_.observer) options_.observer(l, q_.data(), k_.data(), n);
    // The host reads k_ and v_ before the Copy ops below are queued.
    if (s.policy != nullptr) {
      // Rows for the memory node: [layer][token][kv_head][row_width].
      const size_t at = static_cast<size_t>(l) * n * c.n_kv_heads * row_width_;
      s.policy->EncodeRows(k_.data(), n * c.n_kv_heads, &k_stage_[at]);
      s.policy->EncodeRows(v_.data(), n * c.n_kv_heads, &v_stage_[at]);
    }
    // Append this chunk's keys and values: [pos][kv_head][d] -> cache layout.
    // (positions_[i] == s.position + i; positions_ itself is not read on the
    // host while Rope may still read it.)
    float* kc = KeyCache(s, l);
    float* vc = ValueCache(s, l);
    for (int i = 0; i < n; ++i) {
      for (int g = 0; g < c.n_kv_heads; ++g) {
        const size_t dst =
            (static_cast<size_t>(g) * max_seq_len_ + s.position + i) * hd;
        const size_t src = static_cast<size_t>(i) * kvd + g * hd;
        b.Copy(kc + dst, &k_[src], hd);
        b.Copy(vc + dst, &v_[src], hd);
      }
    }
    const bool probs = s.policy != nullptr && s.policy->WantsPrefillProbs();
    if (probs) {
      std::fill(prefill_probs_.begin(),
                prefill_probs_.begin() +
                    static_cast<size_t>(c.n_heads) * (s.position + n),
                0.0f);
    }
    LocalAttention(s, l, 0, n, s.position,
                   probs ? prefill_probs_.data() : nullptr);
    if (s.policy != nullptr) {
      IG_RETURN_IF_ERROR(b.Synchronize());
      s.policy->ObservePrefill(l, q_.data(), n, s.position,
                               probs ? prefill_probs_.data() : nullptr);
    }
    b.Linear(att_.data(), n, qd, w.wo.data(), bias(w.bo), dim, proj_.data());
    b.Add(x_.data(), proj_.data(), static_cast<long>(n) * dim);
    Mlp(w, n);
  }
  if (s.policy != nullptr) {
    AppendResult result;
    IG_RETURN_IF_ERROR(
        AppendRows(s, k_stage_.data(), v_stage_.data(), n, &result));
    MarkAppended(s, s.position, n, result);
  }
  s.position += n;

  if (logits == nullptr) return b.Synchronize();
  // Final norm and classifier: every row, or just the last one.
  const int first = all_logits ? 0 : n - 1;
  Logits(first, n - first, logits);
  return b.Synchronize();
}

absl::Status Engine::AppendRows(Slot& s, const uint16_t* k, const uint16_t* v,
                                int n, AppendResult* result) {
  const ModelConfig& c = weights_.config;
  AppendBlock block;
  block.first_layer = 0;
  block.n_layers = c.n_layers;
  block.n_tokens = n;
  const size_t size =
      static_cast<size_t>(c.n_layers) * n * c.n_kv_heads * row_width_;
  block.k = absl::MakeConstSpan(k, size);
  block.v = absl::MakeConstSpan(v, size);
  IG_ASSIGN_OR_RETURN(*result, options_.kv_client->Append(s.seq, block));
  return absl::OkStatus();
}

void Engine::MarkAppended(Slot& s, int first, int n,
                          const AppendResult& result) {
  const ModelConfig& c = weights_.config;
  // The new positions are present; then drop what the pool evicted.
  for (int l = 0; l < c.n_layers; ++l) {
    for (int g = 0; g < c.n_kv_heads; ++g) {
      uint8_t* pr = &s.present[(static_cast<size_t>(l) * c.n_kv_heads + g) *
                               max_seq_len_];
      std::fill(pr + first, pr + first + n, 1);
    }
    s.present_count[l] += static_cast<long>(n) * c.n_kv_heads;
  }
  for (const auto& e : result.evicted) {
    uint8_t& pr = s.present[(static_cast<size_t>(e.layer) * c.n_kv_heads +
                             e.kv_head) *
                                max_seq_len_ +
                            e.position];
    if (pr) {
      pr = 0;
      --s.present_count[e.layer];
    }
  }
}

void Engine::AppenderLoop() {
  std::vector<int> slots;
  slots.reserve(slots_.size());
  while (true) {
    {
      absl::MutexLock lock(&append_mu_);
      append_mu_.Await(absl::Condition(
          +[](Engine* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->append_mu_) {
            return e->stopping_ || (e->append_pending_ && !e->append_done_);
          },
          this));
      if (stopping_) return;
      slots.assign(append_slots_.begin(), append_slots_.end());
    }
    // Each slot's step rows are staged in k_step/v_step; nobody touches them
    // until FinishAppends returns.
    for (int i : slots) {
      Slot& s = slots_[i];
      s.append_status = AppendRows(s, s.k_step.data(), s.v_step.data(), 1,
                                   &s.appended);
    }
    absl::MutexLock lock(&append_mu_);
    append_done_ = true;
  }
}

void Engine::StartAppends(absl::Span<const int> slots) {
  absl::MutexLock lock(&append_mu_);
  append_slots_.assign(slots.begin(), slots.end());
  append_pending_ = true;
  append_done_ = false;
}

absl::Status Engine::FinishAppends() {
  if (!appender_.joinable()) return absl::OkStatus();
  {
    absl::MutexLock lock(&append_mu_);
    if (!append_pending_) return absl::OkStatus();
    append_mu_.Await(absl::Condition(&append_done_));
    append_pending_ = false;
  }
  absl::Status first;
  std::vector<int> slots;
  {
    absl::MutexLock lock(&append_mu_);
    slots.swap(append_slots_);
  }
  for (int i : slots) {
    Slot& s = slots_[i];
    if (!s.append_status.ok()) {
      if (first.ok()) first = s.append_status;
      continue;
    }
    MarkAppended(s, s.position - 1, 1, s.appended);
  }
  {
    absl::MutexLock lock(&append_mu_);
    append_slots_.swap(slots);  // keep the capacity
  }
  return first;
}

absl::Status Engine::IssueFetch(Slot& s, int layer, const float* xb_prev) {
  const ModelConfig& c = weights_.config;
  // The last copy out of this fetch buffer must have read it.
  IG_RETURN_IF_ERROR(backend_->WaitCopies());
  s.uploaded[layer % 2] = false;
  kv_memory_service::OwnedFetchPlan& plan = s.plans[layer % 2];
  IG_RETURN_IF_ERROR(s.policy->PlanFetch(
      layer, s.position, xb_prev,
      &s.present[static_cast<size_t>(layer) * c.n_kv_heads * max_seq_len_],
      plan));
  s.step_rows += static_cast<long>(plan.indices.size());
  s.stats.rows_fetched += static_cast<long>(plan.indices.size());
  s.stats.bytes_fetched +=
      static_cast<long>(plan.indices.size()) * 2 * row_width_ * 2;
  s.handles[layer % 2] = options_.kv_client->FetchAsync(
      s.seq, layer, plan.view(), s.buffers[layer % 2].get());
  return absl::OkStatus();
}

absl::Status Engine::UploadFetched(Slot& s, int layer) {
  const int slot = layer % 2;
  if (s.uploaded[slot]) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status fetched = s.handles[slot].Wait();
  s.stats.wait_seconds += std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - t0)
                              .count();
  IG_RETURN_IF_ERROR(fetched);
  // K rows of every head, then V rows, as stored.
  const size_t values = 2 * s.plans[slot].indices.size() * row_width_;
  backend_->CopyFromHost(s.staged[slot].data(), s.buffers[slot]->data(),
                         values * sizeof(uint16_t), s.staged_free[slot]);
  s.uploaded[slot] = true;
  return absl::OkStatus();
}

absl::Status Engine::FetchedAttention(Slot& s, int layer, int row) {
  const ModelConfig& c = weights_.config;
  const int hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
  const int slot = layer % 2;
  IG_RETURN_IF_ERROR(UploadFetched(s, layer));
  const kv_memory_service::OwnedFetchPlan& plan = s.plans[slot];
  const int total = static_cast<int>(plan.indices.size());
  const int stride = max_seq_len_ + 1;
  const bool want_probs = s.policy->WantsAttentionProbs();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const KvRowFormat format = s.policy->row_format();
  const float* q = &q_[static_cast<size_t>(row) * c.q_dim()];
  const float* k_new = &k_[static_cast<size_t>(row) * c.kv_dim()];
  const float* v_new = &v_[static_cast<size_t>(row) * c.kv_dim()];
  float* att = &att_[static_cast<size_t>(row) * c.q_dim()];
  const uint16_t* k_rows = s.staged[slot].data();
  const uint16_t* v_rows = k_rows + static_cast<size_t>(total) * row_width_;
  // Each KV head's rows, decoded where attention reads them, then the new
  // token's exact (unstored) row.
  for (int g = 0; g < c.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    const int count = plan.head_offsets[g + 1] - begin;
    float* kg = kf_.data() + static_cast<size_t>(g) * stride * hd;
    float* vg = vf_.data() + static_cast<size_t>(g) * stride * hd;
    if (count > 0) {
      backend_->DecodeKvRows(k_rows + static_cast<size_t>(begin) * row_width_,
                             count, hd, format, kg);
      backend_->DecodeKvRows(v_rows + static_cast<size_t>(begin) * row_width_,
                             count, hd, format, vg);
    }
    backend_->Copy(kg + static_cast<size_t>(count) * hd, k_new + g * hd, hd);
    backend_->Copy(vg + static_cast<size_t>(count) * hd, v_new + g * hd, hd);
  }
  s.staged_free[slot] = backend_->MarkIssued();
  if (want_probs) {
    // The host zeroes the probability rows once earlier attention is done.
    IG_RETURN_IF_ERROR(backend_->Synchronize());
    for (int h = 0; h < c.n_heads; ++h) {
      const int count = plan.head_offsets[h / group + 1] -
                        plan.head_offsets[h / group];
      float* pr = probs_.data() + static_cast<size_t>(h) * stride;
      std::fill(pr, pr + count + 1, 0.0f);
    }
  }
  for (int g = 0; g < c.n_kv_heads; ++g) {
    const int begin = plan.head_offsets[g];
    const int count = plan.head_offsets[g + 1] - begin;
    float* kg = kf_.data() + static_cast<size_t>(g) * stride * hd;
    float* vg = vf_.data() + static_cast<size_t>(g) * stride * hd;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      AttentionParams p;
      p.q = q + h * hd;
      p.k = kg;
      p.v = vg;
      p.out = att + h * hd;
      p.n = 1;
      p.n_heads = 1;
      p.n_kv_heads = 1;
      p.head_dim = hd;
      p.kv_stride = stride;
      p.kv_len0 = count + 1;
      p.scale = scale;
      if (want_probs) {
        p.prob_sums = probs_.data() + static_cast<size_t>(h) * stride;
      }
      backend_->Attention(p);
    }
  }
  if (want_probs) {
    IG_RETURN_IF_ERROR(backend_->Synchronize());
    s.policy->ObserveAttention(layer, plan.view(), probs_.data(), stride);
  }
  return absl::OkStatus();
}

void Engine::StageStepRows(Slot& s) {
  const ModelConfig& c = weights_.config;
  const int hd = c.head_dim;
  for (int l = 0; l < c.n_layers; ++l) {
    const size_t at = static_cast<size_t>(l) * c.n_kv_heads * row_width_;
    for (int g = 0; g < c.n_kv_heads; ++g) {
      const size_t src =
          (static_cast<size_t>(g) * max_seq_len_ + s.position) * hd;
      s.policy->EncodeRows(KeyCache(s, l) + src, 1,
                           &s.k_step[at + static_cast<size_t>(g) * row_width_]);
      s.policy->EncodeRows(ValueCache(s, l) + src, 1,
                           &s.v_step[at + static_cast<size_t>(g) * row_width_]);
    }
    s.policy->OnDecodeAppend(l, s.position, KeyCache(s, l));
  }
}

absl::StatusOr<absl::Span<const float>> Engine::DecodeBatch(
    absl::Span<const int> slot_ids, absl::Span<const int> tokens) {
  const ModelConfig& c = weights_.config;
  const int n = static_cast<int>(slot_ids.size());
  if (n == 0 || static_cast<int>(tokens.size()) != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "decode: %d slots with %d tokens", n, tokens.size()));
  }
  for (int i = 0; i < n; ++i) {
    IG_RETURN_IF_ERROR(CheckSlot(slot_ids[i]));
    for (int j = 0; j < i; ++j) {
      if (slot_ids[j] == slot_ids[i]) {
        return absl::InvalidArgumentError(
            absl::StrFormat("decode: slot %d given twice", slot_ids[i]));
      }
    }
    const Slot& s = slots_[slot_ids[i]];
    if (s.position == 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "decode: slot %d has no prefill", slot_ids[i]));
    }
    if (s.position >= max_seq_len_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "decode: slot %d is full (%d positions)", slot_ids[i],
          max_seq_len_));
    }
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "decode: token %d outside the vocabulary of %d", tokens[i],
          c.vocab_size));
    }
  }
  // The previous step's appends must be in before this step fetches.
  IG_RETURN_IF_ERROR(FinishAppends());
  const bool opt = c.arch == Architecture::kOpt;
  const int dim = c.dim, hd = c.head_dim, qd = c.q_dim(), kvd = c.kv_dim();
  Backend& b = *backend_;
  const bool offloaded = options_.policy.kind != PolicyKind::kIdeal;
  IG_RETURN_IF_ERROR(b.Synchronize());
  for (int i = 0; i < n; ++i) positions_[i] = slots_[slot_ids[i]].position;
  Embed(tokens.data(), positions_.data(), n);
  if (offloaded) {
    for (int i = 0; i < n; ++i) {
      Slot& s = slots_[slot_ids[i]];
      if (!s.decoding) {
        s.policy->FinishPrefill(s.position,
                                [this, &s](int l) { return KeyCache(s, l); });
        s.decoding = true;
      }
      s.step_rows = 0;
      IG_RETURN_IF_ERROR(IssueFetch(s, 0, nullptr));
    }
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    auto bias = [opt](const std::vector<float>& v) {
      return opt ? v.data() : nullptr;
    };
    AttentionNorm(w, n);
    // Layer l + 1's fetch leaves before layer l's attention and MLP run
    // (with the same_layer_input diagnostic, layer l's leaves now, from its
    // own input; layer 0's left at the start of the step).
    const int fetch_layer = options_.policy.same_layer_input ? l : l + 1;
    if (offloaded && fetch_layer > 0 && fetch_layer < c.n_layers) {
      for (int i = 0; i < n; ++i) {
        IG_RETURN_IF_ERROR(IssueFetch(slots_[slot_ids[i]], fetch_layer,
                                      &xb_[static_cast<size_t>(i) * dim]));
      }
    }
    QueryKeyValue(w, n);
    for (int i = 0; i < n; ++i) {
      Slot& s = slots_[slot_ids[i]];
      float* kc = KeyCache(s, l);
      float* vc = ValueCache(s, l);
      const float* kr = &k_[static_cast<size_t>(i) * kvd];
      const float* vr = &v_[static_cast<size_t>(i) * kvd];
      for (int g = 0; g < c.n_kv_heads; ++g) {
        const size_t dst =
            (static_cast<size_t>(g) * max_seq_len_ + s.position) * hd;
        b.Copy(kc + dst, kr + g * hd, hd);
        b.Copy(vc + dst, vr + g * hd, hd);
      }
      if (!offloaded) {
        LocalAttention(s, l, i, 1, s.position, nullptr);
        continue;
      }
      IG_RETURN_IF_ERROR(FetchedAttention(s, l, i));
    }
    // Every fetch of the step is done: the host encodes the step's new rows
    // and the appends run while the last layer's MLP and the classifier
    // compute.
    if (offloaded && l + 1 == c.n_layers) {
      IG_RETURN_IF_ERROR(b.Synchronize());
      for (int i = 0; i < n; ++i) StageStepRows(slots_[slot_ids[i]]);
      StartAppends(slot_ids);
    }
    b.Linear(att_.data(), n, qd, w.wo.data(), bias(w.bo), dim, proj_.data());
    b.Add(x_.data(), proj_.data(), static_cast<long>(n) * dim);
    Mlp(w, n);
    // The next layer's rows move to the backend while this layer computes
    // (its fetch left before this layer's attention).
    if (offloaded && !options_.policy.same_layer_input &&
        l + 1 < c.n_layers) {
      for (int i = 0; i < n; ++i) {
        IG_RETURN_IF_ERROR(UploadFetched(slots_[slot_ids[i]], l + 1));
      }
    }
  }
  Logits(0, n, logits_.data());
  IG_RETURN_IF_ERROR(b.Synchronize());
  for (int i = 0; i < n; ++i) {
    Slot& s = slots_[slot_ids[i]];
    if (offloaded) {
      long cached = 0;
      for (long r : s.present_count) cached += r;
      const double fraction =
          cached > 0 ? static_cast<double>(s.step_rows) / cached : 0.0;
      ++s.stats.steps;
      s.stats.fraction_sum += fraction;
      s.stats.fraction_max = std::max(s.stats.fraction_max, fraction);
    }
    ++s.position;
  }
  return absl::Span<const float>(logits_.data(),
                                 static_cast<size_t>(n) * c.vocab_size);
}

}  // namespace infinigen::gpu_worker
