// How a sequence's planned rows move to attention, chosen once when the
// sequence opens (MakeRowSource); which rows, the policy's (FetchPlanner).
//
//   node gather   the node gathers each plan's rows into the fetch buffer
//                 (KvClient::FetchAsync); a device copies them to its
//                 staging.
//   device gather one-sided reads onto a device: the node's rows, pinned,
//                 are read by the device into its staging
//                 (Backend::GatherRows); the node hears of each read (a
//                 note) through the idle fetch buffer.
//   in place      one-sided reads on a host backend: attention reads the
//                 node's rows where they lie (Backend::AttendStoredRows by
//                 index), noted the same way.
//   cached gather on a host backend with a row cache (Layout::row_cache):
//                 the node gathers the rows the sequence's RowCache does
//                 not hold, and attention reads every planned row from the
//                 cache's slots by index; the rows held are noted where
//                 the node takes notes.
//
// One-sided reads need every position at its own slot (no attached prefix,
// a node that never evicts) and rows the node shares; a device gather the
// backend refuses hands its fetches to the node's gather (HandOff) and the
// sequence goes on with a node gather. Not thread-safe; one per sequence.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_SOURCE_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_SOURCE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/offloaded/fetched_attention.h"
#include "gpu_worker/kv/offloaded/layer_fetch.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::gpu_worker {
namespace offloaded {

// What every row source of a cache shares.
struct RowSourceContext {
  Backend* backend = nullptr;
  kv_memory_service::KvClient* client = nullptr;
  const Layout* layout = nullptr;
  const model::ModelConfig* config = nullptr;
  FetchedAttention* attention = nullptr;
  int max_seq_len = 0;
  std::string node_address;  // for messages (kv_memory_service::AtNode)
  std::string policy_name;   // for messages
};

// With one-sided reads onto a device, the plans the policy makes on the
// backend stay there; a queued copy brings each one's indices to the host
// as it is made, and the node hears of them after the step's last layer
// (Send), with no wait inside the step. Allocated per sequence where both
// apply; its capacity is 0 elsewhere.
class BackendNotes {
 public:
  // Room for n_layers plans of up to `rows` indices each, pinned.
  absl::Status Allocate(Backend& backend, int n_layers, size_t rows,
                        bool& pin_warned);
  void Release(Backend& backend);
  size_t capacity() const { return rows_; }
  bool empty() const { return layers_.empty(); }
  // Queues the copy of `layer`'s plan, its indices at `indices` (backend
  // memory) and its head offsets.
  void Queue(Backend& backend, int layer, const int32_t* indices,
             const std::vector<int32_t>& head_offsets);
  // `layer`'s plan goes another way (the node gathers it).
  void Drop(int layer);
  void Clear() { layers_.clear(); }
  // Sends the noted layers' plans, each through its fetch buffer once the
  // buffer's last note is in; the queued copies must have landed.
  absl::Status Send(const RowSourceContext& ctx,
                    kv_memory_service::SequenceId seq, FetchPair& fetches);

 private:
  size_t rows_ = 0;
  std::vector<int32_t> indices_;               // [layer][rows_]
  std::vector<std::vector<int32_t>> offsets_;  // [layer]
  std::vector<int> layers_;                    // noted, in order
};

class RowSource {
 public:
  virtual ~RowSource() = default;
  // Whether rows are read where the node keeps them.
  virtual bool one_sided() const = 0;
  // After `f`'s plan of `layer` (FetchPlanner): starts the node's gather,
  // or checks that a one-sided read stays within the sequence's rows
  // (InternalError naming the policy's position otherwise).
  virtual absl::Status Issue(LayerFetch& f, int layer, int position,
                             FetchStats& stats) = 0;
  // Waits for `layer`'s rows and makes them readable by the backend; false
  // where the backend cannot read the node's memory (HandOff then).
  virtual absl::StatusOr<bool> Upload(FetchPair& fetches, int layer,
                                      FetchStats& stats) = 0;
  // Attention over `f`'s rows (uploaded) of `layer` plus the new token.
  virtual absl::Status Attend(LayerFetch& f, int layer,
                              const RowAttention& a) = 0;
  // The node's gather takes over `layer`'s fetch and the next layer's
  // where it was planned for one-sided reads: plans to the host, gathers
  // issued.
  virtual absl::Status HandOff(FetchPair& fetches, int layer,
                               BackendNotes& notes, FetchStats& stats) {
    return absl::OkStatus();
  }
  // At the step's end: the node has heard of every read; `stats` has the
  // row cache's bytes.
  virtual absl::Status EndStep(FetchPair& fetches, FetchStats& stats) {
    return absl::OkStatus();
  }
};

// The node's gather.
std::unique_ptr<RowSource> NodeGather(const RowSourceContext& ctx,
                                      kv_memory_service::SequenceId seq);

// One-sided reads of `rows` (KvClient::GetDirectRows, then pinned here for
// a device; unpinned with the source) where `one_sided_allowed` and the
// node shares them, else the node's gather: through a row cache where the
// layout has one and the backend attends over stored rows of `format`,
// its hits noted to the node. `refusal_logged`: the one line per cache
// saying why the node gathers instead.
std::unique_ptr<RowSource> MakeRowSource(const RowSourceContext& ctx,
                                         kv_memory_service::SequenceId seq,
                                         bool one_sided_allowed,
                                         KvRowFormat format,
                                         bool& refusal_logged);

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_ROW_SOURCE_H_
