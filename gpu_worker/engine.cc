#include "gpu_worker/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"

namespace infinigen::gpu_worker {

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
  if (options.batch <= 0 || options.batch > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "engine: batch must be in [1, 1024], got %d", options.batch));
  }
  // The KV options are the cache's to check (KvCache::Create, first in
  // Init, before anything large is allocated).
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
      rows_(std::max(max_chunk, options.batch)),
      positions_of_(options.batch, 0),
      cached_of_(options.batch, 0),
      history_(options.batch),
      prompt_of_(options.batch, 0) {}

absl::Status Engine::Init() {
  const ModelConfig& c = weights_.config;
  // The KV cache first: a configuration over the worker's KV limit is
  // refused before anything else is allocated.
  KvCacheOptions kv;
  kv.batch = options_.batch;
  kv.max_seq_len = max_seq_len_;
  kv.max_chunk = max_chunk_;
  kv.half_local_kv = backend_->HalfKvCache() && c.head_dim % 2 == 0;
  kv.kv = options_.kv;
  IG_ASSIGN_OR_RETURN(cache_, KvCache::Create(weights_, backend_.get(), kv));
  IG_RETURN_IF_ERROR(RegisterWeights());
  // Activations live in the backend's device memory: host code never
  // touches them; positions go in and logits come out by explicit copies.
  Backend* b = backend_.get();
  auto make = [b](DeviceBuffer<float>& buffer, size_t count,
                  const char* what) -> absl::Status {
    IG_ASSIGN_OR_RETURN(buffer, DeviceBuffer<float>::Make(b, count, what));
    return absl::OkStatus();
  };
  const size_t n = rows_;
  const size_t stream = std::max(max_seq_len_, options_.batch);
  IG_RETURN_IF_ERROR(make(x_, stream * c.dim, "the residual stream"));
  IG_ASSIGN_OR_RETURN(positions_,
                      DeviceBuffer<int>::Make(b, stream, "positions"));
  positions_host_.assign(stream, 0);
  IG_RETURN_IF_ERROR(make(xb_, n * c.dim, "activations"));
  IG_RETURN_IF_ERROR(make(q_, n * c.q_dim(), "activations"));
  IG_RETURN_IF_ERROR(make(k_, n * c.kv_dim(), "activations"));
  IG_RETURN_IF_ERROR(make(v_, n * c.kv_dim(), "activations"));
  IG_RETURN_IF_ERROR(make(att_, n * c.q_dim(), "activations"));
  IG_RETURN_IF_ERROR(make(proj_, n * c.dim, "activations"));
  IG_RETURN_IF_ERROR(make(h1_, n * c.hidden_dim, "activations"));
  IG_RETURN_IF_ERROR(make(h3_, n * c.hidden_dim, "activations"));
  // One row per sequence; all_logits prefills grow it to their chunk.
  IG_RETURN_IF_ERROR(make(logits_,
                          static_cast<size_t>(options_.batch) * c.vocab_size,
                          "logits"));
  logits_host_.resize(logits_.size());
  step_positions_.reserve(options_.batch);
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
          &w.w2, &w.b1, &w.b2, &w.q_norm, &w.k_norm, &w.post_attn_norm,
          &w.post_ffn_norm}) {
      IG_RETURN_IF_ERROR(reg(*v));
    }
  }
  return absl::OkStatus();
}

Engine::~Engine() {
  // The cache closes its sequences and unpins its buffers while the
  // backend is alive.
  cache_.reset();
}

absl::Status Engine::CheckSlot(int slot) const {
  if (slot < 0 || slot >= batch()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "slot %d outside the engine's batch of %d", slot, batch()));
  }
  return absl::OkStatus();
}

absl::Status Engine::Flush() { return cache_->Flush(); }

absl::Status Engine::Reset(int slot) {
  IG_RETURN_IF_ERROR(CheckSlot(slot));
  positions_of_[slot] = 0;
  cached_of_[slot] = 0;
  history_[slot].clear();
  prompt_of_[slot] = 0;
  return cache_->Reset(slot);
}

