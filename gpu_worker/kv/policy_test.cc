// The KV policies end to end on the real stories260K model through the
// in-process memory node: what each fetches, and what that does to the
// logits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/kv/policies/registry.h"
#include "gpu_worker/serving/sampler.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/llama2c.h"

namespace infinigen::gpu_worker {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";

class PolicyTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto w = model::LoadLlama2cWeights(kModel);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = new model::Weights(std::move(*w));
    auto tok = model::Llama2cTokenizer::Load(kTokenizer, 512);
    ASSERT_TRUE(tok.ok());
    tokens_ = new std::vector<int>((*tok)->Encode(
        "Once upon a time, there was a little dog named Max. Max liked to run "
        "in the big green park with his friend Sue. One day, Sue found a red "
        "box under a tree. She opened it and saw a shiny key. Max barked and "
        "wagged his tail. They walked home together and had cake.",
        true));
    auto skew = CalibrateSkew(*weights_, *tokens_);
    ASSERT_TRUE(skew.ok()) << skew.status();
    skew_ = new speculator::SkewMatrices(std::move(*skew));
  }

  // Teacher-forced: prefill `prefix` tokens, decode the rest one by one;
  // returns the NLL of every decoded prediction and the engine's stats.
  struct Run {
    std::vector<double> nll;
    std::vector<std::vector<float>> logits;
    FetchStats stats;
  };
  Run TeacherForced(std::optional<PolicyOptions> policy, int prefix,
                    double kv_capacity = 1.0,
                    kv_memory_service::EvictionPolicy eviction =
                        kv_memory_service::EvictionPolicy::kLru,
                    const model::Weights* weights = nullptr) {
    kv_memory_service::KvClientOptions copts;
    copts.inproc_store_options.eviction = eviction;
    auto client = kv_memory_service::ConnectKvClient("inproc:", copts);
    EXPECT_TRUE(client.ok()) << client.status();
    EngineOptions options;
    options.max_seq_len = 128;
    options.kv.policy = policy;
    options.kv.kv_client = client->get();
    options.kv.kv_capacity = kv_capacity;
    auto engine = Engine::Create(weights != nullptr ? *weights : *weights_,
                                 NewCpuBackend(), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    Run run;
    const std::vector<int>& t = *tokens_;
    auto logits = (*engine)->Forward(absl::MakeConstSpan(t).subspan(0, prefix),
                                     false);
    for (size_t i = prefix - 1; i + 1 < t.size(); ++i) {
      EXPECT_TRUE(logits.ok()) << logits.status();
      run.nll.push_back(-LogProb(*logits, t[i + 1]));
      run.logits.emplace_back(logits->begin(), logits->end());
      if (i + 2 < t.size()) logits = (*engine)->Forward({t[i + 1]}, false);
    }
    run.stats = (*engine)->fetch_stats();
    return run;
  }

  // The largest difference between two runs' logits (infinite where
  // their shapes differ).
  static float LargestLogitGap(const Run& a, const Run& b) {
    constexpr float kNever = std::numeric_limits<float>::infinity();
    if (a.logits.size() != b.logits.size()) return kNever;
    float largest = 0.0f;
    for (size_t i = 0; i < a.logits.size(); ++i) {
      if (a.logits[i].size() != b.logits[i].size()) return kNever;
      for (size_t j = 0; j < a.logits[i].size(); ++j) {
        largest = std::max(largest, std::fabs(a.logits[i][j] - b.logits[i][j]));
      }
    }
    return largest;
  }

  static double Mean(const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s / v.size();
  }

  // A prompt of n random tokens for driving a policy directly: queries
  // and keys [n][heads][head_dim], the keys again as [kv_head][n][head_dim]
  // (FinishPrefillLayer's), H2O's attention sums [n_heads][n] (positive),
  // a layer input, every position of max_seq present; the context of a
  // CPU backend.
  struct Prompt {
    std::unique_ptr<Backend> cpu = NewCpuBackend();
    KvPolicy::Context ctx;
    int n = 0;
    std::vector<float> q, k, keys, probs, x;
    std::vector<uint8_t> present;
  };
  static std::unique_ptr<Prompt> MakePrompt(int n, int max_seq,
                                            uint32_t seed) {
    const model::ModelConfig& m = weights_->config;
    auto prompt = std::make_unique<Prompt>();
    Prompt& r = *prompt;
    r.ctx.weights = weights_;
    r.ctx.backend = r.cpu.get();
    r.ctx.max_seq_len = max_seq;
    r.n = n;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    r.q.resize(static_cast<size_t>(n) * m.q_dim());
    r.k.resize(static_cast<size_t>(n) * m.kv_dim());
    r.x.resize(m.dim);
    r.probs.resize(static_cast<size_t>(m.n_heads) * n);
    for (auto* v : {&r.q, &r.k, &r.x, &r.probs}) {
      for (float& e : *v) e = normal(rng);
    }
    for (float& e : r.probs) e = std::fabs(e);
    r.keys.resize(r.k.size());
    for (int t = 0; t < n; ++t) {
      for (int g = 0; g < m.n_kv_heads; ++g) {
        std::copy_n(
            &r.k[(static_cast<size_t>(t) * m.n_kv_heads + g) * m.head_dim],
            m.head_dim, &r.keys[(static_cast<size_t>(g) * n + t) * m.head_dim]);
      }
    }
    r.present.assign(static_cast<size_t>(m.n_kv_heads) * max_seq, 1);
    return prompt;
  }
  // Every layer of `p` sees the prompt's prefill.
  static void Prefill(KvPolicy& p, const Prompt& r) {
    for (int l = 0; l < weights_->config.n_layers; ++l) {
      p.ObservePrefill(l, r.q.data(), r.k.data(), r.n, 0, r.probs.data());
      ASSERT_TRUE(p.FinishPrefillLayer(l, r.n, r.keys.data(), r.n).ok());
    }
  }

  static model::Weights* weights_;
  static std::vector<int>* tokens_;
  static speculator::SkewMatrices* skew_;
};

model::Weights* PolicyTest::weights_ = nullptr;
std::vector<int>* PolicyTest::tokens_ = nullptr;
speculator::SkewMatrices* PolicyTest::skew_ = nullptr;

// Logits of two runs that attend to the same rows, through different
// arithmetic (Quest's host bounds and the oracle's scores differ in their
// last bits, and so, after the log-softmax, in what rounds): a different
// selection moves them by far more.
constexpr float kSameSelection = 5e-3f;

PolicyOptions Policy(PolicyKind kind) {
  PolicyOptions p;
  p.kind = kind;
  return p;
}

// The local cache (--policy=ideal): no policy, nothing fetched.
constexpr std::nullopt_t kLocalCache = std::nullopt;

