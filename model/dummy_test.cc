#include "model/dummy.h"

#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infinigen::model {
namespace {

using ::testing::HasSubstr;

TEST(DummyModelConfig, PresetsHaveThePublishedShapes) {
  auto llama2 = DummyModelConfig("llama-2-7b");
  ASSERT_TRUE(llama2.ok()) << llama2.status();
  const ModelConfig& a = llama2->config;
  EXPECT_EQ(a.arch, Architecture::kLlama);
  EXPECT_EQ(a.dim, 4096);
  EXPECT_EQ(a.hidden_dim, 11008);
  EXPECT_EQ(a.n_layers, 32);
  EXPECT_EQ(a.n_heads, 32);
  EXPECT_EQ(a.n_kv_heads, 32);
  EXPECT_EQ(a.head_dim, 128);
  EXPECT_EQ(a.vocab_size, 32000);
  EXPECT_EQ(a.max_seq_len, 131072);
  EXPECT_FALSE(llama2->tie_word_embeddings);
  auto llama3 = DummyModelConfig("llama-3-8b");
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  EXPECT_EQ(llama3->config.n_kv_heads, 8);
  EXPECT_EQ(llama3->config.vocab_size, 128256);
  EXPECT_EQ(llama3->config.rope_theta, 500000.0f);
  auto opt = DummyModelConfig("opt-13b");
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_EQ(opt->config.arch, Architecture::kOpt);
  EXPECT_EQ(opt->config.dim, 5120);
  EXPECT_EQ(opt->config.n_layers, 40);
  EXPECT_EQ(opt->config.max_seq_len, 2048);
  EXPECT_TRUE(opt->tie_word_embeddings);
  EXPECT_THAT(DummyModelPresets(),
              ::testing::ElementsAre("llama-2-7b", "llama-3-8b", "opt-13b"));
}

TEST(DummyModelConfig, ReadsAConfigJsonOrSaysWhatItKnows) {
  for (const std::string path : {"tests/testdata/hf_tiny_llama",
                                 "tests/testdata/hf_tiny_llama/config.json"}) {
    auto c = DummyModelConfig(path);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->config.dim, 16);
    EXPECT_EQ(c->config.n_kv_heads, 2);
  }
  auto unknown = DummyModelConfig("llama-9b");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()),
              HasSubstr("'llama-9b' is neither a known model (llama-2-7b, "
                        "llama-3-8b, opt-13b) nor a config.json"));
}

TEST(DummyWeights, DeterministicValidAndScaledLikeAnInitialisation) {
  for (const std::string path :
       {"tests/testdata/hf_tiny_llama", "tests/testdata/hf_tiny_opt"}) {
    SCOPED_TRACE(path);
    auto c = DummyModelConfig(path);
    ASSERT_TRUE(c.ok()) << c.status();
    const Weights w = DummyWeights(*c, 7);
    ASSERT_TRUE(w.Validate().ok()) << w.Validate();
    EXPECT_EQ(w.lm_head.empty(), c->tie_word_embeddings);
    const Weights again = DummyWeights(*c, 7);
    EXPECT_EQ(again.layers[1].wq, w.layers[1].wq);
    EXPECT_EQ(again.token_embedding, w.token_embedding);
    const Weights other = DummyWeights(*c, 8);
    EXPECT_NE(other.layers[1].wq, w.layers[1].wq);
    // Tensors differ from each other, not only across seeds.
    EXPECT_NE(w.layers[0].wq, w.layers[1].wq);
    EXPECT_EQ(w.final_norm, std::vector<float>(c->config.dim, 1.0f));
    double sum = 0, sq = 0, most = 0;
    const std::vector<float>& e = w.token_embedding;
    for (float x : e) {
      sum += x;
      sq += double(x) * x;
      most = std::max(most, std::fabs(double(x)));
    }
    EXPECT_NEAR(sum / e.size(), 0.0, 0.004);
    EXPECT_NEAR(std::sqrt(sq / e.size()), 0.02, 0.003);
    EXPECT_LE(most, 0.02 * std::sqrt(3.0) + 1e-6);
  }
}

// Large tensors are filled on several threads: the values are those of one.
TEST(DummyWeights, ThreadCountDoesNotChangeTheValues) {
  auto c = DummyModelConfig("tests/testdata/hf_tiny_llama");
  ASSERT_TRUE(c.ok());
  c->config.vocab_size = 1 << 20;  // 16M-value embedding: several threads
  const Weights w = DummyWeights(*c, 3);
  c->config.vocab_size = 1 << 10;  // the same first rows on one thread
  const Weights small = DummyWeights(*c, 3);
  ASSERT_EQ(small.token_embedding.size(), size_t{1 << 10} * 16);
  EXPECT_TRUE(std::equal(small.token_embedding.begin(),
                         small.token_embedding.end(),
                         w.token_embedding.begin()));
}

}  // namespace
}  // namespace infinigen::model
