#include "gpu_worker/engine.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "gpu_worker/serving/sampler.h"
#include "model/llama2c.h"

namespace infinigen::gpu_worker {
namespace {

using model::Architecture;
using model::LayerWeights;
using model::ModelConfig;
using model::Weights;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";

// stories260K's greedy (temperature 0) continuation of the prompt, a fact
// of the model.
constexpr char kOnceUponATime[] =
    "Once upon a time, there was a little girl named Lily. She loved to play "
    "outside in the park. One day, she saw a big, red ball. She wanted to "
    "play with it, but it was too high.";

TEST(Engine, Stories260KGreedyContinuation) {
  auto w = model::LoadLlama2cWeights(kModel);
  ASSERT_TRUE(w.ok()) << w.status();
  auto tok = model::Llama2cTokenizer::Load(kTokenizer, w->config.vocab_size);
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto engine = Engine::Create(*w, NewCpuBackend());
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<int> ids = (*tok)->Encode("Once upon a time", true);
  auto logits = (*engine)->Forward(ids, false);
  ASSERT_TRUE(logits.ok());
  for (int i = 0; i < 60; ++i) {
    const int next = Argmax(*logits);
    ids.push_back(next);
    logits = (*engine)->Forward({next}, false);
    ASSERT_TRUE(logits.ok());
  }
  const std::string text = (*tok)->Decode(ids);
  EXPECT_EQ(text.substr(0, std::string(kOnceUponATime).size()), kOnceUponATime)
      << text;
}

// Prefill of a whole prompt in one call, in chunks, and token by token must
// give the same logits: the cache, positions and causal mask agree.
TEST(Engine, ChunkedPrefillMatchesTokenByToken) {
  auto w = model::LoadLlama2cWeights(kModel);
  ASSERT_TRUE(w.ok());
  std::vector<int> ids;
  std::mt19937 rng(3);
  for (int i = 0; i < 40; ++i) ids.push_back(3 + rng() % 500);
  EngineOptions small;
  small.max_chunk = 7;
  auto whole = Engine::Create(*w, NewCpuBackend());
  auto chunked = Engine::Create(*w, NewCpuBackend(), small);
  auto single = Engine::Create(*w, NewCpuBackend());
  ASSERT_TRUE(whole.ok() && chunked.ok() && single.ok());
  auto all = (*whole)->Forward(ids, /*all_logits=*/true);
  ASSERT_TRUE(all.ok());
  std::vector<float> all_copy(all->begin(), all->end());
  auto last = (*chunked)->Forward(ids, /*all_logits=*/false);
  ASSERT_TRUE(last.ok());
  const int v = w->config.vocab_size;
  for (int j = 0; j < v; ++j) {
    EXPECT_NEAR((*last)[j], all_copy[39 * v + j], 1e-4);
  }
  for (int i = 0; i < 40; ++i) {
    auto step = (*single)->Forward({ids[i]}, false);
    ASSERT_TRUE(step.ok());
    for (int j = 0; j < v; j += 17) {
      EXPECT_NEAR((*step)[j], all_copy[i * v + j], 1e-4) << i << " " << j;
    }
  }
  EXPECT_EQ((*single)->position(), 40);
}

// ForwardEachRow hands over every row of a prompt longer than one chunk,
// the rows Forward(all_logits) gives, and returns the last one.
TEST(Engine, ForwardEachRowGivesEveryRowOfALongPrompt) {
  auto w = model::LoadLlama2cWeights(kModel);
  ASSERT_TRUE(w.ok());
  std::vector<int> ids;
  std::mt19937 rng(5);
  for (int i = 0; i < 30; ++i) ids.push_back(3 + rng() % 500);
  EngineOptions small;
  small.max_chunk = 7;
  auto whole = Engine::Create(*w, NewCpuBackend());
  auto rows = Engine::Create(*w, NewCpuBackend(), small);
  ASSERT_TRUE(whole.ok() && rows.ok());
  auto all = (*whole)->Forward(ids, /*all_logits=*/true);
  ASSERT_TRUE(all.ok());
  const int v = w->config.vocab_size;
  std::vector<int> seen;
  auto last = (*rows)->ForwardEachRow(
      0, ids, [&](int row, absl::Span<const float> logits) {
        seen.push_back(row);
        ASSERT_EQ(logits.size(), static_cast<size_t>(v));
        for (int j = 0; j < v; j += 13) {
          EXPECT_NEAR(logits[j], (*all)[row * v + j], 1e-4) << row;
        }
      });
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_EQ(seen.size(), ids.size());
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], i);
  for (int j = 0; j < v; ++j) EXPECT_NEAR((*last)[j], (*all)[29 * v + j], 1e-4);
  EXPECT_EQ((*rows)->position(), 30);
  // The sequence goes on as after Forward.
  auto next = (*rows)->Forward({ids[0]}, false);
  ASSERT_TRUE(next.ok());
}

