#include "gpu_worker/kv/fetch_schedule.h"

#include <vector>

#include "gtest/gtest.h"

namespace infinigen::gpu_worker {
namespace {

using P = FetchPoint;

std::vector<FetchPoint> Points(const FetchSchedule& s) {
  std::vector<FetchPoint> out;
  for (int l = 0; l < s.n_layers(); ++l) out.push_back(s.at(l));
  return out;
}

PolicyOptions Of(PolicyKind kind) {
  PolicyOptions o;
  o.kind = kind;
  return o;
}

TEST(FetchSchedule, FullAndInt4FetchEachLayerWhileThePreviousComputes) {
  for (PolicyKind kind : {PolicyKind::kFull, PolicyKind::kInt4,
                          PolicyKind::kH2O}) {
    const FetchSchedule s = FetchSchedule::Of(Of(kind), 3);
    EXPECT_EQ(Points(s), (std::vector<P>{P::kStepStart, P::kPreviousInput,
                                         P::kPreviousInput}));
    EXPECT_FALSE(s.WantsPostAttentionInput());
    EXPECT_TRUE(s.UploadsEarly(1));
  }
}

TEST(FetchSchedule, InfiniGenSpeculatesOneLayerAhead) {
  const FetchSchedule s = FetchSchedule::Of(Of(PolicyKind::kInfiniGen), 4);
  EXPECT_EQ(Points(s), (std::vector<P>{P::kStepStart, P::kPreviousInput,
                                       P::kPreviousInput, P::kPreviousInput}));
  // At layer 1's input, layer 2's fetch leaves; nothing is due for layer 1
  // itself (it left at layer 0's input).
  EXPECT_EQ(s.DueAt(P::kPreviousInput, 1), 2);
  EXPECT_EQ(s.DueAt(P::kOwnInput, 1), -1);
  EXPECT_EQ(s.DueAt(P::kPreviousInput, 3), -1);  // no layer 4
  EXPECT_EQ(s.DueAt(P::kStepStart, 0), 0);
}

TEST(FetchSchedule, PostAttentionSpeculationWaitsForTheAttention) {
  PolicyOptions o = Of(PolicyKind::kInfiniGen);
  o.infinigen.speculation_input =
      InfiniGenOptions::SpeculationInput::kPostAttention;
  o.selection.dense_layers = 0;  // layer 0 selects from its own input
  const FetchSchedule s = FetchSchedule::Of(o, 3);
  EXPECT_EQ(Points(s), (std::vector<P>{P::kOwnInput, P::kPreviousAttention,
                                       P::kPreviousAttention}));
  EXPECT_TRUE(s.WantsPostAttentionInput());
  EXPECT_EQ(s.DueAt(P::kPreviousAttention, 0), 1);
  EXPECT_EQ(s.DueAt(P::kPreviousInput, 0), -1);
  EXPECT_EQ(s.DueAt(P::kStepStart, 0), -1);
  EXPECT_TRUE(s.UploadsEarly(1));
}

TEST(FetchSchedule, OwnInputPoliciesCannotFetchEarly) {
  for (PolicyKind kind : {PolicyKind::kOracle, PolicyKind::kQuest}) {
    PolicyOptions o = Of(kind);
    FetchSchedule s = FetchSchedule::Of(o, 3);
    EXPECT_EQ(Points(s), (std::vector<P>{P::kStepStart, P::kOwnInput,
                                         P::kOwnInput}));
    EXPECT_FALSE(s.UploadsEarly(1));
    EXPECT_EQ(s.DueAt(P::kOwnInput, 2), 2);
    o.selection.dense_layers = 0;
    s = FetchSchedule::Of(o, 3);
    EXPECT_EQ(s.at(0), P::kOwnInput);
  }
  // The same_layer_input diagnostic moves infinigen to its own input.
  PolicyOptions o = Of(PolicyKind::kInfiniGen);
  o.infinigen.same_layer_input = true;
  EXPECT_EQ(FetchSchedule::Of(o, 2).at(1), P::kOwnInput);
}

}  // namespace
}  // namespace infinigen::gpu_worker
