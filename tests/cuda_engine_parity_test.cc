// A whole forward pass on the CUDA backend against the CPU backend: prefill
// and batched decode steps of stories260K (and of SmolLM2-135M when the
// fetch script has cached it), every policy. Skips with the reason when no
// CUDA device answers.
//
// Tolerances: with fp32 GEMMs (CudaBackendOptions::half_precision = false) the
// two backends differ only in summation order, so logits agree to 2e-3
// absolute (logits are O(10)); with fp16 weights and activations they agree
// to 5% of the logit range, and the greedy token agrees on at least 90% of
// the steps. The offloaded policies (full, h2o) fetch rows the memory node
// stores as fp16: a summation-order difference in a K or V value can flip
// its fp16 rounding (a relative 5e-4), so their logits agree to 1e-2 (seen
// on an H200: at most 4.4e-3). InfiniGen's selection is discrete, so a
// near-tie can flip one token's selection between backends: it gets the
// argmax check. int4 rounds each K and V value to one of 16 levels on the
// host, so a summation-order difference flips a value by a whole level
// (seen on an H100 for SmolLM2: logits apart by up to 0.107 after 8 steps);
// its bound is relative to int4's own error: each row's CPU-GPU gap is
// under a tenth of that row's int4-vs-full gap on the CPU (seen: at most
// 4.4%; a row dequantized wrongly on the device is off by the whole error).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/backend/backend.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/backend/cuda/cuda_backend.h"
#include "gpu_worker/engine.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/loader.h"

namespace infinigen {
namespace {

using gpu_worker::Backend;
using gpu_worker::Engine;
using gpu_worker::EngineOptions;

std::string Root() {
  const char* r = std::getenv("INFINIGEN_ROOT");
  return r != nullptr ? std::string(r) + "/" : "";
}

struct DecodeRun {
  std::vector<std::vector<float>> logits;  // per decode step, [batch, vocab]
};

class CudaEngineParity : public ::testing::Test {
 protected:
  void SetUp() override {
    auto probe = gpu_worker::NewCudaBackend(0);
    if (!probe.ok()) GTEST_SKIP() << probe.status().message();
  }

  // Prefill of `prompt` tokens in two slots, then `steps` batched decode
  // steps, teacher-forced.
  // `policy` by its --policy name ("ideal": the local cache); `tweak`, when
  // set, adjusts the policy options after kind and skew.
  DecodeRun Decode(const model::Weights& w, const std::vector<int>& tokens,
             std::unique_ptr<Backend> backend, const std::string& policy,
             const speculator::SkewMatrices* skew, int prompt, int steps,
             const std::function<void(gpu_worker::PolicyOptions&)>& tweak =
                 nullptr,
             double row_cache = 0.0) {
    DecodeRun run;
    auto client = kv_memory_service::ConnectKvClient("inproc:");
    EXPECT_TRUE(client.ok()) << client.status();
    EngineOptions o;
    o.max_seq_len = prompt + steps + 2;
    o.max_chunk = max_chunk_;
    o.batch = 2;
    EXPECT_TRUE(gpu_worker::ChoosePolicy(policy, o.kv).ok()) << policy;
    if (o.kv.policy) {
      o.kv.policy->infinigen.skew = skew;
      if (tweak) tweak(*o.kv.policy);
    }
    o.kv.kv_client = client->get();
    o.kv.row_cache = row_cache;
    auto engine = Engine::Create(w, std::move(backend), o);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return run;
    for (int s = 0; s < 2; ++s) {
      auto l = (*engine)->Forward(
          s, absl::MakeConstSpan(tokens).subspan(s, prompt), false);
      EXPECT_TRUE(l.ok()) << l.status();
    }
    for (int i = 0; i < steps; ++i) {
      auto l = (*engine)->DecodeBatch(
          {0, 1}, {tokens[prompt + i], tokens[prompt + i + 1]});
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      run.logits.emplace_back(l->begin(), l->end());
    }
    return run;
  }