TEST(Engine, RejectsBadInputWithoutChangingTheSequence) {
  auto w = model::LoadLlama2cWeights(kModel);
  ASSERT_TRUE(w.ok());
  EngineOptions opts;
  opts.max_seq_len = 8;
  auto engine = Engine::Create(*w, NewCpuBackend(), opts);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  EXPECT_EQ(e.Forward({}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.Forward({1, 512}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.Forward({1, -1}, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.position(), 0);
  ASSERT_TRUE(e.Forward({1, 2, 3, 4, 5, 6}, false).ok());
  auto too_long = e.Forward({1, 2, 3}, false);
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_long.status().message()),
              ::testing::HasSubstr("exceeds"));
  EXPECT_EQ(e.position(), 6);
  ASSERT_TRUE(e.Reset().ok());
  EXPECT_EQ(e.position(), 0);
}

// A one-layer Llama whose attention and MLP contribute nothing: the logits
// are lm_head . rmsnorm(embedding), computed here by hand.
TEST(Engine, HandComputedLlamaLogits) {
  Weights w;
  ModelConfig& c = w.config;
  c.arch = Architecture::kLlama;
  c.dim = 2;
  c.hidden_dim = 2;
  c.n_layers = 1;
  c.n_heads = 1;
  c.n_kv_heads = 1;
  c.head_dim = 2;
  c.vocab_size = 3;
  c.max_seq_len = 4;
  c.norm_eps = 0.0f;
  c.bos_id = 0;
  c.eos_id = 1;
  w.token_embedding = {3, 4, 1, 0, 0, 1};
  LayerWeights l;
  l.attn_norm = {1, 1};
  l.wq = l.wk = l.wv = l.wo = std::vector<float>(4, 0.0f);
  l.ffn_norm = {1, 1};
  l.w1 = l.w2 = l.w3 = std::vector<float>(4, 0.0f);
  w.layers.push_back(l);
  w.final_norm = {1, 2};
  w.lm_head = {1, 0, 0, 1, 1, 1};
  auto engine = Engine::Create(w, NewCpuBackend());
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto logits = (*engine)->Forward({0}, false);
  ASSERT_TRUE(logits.ok());
  // rms([3, 4]) = sqrt(12.5); normed = [0.8485, 1.1314] * gain [1, 2].
  const float a = 3 / std::sqrt(12.5f), b = 8 / std::sqrt(12.5f);
  EXPECT_NEAR((*logits)[0], a, 1e-5);
  EXPECT_NEAR((*logits)[1], b, 1e-5);
  EXPECT_NEAR((*logits)[2], a + b, 1e-5);
}

// A naive double-precision forward pass written from the formulas,
// independent of the engine and the backend, for random tiny models.
std::vector<double> NaiveForward(const Weights& w, const std::vector<int>& ids) {
  const ModelConfig& c = w.config;
  const bool opt = c.arch == Architecture::kOpt;
  const int T = ids.size(), D = c.dim, hd = c.head_dim;
  auto linear = [](const std::vector<double>& x, const std::vector<float>& W,
                   const std::vector<float>& bias, int out) {
    const int in = x.size();
    std::vector<double> y(out, 0.0);
    for (int o = 0; o < out; ++o) {
      for (int i = 0; i < in; ++i) y[o] += W[o * in + i] * x[i];
      if (!bias.empty()) y[o] += bias[o];
    }
    return y;
  };
  auto norm = [&](const std::vector<double>& x, const std::vector<float>& g,
                  const std::vector<float>& b) {
    std::vector<double> y(D);
    if (opt) {
      double mean = 0, var = 0;
      for (double v : x) mean += v / D;
      for (double v : x) var += (v - mean) * (v - mean) / D;
      for (int i = 0; i < D; ++i)
        y[i] = (x[i] - mean) / std::sqrt(var + c.norm_eps) * g[i] + b[i];
    } else {
      double ss = 0;
      for (double v : x) ss += v * v / D;
      for (int i = 0; i < D; ++i) y[i] = x[i] / std::sqrt(ss + c.norm_eps) * g[i];
    }
    return y;
  };
  auto rope = [&](std::vector<double>& v, int heads, int pos) {
    for (int h = 0; h < heads; ++h) {
      for (int j = 0; j < hd / 2; ++j) {
        double ang = pos * std::pow(c.rope_theta, -2.0 * j / hd);
        double a = v[h * hd + j], b = v[h * hd + j + hd / 2];
        v[h * hd + j] = a * std::cos(ang) - b * std::sin(ang);
        v[h * hd + j + hd / 2] = a * std::sin(ang) + b * std::cos(ang);
      }
    }
  };
  std::vector<std::vector<double>> x(T, std::vector<double>(D));
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < D; ++i) {
      x[t][i] = w.token_embedding[ids[t] * D + i];
      if (opt) x[t][i] += w.position_embedding[(t + 2) * D + i];
    }
  }
  const std::vector<float> none;
  for (const LayerWeights& l : w.layers) {
    std::vector<std::vector<double>> q(T), k(T), v(T);
    for (int t = 0; t < T; ++t) {
      auto h = norm(x[t], l.attn_norm, l.attn_norm_bias);
      q[t] = linear(h, l.wq, l.bq, c.q_dim());
      k[t] = linear(h, l.wk, l.bk, c.kv_dim());
      v[t] = linear(h, l.wv, l.bv, c.kv_dim());
      if (!opt) {
        rope(q[t], c.n_heads, t);
        rope(k[t], c.n_kv_heads, t);
      }
    }
    for (int t = 0; t < T; ++t) {
      std::vector<double> att(c.q_dim(), 0.0);
      for (int h = 0; h < c.n_heads; ++h) {
        const int g = h / (c.n_heads / c.n_kv_heads);
        std::vector<double> s(t + 1);
        double mx = -1e300, sum = 0;
        for (int u = 0; u <= t; ++u) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += q[t][h * hd + d] * k[u][g * hd + d];
          s[u] = dot / std::sqrt(double(hd));
          mx = std::max(mx, s[u]);
        }
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int u = 0; u <= t; ++u)
          for (int d = 0; d < hd; ++d)
            att[h * hd + d] += s[u] / sum * v[u][g * hd + d];
      }
      auto o = linear(att, l.wo, l.bo, D);
      for (int i = 0; i < D; ++i) x[t][i] += o[i];
      auto h = norm(x[t], l.ffn_norm, l.ffn_norm_bias);
      auto a = linear(h, l.w1, l.b1, c.hidden_dim);
      if (opt) {
        for (double& e : a) e = std::max(e, 0.0);
      } else {
        auto up = linear(h, l.w3, none, c.hidden_dim);
        for (int i = 0; i < c.hidden_dim; ++i)
          a[i] = a[i] / (1 + std::exp(-a[i])) * up[i];
      }
      auto m = linear(a, l.w2, l.b2, D);
      for (int i = 0; i < D; ++i) x[t][i] += m[i];
    }
  }
  auto h = norm(x[T - 1], w.final_norm, w.final_norm_bias);
  std::vector<float> cls(w.classifier(),
                         w.classifier() + size_t(c.vocab_size) * D);
  return linear(h, cls, none, c.vocab_size);
}

