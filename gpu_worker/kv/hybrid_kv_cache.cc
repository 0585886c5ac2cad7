// The hybrid KV cache (kv_cache.h): an offloading policy on a model that
// mixes sliding-window and global layers (Gemma 3).
//
// A sliding-window layer's rows are needed only for `window` positions, so
// the worker keeps them, in the local cache's sliding buffers (bounded,
// whatever the context). The global layers' rows grow with the context and
// go to the memory node through an offloaded cache over the global layers
// alone (GlobalModel: the model as if it had only those layers), whose
// sequence on the node holds nothing else and whose policy, dense layers
// and target fetch count only them.
//
// A decode step names the offloaded cache's fetch points in the real
// model's terms: a global layer's fetch "from the previous layer's input"
// (or after its attention) is speculated from the input of the layer just
// before it, a sliding-window layer, and moves to the backend while that
// layer computes. Prefix reuse is off: the node does not hold the
// sliding-window layers' rows of a prefix.
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "gpu_worker/kv/kv_cache_impl.h"
#include "gpu_worker/kv/offloaded_kv_cache.h"

namespace infinigen::gpu_worker {

int OffloadedLayerCount(const model::ModelConfig& c) {
  int n = 0;
  for (int l = 0; l < c.n_layers; ++l) n += c.IsLocalLayer(l) ? 0 : 1;
  return n;
}

namespace {

// The global layers of a model as a model of their own, and the options of
// the offloaded cache over them: the policy's skew and head profile cut to
// those layers.
struct GlobalModel {
  model::Weights weights;       // config without windows; no embeddings
  std::vector<int> real;        // [global layer]: its layer in the model
  std::vector<int> global_of;   // [layer]: its global index, or -1
  std::unique_ptr<speculator::SkewMatrices> skew;
  std::unique_ptr<speculator::HeadProfile> profile;
  KvCacheOptions options;
};

// `full`'s layers `real`, in that order.
speculator::HeadProfile CutProfile(const speculator::HeadProfile& full,
                                   const std::vector<int>& real) {
  speculator::HeadProfile cut;
  cut.n_layers = static_cast<int>(real.size());
  cut.n_kv_heads = full.n_kv_heads;
  cut.partial_ratio = full.partial_ratio;
  cut.fractions = full.fractions;
  const size_t per =
      static_cast<size_t>(full.n_kv_heads) * full.fractions.size();
  for (int l : real) {
    const size_t at = full.Offset(l, 0);
    cut.error.insert(cut.error.end(), full.error.begin() + at,
                     full.error.begin() + at + per);
    if (!full.speculated_error.empty()) {
      cut.speculated_error.insert(cut.speculated_error.end(),
                                  full.speculated_error.begin() + at,
                                  full.speculated_error.begin() + at + per);
    }
  }
  return cut;
}

absl::StatusOr<std::unique_ptr<GlobalModel>> MakeGlobalModel(
    const model::Weights& weights, const KvCacheOptions& options) {
  const model::ModelConfig& c = weights.config;
  auto g = std::make_unique<GlobalModel>();
  g->global_of.assign(c.n_layers, -1);
  for (int l = 0; l < c.n_layers; ++l) {
    if (c.IsLocalLayer(l)) continue;
    g->global_of[l] = static_cast<int>(g->real.size());
    g->real.push_back(l);
  }
  if (g->real.empty()) {
    return absl::InvalidArgumentError(
        "kv cache: every layer has a sliding window; nothing to offload (use "
        "--policy=ideal)");
  }
  const int n = static_cast<int>(g->real.size());
  g->weights.config = c;
  g->weights.config.n_layers = n;
  g->weights.config.sliding_window = 0;
  g->weights.config.sliding_window_pattern = 0;
  for (int l : g->real) g->weights.layers.push_back(weights.layers[l]);
  g->options = options;
  g->options.kv.prefix_block_tokens = 0;  // the node lacks the window layers
  PolicyOptions& p = *g->options.kv.policy;
  if (p.infinigen.skew != nullptr) {
    const speculator::SkewMatrices& full = *p.infinigen.skew;
    if (full.n_layers != c.n_layers) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "kv cache: the skew has %d layers, the model %d", full.n_layers,
          c.n_layers));
    }
    auto skew = std::make_unique<speculator::SkewMatrices>();
    skew->n_layers = n;
    skew->n_kv_heads = full.n_kv_heads;
    skew->head_dim = full.head_dim;
    const size_t per_layer =
        static_cast<size_t>(full.n_kv_heads) * full.head_dim * full.head_dim;
    for (int l : g->real) {
      const float* a = full.at(l, 0);
      skew->a.insert(skew->a.end(), a, a + per_layer);
    }
    if (!full.profile.empty()) {
      skew->profile = CutProfile(full.profile, g->real);
    }
    g->skew = std::move(skew);
    p.infinigen.skew = g->skew.get();
  }
  if (p.infinigen.profile != nullptr && !p.infinigen.profile->empty()) {
    if (p.infinigen.profile->n_layers != c.n_layers) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "kv cache: the head profile has %d layers, the model %d",
          p.infinigen.profile->n_layers, c.n_layers));
    }
    g->profile = std::make_unique<speculator::HeadProfile>(
        CutProfile(*p.infinigen.profile, g->real));
    p.infinigen.profile = g->profile.get();
  }
  return g;
}

