// KvCache: where the engine's attention finds K and V. The seam between the
// forward pass and the KV cache, in the spirit of llama.cpp's memory
// interface: the engine runs the layers and calls the cache at a few points
// per layer; the cache decides where rows live and how they reach attention.
//
// Two implementations:
//  - local (KvOptions without a policy; --policy=ideal): every slot's whole
//    cache [layer][kv_head][position][head_dim] in the backend's device
//    memory; nothing fetched.
//  - hybrid (a KvPolicy on a model with sliding-window layers): those
//    layers local in buffers bounded by their window, the global layers
//    offloaded as below (hybrid_kv_cache.cc).
//  - offloaded (a KvPolicy: full, infinigen, h2o, ...): the memory node holds every
//    row (through a KvClient); the worker holds a bounded working set: each
//    sequence's policy state (InfiniGen's partial key cache, H2O's scores
//    and kept set), staging for the rows of the one or two layers in flight,
//    and during a prefill one layer's prompt rows. Prefill runs layer by
//    layer: each layer's K and V go to the memory node before the next
//    layer starts. A decode step fetches layer l + 1's rows while layer l
//    computes, copies them to the backend beside the operations and decodes
//    them where attention reads them; the step's new rows are appended on a
//    background thread while the last MLP and the classifier run.
//
// The engine owns the cache; the cache owns its buffers and policies and
// borrows the backend, the weights and the KvClient (which outlive it).
// Not thread-safe: one engine drives it.
//
// Call order. Prefill of one slot (positions [first, first + n)):
//   BeginPrefill (which may find a leading part of the prompt already
//   cached: the chunks then start after it); for each layer: for each
//   chunk: PrefillAttention; EndPrefillLayer; then EndPrefill.
//
// Prefix reuse (offloaded, with prefix_block_tokens): BeginPrefill opens
// the slot's sequence on the memory node with the prompt's block keys
// (kv_memory_service/prefix_keys.h over model_identity and the row
// format) and learns how many leading tokens another sequence (of this
// worker or another) already stored; those rows are fetched layer by
// layer during the prefill instead of computed, and the policy's prompt
// statistics come with the blocks, so decoding behaves as without reuse.
// Decode step of several slots (one token each, row i = slots[i]):
//   BeginStep returns the step (a KvStep); for each layer: LayerInput
//   (after the attention norm), DecodeAttention (after Q, K, V),
//   PostAttentionInput (after the attention's residual add, where the step
//   wants it), LayerDone (after the MLP); then End. Which of these points
//   sends each layer's fetch is the step's FetchSchedule
//   (kv/fetch_schedule.h), stated once per policy; the offloaded step
//   issues what is due at each point in one place (docs/design.md, "One
//   decode step").
#ifndef INFINIGEN_GPU_WORKER_KV_KV_CACHE_H_
#define INFINIGEN_GPU_WORKER_KV_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/fetch_schedule.h"
#include "gpu_worker/kv/kv_policy.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/weights.h"