Weights RandomWeights(Architecture arch, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (float& e : v) e = normal(rng);
    return v;
  };
  Weights w;
  ModelConfig& c = w.config;
  c.arch = arch;
  c.dim = 8;
  c.hidden_dim = 12;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = arch == Architecture::kOpt ? 4 : 2;
  c.head_dim = 2;
  c.vocab_size = 16;
  c.max_seq_len = 16;
  c.bos_id = 0;
  c.eos_id = 1;
  const bool opt = arch == Architecture::kOpt;
  w.token_embedding = rnd(16 * 8);
  if (opt) w.position_embedding = rnd(18 * 8);
  for (int i = 0; i < 2; ++i) {
    LayerWeights l;
    l.attn_norm = rnd(8);
    l.wq = rnd(64);
    l.wk = rnd(8 * c.kv_dim());
    l.wv = rnd(8 * c.kv_dim());
    l.wo = rnd(64);
    l.ffn_norm = rnd(8);
    l.w1 = rnd(96);
    l.w2 = rnd(96);
    if (opt) {
      l.attn_norm_bias = rnd(8);
      l.ffn_norm_bias = rnd(8);
      l.bq = rnd(8);
      l.bk = rnd(8);
      l.bv = rnd(8);
      l.bo = rnd(8);
      l.b1 = rnd(12);
      l.b2 = rnd(8);
    } else {
      l.w3 = rnd(96);
    }
    w.layers.push_back(l);
  }
  w.final_norm = rnd(8);
  if (opt) w.final_norm_bias = rnd(8);
  if (seed % 2) w.lm_head = rnd(16 * 8);
  return w;
}

class NaiveParity : public ::testing::TestWithParam<Architecture> {};

