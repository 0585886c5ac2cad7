// Which rows a layer's fetch moves: the sequence's policy asked, once per
// layer and step, in the order that costs least. Where every position is
// present and the rows are read one-sided, a policy planning every row
// gets each head's first `position` rows (a leading plan, no indices);
// else a policy that plans on the backend does so into the fetch's plan
// buffer (its indices left there for one-sided reads onto a device, noted
// to the node after the step: BackendNotes); else the policy plans on the
// host. Holds no state of its own.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_FETCH_PLANNER_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_FETCH_PLANNER_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/kv/offloaded/layer_fetch.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "gpu_worker/kv/offloaded/row_presence.h"
#include "gpu_worker/kv/offloaded/row_source.h"

namespace infinigen::gpu_worker {
namespace offloaded {

class FetchPlanner {
 public:
  FetchPlanner(Backend& backend, const Layout& layout, int n_kv_heads,
               std::string policy_name)
      : backend_(backend),
        layout_(layout),
        n_kv_heads_(n_kv_heads),
        policy_name_(std::move(policy_name)) {}

  // `f`'s plan of `layer` for the new token at `position`, ranked by
  // xb_prev (the policy's input; null at the step's start). `one_sided`:
  // the sequence's rows are read where the node keeps them. InternalError
  // where the plan names more rows than the staging holds; else the
  // policy's or the backend's errors.
  absl::Status Plan(KvPolicy& policy, const RowPresence& presence,
                    int layer, int position, const float* xb_prev,
                    bool one_sided, BackendNotes& notes,
                    LayerFetch& f) const;

 private:
  absl::Status CheckRows(size_t rows, int layer) const;

  Backend& backend_;
  const Layout& layout_;
  const int n_kv_heads_;
  const std::string policy_name_;
};

}  // namespace offloaded
}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_FETCH_PLANNER_H_