namespace infinigen::gpu_worker {

// What a slot's policy moved, over its decode steps since its last Reset,
// and what its prompt's prefill waited for.
struct FetchStats {
  long steps = 0;
  double fraction_sum = 0;   // sum over steps of fetched rows / cached rows
  double fraction_max = 0;
  long rows_fetched = 0;     // K/V row pairs, all layers and heads
  long bytes_fetched = 0;    // K and V bytes as stored (fp16 or int4)
  // Of rows_fetched, those read where the node keeps them (one-sided
  // reads, KvOptions::direct_reads) instead of gathered by it.
  long rows_read_in_place = 0;
  double wait_seconds = 0;   // blocked in fetch Wait()
  // The worker's row cache (KvOptions::row_cache): planned rows looked up
  // and those it held (not fetched: rows_fetched and bytes_fetched count
  // the rest), in all and per layer; and the bytes of the rows it holds
  // at the last step's end.
  long row_cache_lookups = 0;
  long row_cache_hits = 0;
  std::vector<long> row_cache_layer_lookups, row_cache_layer_hits;
  int64_t row_cache_bytes = 0;
  // Per layer, where a row cache watches: selected rows the layer's
  // previous step selected too (the overlap of consecutive selections;
  // of row_cache_layer_lookups).
  std::vector<long> selection_layer_repeats;
  // Per layer, with KvOptions::watch_positions: the (KV head, watched
  // position) pairs a step could select (cached, held by the node) and
  // those its plan selected, summed over steps. A plan the policy left on
  // the device is not counted.
  std::vector<long> watched_layer_candidates, watched_layer_selected;
  // Prefill: opening the sequence at the memory node (with its rows pinned
  // for one-sided reads), and blocked on a layer's append to the node
  // after the next layer's work was done.
  double open_seconds = 0;
  double prefill_append_wait_seconds = 0;
  // Prefill: the policy's own work on the host, beside attention (its
  // ObservePrefill, FinishPrefillLayer and prefix summaries: InfiniGen's
  // partial keys, column sums and head profile; H2O's and oracle's scores).
  double prefill_policy_seconds = 0;
  double fraction_mean() const { return steps ? fraction_sum / steps : 0.0; }
  double row_cache_hit_rate() const {
    return row_cache_lookups
               ? static_cast<double>(row_cache_hits) / row_cache_lookups
               : 0.0;
  }
  void Add(const FetchStats& o);
};

// Which held row a miss of the worker's row cache replaces once the cache
// is at its bound (offloaded/row_cache.h): its head's least recently
// selected row, or its least often selected one (selections since the row
// last took its slot; the least recent of those on a tie). Never a row
// the step selected.
enum class RowCacheReplacement { kRecency, kFrequency };

// How the KV cache keeps K and V, as its user chooses it (the engine's
// EngineOptions::kv, copied whole into the cache's options).
struct KvOptions {
  // What a decode step fetches from the memory node: the cache is offloaded
  // with this policy. None: the local cache, the whole of it on the worker
  // (`ideal`, the bound every policy is measured against).
  std::optional<PolicyOptions> policy;
  // The memory node (offloaded only; not owned, outlives the cache).
  kv_memory_service::KvClient* kv_client = nullptr;
  // Tokens the memory node keeps per (layer, KV head), as a fraction of
  // max_seq_len; below 1 its pool evicts.
  double kv_capacity = 1.0;
  // Most bytes the cache may hold on the worker (K/V rows, staging and
  // policy state: KvCache::WorkerBytes); 0 = no limit. Create refuses a
  // configuration above it with ResourceExhausted, before allocating.
  int64_t max_worker_bytes = 0;
  // Prefix reuse through the memory node (offloaded only): tokens per
  // shared block; 0 = none. A prefill that asks for one logit row starts
  // after the prompt's longest prefix the node holds.
  int prefix_block_tokens = 0;
  // One-sided reads: where the memory node shares the worker's process
  // (inproc:), the backend reads the rows a step selects straight from the
  // node's memory instead of the node gathering them for a copy; the node
  // is told what was read. A device gathers them into its staging
  // (GatherRows; each sequence's reserved rows are pinned when it opens,
  // about as long as touching that memory once); the CPU's attention reads
  // fp16 rows where they lie (AttendStoredRows with indices: no copy).
  // Sequences with a reused prefix, or that the node may evict from
  // (kv_capacity < 1), and the CPU's int4 rows are gathered by the node.
  bool direct_reads = false;
  // The worker's row cache: rows a decode step fetched stay on the worker,
  // up to this fraction of a sequence's cached rows (all layers and KV
  // heads together),
  // and a later step fetches only the rows it does not hold
  // (offloaded/row_cache.h); attention computes the same. For the policies
  // that select rows, where the node gathers (not with one-sided reads,
  // which copy nothing): on a host backend in host memory, on a device in
  // its memory for the policies that want no attention probabilities (not
  // h2o). The node is told of the rows held (KvClient::NoteHeldAsync), so
  // that its statistics and evictions are those of fetching every row.
  // Under max_worker_bytes it takes what the rest leaves: less, or none.
  // 0 = none; at most 1.
  double row_cache = 0.0;
  RowCacheReplacement row_cache_replacement = RowCacheReplacement::kRecency;
  // Positions whose selection each decode step counts, per layer
  // (FetchStats::watched_layer_*): which of a needle's rows a policy
  // reads. Sorted, without repeats; empty: none counted.
  std::vector<int32_t> watch_positions;
  // Names the model and everything its rows depend on (weights, skew;
  // ModelIdentity in the worker's commands); the cache adds the policy and
  // row format. Reuse needs it non-empty.
  std::string model_identity;

