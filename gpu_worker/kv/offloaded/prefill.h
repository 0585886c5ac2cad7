// The offloaded cache's prefill, layer by layer, each layer in chunks:
// each chunk's rows are encoded as the memory node will hold them (by the
// backend where it can, else on the host), the layer attends over its
// rows so far (as stored, for a policy that reuses prefixes), the policy
// observes the chunk, and at the layer's end its rows leave for the node
// on a thread of their own (LayerAppend) while the next layer computes,
// from one of two stages. Owns the prefill's buffers, shared by the
// sequences (one prefill at a time). Not thread-safe.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_PREFILL_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_PREFILL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/offloaded/appender.h"
#include "gpu_worker/kv/offloaded/fetched_attention.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "gpu_worker/kv/offloaded/prefix_loader.h"
#include "gpu_worker/kv/offloaded/row_presence.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// The sequence a prefill writes.
struct PrefillTarget {
  KvPolicy* policy = nullptr;
  PrefixState* prefix = nullptr;
  RowPresence* presence = nullptr;
  FetchStats* stats = nullptr;
  kv_memory_service::SequenceId seq = 0;
};

class Prefill {
 public:
  Prefill(Backend& backend, const model::ModelConfig& config,
          const KvCacheOptions& options, const Layout& layout,
          DecodedRows& decoded, kv_memory_service::KvClient& client)
      : backend_(backend),
        c_(config),
        options_(options),
        layout_(layout),
        decoded_(decoded),
        client_(client) {}
  ~Prefill();

  absl::Status Allocate();

  // A prefill of positions [first, tokens) of `target`, those before
  // `first` attached.
  void Begin(const PrefillTarget& target, int first, int tokens);
  int first() const { return first_; }
  // KvCache::PrefillAttention, after a reused prefix's rows are loaded.
  absl::Status Attention(const PrefixLoader& prefix, int layer, int pos,
                         int rows, const float* q, const float* k,
                         const float* v, float* out);
  // KvCache::EndPrefillLayer: the layer's rows leave for the node.
  absl::Status EndLayer(const PrefixLoader& prefix, int layer);
  // Joins the append in flight (if any) and marks its rows present;
  // returns its error.
  absl::Status WaitAppend();

 private:
  uint16_t* StageRows(std::vector<uint16_t>& rows) {
    return rows.data() + stage_ * (rows.size() / 2);
  }

  Backend& backend_;
  const model::ModelConfig& c_;
  const KvCacheOptions& options_;
  const Layout& layout_;
  DecodedRows& decoded_;
  kv_memory_service::KvClient& client_;

  PrefillTarget target_;
  int first_ = 0;   // positions [first_, tokens_) computed
  int tokens_ = 0;

  // A chunk's K rows then its V rows, each [max_chunk][kv_dim], as the
  // memory node will hold them (encoded, then decoded on the backend), and
  // on device backends their encoded form copied there, K then V, each
  // [max_chunk][kv_head][row_width]; chunk_stage_free_ marks the decode
  // that last read it.
  DeviceBuffer<float> chunk_rows_;
  DeviceBuffer<uint16_t> chunk_stage_;
  Backend::Mark chunk_stage_free_ = 0;
  // Attention probabilities (h2o), [n_heads][max_seq], and their host copy.
  DeviceBuffer<float> probs_;
  std::vector<float> probs_host_;
  // Host copies of a chunk's k, v [max_chunk][...], where the backend
  // cannot encode the rows itself.
  std::vector<float> k_host_, v_host_;
  // Two stages of one layer's rows for the memory node, each
  // [pos][kv_head][width]: the layer computing fills stage stage_ while
  // the previous layer's append leaves from the other.
  std::vector<uint16_t> k_stage_, v_stage_;
  int stage_ = 0;
  // The layer's append in flight, and what marking it present needs.
  LayerAppend append_;
  int append_layer_ = 0;
  kv_memory_service::AppendResult appended_;
  PrefillTarget append_target_;
  int append_first_ = 0, append_n_ = 0;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_PREFILL_H_
