// The worker against a memory tier of several kv_memory_server processes
// (kv_memory_service/sharded): decoding with 2 and 4 TCP nodes gives
// exactly the single-node logits for every offloading policy, each node
// holds its share of the rows, and a node that stops answering fails its
// worker's sequences with an error naming it within the fetch timeout while
// a worker on the other nodes decodes on unaffected.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/llama2c.h"
#include "tests/kv_memory_service/server_process.h"

namespace infinigen {
namespace {

using gpu_worker::Engine;
using gpu_worker::EngineOptions;
using gpu_worker::PolicyKind;
using kv_memory_service::KvClient;
using kv_memory_service::ServerProcess;
using ::testing::HasSubstr;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";

class MemoryTier : public ::testing::Test {
 protected:
  void SetUp() override {
    auto w = model::LoadLlama2cWeights(kModel);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = std::move(*w);
    auto tok = model::Llama2cTokenizer::Load(kTokenizer, 512);
    ASSERT_TRUE(tok.ok());
    tokens_ = (*tok)->Encode(
        "Once upon a time, there was a little dog named Max. Max liked to run "
        "in the big green park with his friend Sue. One day, Sue found a red "
        "box under a tree. She opened it and saw a shiny key.",
        true);
    auto skew = gpu_worker::CalibrateSkew(weights_, tokens_);
    ASSERT_TRUE(skew.ok()) << skew.status();
    skew_ = std::move(*skew);
  }

  void StartServers(int n) {
    for (int i = 0; i < n; ++i) {
      auto s = ServerProcess::Start({"--listen=127.0.0.1:0"});
      ASSERT_TRUE(s.ok()) << s.status();
      servers_.push_back(std::move(*s));
    }
  }

  // "tcp://a,tcp://b" of servers [first, first + n).
  std::string Tier(int first, int n) const {
    std::vector<std::string> a;
    for (int i = first; i < first + n; ++i) a.push_back(servers_[i]->address());
    return absl::StrJoin(a, ",");
  }

  int64_t AppendedRows(int server) {
    auto c = kv_memory_service::ConnectKvClient(servers_[server]->address());
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return -1;
    auto s = (*c)->GetStoreStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->appended_rows : -1;
  }

