// Gemma 3 270M (scripts/fetch_gemma3.sh; skips without it) through the
// whole engine on the CPU backend: greedy continuations that llama.cpp
// (built from its public source, run on the same GGUF with --temp 0)
// prints too, and the worker KV of its sliding-window layers, which does not
// grow with the context.
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/serving/sampler.h"
#include "gtest/gtest.h"
#include "model/loader.h"

namespace infinigen {
namespace {

std::string ModelPath() {
  const char* root = std::getenv("INFINIGEN_ROOT");
  return std::string(root != nullptr ? root : ".") +
         "/models_cache/gemma3-270m/gemma-3-270m-q4_k_m.gguf";
}

class Gemma3 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::ifstream(ModelPath()).good()) return;
    auto m = model::LoadModel(ModelPath(), "");
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = new model::LoadedModel(*std::move(m));
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override {
    if (model_ == nullptr) {
      GTEST_SKIP() << ModelPath() << " absent (scripts/fetch_gemma3.sh)";
    }
  }

  // The greedy continuation of `prompt`, `n` tokens.
  std::string Greedy(const std::string& prompt, int n) {
    gpu_worker::EngineOptions o;
    o.max_seq_len = 256;
    auto engine = gpu_worker::Engine::Create(model_->weights,
                                             gpu_worker::NewCpuBackend(), o);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return "";
    std::vector<int> tokens = model_->tokenizer->Encode(prompt, true);
    const size_t prompt_tokens = tokens.size();
    auto logits = (*engine)->Forward(tokens, false);
    for (int i = 0; i < n && logits.ok(); ++i) {
      tokens.push_back(gpu_worker::Argmax(*logits));
      logits = (*engine)->Forward({tokens.back()}, false);
    }
    EXPECT_TRUE(logits.ok()) << logits.status();
    return model_->tokenizer->Decode(std::vector<int>(
        tokens.begin() + prompt_tokens, tokens.end()));
  }

  static model::LoadedModel* model_;
};

model::LoadedModel* Gemma3::model_ = nullptr;

TEST_F(Gemma3, LoadsItsArchitecture) {
  const model::ModelConfig& c = model_->weights.config;
  EXPECT_EQ(c.arch, model::Architecture::kGemma3);
  EXPECT_EQ(c.n_layers, 18);
  EXPECT_EQ(c.dim, 640);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 1);
  EXPECT_EQ(c.sliding_window, 512);
  EXPECT_EQ(c.vocab_size, 262144);
  // Layers 5, 11 and 17 are global; the rest see 512 positions.
  for (int l = 0; l < c.n_layers; ++l) {
    EXPECT_EQ(c.IsLocalLayer(l), (l + 1) % 6 != 0) << l;
  }
  EXPECT_EQ(c.RopeTheta(5), 1000000.0f);
  EXPECT_EQ(c.RopeTheta(0), 10000.0f);
}

// llama.cpp prints the same 24 tokens for the first prompt, and the same
// first 17 for the second (then, at a near-tie, "It is the capital": its
// matrix products round the activations to 8 bits, ours keep fp32).
TEST_F(Gemma3, GreedyContinuationsAsLlamaCpp) {
  EXPECT_EQ(Greedy("def fibonacci(n):", 24),
            "\n    if n == 0:\n        return 0\n    elif n == 1:\n        "
            "return");
  const std::string capital = Greedy("The capital of France is", 20);
  EXPECT_EQ(capital.substr(0, 71),
            " the capital of the country of France. It is the largest city in "
            "France");
}

// The local layers' K and V stay 2 * 512 - 1 + max_chunk rows whatever the
// context; only the three global layers grow with it.
TEST_F(Gemma3, WorkerKvGrowsOnlyWithItsGlobalLayers) {
  auto bytes = [&](int max_seq_len) {
    gpu_worker::EngineOptions o;
    o.max_seq_len = max_seq_len;
    o.max_chunk = 256;
    auto e = gpu_worker::Engine::Create(model_->weights,
                                        gpu_worker::NewCpuBackend(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? (*e)->worker_kv_bytes() : -1;
  };
  const int64_t row = 2 * 1 * 256 * 4;  // K and V of one position, fp32
  const int64_t local = 15 * int64_t{2 * 512 - 1 + 256} * row;
  EXPECT_EQ(bytes(4096), local + 3 * int64_t{4096} * row);
  EXPECT_EQ(bytes(32768), local + 3 * int64_t{32768} * row);
}

}  // namespace
}  // namespace infinigen