  // InvalidArgument naming the field out of range, an invalid policy, or
  // a policy without kv_client.
  absl::Status Validate() const;
  // "ideal" (no policy) or the policy's name.
  const char* policy_name() const;
};

// The layers an offloading policy serves from the memory node: every
// layer, or, in a model with sliding-window layers (Gemma 3), its global
// layers alone (the sliding-window layers keep their bounded rows on the
// worker). A policy's dense_layers and target fetch count these layers.
int OffloadedLayerCount(const model::ModelConfig& c);

// The name --policy gives the local cache.
inline constexpr char kLocalCacheName[] = "ideal";
// Sets kv.policy from a --policy name: "ideal" clears it (the local cache);
// a registered policy's name sets its kind, keeping the other fields
// (PolicyOptions' defaults where there was none). InvalidArgument naming
// every choice.
absl::Status ChoosePolicy(absl::string_view name, KvOptions& kv);

// One decode step of several slots, from KvCache::BeginStep to End: the
// points of the step where the cache moves rows. The cache owns it and
// reuses it step after step (nothing is allocated per step); BeginStep
// hands it out as a KvStepPtr, whose dropping ends the step: one step at a
// time. A step dropped before End (an error part way) counts none of its
// fetches.
class KvStep {
 public:
  // When each layer's fetch leaves (every DueAt -1 for the local cache:
  // nothing is fetched).
  virtual const FetchSchedule& schedule() const = 0;
  // Whether the step speculates layer l + 1's fetch from the residual
  // stream after layer l's attention (PostAttentionInput) rather than from
  // layer l's input.
  bool WantsPostAttentionInput() const {
    return schedule().WantsPostAttentionInput();
  }

  // `layer`'s attention input xb [rows, dim] is queued.
  virtual absl::Status LayerInput(int layer, const float* xb) = 0;
  // With WantsPostAttentionInput, for layer + 1 < n_layers: `layer`'s
  // attention and its residual add are queued, and xb_next [rows, dim] is
  // layer + 1's attention norm of the residual stream at this point (before
  // layer's MLP).
  virtual absl::Status PostAttentionInput(int layer, const float* xb_next) {
    return absl::OkStatus();
  }
  // q [rows, n_heads, head_dim], k, v [rows, n_kv_heads, head_dim] and out
  // [rows, n_heads * head_dim] (backend memory), one row per slot of the
  // step: the new tokens' attention over their cached rows and themselves.
  virtual absl::Status DecodeAttention(int layer, const float* q,
                                       const float* k, const float* v,
                                       float* out) = 0;
  // `layer`'s attention output projection and MLP are queued.
  virtual absl::Status LayerDone(int layer) = 0;
  // After the step's last operation (backend synchronized): counts the
  // step's fetches into each slot's FetchStats.
  virtual absl::Status End() = 0;

 protected:
  ~KvStep() = default;  // its cache's, never deleted through this

