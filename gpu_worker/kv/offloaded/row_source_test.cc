#include "gpu_worker/kv/offloaded/row_source.h"

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/backend/kv_rows.h"
#include "gpu_worker/kv/offloaded/part_test_util.h"
#include "gtest/gtest.h"

namespace infinigen::gpu_worker::offloaded {
namespace {

using kv_memory_service::OwnedFetchPlan;
using PlanKind = LayerFetch::PlanKind;

// A sequence of 6 positions at an in-process node, its K and V rows
// random fp16, and a host backend's row sources over it.
class RowSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto client = kv_memory_service::ConnectKvClient("inproc:", {});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    kv_memory_service::SequenceGeometry g;
    g.n_layers = 2;
    g.n_kv_heads = 2;
    g.head_dim = 4;
    g.max_tokens = kMaxSeq;
    auto opened = client_->OpenSequence(g, {});
    ASSERT_TRUE(opened.ok()) << opened.status();
    seq_ = opened->id;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    std::vector<float> rows(2 * 6 * 2 * 4);  // [layer][token][head][4]
    for (float& x : rows) x = normal(rng);
    k_.resize(rows.size());
    v_.resize(rows.size());
    EncodeKvRows(KvRowFormat::kHalf, rows.data(), 24, 4, k_.data());
    for (float& x : rows) x = normal(rng);
    EncodeKvRows(KvRowFormat::kHalf, rows.data(), 24, 4, v_.data());
    kv_memory_service::AppendBlock block;
    block.first_layer = 0;
    block.n_layers = 2;
    block.n_tokens = 6;
    block.k = k_;
    block.v = v_;
    ASSERT_TRUE(client_->Append(seq_, block).ok());
    bool warned = false;
    for (LayerFetch& f : fetches_) {
      ASSERT_TRUE(f.Allocate(*backend_, *client_, layout_, 2, warned).ok());
    }
    decoded_.stride = kMaxSeq + 1;
    ASSERT_TRUE(decoded_.Allocate(*backend_, weights_.config, layout_).ok());
    ctx_.backend = backend_.get();
    ctx_.client = client_.get();
    ctx_.layout = &layout_;
    ctx_.config = &weights_.config;
    ctx_.attention = &attention_;
    ctx_.node_address = "inproc:";
    ctx_.policy_name = "scripted";
  }
  void TearDown() override {
    for (LayerFetch& f : fetches_) f.Release(*backend_);
  }

  // One query's attention at `layer` over `plan`'s rows through `source`.
  std::vector<float> Attend(RowSource& source, int layer,
                            const OwnedFetchPlan& plan, PlanKind kind) {
    LayerFetch& f = fetches_.For(layer);
    f.plan = plan;
    f.kind = kind;
    f.uploaded = false;
    FetchStats stats;
    EXPECT_TRUE(source.Issue(f, layer, 6, stats).ok());
    auto read = source.Upload(fetches_, layer, stats);
    EXPECT_TRUE(read.ok() && *read) << read.status();
    EXPECT_TRUE(f.uploaded);
    std::vector<float> q(8, 0.5f), k_new(8, 0.25f), v_new(8, -1.0f),
        out(8, 0.0f);
    RowAttention a;
    a.q = q.data();
    a.k_new = k_new.data();
    a.v_new = v_new.data();
    a.out = out.data();
    EXPECT_TRUE(source.Attend(f, layer, a).ok());
    EXPECT_TRUE(source.EndStep(fetches_, stats).ok());
    return out;
  }

  model::Weights weights_ = SmallModel();
  std::unique_ptr<Backend> backend_ = NewCpuBackend();
  Layout layout_ = SmallLayout(/*staged=*/false);
  std::unique_ptr<kv_memory_service::KvClient> client_;
  kv_memory_service::SequenceId seq_ = 0;
  std::vector<uint16_t> k_, v_;
  FetchPair fetches_;
  DecodedRows decoded_;
  FetchedAttention attention_{*backend_, weights_.config, layout_, decoded_};
  RowSourceContext ctx_;
};

