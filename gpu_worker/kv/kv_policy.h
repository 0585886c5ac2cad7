// KV policies: how a layer's K and V reach attention while decoding.
//
// One engine, many policies, chosen by a flag, so every comparison runs in
// one process on the same model:
//   full       offload; every cached row of every layer is fetched each step
//              (FlexGen)
//   infinigen  the first dense_layers layers (2, the paper's; 0 when it
//              speculates after the attention) fetch everything; layer
//              i >= 1 speculates which tokens layer i + 1 needs and only
//              those are fetched (layer 0, when not dense, ranks by its own
//              input, the first thing a step knows)
//   h2o        heavy hitters (accumulated attention) plus a recent window,
//              budget a fraction of the sequence, evicted for good
//   int4       rows stored group-wise 4-bit (asymmetric, group 64, FlexGen's
//              scheme); every row fetched
//   oracle     the upper bound of top-k selection: the first dense_layers
//              (2) fetch everything; each other layer fetches the exact top
//              `budget` of its own attention per KV head (ranked by the
//              largest of the group's query heads' log-softmax, as
//              infinigen ranks its speculated scores), chosen from its own
//              input (the fetch cannot leave early: a diagnostic, not a
//              serving policy)
//   quest      Quest's page selection: keys in pages of page_tokens, each
//              page's element-wise key min and max bound its best score;
//              the layers after the first dense_layers (2, as in the
//              paper) fetch the top budget of pages per KV head by
//              that bound for its own query (a peer at equal fetch; like
//              oracle, chosen from the layer's own input)
// Every policy stores rows in the memory node through a KvClient and
// fetches them with FetchPlans, so the rows moved per step are counted the
// same way for all. The bound of them all, the whole cache on the worker
// with nothing fetched, is not a policy but the local cache (`ideal`,
// KvOptions without a policy: kv_cache.h).
//
// KvPolicy is the offloaded KV cache's internal interface (kv_cache.h),
// implemented once per policy under kv/policies/: one per sequence, it owns
// the policy's state (partial key cache, accumulated attention;
// docs/design.md, "Where each policy's state lives"). Not thread-safe.
#ifndef INFINIGEN_GPU_WORKER_KV_KV_POLICY_H_
#define INFINIGEN_GPU_WORKER_KV_KV_POLICY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/kv_rows.h"
#include "gpu_worker/kv/policies/infinigen_options.h"
#include "gpu_worker/kv/policies/quest_options.h"
#include "gpu_worker/kv/policies/selection_options.h"
#include "kv_memory_service/client/kv_types.h"
#include "model/weights.h"
#include "speculator/speculator.h"

namespace infinigen::gpu_worker {

enum class PolicyKind {
  kFull, kInfiniGen, kH2O, kInt4, kOracle, kQuest
};

// Each kind is one file under kv/policies/ and one entry of its registry
// (kv/policies/registry.h), where its name, traits and factory live.
// By name ("full", "infinigen", ...); InvalidArgument naming the known
// ones. (--policy's "ideal", the local cache, is ChoosePolicy's: kv_cache.h.)
absl::StatusOr<PolicyKind> ParsePolicy(absl::string_view name);
const char* PolicyName(PolicyKind kind);

// Each policy reads its own options struct, declared beside it under
// kv/policies/ (its registry entry validates them and names the flags that
// set them); PolicyOptions carries one of each.

struct PolicyOptions {
  PolicyKind kind = PolicyKind::kFull;
  // infinigen, oracle, quest; h2o its budget.
  SelectionOptions selection;
  // infinigen and oracle.
  InfiniGenOptions infinigen;
  // quest.
  QuestOptions quest;

  // Whether a layer's fetch is chosen from that layer's own input
  // (same_layer_input, oracle, quest) rather than the previous layer's.
  bool SpeculatesFromOwnInput() const;
  // Whether layer l + 1's fetch is speculated after layer l's attention.
  bool SpeculatesAfterAttention() const;
  // Whether layer 0's rows are chosen (from its own attention input, at
  // the start of the layer) rather than all fetched at the step's start.
  bool SelectsLayerZero() const;

