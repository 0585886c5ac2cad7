#include "gpu_worker/kv/offloaded/fetch_planner.h"

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace infinigen::gpu_worker {
namespace offloaded {

using PlanKind = LayerFetch::PlanKind;

absl::Status FetchPlanner::Plan(KvPolicy& policy, const RowPresence& presence,
                                int layer, int p, const float* xb_prev,
                                bool one_sided, BackendNotes& notes,
                                LayerFetch& f) const {
  kv_memory_service::OwnedFetchPlan& plan = f.plan;
  const bool whole = presence.Whole(layer, p);
  PlanRequest request;
  request.layer = layer;
  request.p = p;
  request.input = xb_prev;
  request.present = presence.layer(layer);
  // Each head's first p rows read in place as a whole: no indices to
  // write, upload, check or send.
  request.every_row_ok = whole && one_sided && !policy.WantsAttentionProbs();
  request.backend_indices = whole ? f.plan_dev.data() : nullptr;
  IG_ASSIGN_OR_RETURN(const PlanMade made, policy.Plan(request, plan));
  f.kind = PlanKind::kIndices;
  switch (made) {
    case PlanMade::kEveryRow:
      f.kind = PlanKind::kLeading;
      return CheckRows(static_cast<size_t>(n_kv_heads_) * p, layer);
    case PlanMade::kOnBackend: {
      const size_t rows = plan.head_offsets.back();
      IG_RETURN_IF_ERROR(CheckRows(rows, layer));
      if (one_sided && layout_.staged && notes.capacity() > 0 &&
          rows <= notes.capacity()) {
        // The device reads the rows by these indices where they lie; the
        // node hears of them with the step's appends, from a copy queued
        // now.
        plan.indices.clear();
        notes.Queue(backend_, layer, f.plan_dev.data(), plan.head_offsets);
        f.kind = PlanKind::kOnBackend;
        return absl::OkStatus();
      }
      plan.indices.resize(rows);
      return backend_.CopyToHost(plan.indices.data(), f.plan_dev.data(),
                                 rows * sizeof(int32_t));
    }
    case PlanMade::kIndices:
      break;
  }
  return CheckRows(plan.indices.size(), layer);
}

absl::Status FetchPlanner::CheckRows(size_t rows, int layer) const {
  if (rows <= layout_.plan_rows) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat(
      "kv cache: policy %s planned %d rows for layer %d, above the %d its "
      "staging holds",
      policy_name_, rows, layer, layout_.plan_rows));
}

}  // namespace offloaded
}  // namespace infinigen::gpu_worker