TEST_P(NaiveParity, EngineMatchesNaiveForward) {
  for (unsigned seed = 1; seed <= 4; ++seed) {
    Weights w = RandomWeights(GetParam(), seed);
    auto engine = Engine::Create(w, NewCpuBackend());
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<int> ids = {0, 5, 9, 3, 15, 2, 7};
    // Prefill five, then decode two, checking the last logits each time.
    auto logits = (*engine)->Forward(absl::MakeSpan(ids).subspan(0, 5), false);
    ASSERT_TRUE(logits.ok());
    for (int n = 5; n <= 7; ++n) {
      std::vector<int> prefix(ids.begin(), ids.begin() + n);
      std::vector<double> want = NaiveForward(w, prefix);
      for (int j = 0; j < 16; ++j) {
        EXPECT_NEAR((*logits)[j], want[j], 1e-4) << "seed " << seed << " n " << n;
      }
      if (n < 7) {
        logits = (*engine)->Forward({ids[n]}, false);
        ASSERT_TRUE(logits.ok());
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, NaiveParity,
                         ::testing::Values(Architecture::kLlama,
                                           Architecture::kOpt));

TEST(Engine, RejectsInconsistentWeights) {
  Weights w = RandomWeights(Architecture::kLlama, 2);
  w.layers[1].w3.pop_back();
  auto engine = Engine::Create(w, NewCpuBackend());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(engine.status().message()),
              ::testing::HasSubstr("layers.1.w3"));
}

TEST(Sampler, GreedyTemperatureAndTopP) {
  auto greedy = Sampler::Create({0.0f, 1.0f, 1});
  ASSERT_TRUE(greedy.ok());
  std::vector<float> logits = {0.0f, 3.0f, 1.0f, 3.0f};
  EXPECT_EQ(greedy->Sample(logits), 1);
  // top_p small enough keeps only the most likely token.
  auto nucleus = Sampler::Create({1.0f, 0.05f, 9});
  ASSERT_TRUE(nucleus.ok());
  std::vector<float> peaked = {0.0f, 0.0f, 5.0f, 0.0f};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(nucleus->Sample(peaked), 2);
  // Plain sampling follows the distribution.
  auto sampler = Sampler::Create({1.0f, 1.0f, 11});
  ASSERT_TRUE(sampler.ok());
  std::vector<float> two = {0.0f, std::log(3.0f)};  // p = 0.25, 0.75
  int ones = 0;
  for (int i = 0; i < 4000; ++i) ones += sampler->Sample(two);
  EXPECT_NEAR(ones / 4000.0, 0.75, 0.03);
  EXPECT_EQ(Sampler::Create({-1.0f, 1.0f, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Sampler::Create({1.0f, 0.0f, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Sampler::Create({1.0f, 1.5f, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Sampler, LogProbIsNormalised) {
  std::vector<float> logits = {1.0f, 2.0f, 3.0f, 1000.0f};
  double total = 0;
  for (int i = 0; i < 4; ++i) total += std::exp(LogProb(logits, i));
  EXPECT_NEAR(total, 1.0, 1e-9);
  EXPECT_NEAR(LogProb(logits, 3), 0.0, 1e-9);
}

TEST(Sampler, ScoreTokenGivesTheLogProbAndTheMostLikely) {
  std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f};
  const TokenLogProb scored = ScoreToken(logits, 2, 3);
  EXPECT_EQ(scored.token, 2);
  EXPECT_NEAR(scored.logprob, LogProb(logits, 2), 1e-6);
  ASSERT_EQ(scored.top.size(), 3u);
  // Most likely first, lowest id on ties.
  EXPECT_EQ(scored.top[0].first, 1);
  EXPECT_EQ(scored.top[1].first, 3);
  EXPECT_EQ(scored.top[2].first, 2);
  EXPECT_NEAR(scored.top[0].second, LogProb(logits, 1), 1e-6);
  EXPECT_TRUE(ScoreToken(logits, 0, 0).top.empty());
  EXPECT_EQ(ScoreToken(logits, 0, 99).top.size(), logits.size());
}

TEST(Sampler, PenaltiesLowerWhatWasGenerated) {
  std::vector<float> logits = {5.0f, 4.5f, 0.0f};
  Penalties none(0.0f, 0.0f);
  none.Add(0);
  EXPECT_EQ(none.Apply(logits).data(), logits.data());
  Penalties p(0.5f, 0.25f);
  EXPECT_EQ(p.Apply(logits)[0], 5.0f);  // nothing generated yet
  p.Add(0);
  p.Add(0);
  p.Add(2);
  absl::Span<const float> out = p.Apply(logits);
  EXPECT_FLOAT_EQ(out[0], 5.0f - 2 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(out[1], 4.5f);
  EXPECT_FLOAT_EQ(out[2], 0.0f - 0.5f - 0.25f);
  // Greedy now picks the token not yet said.
  EXPECT_EQ(Argmax(out), 1);
  EXPECT_EQ(logits[0], 5.0f);  // the input is untouched
}

}  // namespace
}  // namespace infinigen::gpu_worker