  // The options `kind` reads (its registry entry's validate): InvalidArgument
  // for values out of range, a missing skew, or adaptive budgets asked of a
  // policy without them.
  absl::Status Validate() const;
};

// Sets `options` (its kind already chosen) so that the mean fraction of
// cached rows fetched per decode step lands at `fraction` on a model of
// `n_layers` layers: infinigen, oracle and quest read their first
// D = options.selection.dense_layers layers whole, so the selecting layers take
// budget (fraction * n_layers - D) / (n_layers - D), with the alpha rule
// off (alpha 1e9: the cap decides) and no score mass; h2o keeps
// `fraction`. Sink and recent tokens come on top. InvalidArgument for a
// fraction outside (0, 1], one at or below what the dense layers fetch
// alone, or a policy whose fetch is not chosen (full, int4).
absl::Status SetTargetFetch(double fraction, int n_layers,
                            PolicyOptions& options);

// What a policy is, declared once in its registry entry
// (kv/policies/registry.h) and read by the cache before and while it acts.
struct PolicyTraits {
  // Whether a layer's rows are chosen rather than all read: dense_layers,
  // budget, sink and recent tokens apply, and layer 0 selects when
  // dense_layers is 0.
  bool selects = false;
  // Whether a layer's rows are chosen from that layer's own input (the
  // fetch cannot leave early) rather than the previous layer's.
  bool own_input = false;
  // InfiniGen's rehearsal: the policy needs a skew, and may speculate after
  // the attention (PolicyOptions::speculation_input).
  bool speculates = false;
  // Whether it takes per-(layer, KV head) budgets from a head profile.
  bool adaptive_budgets = false;
  // Whether it reads attention probabilities: the prefill's summed ones
  // (ObservePrefill's prob_sums) and each step's (ObserveAttention).
  bool attention_probs = false;
  // Whether a sequence may start from the rows of a prompt prefix another
  // sequence computed (kv_cache.h): not where the policy needs the whole
  // prompt's attention itself (h2o) or where its stored rows are far from
  // the exact ones (int4). A policy that reuses attends, in its prefill,
  // over its rows as stored (as it does over a reused prefix's), so that
  // reuse never changes an answer.
  bool reuses_prefix = true;
  // How it stores K and V rows.
  KvRowFormat row_format = KvRowFormat::kHalf;

  // An entry's traits read as a phrase: PolicyTraits().Selects().OwnInput().
  constexpr PolicyTraits Selects() const {
    return With(&PolicyTraits::selects, true);
  }
  constexpr PolicyTraits OwnInput() const {
    return With(&PolicyTraits::own_input, true);
  }
  constexpr PolicyTraits Speculates() const {
    return With(&PolicyTraits::speculates, true);
  }
  constexpr PolicyTraits AdaptiveBudgets() const {
    return With(&PolicyTraits::adaptive_budgets, true);
  }
  constexpr PolicyTraits AttentionProbs() const {
    return With(&PolicyTraits::attention_probs, true);
  }
  constexpr PolicyTraits NoPrefixReuse() const {
    return With(&PolicyTraits::reuses_prefix, false);
  }
  constexpr PolicyTraits Rows(KvRowFormat format) const {
    PolicyTraits t = *this;
    t.row_format = format;
    return t;
  }

 private:
  constexpr PolicyTraits With(bool PolicyTraits::*field, bool value) const {
    PolicyTraits t = *this;
    t.*field = value;
    return t;
  }
};

// What a policy derives from prefill queries and keys beyond the stored
// rows, per layer, as floats that add up over tokens (InfiniGen: the
// summed |q A| its partial columns rank by). A reused prefix block carries
// its tokens' sums, so that a sequence ranks as if it had seen them.
class PrefixSummary {
 public:
  virtual ~PrefixSummary() = default;
  // Floats per layer.
  virtual int floats() const = 0;
  // Adds the contribution of n prefill tokens of `layer` (q, k as in
  // KvPolicy::ObservePrefill: backend memory) to out [floats()] (host
  // memory). Errors are the backend's.
  virtual absl::Status Summarize(int layer, const float* q, const float* k,
                                 int n, float* out) = 0;
  // Counts a reused block's summary of `layer` as if ObservePrefill had
  // seen its tokens.
  virtual void Add(int layer, const float* state) = 0;
};

// What the cache allows a plan of `layer` to be, when positions [0, p)
// are cached.
struct PlanRequest {
  int layer = 0;
  int p = 0;
  // Layer - 1's attention input [dim] in the backend's memory (null for
  // layer 0 at the step's start; the layer's own input for policies that
  // choose from it).
  const float* input = nullptr;
  // [n_kv_heads, max_seq_len] on the host, 0 where the pool evicted a
  // token.
  const uint8_t* present = nullptr;
  // The cache reads each head's first p rows without indices (every
  // position present): a plan of every row may say so (kEveryRow).
  bool every_row_ok = false;
  // Backend memory with room for n_kv_heads * MaxBackendPlanRows(p)
  // indices, where a plan may be made on the backend (every position
  // present); null where it is the host's.
  int32_t* backend_indices = nullptr;
};

// What KvPolicy::Plan made.
enum class PlanMade {
  kIndices,    // plan.indices and head_offsets, on the host
  kEveryRow,   // each head's first p rows; plan.head_offsets alone
  kOnBackend,  // the indices in backend_indices; plan.head_offsets
};

class KvPolicy {
 public:
  struct Context {
    const model::Weights* weights = nullptr;
    // The engine's backend (its weights registered): a policy keeps its
    // per-token state in this backend's shared memory and runs its
    // arithmetic there.
    Backend* backend = nullptr;
    int max_seq_len = 0;  // positions the caches hold
  };

