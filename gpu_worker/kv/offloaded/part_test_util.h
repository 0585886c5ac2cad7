// What the offloaded cache's part tests share: a model shape of two
// layers, two query heads over two KV heads of width 4, 8 positions; a
// policy whose plan the test chooses (ScriptedPolicy); the layout of
// fetches of that shape.
#ifndef INFINIGEN_GPU_WORKER_KV_OFFLOADED_PART_TEST_UTIL_H_
#define INFINIGEN_GPU_WORKER_KV_OFFLOADED_PART_TEST_UTIL_H_

#include <functional>
#include <vector>

#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/kv/offloaded/layout.h"
#include "model/weights.h"

namespace infinigen::gpu_worker::offloaded {

inline model::Weights SmallModel() {
  model::Weights w;
  w.config.dim = 8;
  w.config.n_layers = 2;
  w.config.n_heads = 2;
  w.config.n_kv_heads = 2;
  w.config.head_dim = 4;
  w.config.max_seq_len = 8;
  return w;
}

constexpr int kMaxSeq = 8;

// Fetches of SmallModel's fp16 rows, every position of a layer at most.
inline Layout SmallLayout(bool staged) {
  Layout z;
  z.row_width = 4;
  z.plan_rows = 2 * kMaxSeq;
  z.plan_buffers = true;
  z.plan_room = z.plan_rows;
  z.fetch_values = 2 * z.plan_rows * z.row_width;
  z.staged = staged;
  return z;
}

// A policy whose Plan is the test's `plan` (default: every present row).
class ScriptedPolicy final : public KvPolicy {
 public:
  using PlanFn = std::function<absl::StatusOr<PlanMade>(
      const PlanRequest&, kv_memory_service::OwnedFetchPlan&)>;
  ScriptedPolicy(const Context& c, PlanFn plan)
      : KvPolicy(c), plan_(std::move(plan)) {}
  absl::StatusOr<PlanMade> Plan(
      const PlanRequest& request,
      kv_memory_service::OwnedFetchPlan& plan) override {
    requests.push_back(request);
    if (plan_) return plan_(request, plan);
    return PlanEveryRow(request, plan);
  }
  int MaxBackendPlanRows(int p) const override { return p; }
  std::vector<PlanRequest> requests;

 private:
  PlanFn plan_;
};

}  // namespace infinigen::gpu_worker::offloaded

#endif  // INFINIGEN_GPU_WORKER_KV_OFFLOADED_PART_TEST_UTIL_H_
