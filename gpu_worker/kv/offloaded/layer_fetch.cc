#include "gpu_worker/kv/offloaded/layer_fetch.h"

#include <algorithm>

#include "common/log.h"
#include "common/status.h"

namespace infinigen::gpu_worker {
namespace offloaded {

absl::Status LayerFetch::Allocate(Backend& backend,
                                  kv_memory_service::KvClient& client,
                                  const Layout& layout, int n_kv_heads,
                                  bool& pin_warned) {
  IG_ASSIGN_OR_RETURN(buffer, client.NewFetchBuffer(layout.fetch_values));
  const absl::Status pinned =
      backend.PinHost(buffer->data(), buffer->size() * sizeof(uint16_t));
  if (!pinned.ok() && !pin_warned) {
    IG_LOG(WARNING) << "engine: fetch buffers stay pageable (copies run "
                       "slower): "
                    << pinned.message();
    pin_warned = true;
  }
  if (layout.staged) {
    IG_ASSIGN_OR_RETURN(staged, DeviceBuffer<uint16_t>::Make(
                                    &backend, layout.fetch_values,
                                    "fetch staging"));
  }
  const size_t plan_values = layout.plan_room + n_kv_heads + 1;
  if (layout.plan_buffers) {
    IG_ASSIGN_OR_RETURN(plan_dev, DeviceBuffer<int32_t>::Make(
                                      &backend, plan_values, "fetch plan"));
  }
  if (layout.plan_buffers && layout.staged) {
    plan_host.assign(plan_values, 0);
    const absl::Status pinned = backend.PinHost(
        plan_host.data(), plan_host.size() * sizeof(int32_t));
    if (!pinned.ok() && !pin_warned) {
      IG_LOG(WARNING) << "engine: fetch plans stay pageable (copies hold "
                         "the host): "
                      << pinned.message();
      pin_warned = true;
    }
  }
  return absl::OkStatus();
}

void LayerFetch::Release(Backend& backend) {
  handle.Wait().IgnoreError();
  if (buffer != nullptr) backend.UnpinHost(buffer->data());
  if (!plan_host.empty()) backend.UnpinHost(plan_host.data());
}

void LayerFetch::Abandon() {
  handle.Wait().IgnoreError();
  handle = kv_memory_service::FetchHandle();  // not the old outcome again
}

void LayerFetch::UploadOffsets(Backend& backend, size_t plan_room) {
  const std::vector<int32_t>& offsets = plan.head_offsets;
  int32_t* host = plan_host.data() + plan_room;
  std::copy(offsets.begin(), offsets.end(), host);
  backend.CopyFromHost(plan_dev.data() + plan_room, host,
                       offsets.size() * sizeof(int32_t), staged_free);
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