TEST_F(RowSourceTest, TheNodesGatherFillsTheBufferInPlanOrder) {
  std::unique_ptr<RowSource> source = NodeGather(ctx_, seq_);
  EXPECT_FALSE(source->one_sided());
  LayerFetch& f = fetches_.For(1);
  f.plan = OwnedFetchPlan::PerHead({{4, 1}, {0}});
  FetchStats stats;
  ASSERT_TRUE(source->Issue(f, 1, 6, stats).ok());
  auto read = source->Upload(fetches_, 1, stats);
  ASSERT_TRUE(read.ok() && *read) << read.status();
  // K rows of head 0 (positions 4, 1), of head 1 (0), then V the same.
  const uint16_t* got = f.buffer->data();
  auto row = [](const std::vector<uint16_t>& rows, int layer, int t, int g) {
    return &rows[((static_cast<size_t>(layer) * 6 + t) * 2 + g) * 4];
  };
  const std::pair<int, int> order[] = {{4, 0}, {1, 0}, {0, 1}};
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(got[i * 4 + j], row(k_, 1, order[i].first, order[i].second)[j]);
      EXPECT_EQ(got[12 + i * 4 + j],
                row(v_, 1, order[i].first, order[i].second)[j]);
    }
  }
  EXPECT_EQ(stats.rows_read_in_place, 0);
}

TEST_F(RowSourceTest, WithoutOneSidedReadsTheNodeGathers) {
  bool logged = false;
  EXPECT_FALSE(MakeRowSource(ctx_, seq_, /*one_sided_allowed=*/false,
                             KvRowFormat::kHalf, logged)
                   ->one_sided());
  EXPECT_FALSE(logged);
}

// A host backend reads the node's rows where they lie, and attends over
// them as over the rows the node gathered: the same answer.
TEST_F(RowSourceTest, InPlaceAttentionMatchesTheGatheredRows) {
  bool logged = false;
  std::unique_ptr<RowSource> in_place =
      MakeRowSource(ctx_, seq_, true, KvRowFormat::kHalf, logged);
  ASSERT_TRUE(in_place->one_sided());
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{5, 0, 2}, {3}});
  const std::vector<float> direct =
      Attend(*in_place, 0, plan, PlanKind::kIndices);
  std::unique_ptr<RowSource> gather = NodeGather(ctx_, seq_);
  const std::vector<float> gathered =
      Attend(*gather, 0, plan, PlanKind::kIndices);
  for (int i = 0; i < 8; ++i) EXPECT_FLOAT_EQ(direct[i], gathered[i]) << i;
  // Every head's first rows as a whole: no indices.
  OwnedFetchPlan leading;
  leading.head_offsets = {0, 6, 12};
  const std::vector<float> whole =
      Attend(*in_place, 1, leading, PlanKind::kLeading);
  const std::vector<float> whole_gathered = Attend(
      *gather, 1, OwnedFetchPlan::SameForAllHeads(2, {0, 1, 2, 3, 4, 5}),
      PlanKind::kIndices);
  for (int i = 0; i < 8; ++i) {
    EXPECT_FLOAT_EQ(whole[i], whole_gathered[i]) << i;
    EXPECT_TRUE(std::isfinite(whole[i]));
  }
}

// Rows read one-sided are read before the node checks the plan: a
// position beyond the sequence's rows is refused here, naming the policy.
TEST_F(RowSourceTest, AOneSidedPlanOutsideTheRowsIsRefused) {
  bool logged = false;
  std::unique_ptr<RowSource> source =
      MakeRowSource(ctx_, seq_, true, KvRowFormat::kHalf, logged);
  ASSERT_TRUE(source->one_sided());
  LayerFetch& f = fetches_.For(0);
  f.plan = OwnedFetchPlan::PerHead({{1, 8}, {0}});
  FetchStats stats;
  absl::Status status = source->Issue(f, 0, 6, stats);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("policy scripted planned position 8 of "
                                  "layer 0, outside the 8 rows"),
            std::string::npos)
      << status;
  f.plan = OwnedFetchPlan::PerHead({{-1}, {0}});
  EXPECT_EQ(source->Issue(f, 0, 6, stats).code(), absl::StatusCode::kInternal);
  // A leading plan beyond the rows a head holds.
  f.plan.indices.clear();
  f.plan.head_offsets = {0, 9, 18};
  f.kind = PlanKind::kLeading;
  status = source->Issue(f, 0, 9, stats);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("every row"), std::string::npos) << status;
  // A plan within them is read in place and counted so.
  f.kind = PlanKind::kIndices;
  f.plan = OwnedFetchPlan::PerHead({{1, 2}, {0}});
  ASSERT_TRUE(source->Issue(f, 0, 6, stats).ok());
  EXPECT_EQ(stats.rows_read_in_place, 3);
  EXPECT_TRUE(f.one_sided);
}

}  // namespace
}  // namespace infinigen::gpu_worker::offloaded