TEST_F(PolicyTest, SkewingLeavesLogitsUnchanged) {
  EngineOptions skewed;
  skewed.attention_skew = skew_;
  auto plain = Engine::Create(*weights_, NewCpuBackend());
  auto with_skew = Engine::Create(*weights_, NewCpuBackend(), skewed);
  ASSERT_TRUE(plain.ok() && with_skew.ok());
  auto a = (*plain)->Forward(*tokens_, true);
  ASSERT_TRUE(a.ok());
  std::vector<float> want(a->begin(), a->end());
  auto b = (*with_skew)->Forward(*tokens_, true);
  ASSERT_TRUE(b.ok());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR((*b)[i], want[i], 1e-3) << i;
  }
  // The skew is orthogonal and not the identity.
  const float* m = skew_->at(3, 1);
  const int d = skew_->head_dim;
  double off_identity = 0;
  for (int r = 0; r < d; ++r) {
    for (int c = 0; c < d; ++c) {
      double dot = 0;
      for (int k = 0; k < d; ++k) dot += m[r * d + k] * m[c * d + k];
      EXPECT_NEAR(dot, r == c ? 1.0 : 0.0, 1e-4);
      off_identity += std::fabs(m[r * d + c] - (r == c ? 1.0 : 0.0));
    }
  }
  EXPECT_GT(off_identity, 0.1);
}

TEST_F(PolicyTest, FullMatchesIdealUpToFp16) {
  Run ideal = TeacherForced(kLocalCache, 8);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  ASSERT_EQ(ideal.nll.size(), full.nll.size());
  for (size_t i = 0; i < ideal.nll.size(); ++i) {
    EXPECT_NEAR(full.nll[i], ideal.nll[i], 2e-2) << i;
  }
  EXPECT_EQ(ideal.stats.rows_fetched, 0);
  EXPECT_DOUBLE_EQ(full.stats.fraction_mean(), 1.0);
  EXPECT_DOUBLE_EQ(full.stats.fraction_max, 1.0);
}

TEST_F(PolicyTest, InfiniGenSelectingEverythingIsExactlyFull) {
  PolicyOptions all = Policy(PolicyKind::kInfiniGen);
  all.infinigen.alpha = 1e9f;
  all.selection.budget = 1.0f;
  all.infinigen.skew = skew_;
  Run inf = TeacherForced(all, 8);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  ASSERT_EQ(inf.logits.size(), full.logits.size());
  for (size_t i = 0; i < inf.logits.size(); ++i) {
    ASSERT_EQ(inf.logits[i], full.logits[i]) << "step " << i;
  }
  EXPECT_DOUBLE_EQ(inf.stats.fraction_mean(), 1.0);
}

TEST_F(PolicyTest, InfiniGenFetchesWithinTheCapAndTracksFull) {
  PolicyOptions p = Policy(PolicyKind::kInfiniGen);
  p.infinigen.skew = skew_;
  p.selection.budget = 0.2f;
  Run inf = TeacherForced(p, 8);
  // Layers 0 and 1 of 5 read everything; layers 2..4 at most 20% + 1 row.
  EXPECT_GT(inf.stats.fraction_mean(), 0.4);
  EXPECT_LT(inf.stats.fraction_max, 0.4 + 0.6 * 0.2 + 0.6 / 8 + 1e-9);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  Run tight = TeacherForced([&] {
    PolicyOptions t = p;
    t.selection.budget = 0.05f;
    t.infinigen.alpha = 0.5f;
    return t;
  }(), 8);
  // Fewer rows cost accuracy, in order.
  EXPECT_LT(Mean(full.nll), Mean(inf.nll) + 1e-9);
  EXPECT_LT(tight.stats.fraction_mean(), inf.stats.fraction_mean());
}

TEST_F(PolicyTest, SameLayerInputSpeculatesFromTheLayersOwnInput) {
  PolicyOptions all = Policy(PolicyKind::kInfiniGen);
  all.infinigen.alpha = 1e9f;
  all.selection.budget = 1.0f;
  all.infinigen.skew = skew_;
  all.infinigen.same_layer_input = true;
  Run every = TeacherForced(all, 8);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  ASSERT_EQ(every.logits, full.logits);
  // At a 20% cap the layer's own query picks other rows than the previous
  // layer's input does, within the same cap.
  PolicyOptions own = all;
  own.selection.budget = 0.2f;
  own.infinigen.partial_ratio = 1.0f;
  PolicyOptions ahead = own;
  ahead.infinigen.same_layer_input = false;
  Run by_own = TeacherForced(own, 8);
  Run by_ahead = TeacherForced(ahead, 8);
  EXPECT_NE(by_own.logits, by_ahead.logits);
  EXPECT_LT(by_own.stats.fraction_max, 0.4 + 0.6 * 0.2 + 0.6 / 8 + 1e-9);
}

// Speculating after the attention: layer l + 1's norm of the residual
// stream after layer l's attention is layer l + 1's own input when layer
// l's MLP adds nothing, so with every MLP's output projection zeroed and
// full columns of fp32 partial keys infinigen fetches what the oracle
// fetches; from layer l's input (the paper's) it does not.
// The same with no dense layers: layer 0 ranks by its own input, layer 1
// speculates from layer 0's attention output.
TEST_F(PolicyTest, PostAttentionSpeculationIsExactWhenTheMlpAddsNothing) {
  model::Weights no_mlp = *weights_;
  for (model::LayerWeights& w : no_mlp.layers) {
    std::fill(w.w2.begin(), w.w2.end(), 0.0f);
  }
  for (const int dense : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("dense_layers ", dense));
    auto skew = CalibrateSkew(no_mlp, *tokens_, {1.0, true, true, dense});
    ASSERT_TRUE(skew.ok()) << skew.status();
    // The calibration's profile speculates the same way: its speculated
    // ranking is the exact one, so are its errors (not so from the layer's
    // input).
    auto from_input =
        CalibrateSkew(no_mlp, *tokens_, {1.0, false, true, dense});
    ASSERT_TRUE(from_input.ok()) << from_input.status();
    const speculator::HeadProfile& pr = skew->profile;
    double input_gap = 0.0;
    for (size_t i = pr.Offset(dense, 0); i < pr.error.size(); ++i) {
      EXPECT_NEAR(pr.speculated_error[i], pr.error[i],
                  1e-4 * (1.0 + pr.error[i]))
          << i;
      input_gap =
          std::max(input_gap, std::fabs(static_cast<double>(
                                  from_input->profile.speculated_error[i] -
                                  from_input->profile.error[i])));
    }
    EXPECT_GT(input_gap, 1e-3);
    PolicyOptions oracle = Policy(PolicyKind::kOracle);
    oracle.selection.budget = 0.2f;
    oracle.selection.dense_layers = dense;
    PolicyOptions post = Policy(PolicyKind::kInfiniGen);
    post.infinigen.skew = &*skew;
    post.selection.budget = 0.2f;
    post.infinigen.alpha = 1e30f;
    post.infinigen.partial_ratio = 1.0f;
    post.infinigen.speculation_input =
        InfiniGenOptions::SpeculationInput::kPostAttention;
    post.infinigen.exact_partial_keys = true;
    post.selection.dense_layers = dense;
    const auto kLru = kv_memory_service::EvictionPolicy::kLru;
    Run a = TeacherForced(oracle, 8, 1.0, kLru, &no_mlp);
    Run b = TeacherForced(post, 8, 1.0, kLru, &no_mlp);
    EXPECT_LE(LargestLogitGap(a, b), kSameSelection);
    EXPECT_EQ(a.stats.rows_fetched, b.stats.rows_fetched);
    PolicyOptions ahead = post;
    ahead.infinigen.speculation_input =
        InfiniGenOptions::SpeculationInput::kLayerInput;
    Run c = TeacherForced(ahead, 8, 1.0, kLru, &no_mlp);
    EXPECT_EQ(c.stats.rows_fetched, a.stats.rows_fetched);
    EXPECT_GT(LargestLogitGap(a, c), 10 * kSameSelection);
  }
}

