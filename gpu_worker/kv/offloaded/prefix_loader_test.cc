#include "gpu_worker/kv/offloaded/prefix_loader.h"

#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/kv/offloaded/part_test_util.h"
#include "gtest/gtest.h"

namespace infinigen::gpu_worker::offloaded {
namespace {

using kv_memory_service::OpenedSequence;
using kv_memory_service::PrefixRequest;

class PrefixLoaderTest : public ::testing::Test {
 protected:
  PrefixLoaderTest() {
    ctx_.weights = &weights_;
    ctx_.backend = backend_.get();
    ctx_.max_seq_len = kMaxSeq;
    options_.max_seq_len = kMaxSeq;
    options_.kv.policy = PolicyOptions();
    options_.kv.prefix_block_tokens = 2;
    options_.kv.model_identity = "model";
    geometry_.n_layers = 2;
    geometry_.n_kv_heads = 2;
    geometry_.head_dim = 4;
    geometry_.max_tokens = kMaxSeq;
  }
  std::unique_ptr<PrefixLoader> Loader() {
    return std::make_unique<PrefixLoader>(options_, policy_, geometry_,
                                          weights_.config, layout_);
  }

  model::Weights weights_ = SmallModel();
  std::unique_ptr<Backend> backend_ = NewCpuBackend();
  KvPolicy::Context ctx_;
  ScriptedPolicy policy_{ctx_, nullptr};
  KvCacheOptions options_;
  kv_memory_service::SequenceGeometry geometry_;
  Layout layout_ = SmallLayout(false);
};

TEST_F(PrefixLoaderTest, AsksForTheWholeBlocksBeforeTheLastToken) {
  const std::vector<int> tokens = {5, 6, 7, 8, 9};
  std::unique_ptr<PrefixLoader> loader = Loader();
  // Without reuse, nothing.
  EXPECT_TRUE(loader->Request(tokens, false).keys.empty());
  // Two whole blocks of 2 leave the fifth token to compute.
  const PrefixRequest request = loader->Request(tokens, true);
  EXPECT_EQ(request.block_tokens, 2);
  EXPECT_EQ(request.keys.size(), 2u);
  // Four tokens: one block (the last token is computed, not attached).
  EXPECT_EQ(loader->Request({5, 6, 7, 8}, true).keys.size(), 1u);
  // The same prefix asks for the same keys; another model for others.
  EXPECT_EQ(loader->Request({5, 6, 7, 8}, true).keys[0], request.keys[0]);
  options_.kv.model_identity = "another";
  EXPECT_NE(Loader()->Request(tokens, true).keys[0], request.keys[0]);
}

TEST_F(PrefixLoaderTest, NoIdentityOrNoBlocksNoReuse) {
  options_.kv.model_identity.clear();
  EXPECT_TRUE(Loader()->Request({1, 2, 3, 4, 5}, true).keys.empty());
  options_.kv.model_identity = "model";
  options_.kv.prefix_block_tokens = 0;
  EXPECT_TRUE(Loader()->Request({1, 2, 3, 4, 5}, true).keys.empty());
}

TEST_F(PrefixLoaderTest, TakesOverWholeAttachedBlocks) {
  std::unique_ptr<PrefixLoader> loader = Loader();
  const PrefixRequest request = loader->Request({1, 2, 3, 4, 5}, true);
  OpenedSequence opened;
  opened.cached_tokens = 4;
  opened.prefix_meta = {"", ""};  // this policy keeps no summary
  PrefixState state;
  ASSERT_TRUE(loader->Attach(opened, request, policy_, state).ok());
  EXPECT_EQ(state.cached, 4);
  EXPECT_EQ(state.annotated_first, 2);
  EXPECT_TRUE(state.block_state.empty());
  EXPECT_TRUE(loader->BlockMeta(state).empty());
  state.Clear();
  EXPECT_EQ(state.cached, 0);
}

TEST_F(PrefixLoaderTest, RefusesWhatTheNodeShouldNotHaveAttached) {
  std::unique_ptr<PrefixLoader> loader = Loader();
  const PrefixRequest request = loader->Request({1, 2, 3, 4, 5}, true);
  PrefixState state;
  OpenedSequence odd;  // not whole blocks
  odd.cached_tokens = 3;
  odd.prefix_meta = {""};
  absl::Status status = loader->Attach(odd, request, policy_, state);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("attached 3 cached tokens for 2 blocks"),
            std::string::npos)
      << status;
  OpenedSequence too_many;  // more than was asked for
  too_many.cached_tokens = 6;
  too_many.prefix_meta = {"", "", ""};
  EXPECT_EQ(loader->Attach(too_many, request, policy_, state).code(),
            absl::StatusCode::kInternal);
  OpenedSequence unannotated;
  unannotated.cached_tokens = 4;
  unannotated.prefix_meta = {""};
  status = loader->Attach(unannotated, request, policy_, state);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("2 attached blocks came with 1"),
            std::string::npos)
      << status;
  OpenedSequence wrong_size;
  wrong_size.cached_tokens = 2;
  wrong_size.prefix_meta = {"xx"};
  status = loader->Attach(wrong_size, request, policy_, state);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("has 2 bytes, full expects 0"),
            std::string::npos)
      << status;
  EXPECT_EQ(state.cached, 0);  // nothing taken over
}

TEST_F(PrefixLoaderTest, FetchesEveryHeadsCachedPositions) {
  std::unique_ptr<PrefixLoader> loader = Loader();
  auto client = kv_memory_service::ConnectKvClient("inproc:", {});
  ASSERT_TRUE(client.ok());
  auto opened = (*client)->OpenSequence(geometry_, {});
  ASSERT_TRUE(opened.ok());
  std::vector<uint16_t> rows(2 * 3 * 2 * 4, 0x3c00);  // 1.0 in fp16
  kv_memory_service::AppendBlock block;
  block.n_layers = 2;
  block.n_tokens = 3;
  block.k = rows;
  block.v = rows;
  ASSERT_TRUE((*client)->Append(opened->id, block).ok());
  LayerFetch f;
  bool warned = false;
  ASSERT_TRUE(f.Allocate(*backend_, **client, layout_, 2, warned).ok());
  PrefixState state;
  state.cached = 3;
  ASSERT_TRUE(loader->IssueFetch(**client, opened->id, state, 1, f).ok());
  EXPECT_EQ(f.plan.indices, (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(f.plan.head_offsets, (std::vector<int32_t>{0, 3, 6}));
  ASSERT_TRUE(f.handle.Wait().ok());
  DecodedRows decoded;
  decoded.stride = kMaxSeq + 1;
  ASSERT_TRUE(decoded.Allocate(*backend_, weights_.config, layout_).ok());
  loader->Load(*backend_, state, f, f.buffer->data(), KvRowFormat::kHalf,
               decoded);
  for (int g = 0; g < 2; ++g) {
    for (int i = 0; i < 3 * 4; ++i) {
      EXPECT_EQ(decoded.k.data()[g * decoded.stride * 4 + i], 1.0f);
      EXPECT_EQ(decoded.v.data()[g * decoded.stride * 4 + i], 1.0f);
    }
  }
  f.Release(*backend_);
}

}  // namespace
}  // namespace infinigen::gpu_worker::offloaded