  static absl::StatusOr<std::unique_ptr<KvPolicy>> Create(
      const PolicyOptions& options, const Context& context);
  // The same without allocating its state: for the sizes and properties
  // below (RowWidth, MaxPlanRows, traits), not for use.
  static absl::StatusOr<std::unique_ptr<KvPolicy>> CreateUninitialized(
      const PolicyOptions& options, const Context& context);
  // Bytes of per-sequence state a policy of these options holds on the
  // worker (InfiniGen's partial key cache and weights, H2O's scores and kept
  // set), as Create would allocate them; computed without allocating.
  static absl::StatusOr<int64_t> StateBytes(const PolicyOptions& options,
                                            const Context& context);
  virtual ~KvPolicy() = default;

  // Its registry entry's.
  const PolicyTraits& traits() const { return traits_; }
  KvRowFormat row_format() const { return traits_.row_format; }
  bool ReusesPrefix() const { return traits_.reuses_prefix; }
  bool WantsAttentionProbs() const { return traits_.attention_probs; }
  // Whether ObservePrefill and the prefix summary read q and k (the cache
  // then passes them, in the backend's memory; else null). Fixed at
  // creation.
  bool ObservesPrefill() const { return observes_prefill_; }
  // The policy's prefix summary; null where it keeps none. Fixed at
  // creation.
  PrefixSummary* prefix_summary() const { return prefix_summary_; }

  // uint16_t values per stored K or V row.
  int RowWidth() const;
  // rows [n_rows, head_dim] fp32 -> out [n_rows, RowWidth()], on the host
  // (the backend decodes them: PolicyOps::DecodeKvRows).
  void EncodeRows(const float* rows, int n_rows, uint16_t* out) const;
  // Most rows of one (layer, KV head) a plan of this policy names when
  // positions [0, p) are cached: what the fetch staging must hold.
  virtual int MaxPlanRows(int p) const { return p; }
  // Plans made where the scores are (device-side selection): the most rows
  // of one KV head a plan made on the backend names when positions [0, p)
  // are cached; 0 where the policy plans on the host only.
  virtual int MaxBackendPlanRows(int p) const { return 0; }

  // A new sequence begins.
  virtual void Reset() {}

  // Prefill, layer by layer, each layer in chunks: layer's post-RoPE
  // queries q [n, n_heads, head_dim] and keys k [n, n_kv_heads, head_dim]
  // of positions [first_pos, first_pos + n) (backend memory; null unless
  // ObservesPrefill), and, with the attention_probs trait, the summed
  // attention probabilities prob_sums [n_heads, first_pos + n] (host).
  virtual void ObservePrefill(int layer, const float* q, const float* k,
                              int n, int first_pos, const float* prob_sums) {}

  // After layer's last prefill chunk: keys [n_kv_heads, key_stride,
  // head_dim] (backend memory) hold its post-RoPE keys of positions
  // [0, n_tokens). Errors are the backend's.
  virtual absl::Status FinishPrefillLayer(int layer, int n_tokens,
                                          const float* keys, int key_stride) {
    return absl::OkStatus();
  }

  // The rows `request.layer` attends to: where the plan is every present
  // row and request.every_row_ok, kEveryRow (head offsets alone); where
  // the policy can make it on the backend (its scores never leaving the
  // backend's memory) and request.backend_indices is set, kOnBackend
  // (each head's indices ascending there, its head offsets in `plan`);
  // else kIndices with plan's indices on the host. By default every
  // present row (full, int4). Errors are the backend's.
  virtual absl::StatusOr<PlanMade> Plan(
      const PlanRequest& request, kv_memory_service::OwnedFetchPlan& plan) {
    return PlanEveryRow(request, plan);
  }

  // After `layer`'s attention over `plan`'s rows plus the new token:
  // probs [n_heads, stride], head h's row holds the probability of each of
  // its KV head's plan entries in order, then the new token's.
  virtual void ObserveAttention(int layer,
                                const kv_memory_service::FetchPlan& plan,
                                const float* probs, int stride) {}

  // After a decode step: key [n_kv_heads, head_dim] (backend memory) is the
  // post-RoPE key of the new token at position p of `layer`.
  virtual void OnDecodeAppend(int layer, int p, const float* key) {}

 protected:
  explicit KvPolicy(const Context& context) : ctx_(context) {}
  // Allocates what the policy keeps in the backend's memory.
  virtual absl::Status Init() { return absl::OkStatus(); }
  // Every present row: kEveryRow where the request allows it, else each
  // head's present positions, ascending.
  PlanMade PlanEveryRow(const PlanRequest& request,
                        kv_memory_service::OwnedFetchPlan& plan) const;
  void PlanAllPresent(int p, const uint8_t* present,
                      kv_memory_service::OwnedFetchPlan& plan) const;
  const model::ModelConfig& config() const { return ctx_.weights->config; }
  void set_observes_prefill(bool observes) { observes_prefill_ = observes; }
  void set_prefix_summary(PrefixSummary* summary) { prefix_summary_ = summary; }

  Context ctx_;

 private:
  PolicyTraits traits_;
  bool observes_prefill_ = false;
  PrefixSummary* prefix_summary_ = nullptr;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_KV_POLICY_H_