absl::StatusOr<absl::Span<const float>> Engine::Forward(
    int slot, absl::Span<const int> tokens, bool all_logits) {
  return ForwardWith(slot, tokens, all_logits, /*row=*/nullptr);
}

absl::StatusOr<absl::Span<const float>> Engine::ForwardEachRow(
    int slot, absl::Span<const int> tokens, const RowLogits& row) {
  return ForwardWith(slot, tokens, /*all_logits=*/false, &row);
}

absl::StatusOr<absl::Span<const float>> Engine::ForwardWith(
    int slot, absl::Span<const int> tokens, bool all_logits,
    const RowLogits* row) {
  IG_RETURN_IF_ERROR(CheckSlot(slot));
  const ModelConfig& c = weights_.config;
  const int n = static_cast<int>(tokens.size());
  const int position = positions_of_[slot];
  if (n == 0) return absl::InvalidArgumentError("forward: no tokens");
  if (all_logits && n > max_chunk_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: all_logits for %d tokens exceeds max_chunk %d", n,
        max_chunk_));
  }
  if (position + n > max_seq_len_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "forward: sequence of %d tokens exceeds the cache's %d positions",
        position + n, max_seq_len_));
  }
  for (int t : tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "forward: token %d outside the vocabulary of %d", t, c.vocab_size));
    }
  }
  const bool offloaded = cache_->offloaded();
  if (offloaded && position > 0 && n == 1) {
    absl::StatusOr<absl::Span<const float>> logits =
        DecodeBatch({slot}, tokens);
    if (logits.ok() && row != nullptr) (*row)(0, *logits);
    return logits;
  }
  if (offloaded && position > 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "forward: policy %s decodes one token at a time after the prefill",
        options_.kv.policy_name()));
  }
  absl::StatusOr<absl::Span<const float>> out =
      ForwardChecked(slot, tokens, all_logits, row);
  if (out.ok() || position > 0 || !RecoverableKvLoss(out.status())) {
    return out;
  }
  // A prefill the memory node failed: the slot is empty again (the failed
  // prefill reset it); once more, on a fresh sequence.
  IG_LOG(WARNING) << "engine: the memory node failed slot " << slot
                  << "'s prefill (" << out.status().message()
                  << "); prefilling again";
  ++kv_recoveries_;
  return ForwardChecked(slot, tokens, all_logits, row);
}

