// Prefix reuse for the offloaded cache: a sequence may open on the rows a
// prompt prefix left at the memory node (kv_cache.h, KvOptions::
// prefix_block_tokens). The loader names the prompt's whole blocks by
// their keys (the identity hashed in: model, policy, row format, shape),
// takes over what the node attached (checked: whole blocks, each with its
// policy summary, which the policy counts as if it had seen the tokens),
// loads each layer's attached rows into DecodedRows before the layer's
// first chunk (the next layer's fetch leaving meanwhile), and gathers the
// summaries of the prompt's later blocks that go with the last layer's
// rows. One loader per cache; each sequence's part is its PrefixState.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_PREFIX_LOADER_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_PREFIX_LOADER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/offloaded/fetched_attention.h"
#include "gpu_worker/kv/offloaded/layer_fetch.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "gpu_worker/kv/offloaded/row_source.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// One sequence's reuse: its leading tokens attached from shared blocks,
// and the policy summaries of the prompt's later whole blocks
// [annotated_first, ...), [block][layer][state floats].
struct PrefixState {
  int cached = 0;
  int annotated_first = 0;
  std::vector<float> block_state;

  void Clear() { *this = PrefixState(); }
};

class PrefixLoader {
 public:
  // Reuse is off (every request empty) without prefix_block_tokens, a
  // model identity, or a policy that reuses (KvPolicy::ReusesPrefix).
  PrefixLoader(const KvCacheOptions& options, const KvPolicy& policy,
               const kv_memory_service::SequenceGeometry& geometry,
               const model::ModelConfig& config, const Layout& layout);

  // The keys of `tokens`' whole blocks to open with: at least one token
  // left to compute, no more than a layer's fetch holds; none without
  // `reuse`.
  kv_memory_service::PrefixRequest Request(absl::Span<const int> tokens,
                                           bool reuse) const;
  // Takes over what the node attached for `request`: InternalError for a
  // count that is not whole requested blocks or lacks their summaries,
  // DataLoss for a summary of the wrong size.
  absl::Status Attach(const kv_memory_service::OpenedSequence& opened,
                      const kv_memory_service::PrefixRequest& request,
                      KvPolicy& policy, PrefixState& state) const;
  // Starts fetching `layer`'s attached rows into `f`.
  absl::Status IssueFetch(kv_memory_service::KvClient& client,
                          kv_memory_service::SequenceId seq,
                          const PrefixState& state, int layer,
                          LayerFetch& f) const;
  // Decodes `layer`'s fetched rows (`rows`, in plan order) into `decoded`.
  void Load(Backend& backend, const PrefixState& state, const LayerFetch& f,
            const uint16_t* rows, KvRowFormat format,
            DecodedRows& decoded) const;
  // Adds n prefill tokens of `layer` from `pos` (q, k in the backend's
  // memory) to the summaries of the blocks they belong to. Errors are the
  // backend's.
  absl::Status Summarize(KvPolicy& policy, int layer, int pos, int n,
                         const float* q, const float* k,
                         PrefixState& state) const;
  // The summaries of the blocks to share, sent with the last layer's rows.
  std::vector<std::string> BlockMeta(const PrefixState& state) const;

 private:
  const int block_;
  const model::ModelConfig& c_;
  const Layout& layout_;
  const kv_memory_service::SequenceGeometry& geometry_;
  const std::string policy_name_;
  // The identity hashed into the keys (empty: no reuse) and the policy's
  // per-layer summary size.
  std::string identity_;
  int state_floats_ = 0;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_PREFIX_LOADER_H_
