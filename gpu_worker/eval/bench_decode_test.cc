#include "gpu_worker/eval/bench_decode.h"

#include <memory>
#include <vector>

#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/llama2c.h"

namespace infinigen::gpu_worker {
namespace {

constexpr char kModel[] = "models/stories260K/stories260K.bin";

TEST(DecodeBenchSource, RepeatsTextOrMakesDeterministicIds) {
  const std::vector<int> text = {5, 6, 7};
  EXPECT_EQ(DecodeBenchSource(text, 8, 512),
            (std::vector<int>{5, 6, 7, 5, 6, 7, 5, 6}));
  EXPECT_EQ(DecodeBenchSource(text, 2, 512), text);  // never cut
  const std::vector<int> a = DecodeBenchSource({}, 1000, 512);
  ASSERT_EQ(a.size(), 1000u);
  EXPECT_EQ(a, DecodeBenchSource({}, 1000, 512));
  for (int id : a) {
    ASSERT_GE(id, 0);
    ASSERT_LT(id, 512);
  }
}

TEST(Percentile, NearestRank) {
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({3, 1, 2, 4}, 50), 3);
  EXPECT_EQ(Percentile({3, 1, 2, 4}, 0), 1);
  EXPECT_EQ(Percentile({3, 1, 2, 4}, 99), 4);
  EXPECT_EQ(Percentile({3, 1, 2, 4}, 100), 4);
}

class RunDecodeBenchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = model::LoadLlama2cWeights(kModel);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = std::make_unique<model::Weights>(*std::move(w));
    auto client = kv_memory_service::ConnectKvClient("inproc:");
    ASSERT_TRUE(client.ok());
    client_ = *std::move(client);
  }

  std::unique_ptr<Engine> MakeEngine(const std::string& policy, int batch,
                                     int max_seq_len) {
    EngineOptions o;
    EXPECT_TRUE(ChoosePolicy(policy, o.kv).ok());
    o.batch = batch;
    o.max_seq_len = max_seq_len;
    if (o.kv.policy) o.kv.kv_client = client_.get();
    auto e = Engine::Create(*weights_, NewCpuBackend(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *std::move(e) : nullptr;
  }

  std::unique_ptr<model::Weights> weights_;
  std::unique_ptr<kv_memory_service::KvClient> client_;
};

TEST_F(RunDecodeBenchTest, TimesEveryStepAndCountsFetchesOfEverySequence) {
  const int ctx = 20, steps = 6, batch = 3;
  auto engine = MakeEngine("full", batch, ctx + steps);
  ASSERT_NE(engine, nullptr);
  const std::vector<int> source =
      DecodeBenchSource({}, batch * (ctx + steps), 512);
  std::vector<int> prefilled;
  auto r = RunDecodeBench(*engine, source, ctx, steps,
                          [&](int n) { prefilled.push_back(n); });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(prefilled, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(r->policy, "full");
  EXPECT_EQ(r->backend, engine->backend().name());
  EXPECT_EQ(r->tokens(), batch * steps);
  ASSERT_EQ(r->step_seconds.size(), static_cast<size_t>(steps));
  for (double s : r->step_seconds) EXPECT_GT(s, 0);
  EXPECT_GT(r->seconds, 0);
  EXPECT_GT(r->tokens_per_second(), 0);
  EXPECT_LE(r->step_ms(50), r->step_ms(99));
  // full fetches every cached row at every step of every sequence.
  EXPECT_EQ(r->fetch.steps, static_cast<long>(batch) * steps);
  EXPECT_NEAR(r->fetch.fraction_mean(), 1.0, 1e-9);
  EXPECT_GT(r->fetch.bytes_fetched, 0);
  // Each prefill opened its sequence at the node (timed), and waited on
  // its layers' appends for some time or none.
  EXPECT_GT(r->fetch.open_seconds, 0);
  EXPECT_GE(r->fetch.prefill_append_wait_seconds, 0);
  EXPECT_LT(r->fetch.open_seconds + r->fetch.prefill_append_wait_seconds,
            r->prefill_seconds);
  EXPECT_GT(r->worker_kv_bytes, 0);
  EXPECT_GT(r->memory_node_bytes, 0);
  EXPECT_GT(r->peak_rss_bytes, 0);
  // The warm-up ran, and left nothing behind: no prompt reused a prefix of
  // it, and slot 0's statistics are its benchmark sequence's alone.
  EXPECT_GT(r->warmup_seconds, 0);
  EXPECT_EQ(r->cached_tokens, 0);
  EXPECT_EQ(engine->fetch_stats(0).steps, steps);
  // Each sequence decoded its own continuation: position ctx + steps.
  for (int b = 0; b < batch; ++b) EXPECT_EQ(engine->position(b), ctx + steps);
  // A slot's prefill figures are its own sequence's, until it is reset.
  EXPECT_GT(engine->fetch_stats(0).open_seconds, 0);
  ASSERT_TRUE(engine->Reset(0).ok());
  EXPECT_EQ(engine->fetch_stats(0).open_seconds, 0);
  EXPECT_EQ(engine->fetch_stats(0).prefill_append_wait_seconds, 0);
}

// A context shorter than the warm-up's prompt: the warm-up takes ctx
// tokens, and its step still fits the slot.
// A policy that scores the prompt (H2O's accumulated attention) spends
// part of the prefill on it, on the host, and the run says how much.
TEST_F(RunDecodeBenchTest, CountsThePolicysOwnPrefillWork) {
  const int ctx = 64, steps = 2;
  auto engine = MakeEngine("h2o", 1, ctx + steps);
  ASSERT_NE(engine, nullptr);
  const std::vector<int> source = DecodeBenchSource({}, ctx + steps, 512);
  auto r = RunDecodeBench(*engine, source, ctx, steps, nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->fetch.prefill_policy_seconds, 0);
  EXPECT_LT(r->fetch.prefill_policy_seconds, r->prefill_seconds);
}

TEST_F(RunDecodeBenchTest, AShortContextWarmsUpWithinIt) {
  const int ctx = 3, steps = 1;
  auto engine = MakeEngine("full", 1, ctx + steps);
  ASSERT_NE(engine, nullptr);
  const std::vector<int> source = DecodeBenchSource({}, ctx + steps, 512);
  auto r = RunDecodeBench(*engine, source, ctx, steps);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(engine->position(0), ctx + steps);
  EXPECT_EQ(r->fetch.steps, steps);
}

TEST_F(RunDecodeBenchTest, TooLittleInputOrRoomIsRefused) {
  auto engine = MakeEngine("ideal", 2, 16);
  ASSERT_NE(engine, nullptr);
  const std::vector<int> source = DecodeBenchSource({}, 100, 512);
  EXPECT_EQ(RunDecodeBench(*engine, source, 12, 8).status().code(),
            absl::StatusCode::kInvalidArgument);  // 20 > 16 positions
  EXPECT_EQ(RunDecodeBench(*engine, absl::MakeConstSpan(source).subspan(0, 20),
                           10, 4)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);  // 2 x 14 tokens needed
  EXPECT_EQ(RunDecodeBench(*engine, source, 0, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace infinigen::gpu_worker