bool Engine::RecoverableKvLoss(const absl::Status& status) const {
  if (!options_.recompute_on_kv_loss || !cache_->offloaded()) return false;
  // A node known to be down (timed out, or failing its heartbeats) would
  // fail the recomputation too, one more timeout later.
  const kv_memory_service::KvClient* kv = options_.kv.kv_client;
  if (kv != nullptr && (!kv->Unanswered().ok() || !kv->Health().ok())) {
    return false;
  }
  switch (status.code()) {
    case absl::StatusCode::kNotFound:            // the sequence is gone
    case absl::StatusCode::kFailedPrecondition:  // rows gone, buffer stuck
    case absl::StatusCode::kOutOfRange:          // a shorter sequence
    case absl::StatusCode::kUnavailable:         // restarting, unreachable
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

absl::Status Engine::Recompute(absl::Span<const int> slots,
                               const absl::Status& cause) {
  IG_LOG(WARNING) << "engine: the memory node lost the KV of "
                  << slots.size() << " sequence(s) (" << cause.message()
                  << "); recomputing it from their tokens";
  ++kv_recoveries_;
  for (int slot : slots) {
    const std::vector<int> tokens = std::move(history_[slot]);
    const int prompt = prompt_of_[slot];
    // Closing a lost sequence fails; the slot is clean regardless.
    Reset(slot).IgnoreError();
    IG_RETURN_IF_ERROR(ForwardChecked(slot,
                                      absl::MakeConstSpan(tokens.data(), prompt),
                                      /*all_logits=*/false)
                           .status());
    for (size_t i = prompt; i < tokens.size(); ++i) {
      IG_RETURN_IF_ERROR(DecodeChecked({slot}, {tokens[i]}).status());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const float>> Engine::ForwardChecked(
    int slot, absl::Span<const int> tokens, bool all_logits,
    const RowLogits* row) {
  const ModelConfig& c = weights_.config;
  const int n = static_cast<int>(tokens.size());
  const bool offloaded = cache_->offloaded();
  const int logit_rows =
      all_logits ? n : (row != nullptr ? std::min(n, max_chunk_) : 1);
  const size_t logit_values = static_cast<size_t>(logit_rows) * c.vocab_size;
  if (logits_.size() < logit_values) {
    IG_RETURN_IF_ERROR(backend_->Synchronize());
    logits_ = DeviceBuffer<float>();
    IG_ASSIGN_OR_RETURN(logits_, DeviceBuffer<float>::Make(
                                     backend_.get(), logit_values, "logits"));
    logits_host_.resize(logit_values);
  }
  // Reuse needs only the last token's logits: all_logits and row compute
  // all.
  absl::StatusOr<int> cached =
      Prefill(slot, tokens, /*reuse=*/!all_logits && row == nullptr);
  if (!cached.ok()) {
    // An offloaded cache cannot resume a prefill cut short: start over.
    if (offloaded) Reset(slot).IgnoreError();
    return cached.status();
  }
  if (history_[slot].empty()) prompt_of_[slot] = n;
  history_[slot].insert(history_[slot].end(), tokens.begin(), tokens.end());
  // Final norm and classifier: every computed row, or just the last one.
  const int computed = n - *cached;
  if (row != nullptr) {
    absl::Span<const float> last;
    for (int first = 0; first < computed; first += max_chunk_) {
      const int rows = std::min(max_chunk_, computed - first);
      IG_ASSIGN_OR_RETURN(absl::Span<const float> logits, Logits(first, rows));
      for (int r = 0; r < rows; ++r) {
        last = logits.subspan(static_cast<size_t>(r) * c.vocab_size,
                              c.vocab_size);
        (*row)(first + r, last);
      }
    }
    return last;
  }
  const int first = all_logits ? 0 : computed - 1;
  return Logits(first, computed - first);
}

absl::StatusOr<int> Engine::Prefill(int slot, absl::Span<const int> tokens,
                                    bool reuse) {
  const ModelConfig& c = weights_.config;
  const int n = static_cast<int>(tokens.size());
  const int position = positions_of_[slot];
  // Earlier steps' appends are in. One that failed marks its own slot
  // lost (its next step fails), not this prefill.
  cache_->Flush().IgnoreError();
  // Earlier operations may still read x_ and positions_.
  IG_RETURN_IF_ERROR(backend_->Synchronize());
  // The cache may hold a leading part already: only the rest is computed.
  IG_ASSIGN_OR_RETURN(const int cached,
                      cache_->BeginPrefill(slot, position, tokens, reuse));
  const int m = n - cached;
  const int first = position + cached;
  for (int i = 0; i < m; ++i) positions_host_[i] = first + i;
  Embed(tokens.data() + cached, m);
  // Layer by layer over the whole input, each layer in chunks: a layer's
  // K and V can leave before the next layer starts.
  for (int l = 0; l < c.n_layers; ++l) {
    for (int start = 0; start < m; start += max_chunk_) {
      const int len = std::min(max_chunk_, m - start);
      IG_RETURN_IF_ERROR(RunLayer(l, start, len, /*step=*/nullptr,
                                  first + start));
    }
    IG_RETURN_IF_ERROR(cache_->EndPrefillLayer(l));
    if (options_.on_prefill_layer) options_.on_prefill_layer(l + 1, c.n_layers, m);
  }
  IG_RETURN_IF_ERROR(cache_->EndPrefill());
  positions_of_[slot] += n;
  cached_of_[slot] = cached;
  return cached;
}

void Engine::Embed(const int* tokens, int n) {
  const ModelConfig& c = weights_.config;
  const int dim = c.dim;
  Backend& b = *backend_;
  // positions_host_ [0, n) is written; the backend's copy leaves after
  // every operation issued so far (the caller synchronized).
  b.CopyFromHost(positions_.data(), positions_host_.data(), n * sizeof(int),
                 b.MarkIssued());
  for (int i = 0; i < n; ++i) {
    float* x = x_.data() + static_cast<size_t>(i) * dim;
    b.Copy(x, &weights_.token_embedding[static_cast<size_t>(tokens[i]) * dim],
           dim);
    if (c.arch == Architecture::kOpt) {
      b.Add(x,
            &weights_.position_embedding[static_cast<size_t>(
                                             positions_host_[i] +
                                             ModelConfig::kOptPositionOffset) *
                                         dim],
            dim);
    }
  }
  if (c.embedding_scale != 1.0f) {
    b.Scale(x_.data(), static_cast<long>(n) * dim, c.embedding_scale);
  }
}

void Engine::AttentionNorm(const LayerWeights& w, const float* x, int n) {
  const ModelConfig& c = weights_.config;
  if (c.arch == Architecture::kOpt) {
    backend_->LayerNorm(x, n, c.dim, w.attn_norm.data(),
                        w.attn_norm_bias.data(), c.norm_eps, xb_.data());
  } else {
    backend_->RmsNorm(x, n, c.dim, w.attn_norm.data(), c.norm_eps,
                      xb_.data());
  }
}

void Engine::QueryKeyValue(int l, int n, const int* positions) {
  const ModelConfig& c = weights_.config;
  const LayerWeights& w = weights_.layers[l];
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
  if (c.arch == Architecture::kGemma3) {
    // Each head's query and key normalized (in place: a row is read whole
    // before it is written).
    b.RmsNorm(q_.data(), n * c.n_heads, c.head_dim, w.q_norm.data(),
              c.norm_eps, q_.data());
    b.RmsNorm(k_.data(), n * c.n_kv_heads, c.head_dim, w.k_norm.data(),
              c.norm_eps, k_.data());
  }
  if (!opt) {
    const float theta = c.RopeTheta(l);
    b.Rope(q_.data(), n, c.n_heads, c.head_dim, positions, theta);
    b.Rope(k_.data(), n, c.n_kv_heads, c.head_dim, positions, theta);
  }
}

void Engine::Mlp(const LayerWeights& w, float* x, int n) {
  const ModelConfig& c = weights_.config;
  Backend& b = *backend_;
  const int dim = c.dim;
  if (c.arch == Architecture::kOpt) {
    b.LayerNorm(x, n, dim, w.ffn_norm.data(), w.ffn_norm_bias.data(),
                c.norm_eps, xb_.data());
    b.Linear(xb_.data(), n, dim, w.w1.data(), w.b1.data(), c.hidden_dim,
             h1_.data());
    b.Relu(h1_.data(), static_cast<long>(n) * c.hidden_dim);
    b.Linear(h1_.data(), n, c.hidden_dim, w.w2.data(), w.b2.data(), dim,
             proj_.data());
  } else {
    const bool gemma = c.arch == Architecture::kGemma3;
    b.RmsNorm(x, n, dim, w.ffn_norm.data(), c.norm_eps, xb_.data());
    b.Linear(xb_.data(), n, dim, w.w1.data(), nullptr, c.hidden_dim,
             h1_.data());
    b.Linear(xb_.data(), n, dim, w.w3.data(), nullptr, c.hidden_dim,
             h3_.data());
    const long count = static_cast<long>(n) * c.hidden_dim;
    if (gemma) {
      b.GeluTanhGate(h1_.data(), h3_.data(), count);
    } else {
      b.SwiGlu(h1_.data(), h3_.data(), count);
    }
    b.Linear(h1_.data(), n, c.hidden_dim, w.w2.data(), nullptr, dim,
             proj_.data());
    if (gemma) {
      // The MLP's output normalized before the residual add.
      b.RmsNorm(proj_.data(), n, dim, w.post_ffn_norm.data(), c.norm_eps,
                proj_.data());
    }
  }
  b.Add(x, proj_.data(), static_cast<long>(n) * dim);
}

absl::StatusOr<absl::Span<const float>> Engine::Logits(int first, int rows) {
  const ModelConfig& c = weights_.config;
  const float* xr = x_.data() + static_cast<size_t>(first) * c.dim;
  if (c.arch == Architecture::kOpt) {
    backend_->LayerNorm(xr, rows, c.dim, weights_.final_norm.data(),
                        weights_.final_norm_bias.data(), c.norm_eps,
                        xb_.data());
  } else {
    backend_->RmsNorm(xr, rows, c.dim, weights_.final_norm.data(), c.norm_eps,
                      xb_.data());
  }
  backend_->Linear(xb_.data(), rows, c.dim, weights_.classifier(), nullptr,
                   c.vocab_size, logits_.data());
  const size_t values = static_cast<size_t>(rows) * c.vocab_size;
  IG_RETURN_IF_ERROR(backend_->CopyToHost(logits_host_.data(), logits_.data(),
                                          values * sizeof(float)));
  return absl::Span<const float>(logits_host_.data(), values);
}

absl::Status Engine::ObservePrefill(int l, int n, const float* x) {
  const ModelConfig& c = weights_.config;
  if (options_.attention_skew == nullptr && options_.observer == nullptr) {
    return absl::OkStatus();
  }
  // The skew and the observer work on host copies of q_ and k_.
  const size_t q_values = static_cast<size_t>(n) * c.q_dim();
  const size_t k_values = static_cast<size_t>(n) * c.kv_dim();
  q_host_.resize(q_values);
  k_host_.resize(k_values);
  IG_RETURN_IF_ERROR(backend_->CopyToHost(q_host_.data(), q_.data(),
                                          q_values * sizeof(float)));
  IG_RETURN_IF_ERROR(backend_->CopyToHost(k_host_.data(), k_.data(),
                                          k_values * sizeof(float)));
  if (options_.attention_skew != nullptr) {
    const int hd = c.head_dim, group = c.n_heads / c.n_kv_heads;
    // Each head's rows [n, heads, d] skewed by its KV head's A in one
    // product, into skew_rows_, then back.
    auto skew_rows = [&](std::vector<float>& rows, int heads, int per_kv) {
      skew_rows_.resize(rows.size());
      const int width = heads * hd;
      for (int h = 0; h < heads; ++h) {
        speculator::ApplySkew(rows.data() + h * hd, n, width,
                              options_.attention_skew->at(l, h / per_kv), hd,
                              skew_rows_.data() + h * hd, width);
      }
      rows.swap(skew_rows_);
    };
    skew_rows(q_host_, c.n_heads, group);
    skew_rows(k_host_, c.n_kv_heads, 1);
    // Back to the backend; the host copies stay unchanged until the next
    // CopyToHost, which waits for these.
    Backend& b = *backend_;
    b.CopyFromHost(q_.data(), q_host_.data(), q_values * sizeof(float),
                   b.MarkIssued());
    b.CopyFromHost(k_.data(), k_host_.data(), k_values * sizeof(float),
                   b.MarkIssued());
  }
  if (options_.observer != nullptr) {
    v_host_.resize(k_values);
    IG_RETURN_IF_ERROR(backend_->CopyToHost(v_host_.data(), v_.data(),
                                            k_values * sizeof(float)));
    x_host_.resize(static_cast<size_t>(n) * c.dim);
    IG_RETURN_IF_ERROR(backend_->CopyToHost(
        x_host_.data(), x, x_host_.size() * sizeof(float)));
    options_.observer->OnLayer(l, q_host_.data(), k_host_.data(),
                               v_host_.data(), x_host_.data(), n);
  }
  return absl::OkStatus();
}

absl::Status Engine::RunLayer(int l, int first, int n, KvStep* step,
                              int pos) {
  const ModelConfig& c = weights_.config;
  const LayerWeights& w = weights_.layers[l];
  const bool opt = c.arch == Architecture::kOpt;
  Backend& b = *backend_;
  float* x = x_.data() + static_cast<size_t>(first) * c.dim;
  const bool decode = step != nullptr;
  AttentionNorm(w, x, n);
  if (decode) IG_RETURN_IF_ERROR(step->LayerInput(l, xb_.data()));
  QueryKeyValue(l, n, positions_.data() + first);
  if (decode) {
    IG_RETURN_IF_ERROR(step->DecodeAttention(l, q_.data(), k_.data(),
                                             v_.data(), att_.data()));
  } else {
    IG_RETURN_IF_ERROR(ObservePrefill(l, n, x));
    IG_RETURN_IF_ERROR(cache_->PrefillAttention(
        l, pos, n, q_.data(), k_.data(), v_.data(), att_.data()));
  }
  b.Linear(att_.data(), n, c.q_dim(), w.wo.data(), opt ? w.bo.data() : nullptr,
           c.dim, proj_.data());
  if (c.arch == Architecture::kGemma3) {
    // The attention's output normalized before the residual add.
    b.RmsNorm(proj_.data(), n, c.dim, w.post_attn_norm.data(), c.norm_eps,
              proj_.data());
  }
  b.Add(x, proj_.data(), static_cast<long>(n) * c.dim);
  if (decode && l + 1 < c.n_layers && step->WantsPostAttentionInput()) {
    // xb_ is free until the MLP's norm: the next layer's norm of the
    // residual so far, from which the cache speculates that layer's fetch.
    AttentionNorm(weights_.layers[l + 1], x, n);
    IG_RETURN_IF_ERROR(step->PostAttentionInput(l, xb_.data()));
  }
  if (!decode && options_.observer != nullptr &&
      options_.observer->WantsPostAttention()) {
    x_host_.resize(static_cast<size_t>(n) * c.dim);
    IG_RETURN_IF_ERROR(backend_->CopyToHost(x_host_.data(), x,
                                            x_host_.size() * sizeof(float)));
    options_.observer->OnPostAttention(l, x_host_.data(), n);
  }
  Mlp(w, x, n);
  if (decode) IG_RETURN_IF_ERROR(step->LayerDone(l));
  return absl::OkStatus();
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
    const int position = positions_of_[slot_ids[i]];
    if (position == 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "decode: slot %d has no prefill", slot_ids[i]));
    }
    if (position >= max_seq_len_) {
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
  absl::StatusOr<absl::Span<const float>> out = DecodeChecked(slot_ids, tokens);
  if (out.ok() || !RecoverableKvLoss(out.status())) return out;
  IG_RETURN_IF_ERROR(Recompute(slot_ids, out.status()));
  return DecodeChecked(slot_ids, tokens);
}

absl::StatusOr<absl::Span<const float>> Engine::DecodeChecked(
    absl::Span<const int> slot_ids, absl::Span<const int> tokens) {
  const ModelConfig& c = weights_.config;
  const int n = static_cast<int>(slot_ids.size());
  // The previous step's appends must be in before this step fetches; a
  // slot whose rows did not get there fails BeginStep.
  cache_->Flush().IgnoreError();
  Backend& b = *backend_;
  IG_RETURN_IF_ERROR(b.Synchronize());
  step_positions_.clear();
  for (int i = 0; i < n; ++i) {
    step_positions_.push_back(positions_of_[slot_ids[i]]);
    positions_host_[i] = step_positions_[i];
  }
  Embed(tokens.data(), n);
  IG_ASSIGN_OR_RETURN(KvStepPtr step,
                      cache_->BeginStep(slot_ids, step_positions_));
  for (int l = 0; l < c.n_layers; ++l) {
    IG_RETURN_IF_ERROR(RunLayer(l, 0, n, step.get(), 0));
  }
  IG_ASSIGN_OR_RETURN(absl::Span<const float> logits, Logits(0, n));
  IG_RETURN_IF_ERROR(step->End());
  for (int i = 0; i < n; ++i) {
    ++positions_of_[slot_ids[i]];
    history_[slot_ids[i]].push_back(tokens[i]);
  }
  return logits;
}

}  // namespace infinigen::gpu_worker
