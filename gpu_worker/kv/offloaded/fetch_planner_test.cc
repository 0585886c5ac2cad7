#include "gpu_worker/kv/offloaded/fetch_planner.h"

#include <memory>
#include <vector>

#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/kv/offloaded/part_test_util.h"
#include "gtest/gtest.h"

namespace infinigen::gpu_worker::offloaded {
namespace {

using kv_memory_service::OwnedFetchPlan;
using PlanKind = LayerFetch::PlanKind;

class FetchPlannerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ctx_.weights = &weights_;
    ctx_.backend = backend_.get();
    ctx_.max_seq_len = kMaxSeq;
    auto plan_dev = DeviceBuffer<int32_t>::Make(
        backend_.get(), layout_.plan_room + 3, "plan");
    ASSERT_TRUE(plan_dev.ok());
    f_.plan_dev = *std::move(plan_dev);
    presence_.Mark(0, 2, 0, 5, {});  // 5 positions, every head
  }

  model::Weights weights_ = SmallModel();
  std::unique_ptr<Backend> backend_ = NewCpuBackend();
  KvPolicy::Context ctx_;
  Layout layout_ = SmallLayout(/*staged=*/true);
  FetchPlanner planner_{*backend_, layout_, 2, "scripted"};
  RowPresence presence_{2, 2, kMaxSeq};
  BackendNotes notes_;
  LayerFetch f_;
};

TEST_F(FetchPlannerTest, EveryRowReadOneSidedHasNoIndices) {
  ScriptedPolicy policy(ctx_, nullptr);
  ASSERT_TRUE(planner_
                  .Plan(policy, presence_, 1, 5, nullptr, /*one_sided=*/true,
                        notes_, f_)
                  .ok());
  ASSERT_EQ(policy.requests.size(), 1u);
  const PlanRequest& r = policy.requests[0];
  EXPECT_EQ(r.layer, 1);
  EXPECT_EQ(r.p, 5);
  EXPECT_TRUE(r.every_row_ok);
  EXPECT_EQ(r.backend_indices, f_.plan_dev.data());
  EXPECT_EQ(r.present, presence_.layer(1));
  EXPECT_EQ(f_.kind, PlanKind::kLeading);
  EXPECT_TRUE(f_.plan.indices.empty());
  EXPECT_EQ(f_.plan.head_offsets, (std::vector<int32_t>{0, 5, 10}));
  EXPECT_EQ(f_.rows(), 10u);
}

TEST_F(FetchPlannerTest, GatheredRowsAreNamedByIndex) {
  ScriptedPolicy policy(ctx_, nullptr);
  ASSERT_TRUE(
      planner_.Plan(policy, presence_, 0, 5, nullptr, false, notes_, f_).ok());
  EXPECT_FALSE(policy.requests[0].every_row_ok);
  EXPECT_EQ(f_.kind, PlanKind::kIndices);
  EXPECT_EQ(f_.plan.indices,
            (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
}

TEST_F(FetchPlannerTest, AnEvictedRowLeavesThePlanToTheHost) {
  const kv_memory_service::EvictedToken gone[] = {{0, 1, 3}};
  presence_.Mark(0, 1, 5, 0, gone);
  ScriptedPolicy policy(ctx_, nullptr);
  ASSERT_TRUE(
      planner_.Plan(policy, presence_, 0, 5, nullptr, true, notes_, f_).ok());
  const PlanRequest& r = policy.requests[0];
  EXPECT_FALSE(r.every_row_ok);
  EXPECT_EQ(r.backend_indices, nullptr);
  EXPECT_EQ(f_.kind, PlanKind::kIndices);
  EXPECT_EQ(f_.plan.indices, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 4}));
  EXPECT_EQ(f_.plan.head_offsets, (std::vector<int32_t>{0, 5, 9}));
}

// A plan the policy wrote to the backend: with one-sided reads onto a
// device and room for notes its indices stay there and the step notes
// them; otherwise they come to the host.
TEST_F(FetchPlannerTest, PlansMadeOnTheBackendStayThereForOneSidedReads) {
  auto on_backend = [](const PlanRequest& r, OwnedFetchPlan& plan) {
    // The CPU backend's memory is the host's.
    const int32_t picked[] = {4, 1, 2};
    std::copy(picked, picked + 3, r.backend_indices);
    plan.head_offsets = {0, 2, 3};
    return PlanMade::kOnBackend;
  };
  bool pin_warned = false;
  ASSERT_TRUE(notes_.Allocate(*backend_, 2, 16, pin_warned).ok());
  ScriptedPolicy policy(ctx_, on_backend);
  ASSERT_TRUE(
      planner_.Plan(policy, presence_, 1, 5, nullptr, true, notes_, f_).ok());
  EXPECT_EQ(f_.kind, PlanKind::kOnBackend);
  EXPECT_TRUE(f_.plan.indices.empty());
  EXPECT_FALSE(notes_.empty());
  notes_.Drop(1);
  EXPECT_TRUE(notes_.empty());

  LayerFetch gathered;
  gathered.plan_dev = std::move(f_.plan_dev);
  ASSERT_TRUE(
      planner_.Plan(policy, presence_, 1, 5, nullptr, false, notes_, gathered)
          .ok());
  EXPECT_EQ(gathered.kind, PlanKind::kIndices);
  EXPECT_EQ(gathered.plan.indices, (std::vector<int32_t>{4, 1, 2}));
  EXPECT_TRUE(notes_.empty());
  notes_.Release(*backend_);
}

TEST_F(FetchPlannerTest, APlanBeyondTheStagingIsAnError) {
  auto too_many = [](const PlanRequest& r, OwnedFetchPlan& plan) {
    plan.indices.assign(17, 0);  // the staging holds 16
    plan.head_offsets = {0, 9, 17};
    return PlanMade::kIndices;
  };
  ScriptedPolicy policy(ctx_, too_many);
  const absl::Status status =
      planner_.Plan(policy, presence_, 1, 5, nullptr, false, notes_, f_);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("policy scripted planned 17 rows for "
                                  "layer 1, above the 16"),
            std::string::npos)
      << status;
}

TEST_F(FetchPlannerTest, ThePolicysErrorIsReturned) {
  ScriptedPolicy policy(ctx_, [](const PlanRequest&, OwnedFetchPlan&) {
    return absl::StatusOr<PlanMade>(absl::ResourceExhaustedError("scores"));
  });
  EXPECT_EQ(planner_.Plan(policy, presence_, 0, 5, nullptr, false, notes_, f_)
                .code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace infinigen::gpu_worker::offloaded