 private:
  friend struct KvStepCloser;
  // The step was dropped: its cache may open the next.
  virtual void Close() = 0;
};

// Closes, rather than deletes, the step it holds.
struct KvStepCloser {
  void operator()(KvStep* step) const { step->Close(); }
};
// The open step of a cache; dropping it ends the step.
using KvStepPtr = std::unique_ptr<KvStep, KvStepCloser>;

struct KvCacheOptions {
  int batch = 1;        // sequence slots
  int max_seq_len = 0;  // positions per slot
  int max_chunk = 1;    // most prefill tokens per PrefillAttention
  // The rows kept on the worker for attention in fp16 rather than fp32:
  // the local cache's, and a device's offloaded prefill layer
  // (offloaded::Layout::half_rows). The engine sets it where
  // Backend::HalfKvCache() and head_dim is even.
  bool half_local_kv = false;
  KvOptions kv;
};

class KvCache {
 public:
  // The local cache without a policy, the offloaded one with it.
  // InvalidArgument for bad options (a policy without kv_client);
  // ResourceExhausted, naming what the configuration needs and the limit,
  // when WorkerBytes(...) > max_worker_bytes, or when the backend is out of
  // memory.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(
      const model::Weights& weights, Backend* backend,
      const KvCacheOptions& options);
  // Bytes the cache of these options holds on the worker (backend and host
  // memory: K/V rows, staging, decoded rows, policy state), computed without
  // allocating. The accounting `bench-decode` reports as worker_kv_bytes.
  static absl::StatusOr<int64_t> WorkerBytes(const model::Weights& weights,
                                             const KvCacheOptions& options);
  virtual ~KvCache() = default;

  // --- Prefill of one slot, layer-major.
  // `tokens` at positions [first, first + n). Returns how many leading
  // tokens are already cached (prefix reuse, when `reuse` and the cache
  // does it; fewer than n): the engine computes only the rest, and the
  // PrefillAttention calls start at first + that. FailedPrecondition where
  // the cache cannot continue this slot's prefill (offloaded: after its
  // first prefill call).
  virtual absl::StatusOr<int> BeginPrefill(int slot, int first,
                                           absl::Span<const int> tokens,
                                           bool reuse) = 0;
  // One chunk of `layer`: q [rows, n_heads, head_dim] and k, v [rows,
  // n_kv_heads, head_dim] (backend memory, host-readable after
  // Synchronize) of positions [pos, pos + rows). Stores the chunk's K and V
  // and queues causal attention of its queries over every position up to
  // their own into out [rows, n_heads * head_dim].
  virtual absl::Status PrefillAttention(int layer, int pos, int rows,
                                        const float* q, const float* k,
                                        const float* v, float* out) = 0;
  virtual absl::Status EndPrefillLayer(int layer) = 0;
  virtual absl::Status EndPrefill() = 0;

  // --- Decode step of `slots` (distinct, each prefilled), slot slots[i]'s
  // new token at positions[i], in row i of the engine's activations. The
  // step's first fetches leave here (FetchPoint::kStepStart). The error of
  // a slot whose rows were lost (see Flush); FailedPrecondition while
  // another step of this cache is open.
  virtual absl::StatusOr<KvStepPtr> BeginStep(
      absl::Span<const int> slots, absl::Span<const int> positions) = 0;

  // Forgets `slot`'s sequence (closing it on the memory node; the close's
  // error is returned, the slot is clean regardless).
  virtual absl::Status Reset(int slot) = 0;
  // Finishes background work (a step's appends) and returns its first
  // error. A slot whose rows did not reach the memory node is lost: its
  // next BeginStep returns that error again, until Reset.
  virtual absl::Status Flush() = 0;

  // Whether slot's cache holds rows of a sequence that may take several
  // prefill calls (local) or only one (offloaded).
  virtual bool offloaded() const = 0;
  virtual const FetchStats& fetch_stats(int slot) const = 0;
  // Bytes held on the worker now (as WorkerBytes) and reserved on the
  // memory node for this cache's open sequences.
  virtual int64_t worker_bytes() const = 0;
  virtual int64_t node_bytes() const = 0;
};

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_KV_CACHE_H_