class HybridKvCache final : public KvCache {
 public:
  HybridKvCache(std::unique_ptr<GlobalModel> global,
                std::unique_ptr<KvCache> local,
                std::unique_ptr<offloaded::OffloadedKvCache> offloaded)
      : global_(std::move(global)),
        local_(std::move(local)),
        offloaded_(std::move(offloaded)),
        step_(*this) {}

  absl::StatusOr<int> BeginPrefill(int slot, int first,
                                   absl::Span<const int> tokens,
                                   bool reuse) override {
    IG_RETURN_IF_ERROR(local_->BeginPrefill(slot, first, tokens, false).status());
    // Nothing is reused: every layer's rows are computed.
    IG_ASSIGN_OR_RETURN(const int cached,
                        offloaded_->BeginPrefill(slot, first, tokens, false));
    if (cached != 0) {
      return absl::InternalError("kv cache: a prefix was reused without reuse");
    }
    return 0;
  }
  absl::Status PrefillAttention(int layer, int pos, int rows, const float* q,
                                const float* k, const float* v,
                                float* out) override {
    const int g = global_->global_of[layer];
    if (g < 0) return local_->PrefillAttention(layer, pos, rows, q, k, v, out);
    return offloaded_->PrefillAttention(g, pos, rows, q, k, v, out);
  }
  absl::Status EndPrefillLayer(int layer) override {
    const int g = global_->global_of[layer];
    if (g < 0) return local_->EndPrefillLayer(layer);
    return offloaded_->EndPrefillLayer(g);
  }
  absl::Status EndPrefill() override {
    IG_RETURN_IF_ERROR(local_->EndPrefill());
    return offloaded_->EndPrefill();
  }

  absl::StatusOr<KvStepPtr> BeginStep(
      absl::Span<const int> slots, absl::Span<const int> positions) override {
    if (step_.open()) {
      return absl::FailedPreconditionError(
          "kv cache: a decode step is already open");
    }
    IG_ASSIGN_OR_RETURN(KvStepPtr local, local_->BeginStep(slots, positions));
    IG_ASSIGN_OR_RETURN(KvStepPtr off, offloaded_->BeginStep(slots, positions));
    step_.Open(std::move(local), std::move(off));
    return KvStepPtr(&step_);
  }
  absl::Status Reset(int slot) override {
    absl::Status local = local_->Reset(slot);
    absl::Status off = offloaded_->Reset(slot);
    return off.ok() ? local : off;
  }
  absl::Status Flush() override { return offloaded_->Flush(); }
  bool offloaded() const override { return true; }
  const FetchStats& fetch_stats(int slot) const override {
    return offloaded_->fetch_stats(slot);
  }
  int64_t worker_bytes() const override {
    return local_->worker_bytes() + offloaded_->worker_bytes();
  }
  int64_t node_bytes() const override { return offloaded_->node_bytes(); }

 private:
  // A decode step: the sliding-window layers' through the local cache's
  // step, the global layers' through the offloaded one's, whose fetch
  // points it names in the real model's layers.
  class Step final : public KvStep {
   public:
    explicit Step(HybridKvCache& cache) : cache_(cache) {}
    bool open() const { return off_ != nullptr; }
    void Open(KvStepPtr local, KvStepPtr off) {
      local_ = std::move(local);
      off_ = std::move(off);
    }