  int max_chunk_ = 256;

  // Largest absolute logit difference of each (step, row), step-major.
  static std::vector<double> RowGaps(const DecodeRun& a, const DecodeRun& b,
                                     int vocab) {
    std::vector<double> gaps;
    for (size_t i = 0; i < a.logits.size() && i < b.logits.size(); ++i) {
      const auto& x = a.logits[i];
      const auto& y = b.logits[i];
      for (size_t r = 0; r < x.size() / vocab && r < y.size() / vocab; ++r) {
        double worst = 0;
        for (int v = 0; v < vocab; ++v) {
          const size_t j = r * vocab + v;
          worst = std::max(worst, static_cast<double>(std::abs(x[j] - y[j])));
        }
        gaps.push_back(worst);
      }
    }
    return gaps;
  }

  static void ExpectClose(const DecodeRun& a, const DecodeRun& b, int vocab,
                          double abs_tol, double range_frac,
                          double argmax_agreement) {
    ASSERT_EQ(a.logits.size(), b.logits.size());
    for (size_t i = 0; i < a.logits.size(); ++i) {
      ASSERT_EQ(a.logits[i].size(), b.logits[i].size());
    }
    const std::vector<double> gaps = RowGaps(a, b, vocab);
    int agree = 0, total = 0;
    for (size_t i = 0; i < a.logits.size(); ++i) {
      const auto& x = a.logits[i];
      const auto& y = b.logits[i];
      for (size_t r = 0; r < x.size() / vocab; ++r) {
        float lo = x[r * vocab];
        float hi = lo;
        size_t ax = 0, ay = 0;
        for (int v = 0; v < vocab; ++v) {
          const size_t j = r * vocab + v;
          lo = std::min(lo, x[j]);
          hi = std::max(hi, x[j]);
          if (x[j] > x[r * vocab + ax]) ax = v;
          if (y[j] > y[r * vocab + ay]) ay = v;
        }
        if (abs_tol > 0 || range_frac > 0) {
          EXPECT_LE(gaps[total], abs_tol + range_frac * (hi - lo))
              << "step " << i << " row " << r;
        }
        agree += ax == ay;
        ++total;
      }
    }
    EXPECT_GE(agree, argmax_agreement * total);
  }
};

TEST_F(CudaEngineParity, Stories260KEveryPolicy) {
  auto m = model::LoadModel(Root() + "models/stories260K/stories260K.bin",
                            Root() + "models/stories260K/tok512.bin");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<int> tokens = m->tokenizer->Encode(
      "Once upon a time, there was a little dog named Max. Max liked to run "
      "in the big green park with his friend Sue. One day, Sue found a red "
      "box under a tree. She opened it and saw a shiny key. She was happy.",
      true);
  ASSERT_GE(tokens.size(), 40u);
  auto skew = gpu_worker::CalibrateSkew(m->weights, tokens);
  ASSERT_TRUE(skew.ok()) << skew.status();
  const int vocab = m->weights.config.vocab_size;
  for (std::string kind : {"ideal", "full",
                          "h2o", "int4",
                          "infinigen"}) {
    SCOPED_TRACE(kind);
    const DecodeRun cpu = Decode(m->weights, tokens, gpu_worker::NewCpuBackend(),
                           kind, &*skew, 12, 24);
    gpu_worker::cuda::CudaBackendOptions fp32;
    fp32.half_precision = false;
    auto cuda = gpu_worker::cuda::CreateCudaBackend(0, fp32);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    const DecodeRun gpu =
        Decode(m->weights, tokens, std::move(*cuda), kind, &*skew, 12, 24);
    if (kind == "infinigen") {
      ExpectClose(cpu, gpu, vocab, 0, 0, 0.9);
    } else if (kind == "full" || kind == "h2o") {
      ExpectClose(cpu, gpu, vocab, 1e-2, 0, 1.0);
    } else {
      ExpectClose(cpu, gpu, vocab, 2e-3, 0, 1.0);
    }
  }
  // infinigen as --target_fetch runs it (every column in 4-bit rows,
  // speculated after the attention, no dense layer: layer 0 from its own
  // input, adaptive head budgets) and the oracle (fp32 rows, layers 0 and
  // 1 whole), each at a 60% target fetch.
  auto tuned =
      gpu_worker::CalibrateSkew(m->weights, tokens, {1.0, true, false, 0});
  ASSERT_TRUE(tuned.ok()) << tuned.status();
  for (std::string kind : {"infinigen", "oracle"}) {
    SCOPED_TRACE("target fetch " + kind);
    auto tweak = [&](gpu_worker::PolicyOptions& p) {
      if (kind == "infinigen") p.selection.dense_layers = 0;
      ASSERT_TRUE(gpu_worker::SetTargetFetch(
                      0.6, m->weights.config.n_layers, p).ok());
      if (kind != "infinigen") return;
      p.infinigen.skew = &*tuned;
      p.infinigen.partial_ratio = 1.0f;
      p.infinigen.speculation_input =
          gpu_worker::InfiniGenOptions::SpeculationInput::kPostAttention;
      p.infinigen.adaptive_budgets = true;
      p.infinigen.profile = &tuned->profile;
    };
    const DecodeRun cpu = Decode(m->weights, tokens,
                                 gpu_worker::NewCpuBackend(), kind, nullptr,
                                 12, 24, tweak);
    gpu_worker::cuda::CudaBackendOptions fp32;
    fp32.half_precision = false;
    auto cuda = gpu_worker::cuda::CreateCudaBackend(0, fp32);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    const DecodeRun gpu = Decode(m->weights, tokens, std::move(*cuda), kind,
                                 nullptr, 12, 24, tweak);
    ExpectClose(cpu, gpu, vocab, 0, 0, 0.9);
  }
  // fp16 weights (the default): looser.
  const DecodeRun cpu = Decode(m->weights, tokens, gpu_worker::NewCpuBackend(),
                         "ideal", nullptr, 12, 24);
  auto half = gpu_worker::NewCudaBackend(0);
  ASSERT_TRUE(half.ok());
  const DecodeRun gpu = Decode(m->weights, tokens, std::move(*half),
                         "ideal", nullptr, 12, 24);
  ExpectClose(cpu, gpu, vocab, 0, 0.05, 0.9);
}

// The row cache in device memory: the misses staged and moved to their
// slots, attention reading every row by slot, gives the logits of the
// same device fetching every selected row, bit for bit (the same rows in
// the same order through the same kernel), with room to spare and at a
// bound the steps reach.
TEST_F(CudaEngineParity, RowCacheOnTheDeviceGivesTheLogitsOfEveryRow) {
  auto m = model::LoadModel(Root() + "models/stories260K/stories260K.bin",
                            Root() + "models/stories260K/tok512.bin");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<int> tokens = m->tokenizer->Encode(
      "Once upon a time, there was a little dog named Max. Max liked to run "
      "in the big green park with his friend Sue. One day, Sue found a red "
      "box under a tree. She opened it and saw a shiny key. She was happy.",
      true);
  ASSERT_GE(tokens.size(), 40u);
  auto tweak = [&](gpu_worker::PolicyOptions& p) {
    ASSERT_TRUE(gpu_worker::SetTargetFetch(
                    0.3, m->weights.config.n_layers, p).ok());
  };
  for (std::string kind : {"oracle", "quest"}) {
    for (double fraction : {0.5, 0.15}) {
      SCOPED_TRACE(kind + " at " + std::to_string(fraction));
      auto plain = gpu_worker::NewCudaBackend(0);
      ASSERT_TRUE(plain.ok()) << plain.status();
      const DecodeRun want = Decode(m->weights, tokens, std::move(*plain),
                                    kind, nullptr, 12, 24, tweak);
      auto cached = gpu_worker::NewCudaBackend(0);
      ASSERT_TRUE(cached.ok());
      const DecodeRun got = Decode(m->weights, tokens, std::move(*cached),
                                   kind, nullptr, 12, 24, tweak, fraction);
      ASSERT_EQ(got.logits.size(), want.logits.size());
      for (size_t i = 0; i < want.logits.size(); ++i) {
        EXPECT_EQ(got.logits[i], want.logits[i]) << "step " << i;
      }
    }
  }
}

// Gemma 3's layer (query and key norms, post-norms, the GELU gate, scaled
// embeddings) and its sliding-window attention on the device: the tiny
// random checkpoint, a window of 4 that the prompt and the steps overrun,
// prefill chunks of 2 that make the local layers' buffers slide.
TEST_F(CudaEngineParity, Gemma3SlidingWindowDecodeStep) {
  auto m = model::LoadModel("tests/testdata/hf_tiny_gemma3", "");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<int> tokens = {2, 7, 30, 3, 19, 11, 5, 23, 23, 8, 0, 31,
                                   14, 9, 4, 17, 21, 6};
  const int vocab = m->weights.config.vocab_size;
  gpu_worker::cuda::CudaBackendOptions fp32;
  fp32.half_precision = false;
  auto cuda = gpu_worker::cuda::CreateCudaBackend(0, fp32);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  max_chunk_ = 2;
  const DecodeRun cpu = Decode(m->weights, tokens, gpu_worker::NewCpuBackend(),
                               "ideal", nullptr, 6, 10);
  const DecodeRun gpu =
      Decode(m->weights, tokens, std::move(*cuda), "ideal", nullptr, 6, 10);
  ExpectClose(cpu, gpu, vocab, 2e-3, 0, 1.0);
}

TEST_F(CudaEngineParity, SmolLM2DecodeStep) {
  const std::string path =
      Root() + "models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::ifstream(path).good()) {
    GTEST_SKIP() << path << " absent (scripts/fetch_smollm2.sh fetches it)";
  }
  auto m = model::LoadModel(path, "");
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<int> tokens = m->tokenizer->Encode(
      "The history of the city begins in the twelfth century, when a small "
      "market grew up beside the river crossing. Over the next three hundred "
      "years it became one of the richest towns of the region, with a "
      "cathedral, a university and a harbour that traded across the sea.",
      false);
  ASSERT_GE(tokens.size(), 40u);
  const int vocab = m->weights.config.vocab_size;
  DecodeRun cpu_full;
  for (std::string kind :
       {"ideal", "full", "int4"}) {
    SCOPED_TRACE(kind);
    const DecodeRun cpu = Decode(m->weights, tokens, gpu_worker::NewCpuBackend(),
                           kind, nullptr, 24, 8);
    gpu_worker::cuda::CudaBackendOptions fp32;
    fp32.half_precision = false;
    auto cuda = gpu_worker::cuda::CreateCudaBackend(0, fp32);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    const DecodeRun gpu =
        Decode(m->weights, tokens, std::move(*cuda), kind, nullptr, 24, 8);
    if (kind == "full") cpu_full = cpu;
    if (kind != "int4") {
      ExpectClose(cpu, gpu, vocab, 5e-3, 0, 1.0);
      continue;
    }
    ExpectClose(cpu, gpu, vocab, 0, 0, 1.0);  // the greedy token, every step
    const std::vector<double> backends = RowGaps(cpu, gpu, vocab);
    const std::vector<double> int4_error = RowGaps(cpu, cpu_full, vocab);
    ASSERT_EQ(backends.size(), int4_error.size());
    ASSERT_FALSE(backends.empty());
    for (size_t i = 0; i < backends.size(); ++i) {
      EXPECT_LE(backends[i], 0.1 * int4_error[i])
          << "step " << i / 2 << " row " << i % 2;
    }
  }
}

}  // namespace
}  // namespace infinigen
