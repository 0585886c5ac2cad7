// One layer's fetch in flight (LayerFetch) and a sequence's two of them
// (FetchPair: layer l's and layer l + 1's are in flight together).
//
// A LayerFetch owns what one fetch moves through: its plan, the host
// buffer the data plane fills (pinned by the backend where it can), the
// handle of the gather or note that holds that buffer and, on a device,
// the staging its rows are copied to with the plan's copy there. Which
// rows the plan names is the policy's (FetchPlanner); how they move, the
// sequence's row source (row_source.h). Not thread-safe.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_LAYER_FETCH_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_LAYER_FETCH_H_

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::gpu_worker {
namespace offloaded {

struct LayerFetch {
  // How the plan names its rows.
  enum class PlanKind {
    kIndices,    // plan.indices on the host (copied to plan_dev to read)
    // Indices the policy wrote to plan_dev (KvPolicy::PlanFetchOnBackend)
    // and left there; plan holds the head offsets alone.
    kOnBackend,
    // Each head's first `position` rows, read as a whole: plan holds the
    // head offsets alone.
    kLeading,
  };

  // Buffers for fetches of `layout` on `backend`: the data plane's buffer
  // (pinned where the backend can; one warning per cache in `pin_warned`),
  // a device's staging and the plan buffers.
  absl::Status Allocate(Backend& backend, kv_memory_service::KvClient& client,
                        const Layout& layout, int n_kv_heads,
                        bool& pin_warned);
  // Waits for what holds the buffer and unpins it (the backend's copies
  // out of it are done).
  void Release(Backend& backend);
  // Ends what holds the buffer, its outcome forgotten.
  void Abandon();

  // Rows the plan names, every head.
  size_t rows() const { return plan.head_offsets.back(); }
  // Where the backend reads the fetched rows (K of every head, then V):
  // the staging on a device, else the buffer.
  const uint16_t* fetched(bool staged_layout) const {
    return staged_layout ? staged.data() : buffer->data();
  }
  // The plan's head offsets to plan_dev (after room for `plan_room`
  // indices), through plan_host, once staging's last reader is done.
  void UploadOffsets(Backend& backend, size_t plan_room);

  std::unique_ptr<kv_memory_service::FetchBuffer> buffer;
  kv_memory_service::OwnedFetchPlan plan;
  kv_memory_service::FetchHandle handle;
  PlanKind kind = PlanKind::kIndices;
  // Planned for a one-sided read, not read yet.
  bool one_sided = false;
  // The plan's rows are readable by the backend.
  bool uploaded = false;
  // The buffer's rows copied to the backend (device backends only);
  // staged_free marks the last operation that read them.
  DeviceBuffer<uint16_t> staged;
  Backend::Mark staged_free = 0;
  // The plan's indices (where they go to the backend: one-sided reads,
  // plans made there), then its head offsets (device backends), and their
  // pinned way there from the host.
  DeviceBuffer<int32_t> plan_dev;
  std::vector<int32_t> plan_host;
};

class FetchPair {
 public:
  LayerFetch& For(int layer) { return fetches_[layer & 1]; }
  const LayerFetch& For(int layer) const { return fetches_[layer & 1]; }
  auto begin() { return fetches_.begin(); }
  auto end() { return fetches_.end(); }

 private:
  std::array<LayerFetch, 2> fetches_;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_LAYER_FETCH_H_