    const FetchSchedule& schedule() const override {
      return off_->schedule();
    }
    absl::Status LayerInput(int layer, const float* xb) override {
      const GlobalModel& gm = *cache_.global_;
      const int g = gm.global_of[layer];
      if (g < 0) {
        IG_RETURN_IF_ERROR(local_->LayerInput(layer, xb));
      } else {
        // Its own input: the fetches ranked by it.
        IG_RETURN_IF_ERROR(
            cache_.offloaded_->IssueDue(FetchPoint::kOwnInput, g, xb));
      }
      // The input of the layer before a global layer: that layer's
      // speculated fetch (the offloaded cache's "previous layer" g - 1).
      if (const int next = NextGlobal(layer); next >= 0) {
        IG_RETURN_IF_ERROR(cache_.offloaded_->IssueDue(
            FetchPoint::kPreviousInput, next - 1, xb));
      }
      return absl::OkStatus();
    }
    absl::Status PostAttentionInput(int layer, const float* xb_next) override {
      if (const int next = NextGlobal(layer); next >= 0) {
        return cache_.offloaded_->IssueDue(FetchPoint::kPreviousAttention,
                                           next - 1, xb_next);
      }
      return absl::OkStatus();
    }
    absl::Status DecodeAttention(int layer, const float* q, const float* k,
                                 const float* v, float* out) override {
      const int g = cache_.global_->global_of[layer];
      if (g < 0) return local_->DecodeAttention(layer, q, k, v, out);
      return off_->DecodeAttention(g, q, k, v, out);
    }
    absl::Status LayerDone(int layer) override {
      // Before a global layer, its rows move to the backend while this
      // layer's output projection and MLP compute (the offloaded step's
      // LayerDone of the global layer before it).
      if (const int next = NextGlobal(layer); next >= 1) {
        return off_->LayerDone(next - 1);
      }
      return absl::OkStatus();
    }
    absl::Status End() override {
      IG_RETURN_IF_ERROR(local_->End());
      return off_->End();
    }

   private:
    // The global index of layer + 1 when it is global, else -1.
    int NextGlobal(int layer) const {
      const GlobalModel& gm = *cache_.global_;
      return layer + 1 < static_cast<int>(gm.global_of.size())
                 ? gm.global_of[layer + 1]
                 : -1;
    }
    void Close() override {
      off_.reset();
      local_.reset();
    }

    HybridKvCache& cache_;
    KvStepPtr local_, off_;
  };

  const std::unique_ptr<GlobalModel> global_;
  const std::unique_ptr<KvCache> local_;
  const std::unique_ptr<offloaded::OffloadedKvCache> offloaded_;
  Step step_;
};

}  // namespace

absl::StatusOr<int64_t> HybridKvCacheBytes(const model::Weights& weights,
                                           const KvCacheOptions& options) {
  IG_ASSIGN_OR_RETURN(std::unique_ptr<GlobalModel> g,
                      MakeGlobalModel(weights, options));
  IG_ASSIGN_OR_RETURN(const int64_t off,
                      OffloadedKvCacheBytes(g->weights, g->options));
  return LocalKvCacheBytes(weights.config, options, /*only_windows=*/true) +
         off;
}

absl::StatusOr<std::unique_ptr<KvCache>> NewHybridKvCache(
    const model::Weights& weights, Backend* backend,
    const KvCacheOptions& options) {
  IG_ASSIGN_OR_RETURN(std::unique_ptr<GlobalModel> g,
                      MakeGlobalModel(weights, options));
  // The global layers' weights are copies: the backend takes them as
  // constants as it took the model's (a device backend copies them).
  for (const model::LayerWeights& w : g->weights.layers) {
    for (const std::vector<float>* t :
         {&w.attn_norm, &w.wq, &w.wk, &w.wv, &w.wo, &w.ffn_norm, &w.w1,
          &w.w3, &w.w2, &w.q_norm, &w.k_norm, &w.post_attn_norm,
          &w.post_ffn_norm}) {
      if (!t->empty()) {
        IG_RETURN_IF_ERROR(backend->RegisterConstant(t->data(), t->size()));
      }
    }
  }
  IG_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> local,
                      NewLocalKvCache(weights, backend, options,
                                      /*only_windows=*/true));
  IG_ASSIGN_OR_RETURN(
      const offloaded::Layout z,
      offloaded::MakeLayout(g->weights, backend->OperatesOnHostMemory(),
                            g->options));
  auto off = std::make_unique<offloaded::OffloadedKvCache>(
      g->weights, backend, g->options, z);
  IG_RETURN_IF_ERROR(off->Init());
  return std::unique_ptr<KvCache>(std::make_unique<HybridKvCache>(
      std::move(g), std::move(local), std::move(off)));
}

}  // namespace infinigen::gpu_worker
