#include "gpu_worker/eval/perplexity.h"

#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/llama2c.h"

namespace infinigen::gpu_worker {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";

class PerplexityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = model::LoadLlama2cWeights(kModel);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = std::make_unique<model::Weights>(*std::move(w));
    auto tok = model::Llama2cTokenizer::Load(kTokenizer,
                                             weights_->config.vocab_size);
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokens_ = (*tok)->Encode(
        "Once upon a time, there was a little girl named Lily. She loved to "
        "play outside in the park. One day, she saw a big, red ball. She "
        "wanted to play with it, but it was too high. Her mom said, \"Lily, "
        "let's go to the park and play with the ball.\" Lily was happy and "
        "they went to the park together. They played all day long.",
        /*add_bos=*/false);
    bos_ = (*tok)->bos_id();
  }

  std::unique_ptr<Engine> MakeEngine(int max_seq_len, const std::string& policy) {
    EngineOptions o;
    o.max_seq_len = max_seq_len;
    o.max_chunk = 16;  // several chunks per window
    EXPECT_TRUE(ChoosePolicy(policy, o.kv).ok());
    if (o.kv.policy) {
      auto client = kv_memory_service::ConnectKvClient("inproc:");
      EXPECT_TRUE(client.ok());
      client_ = *std::move(client);
      o.kv.kv_client = client_.get();
    }
    auto e = Engine::Create(*weights_, NewCpuBackend(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }

  std::unique_ptr<model::Weights> weights_;
  std::vector<int> tokens_;
  int bos_ = -1;
  std::unique_ptr<kv_memory_service::KvClient> client_;
};

TEST_F(PerplexityTest, WindowsCountFullWindowsAShortTextAndTheCap) {
  PerplexityOptions o;
  o.ctx = 100;
  o.bos = 1;  // 99 text tokens per window
  EXPECT_EQ(*PerplexityWindows(990, o), 10);
  EXPECT_EQ(*PerplexityWindows(1000, o), 10);
  EXPECT_EQ(*PerplexityWindows(50, o), 1);  // short text: one window
  EXPECT_EQ(*PerplexityWindows(1, o), 0);   // nothing to predict
  o.bos = -1;
  EXPECT_EQ(*PerplexityWindows(1000, o), 10);
  o.max_windows = 3;
  EXPECT_EQ(*PerplexityWindows(1000, o), 3);
}

TEST_F(PerplexityTest, OptionsOutOfRangeAreInvalidArguments) {
  PerplexityOptions o;
  o.ctx = 1;
  EXPECT_THAT(std::string(PerplexityWindows(100, o).status().message()),
              HasSubstr("--ctx"));
  o.ctx = 10;
  o.max_windows = -1;
  EXPECT_THAT(std::string(PerplexityWindows(100, o).status().message()),
              HasSubstr("--max_windows"));
  o.max_windows = 0;
  o.prompt_tokens = 10;
  EXPECT_THAT(std::string(PerplexityWindows(100, o).status().message()),
              HasSubstr("--prompt_tokens"));
}

TEST_F(PerplexityTest, AWindowLongerThanTheEngineOrNoTextIsRefused) {
  auto engine = MakeEngine(32, "ideal");
  ASSERT_NE(engine, nullptr);
  PerplexityOptions o;
  o.ctx = 64;
  EXPECT_EQ(ScorePerplexity(*engine, tokens_, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.ctx = 32;
  EXPECT_EQ(ScorePerplexity(*engine, {7}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Dense scoring in chunks and teacher-forced decoding of the same windows
// score the same tokens with the same model: the same nll, and a
// perplexity a tiny story model gives its own kind of text (well below the
// vocabulary's 512).
TEST_F(PerplexityTest, DenseAndDecodedScoringAgree) {
  ASSERT_GT(tokens_.size(), 64u);
  PerplexityOptions o;
  o.ctx = 32;
  o.bos = bos_;
  auto engine = MakeEngine(32, "ideal");
  ASSERT_NE(engine, nullptr);
  std::vector<PerplexityProgress> progress;
  auto dense = ScorePerplexity(
      *engine, tokens_, o,
      [&](const PerplexityProgress& p) { progress.push_back(p); });
  ASSERT_TRUE(dense.ok()) << dense.status();
  const int windows = static_cast<int>(tokens_.size() / 31);
  EXPECT_EQ(dense->windows, windows);
  EXPECT_EQ(dense->predicted, 31L * windows);  // every position after BOS
  ASSERT_EQ(progress.size(), static_cast<size_t>(windows));
  EXPECT_EQ(progress.back().window, windows);
  EXPECT_EQ(progress.back().predicted, dense->predicted);
  EXPECT_GT(dense->perplexity(), 1.0);
  EXPECT_LT(dense->perplexity(), 100.0);
  EXPECT_EQ(dense->fetch.steps, 0);  // no policy ran

  o.prompt_tokens = 1;  // BOS dense, then every token decoded
  auto decoded = ScorePerplexity(*engine, tokens_, o);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->predicted, dense->predicted);
  EXPECT_NEAR(decoded->nll, dense->nll, 1e-4);
}

// Through the full policy (every row fetched from the memory node) the
// decoded score equals the local one, and the fetch statistics say every
// cached row was fetched at each step of every window.
TEST_F(PerplexityTest, DecodingThroughAPolicySumsItsFetchesOverWindows) {
  PerplexityOptions o;
  o.ctx = 32;
  o.bos = bos_;
  o.prompt_tokens = 8;
  o.max_windows = 2;
  auto ideal = MakeEngine(32, "ideal");
  auto full = MakeEngine(32, "full");
  ASSERT_NE(ideal, nullptr);
  ASSERT_NE(full, nullptr);
  auto local = ScorePerplexity(*ideal, tokens_, o);
  auto fetched = ScorePerplexity(*full, tokens_, o);
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->windows, 2);
  EXPECT_EQ(fetched->predicted, 2L * (32 - 8));
  EXPECT_NEAR(fetched->nll, local->nll, 1e-3);
  // 23 decode steps per window (the last token is scored, not decoded).
  EXPECT_EQ(fetched->fetch.steps, 2L * 23);
  EXPECT_NEAR(fetched->fetch.fraction_mean(), 1.0, 1e-9);
  EXPECT_GT(fetched->fetch.bytes_fetched, 0);
}

}  // namespace
}  // namespace infinigen::gpu_worker
