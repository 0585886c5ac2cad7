// Loader + engine against Hugging Face Transformers: tiny randomly
// initialised Llama (GQA), OPT and Gemma 3 (sliding-window and global
// layers, a window the prompt overruns) checkpoints whose logits
// Transformers computed (tests/make_hf_reference.py wrote
// tests/testdata/hf_tiny_*).
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "gtest/gtest.h"
#include "model/loader.h"

namespace infinigen {
namespace {

class HfReference : public ::testing::TestWithParam<std::string> {};

TEST_P(HfReference, LogitsMatchTransformers) {
  const std::string dir = "tests/testdata/" + GetParam();
  auto m = model::LoadModel(dir, "");
  ASSERT_TRUE(m.ok()) << m.status();
  std::ifstream tf(dir + "/tokens.json");
  const std::vector<int> tokens = nlohmann::json::parse(tf).get<std::vector<int>>();
  const int vocab = m->weights.config.vocab_size;
  std::vector<float> want(tokens.size() * vocab);
  std::ifstream lf(dir + "/logits.bin", std::ios::binary);
  lf.read(reinterpret_cast<char*>(want.data()), want.size() * sizeof(float));
  ASSERT_EQ(lf.gcount(), static_cast<std::streamsize>(want.size() * 4));

  // Whole prompt at once, then again as a prefill of 5 and single decodes.
  auto engine = gpu_worker::Engine::Create(m->weights, gpu_worker::NewCpuBackend());
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto all = (*engine)->Forward(tokens, /*all_logits=*/true);
  ASSERT_TRUE(all.ok());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR((*all)[i], want[i], 2e-4) << "position " << i / vocab
                                          << " token " << i % vocab;
  }
  ASSERT_TRUE((*engine)->Reset().ok());
  auto last = (*engine)->Forward(absl::MakeConstSpan(tokens).subspan(0, 5), false);
  for (size_t t = 5; t <= tokens.size(); ++t) {
    ASSERT_TRUE(last.ok());
    for (int j = 0; j < vocab; ++j) {
      ASSERT_NEAR((*last)[j], want[(t - 1) * vocab + j], 2e-4) << t;
    }
    if (t < tokens.size()) last = (*engine)->Forward({tokens[t]}, false);
  }
  // Prefill chunks of 2: Gemma 3's sliding-window layers keep a buffer of
  // 2 * window - 1 + 2 = 9 rows, which the 13 tokens make slide, in the
  // prefill (3 tokens) and in the decode steps after it.
  gpu_worker::EngineOptions small;
  small.max_chunk = 2;
  small.max_seq_len = 64;
  auto chunked = gpu_worker::Engine::Create(m->weights,
                                            gpu_worker::NewCpuBackend(), small);
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  auto rows = (*chunked)->Forward(absl::MakeConstSpan(tokens).subspan(0, 3),
                                  false);
  for (size_t t = 3; t <= tokens.size(); ++t) {
    ASSERT_TRUE(rows.ok()) << rows.status();
    for (int j = 0; j < vocab; ++j) {
      ASSERT_NEAR((*rows)[j], want[(t - 1) * vocab + j], 2e-4) << t;
    }
    if (t < tokens.size()) rows = (*chunked)->Forward({tokens[t]}, false);
  }
}

// A sliding-window layer's KV does not grow with the context: Gemma 3's
// local layers hold 2 * window - 1 + max_chunk rows whatever max_seq_len;
// its global layers, every position.
TEST(HfReferenceGemma3, LocalLayersKvIsBoundedByTheWindow) {
  auto m = model::LoadModel("tests/testdata/hf_tiny_gemma3", "");
  ASSERT_TRUE(m.ok()) << m.status();
  const model::ModelConfig& c = m->weights.config;
  ASSERT_EQ(c.sliding_window, 4);
  auto bytes = [&](int max_seq_len) {
    gpu_worker::EngineOptions o;
    o.max_chunk = 2;
    o.max_seq_len = max_seq_len;
    auto e = gpu_worker::Engine::Create(m->weights, gpu_worker::NewCpuBackend(),
                                        o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? (*e)->worker_kv_bytes() : -1;
  };
  // Per position of a global layer, K and V: 2 * kv_heads * head_dim floats.
  const int64_t row = 2 * c.n_kv_heads * c.head_dim * sizeof(float);
  int global = 0, local = 0;
  for (int l = 0; l < c.n_layers; ++l) ++(c.IsLocalLayer(l) ? local : global);
  ASSERT_EQ(global, 2);
  ASSERT_EQ(local, 2);
  for (int len : {16, 32, 64}) {
    EXPECT_EQ(bytes(len), global * len * row + local * (2 * 4 - 1 + 2) * row)
        << len;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HfReference,
                         ::testing::Values("hf_tiny_llama", "hf_tiny_opt",
                                           "hf_tiny_gemma3"));

}  // namespace
}  // namespace infinigen