  std::unique_ptr<Engine> MakeEngine(KvClient* client, PolicyKind kind) {
    EngineOptions options;
    options.max_seq_len = 96;
    options.batch = 2;
    options.kv.policy.emplace().kind = kind;
    options.kv.policy->infinigen.skew = &skew_;
    options.kv.kv_client = client;
    auto engine = Engine::Create(weights_, gpu_worker::NewCpuBackend(), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? std::move(*engine) : nullptr;
  }

  absl::Status Prefill(Engine& engine) {
    for (int s = 0; s < 2; ++s) {
      auto r = engine.Forward(s, absl::MakeConstSpan(tokens_).subspan(s, 8),
                              false);
      if (!r.ok()) return r.status();
    }
    return absl::OkStatus();
  }

  // Logits of decode step i (teacher-forced), both sequences.
  absl::StatusOr<std::vector<float>> Step(Engine& engine, int i) {
    auto l = engine.DecodeBatch({0, 1}, {tokens_[i], tokens_[i + 1]});
    if (!l.ok()) return l.status();
    return std::vector<float>(l->begin(), l->end());
  }

  std::vector<std::vector<float>> Decode(const std::string& address,
                                         PolicyKind kind) {
    auto client = kv_memory_service::ConnectKvClient(address);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return {};
    auto engine = MakeEngine(client->get(), kind);
    if (engine == nullptr) return {};
    EXPECT_TRUE(Prefill(*engine).ok());
    std::vector<std::vector<float>> out;
    for (int i = 8; i < 30; ++i) {
      auto l = Step(*engine, i);
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      out.push_back(std::move(*l));
    }
    return out;
  }

  model::Weights weights_;
  std::vector<int> tokens_;
  speculator::SkewMatrices skew_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
};

TEST_F(MemoryTier, TwoAndFourNodesGiveExactlyTheSingleNodeLogits) {
  StartServers(4);
  ASSERT_EQ(servers_.size(), 4u);
  for (PolicyKind kind : {PolicyKind::kFull, PolicyKind::kInfiniGen,
                          PolicyKind::kH2O, PolicyKind::kInt4}) {
    SCOPED_TRACE(gpu_worker::PolicyName(kind));
    const int64_t before0 = AppendedRows(0);
    const auto want = Decode(servers_[0]->address(), kind);
    ASSERT_EQ(want.size(), 22u);
    const int64_t single = AppendedRows(0) - before0;
    ASSERT_GT(single, 0);
    for (int n : {2, 4}) {
      SCOPED_TRACE(n);
      std::vector<int64_t> before;
      for (int i = 0; i < n; ++i) before.push_back(AppendedRows(i));
      EXPECT_EQ(Decode(Tier(0, n), kind), want);
      // stories260K has 4 KV heads: each node holds 4 / n of them, so
      // exactly 1 / n of the rows.
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(AppendedRows(i) - before[i], single / n) << "server " << i;
      }
    }
  }
}

// The same tier over the shared-memory plane: each node's rows reach the
// worker through its own shm slots, then the composite buffer.
TEST_F(MemoryTier, AShmTierGivesExactlyTheSingleNodeLogits) {
  std::vector<std::string> shm;
  for (int i = 0; i < 2; ++i) {
    shm.push_back("shm:unix:" +
                  ServerProcess::SocketPath("tier_shm" + std::to_string(i)));
    auto s = ServerProcess::Start(
        {"--listen=127.0.0.1:0", "--shm_listen=" + shm.back().substr(4)});
    ASSERT_TRUE(s.ok()) << s.status();
    servers_.push_back(std::move(*s));
  }
  for (PolicyKind kind : {PolicyKind::kFull, PolicyKind::kInfiniGen}) {
    SCOPED_TRACE(gpu_worker::PolicyName(kind));
    const int64_t before0 = AppendedRows(0), before1 = AppendedRows(1);
    const auto want = Decode(shm[0], kind);
    ASSERT_EQ(want.size(), 22u);
    const int64_t single = AppendedRows(0) - before0;
    ASSERT_GT(single, 0);
    EXPECT_EQ(Decode(shm[0] + "," + shm[1], kind), want);
    EXPECT_EQ(AppendedRows(0) - before0, single + single / 2);
    EXPECT_EQ(AppendedRows(1) - before1, single / 2);
  }
}

TEST_F(MemoryTier, AStoppedNodeFailsItsWorkerInBoundedTimeNotTheOthers) {
  StartServers(3);
  ASSERT_EQ(servers_.size(), 3u);
  const auto reference = Decode("inproc:", PolicyKind::kFull);
  ASSERT_EQ(reference.size(), 22u);

  kv_memory_service::KvClientOptions copts;
  copts.fetch_timeout = absl::Seconds(2);
  copts.rpc_timeout = absl::Seconds(2);
  // Worker A's KV spreads over all three nodes, worker B's over nodes 1, 2.
  auto client_a = kv_memory_service::ConnectKvClient(Tier(0, 3), copts);
  auto client_b = kv_memory_service::ConnectKvClient(Tier(1, 2), copts);
  ASSERT_TRUE(client_a.ok()) << client_a.status();
  ASSERT_TRUE(client_b.ok()) << client_b.status();
  auto a = MakeEngine(client_a->get(), PolicyKind::kFull);
  auto b = MakeEngine(client_b->get(), PolicyKind::kFull);
  ASSERT_TRUE(a != nullptr && b != nullptr);
  ASSERT_TRUE(Prefill(*a).ok());
  ASSERT_TRUE(Prefill(*b).ok());
  for (int i = 8; i < 12; ++i) {
    auto la = Step(*a, i);
    auto lb = Step(*b, i);
    ASSERT_TRUE(la.ok() && lb.ok());
    EXPECT_EQ(*la, reference[i - 8]);
    EXPECT_EQ(*lb, reference[i - 8]);
  }
  // Node 0 stops answering (SIGSTOP: no reset, no FIN: only the timeouts
  // can tell).
  servers_[0]->Stop();
  absl::Status status;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 12; i < 20 && status.ok(); ++i) status = Step(*a, i).status();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  ASSERT_FALSE(status.ok()) << "a stopped node must fail its sequences";
  std::fprintf(stderr, "worker A, %.2f s after node 0 stopped: %s\n", secs,
               status.ToString().c_str());
  EXPECT_THAT(status.code(),
              ::testing::AnyOf(absl::StatusCode::kUnavailable,
                               absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("memory node " + servers_[0]->address()));
  // One fetch timeout: the recovery's close, reopen and appends fail at once
  // on a node known not to answer instead of each waiting its own timeout.
  EXPECT_LT(secs, 2.0 + 1.5);
  // Worker B, on the nodes that answer, decodes on, bit for bit.
  for (int i = 12; i < 30; ++i) {
    auto lb = Step(*b, i);
    ASSERT_TRUE(lb.ok()) << lb.status();
    EXPECT_EQ(*lb, reference[i - 8]) << "step " << i;
  }
  EXPECT_TRUE((*client_b)->Health().ok());
  // Node 0 answers again: worker A's client takes calls again by itself
  // (its heartbeat clears the node), and a new generation decodes as before.
  servers_[0]->Continue();
  std::unique_ptr<Engine> again;
  absl::Status prefill = absl::UnknownError("not tried");
  for (int attempt = 0; attempt < 50 && !prefill.ok(); ++attempt) {
    if (attempt > 0) absl::SleepFor(absl::Milliseconds(100));
    again = MakeEngine(client_a->get(), PolicyKind::kFull);
    ASSERT_NE(again, nullptr);
    prefill = Prefill(*again);
  }
  ASSERT_TRUE(prefill.ok()) << prefill;
  for (int i = 8; i < 12; ++i) {
    auto la = Step(*again, i);
    ASSERT_TRUE(la.ok()) << la.status();
    EXPECT_EQ(*la, reference[i - 8]) << "step " << i;
  }
}

}  // namespace
}  // namespace infinigen