// With no dense layers every layer shares the budget: layer 0 ranks its
// rows by its own input (at budget 1, all of them: exactly full), so a
// target below what two whole layers fetch is reachable and lands, with
// no step reading more than the budget of any layer.
TEST_F(PolicyTest, WithNoDenseLayersEveryLayerSharesTheBudget) {
  const int layers = weights_->config.n_layers;  // 5: 2 dense are 40%
  const Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  PolicyOptions post = Policy(PolicyKind::kInfiniGen);
  post.infinigen.speculation_input =
      InfiniGenOptions::SpeculationInput::kPostAttention;
  for (PolicyOptions p :
       {Policy(PolicyKind::kOracle), Policy(PolicyKind::kQuest),
        Policy(PolicyKind::kInfiniGen), post}) {
    SCOPED_TRACE(absl::StrCat(PolicyName(p.kind), " after attention ",
                              p.SpeculatesAfterAttention()));
    p.infinigen.skew = skew_;
    p.selection.dense_layers = 0;
    p.quest.page_tokens = 1;
    EXPECT_TRUE(p.SelectsLayerZero());
    PolicyOptions every = p;
    every.selection.budget = 1.0f;
    every.infinigen.alpha = 1e30f;
    EXPECT_EQ(TeacherForced(every, 8).logits, full.logits);
    ASSERT_TRUE(SetTargetFetch(0.3, layers, p).ok());
    EXPECT_FLOAT_EQ(p.selection.budget, 0.3f);
    const Run run = TeacherForced(p, 8);
    EXPECT_NEAR(run.stats.fraction_mean(), 0.3, 0.03);
    EXPECT_LE(run.stats.fraction_max, 0.3 + 1e-9);
    EXPECT_GT(Mean(run.nll), Mean(full.nll));
  }
  // Two dense layers: layer 0 whole, a target of 0.3 out of reach.
  PolicyOptions dense = Policy(PolicyKind::kInfiniGen);
  EXPECT_FALSE(dense.SelectsLayerZero());
  EXPECT_EQ(SetTargetFetch(0.3, layers, dense).code(),
            absl::StatusCode::kInvalidArgument);
  dense.selection.dense_layers = -1;
  dense.infinigen.skew = skew_;
  EXPECT_EQ(dense.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// The oracle is the same-layer diagnostic at full columns with no alpha
// cut, needing no skew: the same logits and fetches as spelling it out.
TEST_F(PolicyTest, OracleIsTheExactTopKOfTheLayersOwnScores) {
  PolicyOptions oracle = Policy(PolicyKind::kOracle);
  oracle.selection.budget = 0.2f;
  PolicyOptions spelled = Policy(PolicyKind::kInfiniGen);
  spelled.infinigen.skew = skew_;
  spelled.selection.budget = 0.2f;
  spelled.infinigen.alpha = 1e30f;
  spelled.infinigen.partial_ratio = 1.0f;
  spelled.infinigen.same_layer_input = true;
  Run a = TeacherForced(oracle, 8);
  Run b = TeacherForced(spelled, 8);
  // The skew rotates the scores (same ranking up to rounding).
  EXPECT_LE(LargestLogitGap(a, b), kSameSelection);
  EXPECT_EQ(a.stats.rows_fetched, b.stats.rows_fetched);
  // Everything at budget 1: exactly full.
  oracle.selection.budget = 1.0f;
  EXPECT_EQ(TeacherForced(oracle, 8).logits,
            TeacherForced(Policy(PolicyKind::kFull), 8).logits);
}

// Sinks and the recent window come on top of Quest's ranked pages as for
// the oracle: with one-token pages the two fetch the same rows; with
// bigger pages the pages holding them are added.
TEST_F(PolicyTest, QuestAddsTheSinkAndRecentPages) {
  PolicyOptions quest = Policy(PolicyKind::kQuest);
  quest.selection.budget = 0.1f;
  quest.quest.page_tokens = 1;
  quest.selection.sink_tokens = 2;
  quest.selection.recent_tokens = 3;
  PolicyOptions oracle = Policy(PolicyKind::kOracle);
  oracle.selection.budget = 0.1f;
  oracle.selection.sink_tokens = 2;
  oracle.selection.recent_tokens = 3;
  Run a = TeacherForced(quest, 8);
  Run b = TeacherForced(oracle, 8);
  EXPECT_EQ(a.stats.rows_fetched, b.stats.rows_fetched);
  EXPECT_LE(LargestLogitGap(a, b), kSameSelection);
  quest.quest.page_tokens = 4;
  PolicyOptions plain = quest;
  plain.selection.sink_tokens = 0;
  plain.selection.recent_tokens = 0;
  Run with = TeacherForced(quest, 8);
  Run without = TeacherForced(plain, 8);
  EXPECT_GT(with.stats.rows_fetched, without.stats.rows_fetched);
  EXPECT_LE(Mean(with.nll), Mean(without.nll) + 0.05);
}

// The calibration measures both rankings' errors, and they fall to zero
// when a head reads everything.
TEST_F(PolicyTest, CalibrationMeasuresTheHeadProfile) {
  const speculator::HeadProfile& p = skew_->profile;
  const model::ModelConfig& c = weights_->config;
  ASSERT_FALSE(p.empty());
  EXPECT_EQ(p.n_layers, c.n_layers);
  EXPECT_EQ(p.n_kv_heads, c.n_kv_heads);
  EXPECT_FLOAT_EQ(p.partial_ratio, 0.3f);
  const size_t n_f = p.fractions.size();
  ASSERT_EQ(p.error.size(), c.n_layers * c.n_kv_heads * n_f);
  ASSERT_EQ(p.speculated_error.size(), p.error.size());
  double smallest_share = 0, speculated = 0, exact = 0;
  for (int l = 2; l < c.n_layers; ++l) {
    for (int g = 0; g < c.n_kv_heads; ++g) {
      const size_t at = p.Offset(l, g);
      EXPECT_LT(p.error[at + n_f - 1], 1e-12f);
      EXPECT_LT(p.speculated_error[at + n_f - 1], 1e-12f);
      smallest_share += p.error[at];
      exact += p.error[at + 1];
      speculated += p.speculated_error[at + 1];
    }
  }
  // Reading the fewest tokens loses something; speculating loses more than
  // ranking exactly.
  EXPECT_GT(smallest_share, 0.0);
  EXPECT_GT(speculated, exact);
}

// Adaptive head budgets: every head reads everything at a budget of 1; at
// a small budget the fetch stays about the uniform one's, and without a
// profile, or for a policy that cannot use one, the options are refused.
TEST_F(PolicyTest, AdaptiveBudgetsKeepTheMeanFetch) {
  PolicyOptions full_share = Policy(PolicyKind::kInfiniGen);
  full_share.infinigen.skew = skew_;
  full_share.infinigen.alpha = 1e9f;
  full_share.selection.budget = 1.0f;
  full_share.infinigen.adaptive_budgets = true;
  full_share.infinigen.profile = &skew_->profile;
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  Run all = TeacherForced(full_share, 8);
  ASSERT_EQ(all.logits.size(), full.logits.size());
  for (size_t i = 0; i < all.logits.size(); ++i) {
    for (size_t j = 0; j < all.logits[i].size(); ++j) {
      ASSERT_NEAR(all.logits[i][j], full.logits[i][j], 1e-3) << i << " " << j;
    }
  }

  for (PolicyKind kind : {PolicyKind::kInfiniGen, PolicyKind::kOracle}) {
    PolicyOptions uniform = Policy(kind);
    uniform.infinigen.skew = skew_;
    uniform.infinigen.alpha = 1e9f;
    uniform.selection.budget = 0.3f;
    PolicyOptions adaptive = uniform;
    adaptive.infinigen.adaptive_budgets = true;
    adaptive.infinigen.profile = &skew_->profile;
    adaptive.infinigen.budget_floor = 0.0f;
    Run u = TeacherForced(uniform, 8);
    Run a = TeacherForced(adaptive, 8);
    EXPECT_NE(a.logits, u.logits) << PolicyName(kind);
    EXPECT_NEAR(static_cast<double>(a.stats.rows_fetched),
                static_cast<double>(u.stats.rows_fetched),
                0.1 * u.stats.rows_fetched)
        << PolicyName(kind);
  }

  PolicyOptions bad = full_share;
  bad.infinigen.profile = nullptr;
  EXPECT_THAT(std::string(bad.Validate().message()),
              HasSubstr("head profile"));
  bad.infinigen.profile = &skew_->profile;
  bad.kind = PolicyKind::kQuest;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
  bad.kind = PolicyKind::kInfiniGen;
  bad.infinigen.budget_floor = 1.5f;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// Quest with one-token pages bounds each token by its exact score: it is
// the oracle. With bigger pages it fetches whole pages, at most the budget;
// with every page, it is full.
TEST_F(PolicyTest, QuestSelectsPagesByTheirKeyBounds) {
  PolicyOptions quest = Policy(PolicyKind::kQuest);
  quest.selection.budget = 0.25f;
  quest.quest.page_tokens = 1;
  PolicyOptions oracle = Policy(PolicyKind::kOracle);
  oracle.selection.budget = 0.25f;
  Run a = TeacherForced(quest, 8);
  Run b = TeacherForced(oracle, 8);
  EXPECT_LE(LargestLogitGap(a, b), kSameSelection);
  EXPECT_EQ(a.stats.rows_fetched, b.stats.rows_fetched);

  quest.quest.page_tokens = 4;
  Run paged = TeacherForced(quest, 8);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  // Whole pages, a quarter of them per speculated layer (at least one).
  EXPECT_GT(paged.stats.rows_fetched, 0);
  EXPECT_LT(paged.stats.rows_fetched, full.stats.rows_fetched * 0.7);
  EXPECT_NE(paged.logits, a.logits);
  EXPECT_LT(Mean(paged.nll) - Mean(full.nll), 0.5);

  quest.selection.budget = 1.0f;
  EXPECT_EQ(TeacherForced(quest, 8).logits, full.logits);

  EXPECT_EQ(*ParsePolicy("quest"), PolicyKind::kQuest);
  quest.quest.page_tokens = 0;
  EXPECT_EQ(quest.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// Score-mass selection: each head's own count. A mass of 1 at a budget of
// 1 takes every row (full's logits); a small mass takes fewer rows than
// the alpha rule's cap, and out-of-range masses are refused.
// --target_fetch: the budget that makes the dense layers 0 and 1 (whole)
// and the selecting layers average the target; the mean fetched fraction lands
// there.
TEST_F(PolicyTest, TargetFetchLandsTheMeanFetchedFraction) {
  const int layers = weights_->config.n_layers;  // 5: layers 0, 1 are 40%
  for (PolicyKind kind : {PolicyKind::kOracle, PolicyKind::kInfiniGen}) {
    SCOPED_TRACE(PolicyName(kind));
    PolicyOptions p = Policy(kind);
    p.infinigen.skew = skew_;
    p.infinigen.score_mass = 0.5f;
    ASSERT_TRUE(SetTargetFetch(0.7, layers, p).ok());
    EXPECT_FLOAT_EQ(p.selection.budget, 0.5f);
    EXPECT_EQ(p.infinigen.score_mass, 0.0f);
    EXPECT_GE(p.infinigen.alpha, 1e9f);
    Run run = TeacherForced(p, 8);
    EXPECT_NEAR(run.stats.fraction_mean(), 0.7, 0.05);
  }
  PolicyOptions h2o = Policy(PolicyKind::kH2O);
  ASSERT_TRUE(SetTargetFetch(0.3, layers, h2o).ok());
  EXPECT_FLOAT_EQ(h2o.selection.budget, 0.3f);
  // SmolLM2-135M's 30 layers at 10%: 1/28 of each selecting layer.
  PolicyOptions oracle = Policy(PolicyKind::kOracle);
  ASSERT_TRUE(SetTargetFetch(0.1, 30, oracle).ok());
  EXPECT_NEAR(oracle.selection.budget, 1.0 / 28, 1e-6);
  // Below what layers 0 and 1 fetch alone, out of range, or a policy that
  // does not choose its rows: InvalidArgument, options untouched.
  oracle.selection.budget = 0.25f;
  absl::Status low = SetTargetFetch(0.3, layers, oracle);
  EXPECT_EQ(low.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(low.message()),
              HasSubstr("its 2 dense layers alone fetch 0.4"));
  EXPECT_FLOAT_EQ(oracle.selection.budget, 0.25f);
  for (double bad : {0.0, -0.1, 1.5}) {
    EXPECT_EQ(SetTargetFetch(bad, layers, oracle).code(),
              absl::StatusCode::kInvalidArgument) << bad;
  }
  for (PolicyKind kind : {PolicyKind::kFull, PolicyKind::kInt4}) {
    PolicyOptions other = Policy(kind);
    EXPECT_EQ(SetTargetFetch(0.5, layers, other).code(),
              absl::StatusCode::kInvalidArgument) << PolicyName(kind);
  }
}

TEST_F(PolicyTest, ScoreMassAdaptsEachHeadsCount) {
  PolicyOptions p = Policy(PolicyKind::kInfiniGen);
  p.infinigen.skew = skew_;
  p.selection.budget = 0.5f;
  Run capped = TeacherForced(p, 8);
  p.infinigen.score_mass = 0.5f;
  Run half = TeacherForced(p, 8);
  EXPECT_GT(half.stats.rows_fetched, 0);
  EXPECT_NE(half.logits, capped.logits);
  p.infinigen.score_mass = 0.99f;
  Run most = TeacherForced(p, 8);
  EXPECT_GT(most.stats.rows_fetched, half.stats.rows_fetched);
  PolicyOptions o = Policy(PolicyKind::kOracle);
  o.selection.budget = 1.0f;
  o.infinigen.score_mass = 1.0f;
  EXPECT_EQ(TeacherForced(o, 8).logits,
            TeacherForced(Policy(PolicyKind::kFull), 8).logits);
  for (float bad : {-0.1f, 1.5f}) {
    p.infinigen.score_mass = bad;
    EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// Sinks and a recent window come on top of the speculated selection: more
// rows fetched; when they cover every position, the speculated layers read
// everything.
TEST_F(PolicyTest, SinksAndRecentTokensAreAlwaysFetched) {
  PolicyOptions p = Policy(PolicyKind::kInfiniGen);
  p.infinigen.skew = skew_;
  p.selection.budget = 0.05f;
  p.infinigen.alpha = 0.0f;  // the head's best token only
  Run bare = TeacherForced(p, 8);
  PolicyOptions with = p;
  with.selection.sink_tokens = 2;
  with.selection.recent_tokens = 4;
  Run more = TeacherForced(with, 8);
  EXPECT_GT(more.stats.rows_fetched, bare.stats.rows_fetched);
  // With every position a sink (or recent), the speculated layers read
  // everything: full's rows in another order, so the same up to rounding
  // (amplified where a new row rounds to another fp16 value).
  const Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  for (bool sinks : {true, false}) {
    PolicyOptions all = p;
    (sinks ? all.selection.sink_tokens : all.selection.recent_tokens) = 1000;
    const Run every = TeacherForced(all, 8);
    EXPECT_DOUBLE_EQ(every.stats.fraction_mean(), 1.0);
    ASSERT_EQ(every.logits.size(), full.logits.size());
    for (size_t i = 0; i < every.logits.size(); ++i) {
      for (size_t j = 0; j < every.logits[i].size(); ++j) {
        ASSERT_NEAR(every.logits[i][j], full.logits[i][j],
                    2e-2 * std::max(1.0f, std::fabs(full.logits[i][j])))
            << i;
      }
    }
  }
}

TEST_F(PolicyTest, ColumnRankingByKeysChangesOnlyWhichColumns) {
  // With every column kept the ranking cannot matter: identical logits.
  PolicyOptions q = Policy(PolicyKind::kInfiniGen);
  q.infinigen.skew = skew_;
  q.infinigen.partial_ratio = 1.0f;
  PolicyOptions qk = q;
  qk.infinigen.rank_columns_by_keys = true;
  Run by_q = TeacherForced(q, 8);
  Run by_qk = TeacherForced(qk, 8);
  ASSERT_EQ(by_q.logits, by_qk.logits);
  // With a partial set it still fetches within the same cap.
  qk.infinigen.partial_ratio = 0.3f;
  Run partial = TeacherForced(qk, 8);
  EXPECT_LT(partial.stats.fraction_max, 0.4 + 0.6 * 0.2 + 0.6 / 8 + 1e-9);
  EXPECT_EQ(partial.nll.size(), by_q.nll.size());
}

// The prompt's column sums only choose columns: where every column is kept
// (partial_ratio 1, what --target_fetch sets) InfiniGen neither observes
// the prompt (no queries or keys copied to the host) nor keeps per-block
// sums for prefix reuse; with a partial set it does both.
TEST_F(PolicyTest, KeepingEveryColumnLeavesThePromptUnobserved) {
  const std::unique_ptr<Prompt> prompt = MakePrompt(20, 64, 3);
  for (const float ratio : {1.0f, 0.3f}) {
    SCOPED_TRACE(ratio);
    PolicyOptions o = Policy(PolicyKind::kInfiniGen);
    o.infinigen.skew = skew_;
    o.infinigen.partial_ratio = ratio;
    auto policy = KvPolicy::Create(o, prompt->ctx);
    ASSERT_TRUE(policy.ok()) << policy.status();
    EXPECT_EQ((*policy)->ObservesPrefill(), ratio < 1.0f);
    EXPECT_EQ((*policy)->prefix_summary() != nullptr &&
                  (*policy)->prefix_summary()->floats() > 0,
              ratio < 1.0f);
  }
}

TEST_F(PolicyTest, H2OKeepsItsBudget) {
  PolicyOptions p = Policy(PolicyKind::kH2O);
  p.selection.budget = 0.2f;
  Run h2o = TeacherForced(p, 16);
  // Half recent and half heavy, each int(p * 0.1) rows at least one.
  EXPECT_LE(h2o.stats.fraction_max, 0.2 + 2.0 / 16 + 1e-9);
  EXPECT_GT(h2o.stats.fraction_mean(), 0.05);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 16);
  EXPECT_GT(Mean(h2o.nll), Mean(full.nll));
}

TEST_F(PolicyTest, Int4FetchesEverythingAtAQuarterOfTheBytes) {
  Run int4 = TeacherForced(Policy(PolicyKind::kInt4), 8);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  EXPECT_DOUBLE_EQ(int4.stats.fraction_mean(), 1.0);
  EXPECT_EQ(int4.stats.rows_fetched, full.stats.rows_fetched);
  // head_dim 8: one group of 8 nibbles (2 values) + scale + min = 4 values
  // per row instead of 8.
  EXPECT_EQ(int4.stats.bytes_fetched * 2, full.stats.bytes_fetched);
  // 4-bit keys cost some accuracy on this tiny model, not most of it.
  EXPECT_GT(Mean(int4.nll), Mean(full.nll));
  EXPECT_LT(Mean(int4.nll), Mean(full.nll) * 1.5);
}

TEST_F(PolicyTest, Int4CodecErrorIsWithinHalfAStep) {
  model::Weights w = *weights_;
  w.config.head_dim = 128;  // two groups of 64 per row
  w.config.n_heads = 1;
  w.config.n_kv_heads = 1;
  KvPolicy::Context ctx;
  ctx.weights = &w;
  ctx.max_seq_len = 4;
  auto int4 = KvPolicy::Create(Policy(PolicyKind::kInt4), ctx);
  ASSERT_TRUE(int4.ok()) << int4.status();
  EXPECT_EQ((*int4)->RowWidth(), 2 * 2 + 128 / 4);
  std::vector<float> rows(3 * 128);
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i] = std::sin(0.37 * i) * (1 + i % 7) - 0.5;
  }
  std::vector<uint16_t> packed(3 * (*int4)->RowWidth());
  std::vector<float> back(rows.size());
  (*int4)->EncodeRows(rows.data(), 3, packed.data());
  DecodeKvRows((*int4)->row_format(), packed.data(), 3, 128, back.data());
  for (int g = 0; g < 6; ++g) {
    float mn = rows[g * 64], mx = rows[g * 64];
    for (int i = 0; i < 64; ++i) {
      mn = std::min(mn, rows[g * 64 + i]);
      mx = std::max(mx, rows[g * 64 + i]);
    }
    const float step = (mx - mn) / 15;
    for (int i = 0; i < 64; ++i) {
      EXPECT_NEAR(back[g * 64 + i], rows[g * 64 + i], 0.5f * step * 1.02f + 1e-3f)
          << g << " " << i;
    }
  }
}

// InfiniGen and the oracle plan a selecting layer on the backend where each
// head takes its top k (a target fetch: the cap alone): the same rows, in
// the same order, as their plan on the host from the same state; the dense
// layers, the alpha rule, score mass and sink tokens plan on the host only.
TEST_F(PolicyTest, PlansOnTheBackendAreTheHostsPlans) {
  const model::ModelConfig& m = weights_->config;
  const int n = 50;
  const std::unique_ptr<Prompt> prompt = MakePrompt(n, 64, 3);

  struct Case {
    const char* name;
    PolicyOptions options;
    bool on_backend;
  };
  std::vector<Case> cases;
  for (PolicyKind kind : {PolicyKind::kInfiniGen, PolicyKind::kOracle}) {
    PolicyOptions o = Policy(kind);
    o.infinigen.skew = skew_;
    ASSERT_TRUE(SetTargetFetch(0.5, m.n_layers, o).ok());
    cases.push_back({PolicyName(kind), o, true});
  }
  PolicyOptions alpha = Policy(PolicyKind::kInfiniGen);
  alpha.infinigen.skew = skew_;
  cases.push_back({"alpha rule", alpha, false});
  PolicyOptions mass = cases[0].options;
  mass.infinigen.score_mass = 0.9f;
  cases.push_back({"score mass", mass, false});
  PolicyOptions sinks = cases[0].options;
  sinks.selection.sink_tokens = 2;
  cases.push_back({"sink tokens", sinks, false});

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto policy = KvPolicy::Create(c.options, prompt->ctx);
    ASSERT_TRUE(policy.ok()) << policy.status();
    KvPolicy& p = **policy;
    EXPECT_EQ(p.MaxBackendPlanRows(n) > 0, c.on_backend);
    ASSERT_NO_FATAL_FAILURE(Prefill(p, *prompt));
    const float* x = prompt->x.data();
    for (int l = 0; l < m.n_layers; ++l) {
      SCOPED_TRACE(l);
      kv_memory_service::OwnedFetchPlan host;
      PlanRequest request;
      request.layer = l;
      request.p = n;
      request.input = x;
      request.present = prompt->present.data();
      auto host_made = p.Plan(request, host);
      ASSERT_TRUE(host_made.ok()) << host_made.status();
      ASSERT_EQ(*host_made, PlanMade::kIndices);
      std::vector<int32_t> indices(
          static_cast<size_t>(m.n_kv_heads) * std::max(1, p.MaxBackendPlanRows(n)),
          -1);
      kv_memory_service::OwnedFetchPlan on_backend;
      request.backend_indices = indices.data();
      auto made = p.Plan(request, on_backend);
      ASSERT_TRUE(made.ok()) << made.status();
      const bool selects = l >= c.options.selection.dense_layers;
      EXPECT_EQ(*made == PlanMade::kOnBackend, c.on_backend && selects);
      if (*made != PlanMade::kOnBackend) continue;
      const std::vector<int32_t>& offsets = on_backend.head_offsets;
      // Each head its cap of the 50 cached tokens.
      EXPECT_EQ(
          offsets.back(),
          m.n_kv_heads * static_cast<int>(n * c.options.selection.budget));
      EXPECT_EQ(offsets, host.head_offsets);
      indices.resize(offsets.back());
      EXPECT_EQ(indices, host.indices);
    }
  }
}

// Where a policy says its plan is every row (kEveryRow: the cache then
// reads each head's first rows with no indices), its plan with indices
// names exactly every present position of every head, in order. Every
// policy, every layer, with and without an input.
TEST_F(PolicyTest, PlansOfEveryRowAreEveryPresentRow) {
  const model::ModelConfig& m = weights_->config;
  const int n = 50;
  const std::unique_ptr<Prompt> prompt = MakePrompt(n, 64, 5);
  int every_row = 0;
  for (const PolicyEntry* entry : Policies()) {
    SCOPED_TRACE(entry->name);
    PolicyOptions o = Policy(entry->kind);
    o.infinigen.skew = skew_;
    o.selection.budget = 0.3f;
    auto policy = KvPolicy::Create(o, prompt->ctx);
    ASSERT_TRUE(policy.ok()) << policy.status();
    KvPolicy& p = **policy;
    ASSERT_NO_FATAL_FAILURE(Prefill(p, *prompt));
    for (int l = 0; l < m.n_layers; ++l) {
      for (const float* input : {static_cast<const float*>(nullptr),
                                 static_cast<const float*>(
                                     prompt->x.data())}) {
        SCOPED_TRACE(absl::StrCat("layer ", l, input ? " with" : " without",
                                  " an input"));
        PlanRequest request;
        request.layer = l;
        request.p = n;
        request.input = input;
        request.present = prompt->present.data();
        request.every_row_ok = true;
        kv_memory_service::OwnedFetchPlan leading;
        auto leading_made = p.Plan(request, leading);
        ASSERT_TRUE(leading_made.ok()) << leading_made.status();
        request.every_row_ok = false;
        kv_memory_service::OwnedFetchPlan plan;
        ASSERT_TRUE(p.Plan(request, plan).ok());
        const bool all = *leading_made == PlanMade::kEveryRow;
        every_row += all;
        if (!all) continue;
        ASSERT_EQ(plan.head_offsets.back(), m.n_kv_heads * n);
        for (int g = 0; g < m.n_kv_heads; ++g) {
          ASSERT_EQ(plan.head_offsets[g], g * n);
          for (int t = 0; t < n; ++t) {
            ASSERT_EQ(plan.indices[static_cast<size_t>(g) * n + t], t);
          }
        }
      }
    }
  }
  EXPECT_GT(every_row, 0);
}

TEST_F(PolicyTest, PoolEvictionFetchesOnlyWhatIsPresent) {
  const int n = static_cast<int>(tokens_->size());
  for (auto eviction : {kv_memory_service::EvictionPolicy::kFifo,
                        kv_memory_service::EvictionPolicy::kLru,
                        kv_memory_service::EvictionPolicy::kCounter}) {
    // 128 positions at capacity 0.25 keep 32 tokens per (layer, head).
    Run run = TeacherForced(Policy(PolicyKind::kFull), 8, 0.25, eviction);
    ASSERT_EQ(static_cast<int>(run.nll.size()), n - 8);
    // Every step fetches every present row: all 5 layers x 4 heads x
    // min(p, 32), never more.
    EXPECT_LE(run.stats.rows_fetched,
              static_cast<long>(run.stats.steps) * 5 * 4 * 32);
    EXPECT_DOUBLE_EQ(run.stats.fraction_max, 1.0);
  }
  Run fifo = TeacherForced(Policy(PolicyKind::kFull), 8, 0.25,
                           kv_memory_service::EvictionPolicy::kFifo);
  Run full = TeacherForced(Policy(PolicyKind::kFull), 8);
  EXPECT_GT(Mean(fifo.nll), Mean(full.nll));
}

// The CPU backend, recording how the engine moves fetched rows to the
// backend: which host ranges it pins, what it copies, and whether every
// copy into a staging buffer waits (its `after` mark) for the operations
// that last read that buffer. On the CPU the operations are synchronous,
// so only this bookkeeping shows that a device would see the right order.
class RecordingBackend final : public BackendWrapper {
 public:
  struct Log {
    int pins = 0, unpins = 0;
    // Copies from pinned memory (the fetch buffers: fetched rows) and from
    // pageable memory (the engine's small control data: positions, the
    // speculated position, partial weights at the prefill).
    long copies = 0, unpinned_copies = 0, decodes = 0;
    size_t largest_unpinned_copy = 0;
    std::vector<std::string> violations;
  };
  explicit RecordingBackend(Log* log)
      : BackendWrapper(NewCpuBackend()), log_(log) {}

  std::string name() const override { return "recording-cpu"; }
  // As a device: fetched rows reach the operations by CopyFromHost.
  bool OperatesOnHostMemory() const override { return false; }
  void Linear(const float* x, int n, int in, const float* w, const float* b,
              int out, float* y) override {
    ++issued_;
    BackendWrapper::Linear(x, n, in, w, b, out, y);
  }
  void RmsNorm(const float* x, int n, int dim, const float* gain, float eps,
               float* y) override {
    ++issued_;
    BackendWrapper::RmsNorm(x, n, dim, gain, eps, y);
  }
  void LayerNorm(const float* x, int n, int dim, const float* gain,
                 const float* bias, float eps, float* y) override {
    ++issued_;
    BackendWrapper::LayerNorm(x, n, dim, gain, bias, eps, y);
  }
  void Rope(float* x, int n, int n_heads, int head_dim, const int* positions,
            float theta) override {
    ++issued_;
    BackendWrapper::Rope(x, n, n_heads, head_dim, positions, theta);
  }
  void Attention(const AttentionParams& p) override {
    ++issued_;
    BackendWrapper::Attention(p);
  }
  void SwiGlu(float* gate, const float* up, long count) override {
    ++issued_;
    BackendWrapper::SwiGlu(gate, up, count);
  }
  void Relu(float* x, long count) override {
    ++issued_;
    BackendWrapper::Relu(x, count);
  }
  void Add(float* x, const float* y, long count) override {
    ++issued_;
    BackendWrapper::Add(x, y, count);
  }
  void Copy(float* dst, const float* src, long count) override {
    ++issued_;
    BackendWrapper::Copy(dst, src, count);
  }
  void DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                    KvRowFormat format, float* rows) override {
    ++issued_;
    ++log_->decodes;
    const auto* begin = reinterpret_cast<const char*>(in);
    reads_.push_back({begin,
                      begin + static_cast<size_t>(n_rows) *
                                  KvRowWidth(format, head_dim) * 2,
                      issued_});
    BackendWrapper::DecodeKvRows(in, n_rows, head_dim, format, rows);
  }
  Mark MarkIssued() override {
    mark_at_.push_back(issued_);
    return mark_at_.size();
  }
  void CopyFromHost(void* dst, const void* src, size_t bytes,
                    Mark after) override {

    const long waited_for = after == 0 ? 0 : mark_at_.at(after - 1);
    const char* d = static_cast<const char*>(dst);
    for (const Read& r : reads_) {
      if (r.begin < d + bytes && d < r.end && r.op > waited_for) {
        log_->violations.push_back(
            "a copy overwrites rows that an operation after its mark reads");
      }
    }
    const char* sp = static_cast<const char*>(src);
    bool inside = false;
    for (const auto& [begin, end] : pinned_) {
      inside |= sp >= begin && sp + bytes <= end;
    }
    if (inside) {
      ++log_->copies;
    } else {
      ++log_->unpinned_copies;
      log_->largest_unpinned_copy =
          std::max(log_->largest_unpinned_copy, bytes);
    }
    std::memcpy(dst, src, bytes);
  }
  absl::Status PinHost(void* p, size_t bytes) override {
    ++log_->pins;
    pinned_.push_back({static_cast<char*>(p), static_cast<char*>(p) + bytes});
    return absl::OkStatus();
  }
  void UnpinHost(void* p) override { ++log_->unpins; }

 private:
  struct Read {
    const char* begin;
    const char* end;
    long op;  // issued_ when it was issued
  };
  Log* log_;
  long issued_ = 0;
  std::vector<long> mark_at_;
  std::vector<Read> reads_;
  std::vector<std::pair<const char*, const char*>> pinned_;
};

TEST_F(PolicyTest, FetchedRowsMoveThroughPinnedCopiesInMarkOrder) {
  PolicyOptions inf = Policy(PolicyKind::kInfiniGen);
  inf.infinigen.skew = skew_;
  for (PolicyOptions policy :
       {Policy(PolicyKind::kFull), Policy(PolicyKind::kInt4), inf}) {
    SCOPED_TRACE(PolicyName(policy.kind));
    auto client = kv_memory_service::ConnectKvClient("inproc:", {});
    ASSERT_TRUE(client.ok());
    EngineOptions options;
    options.max_seq_len = 128;
    options.kv.policy = policy;
    options.kv.kv_client = client->get();
    options.batch = 2;
    RecordingBackend::Log log;
    auto cpu = Engine::Create(*weights_, NewCpuBackend(), options);
    auto recorded = Engine::Create(
        *weights_, std::make_unique<RecordingBackend>(&log), options);
    ASSERT_TRUE(cpu.ok() && recorded.ok());
    const std::vector<int>& t = *tokens_;
    const int steps = 6, layers = weights_->config.n_layers;
    for (Engine* e : {cpu->get(), recorded->get()}) {
      for (int slot = 0; slot < 2; ++slot) {
        ASSERT_TRUE(
            e->Forward(slot, absl::MakeConstSpan(t).subspan(0, 10 + slot),
                       false)
                .ok());
      }
    }
    log.unpinned_copies = 0;  // from here on: decode steps only
    log.largest_unpinned_copy = 0;
    for (int step = 0; step < steps; ++step) {
      const int tokens[] = {t[10 + step], t[11 + step]};
      auto want = (*cpu)->DecodeBatch({0, 1}, tokens);
      ASSERT_TRUE(want.ok()) << want.status();
      const std::vector<float> w(want->begin(), want->end());
      auto got = (*recorded)->DecodeBatch({0, 1}, tokens);
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<float> g(got->begin(), got->end());
      if (policy.kind == PolicyKind::kInt4) {
        // The same arithmetic in the same order: bit for bit.
        ASSERT_EQ(g, w);
      } else {
        // The CPU attends over fp16 rows where they lie (AttendStoredRows),
        // the staged path over decoded rows: the same values summed in
        // another order (1e-4 apart). Each step's new rows are stored in
        // fp16 from each engine's own activations, so such a difference
        // can flip an fp16 rounding (1e-3 of the value) and carry into the
        // later steps.
        ASSERT_EQ(g.size(), w.size());
        for (size_t j = 0; j < w.size(); ++j) {
          ASSERT_NEAR(g[j], w[j], 5e-3f * (1.0f + std::fabs(w[j]))) << j;
        }
      }
    }
    // Two fetch buffers and two plan buffers per slot, the prefill's K and
    // V row stages.
    EXPECT_EQ(log.pins, 2 * 4 + 2);
    // Fetched rows and their head offsets: two copies per slot, layer and
    // step, from pinned memory.
    EXPECT_EQ(log.copies, 2 * 2L * steps * layers);
    // Nothing but control data moves from pageable memory while decoding:
    // the step's positions and, for infinigen, a speculated position.
    EXPECT_GT(log.unpinned_copies, 0);
    EXPECT_LE(log.largest_unpinned_copy, 2 * sizeof(int));
    EXPECT_GE(log.decodes, 2L * 2 * steps * layers);
    EXPECT_THAT(log.violations, ::testing::IsEmpty());
    recorded->reset();
    EXPECT_EQ(log.unpins, log.pins);
  }
}

// Several sequences decoding together give each the logits it gets alone:
// the batched GEMMs, per-sequence attention and selection do not mix them.
TEST_F(PolicyTest, BatchedDecodingMatchesSingleSequences) {
  PolicyOptions inf = Policy(PolicyKind::kInfiniGen);
  inf.infinigen.skew = skew_;
  for (std::optional<PolicyOptions> policy :
       {std::optional<PolicyOptions>(kLocalCache),
        std::optional<PolicyOptions>(Policy(PolicyKind::kFull)),
        std::optional<PolicyOptions>(inf),
        std::optional<PolicyOptions>(Policy(PolicyKind::kH2O))}) {
    SCOPED_TRACE(policy ? PolicyName(policy->kind) : kLocalCacheName);
    auto client = kv_memory_service::ConnectKvClient("inproc:");
    ASSERT_TRUE(client.ok());
    EngineOptions options;
    options.max_seq_len = 96;
    options.batch = 3;
    options.kv.policy = policy;
    options.kv.kv_client = client->get();
    auto batched = Engine::Create(*weights_, NewCpuBackend(), options);
    ASSERT_TRUE(batched.ok()) << batched.status();
    const std::vector<int>& t = *tokens_;
    const int prefix[3] = {5, 9, 14};
    // Each slot decodes its own continuation of a different prefix.
    std::vector<std::vector<float>> want[3];
    for (int s = 0; s < 3; ++s) {
      options.batch = 1;
      auto single = Engine::Create(*weights_, NewCpuBackend(), options);
      ASSERT_TRUE(single.ok());
      ASSERT_TRUE((*single)
                      ->Forward(absl::MakeConstSpan(t).subspan(s * 7, prefix[s]),
                                false)
                      .ok());
      for (int step = 0; step < 12; ++step) {
        auto l = (*single)->Forward({t[s * 7 + prefix[s] + step]}, false);
        ASSERT_TRUE(l.ok()) << l.status();
        want[s].emplace_back(l->begin(), l->end());
      }
      ASSERT_TRUE((*batched)
                      ->Forward(s, absl::MakeConstSpan(t).subspan(s * 7, prefix[s]),
                                false)
                      .ok());
    }
    const int v = weights_->config.vocab_size;
    // GEMM over the batch rounds differently from GEMV; stored fp16 rows
    // turn that into fp16 ulps (1e-3 relative) of the keys.
    const float tol = !policy ? 1e-3f : 2e-2f;
    for (int step = 0; step < 12; ++step) {
      std::vector<int> slots = {2, 0, 1};
      std::vector<int> next;
      for (int s : slots) next.push_back(t[s * 7 + prefix[s] + step]);
      auto l = (*batched)->DecodeBatch(slots, next);
      ASSERT_TRUE(l.ok()) << l.status();
      for (int i = 0; i < 3; ++i) {
        for (int j = 0; j < v; ++j) {
          const float w = want[slots[i]][step][j];
          ASSERT_NEAR((*l)[i * v + j], w, tol * (1 + std::fabs(w)))
              << "step " << step << " slot " << slots[i];
        }
      }
    }
    EXPECT_EQ((*batched)->position(0), 5 + 12);
    EXPECT_EQ((*batched)->DecodeBatch({0, 0}, {1, 2}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*batched)->DecodeBatch({3}, {1}).status().code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE((*batched)->Reset(1).ok());
    EXPECT_EQ((*batched)->DecodeBatch({1}, {1}).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

TEST_F(PolicyTest, BadOptionsAreRejected) {
  auto client = kv_memory_service::ConnectKvClient("inproc:");
  ASSERT_TRUE(client.ok());
  EngineOptions o;
  o.kv.policy = Policy(PolicyKind::kFull);
  auto no_client = Engine::Create(*weights_, NewCpuBackend(), o);
  EXPECT_EQ(no_client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(no_client.status().message()),
              HasSubstr("KV memory node"));
  o.kv.kv_client = client->get();
  o.kv.policy = Policy(PolicyKind::kInfiniGen);
  EXPECT_EQ(Engine::Create(*weights_, NewCpuBackend(), o).status().code(),
            absl::StatusCode::kInvalidArgument);  // no skew
  o.kv.policy->infinigen.skew = skew_;
  o.kv.policy->infinigen.alpha = -1;
  EXPECT_EQ(Engine::Create(*weights_, NewCpuBackend(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.kv.policy = Policy(PolicyKind::kFull);
  o.kv.kv_capacity = 0;
  EXPECT_EQ(Engine::Create(*weights_, NewCpuBackend(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.kv.kv_capacity = 1;
  o.max_seq_len = 64;
  auto engine = Engine::Create(*weights_, NewCpuBackend(), o);
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE((*engine)->Forward({1, 5, 9}, false).ok());
  ASSERT_TRUE((*engine)->Forward({7}, false).ok());
  EXPECT_EQ((*engine)->Forward({7, 8}, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ParsePolicy("bogus").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParsePolicy("oracle"), PolicyKind::kOracle);
  PolicyOptions negative = Policy(PolicyKind::kOracle);
  negative.selection.sink_tokens = -1;
  EXPECT_EQ(negative.Validate().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace infinigen::gpu_worker
