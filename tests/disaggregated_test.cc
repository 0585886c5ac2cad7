// The worker against a separate kv_memory_server process: decoding through
// TCP and shared memory gives exactly what it gives in process, and a
// server that dies mid-generation gives the worker a clear error, not a
// hang.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/llama2c.h"
#include "model/loader.h"
#include "tests/kv_memory_service/server_process.h"

namespace infinigen {
namespace {

using gpu_worker::Engine;
using gpu_worker::EngineOptions;
using gpu_worker::PolicyKind;
using kv_memory_service::ServerProcess;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";

class Disaggregated : public ::testing::Test {
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

  // Teacher-forced logits of every decoded position, two sequences in a
  // batch, through the memory node at `address`.
  // With `direct`, one-sided reads (KvOptions::direct_reads); *in_place
  // (may be null) gets the rows read where the node keeps them, of
  // *fetched. `row_cache`: KvOptions::row_cache; *stats (may be null) the
  // two sequences' fetch statistics; `kv_capacity`: KvOptions::kv_capacity.
  std::vector<std::vector<float>> Decode(
      const std::string& address, PolicyKind kind, bool direct = false,
      long* in_place = nullptr, long* fetched = nullptr,
      double row_cache = 0.0, gpu_worker::FetchStats* stats = nullptr,
      double kv_capacity = 1.0) {
    auto client = kv_memory_service::ConnectKvClient(address);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return {};
    EngineOptions options;
    options.max_seq_len = 96;
    options.batch = 2;
    options.kv.policy.emplace().kind = kind;
    options.kv.policy->infinigen.skew = &skew_;
    options.kv.kv_client = client->get();
    options.kv.direct_reads = direct;
    options.kv.row_cache = row_cache;
    options.kv.kv_capacity = kv_capacity;
    auto engine = Engine::Create(weights_, gpu_worker::NewCpuBackend(), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return {};
    std::vector<std::vector<float>> out;
    for (int s = 0; s < 2; ++s) {
      EXPECT_TRUE((*engine)
                      ->Forward(s, absl::MakeConstSpan(tokens_).subspan(s, 8),
                                false)
                      .ok());
    }
    for (int i = 8; i < 30; ++i) {
      auto l = (*engine)->DecodeBatch({0, 1}, {tokens_[i], tokens_[i + 1]});
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      out.emplace_back(l->begin(), l->end());
    }
    if (in_place != nullptr) *in_place = (*engine)->fetch_stats().rows_read_in_place;
    if (fetched != nullptr) *fetched = (*engine)->fetch_stats().rows_fetched;
    if (stats != nullptr) {
      *stats = gpu_worker::FetchStats();
      for (int s = 0; s < 2; ++s) stats->Add((*engine)->fetch_stats(s));
    }
    return out;
  }

  model::Weights weights_;
  std::vector<int> tokens_;
  speculator::SkewMatrices skew_;
};

TEST_F(Disaggregated, RemoteMemoryNodesGiveExactlyTheInProcessLogits) {
  auto tcp = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const std::string shm_sock = ServerProcess::SocketPath("dis_shm.sock");
  auto shm = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm_sock});
  ASSERT_TRUE(shm.ok()) << shm.status();
  for (PolicyKind kind : {PolicyKind::kFull, PolicyKind::kInfiniGen,
                          PolicyKind::kH2O, PolicyKind::kInt4}) {
    SCOPED_TRACE(gpu_worker::PolicyName(kind));
    const auto want = Decode("inproc:", kind);
    ASSERT_FALSE(want.empty());
    EXPECT_EQ(Decode((*tcp)->address(), kind), want);
    EXPECT_EQ(Decode("shm:unix:" + shm_sock, kind), want);
    // One-sided reads in process and over shm (the node's rows mapped
    // read-only): the CPU attends over them in place, the same logits;
    // int4 rows are gathered.
    for (const std::string address : {std::string("inproc:"),
                                      "shm:unix:" + shm_sock}) {
      SCOPED_TRACE(address);
      long in_place = -1, fetched = -1;
      EXPECT_EQ(Decode(address, kind, true, &in_place, &fetched), want);
      EXPECT_GT(fetched, 0);
      EXPECT_EQ(in_place, kind == PolicyKind::kInt4 ? 0 : fetched);
    }
  }
}

// A CPU backend that records the host ranges PinHost is asked to pin:
// where a device backend registers memory with the device (the host twin).
class PinRecordingBackend : public gpu_worker::BackendWrapper {
 public:
  explicit PinRecordingBackend(std::vector<const void*>* pinned)
      : BackendWrapper(gpu_worker::NewCpuBackend()), pinned_(pinned) {}
  absl::Status PinHost(void* p, size_t bytes) override {
    pinned_->push_back(p);
    return BackendWrapper::PinHost(p, bytes);
  }

 private:
  std::vector<const void*>* const pinned_;
};

// A worker that serves prompt after prompt over shm with one-sided reads
// reads each new sequence where it read the last: the node opens it in the
// closed sequence's rows (--shm_spare_rows), which the client kept mapped
// and registered, so the rows asked to be pinned are the ones pinned
// before, not a new mapping a sequence. The logits are the same every
// time, and those of a node without spares.
TEST_F(Disaggregated, EachNewSequenceIsReadWhereTheLastOneWas) {
  const std::string shm_sock = ServerProcess::SocketPath("dis_spare.sock");
  std::vector<std::vector<float>> want;
  for (const int spares : {0, 1}) {
    SCOPED_TRACE(spares);
    auto shm = ServerProcess::Start({"--listen=127.0.0.1:0",
                                     "--shm_listen=unix:" + shm_sock,
                                     absl::StrCat("--shm_spare_rows=", spares)});
    ASSERT_TRUE(shm.ok()) << shm.status();
    auto client = kv_memory_service::ConnectKvClient("shm:unix:" + shm_sock);
    ASSERT_TRUE(client.ok()) << client.status();
    EngineOptions options;
    options.max_seq_len = 96;
    options.kv.policy.emplace().kind = PolicyKind::kFull;
    options.kv.kv_client = client->get();
    options.kv.direct_reads = true;
    std::vector<const void*> pinned;
    auto engine = Engine::Create(
        weights_, std::make_unique<PinRecordingBackend>(&pinned), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const size_t buffers = pinned.size();  // the cache's own, pinned once
    std::vector<std::vector<const void*>> rows_pinned;
    for (int round = 0; round < 3; ++round) {
      ASSERT_TRUE((*engine)->Reset(0).ok());
      const size_t before = pinned.size();
      auto prefill = (*engine)->Forward(
          0, absl::MakeConstSpan(tokens_).subspan(0, 8), false);
      ASSERT_TRUE(prefill.ok()) << prefill.status();
      std::vector<float> logits(prefill->begin(), prefill->end());
      for (int i = 8; i < 20; ++i) {
        auto l = (*engine)->Forward(0, {tokens_[i]}, false);
        ASSERT_TRUE(l.ok()) << l.status();
        logits.insert(logits.end(), l->begin(), l->end());
      }
      EXPECT_GT((*engine)->fetch_stats().rows_read_in_place, 0);
      rows_pinned.emplace_back(pinned.begin() + before, pinned.end());
      if (want.size() <= static_cast<size_t>(round)) {
        want.push_back(logits);
      } else {
        EXPECT_EQ(logits, want[round]);
      }
    }
    EXPECT_GE(buffers, 1u);
    ASSERT_EQ(rows_pinned[0].size(), 2u);  // the node's K and V rows
    if (spares > 0) {
      EXPECT_EQ(rows_pinned[1], rows_pinned[0]);
      EXPECT_EQ(rows_pinned[2], rows_pinned[0]);
    }
    auto stats = (*client)->GetStoreStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->reused_row_sequences, spares > 0 ? 2 : 0);
  }
  EXPECT_EQ(want[1], want[0]);
}

// The rows the node at `address` has counted as fetched (gathered or
// noted), all sequences together.
int64_t NodeFetchedRows(const std::string& address) {
  auto client = kv_memory_service::ConnectKvClient(address);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return -1;
  auto stats = (*client)->GetStoreStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->fetched_rows : -1;
}

// The worker's row cache over every data plane, two sequences in a batch
// (each its own cache): the logits of fetching every selected row, bit for
// bit, with only the rows the worker did not hold fetched. A remote node
// still counts every selected row as fetched: the hits are noted to it.
TEST_F(Disaggregated, TheRowCacheGivesTheSameLogitsOnEveryPlane) {
  auto tcp = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const std::string shm_sock = ServerProcess::SocketPath("dis_rows.sock");
  auto shm = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm_sock});
  ASSERT_TRUE(shm.ok()) << shm.status();
  for (PolicyKind kind : {PolicyKind::kInfiniGen, PolicyKind::kOracle,
                          PolicyKind::kQuest, PolicyKind::kH2O}) {
    SCOPED_TRACE(gpu_worker::PolicyName(kind));
    gpu_worker::FetchStats all;
    const auto want =
        Decode("inproc:", kind, false, nullptr, nullptr, 0.0, &all);
    ASSERT_FALSE(want.empty());
    for (const std::string address :
         {std::string("inproc:"), (*tcp)->address(), "shm:unix:" + shm_sock}) {
      SCOPED_TRACE(address);
      const bool remote = address != "inproc:";
      const int64_t before = remote ? NodeFetchedRows(address) : 0;
      gpu_worker::FetchStats got;
      EXPECT_EQ(Decode(address, kind, false, nullptr, nullptr, 0.5, &got),
                want);
      EXPECT_EQ(got.row_cache_lookups, all.rows_fetched);
      EXPECT_GT(got.row_cache_hits, 0);
      EXPECT_EQ(got.rows_fetched, all.rows_fetched - got.row_cache_hits);
      if (remote) {
        EXPECT_EQ(NodeFetchedRows(address) - before, all.rows_fetched);
      }
    }
  }
}

// A node that evicts (LRU, a pool of a quarter of the context): with the
// row cache its hits are noted over TCP and shm as rows of each layer's
// fetch, so the node evicts what it evicts for a worker that fetches every
// selected row, and the logits are the same.
TEST_F(Disaggregated, AnEvictingNodeEvictsAsWithoutTheRowCache) {
  auto tcp = ServerProcess::Start({"--listen=127.0.0.1:0", "--eviction=lru"});
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const std::string shm_sock = ServerProcess::SocketPath("dis_evict.sock");
  auto shm = ServerProcess::Start({"--listen=127.0.0.1:0", "--eviction=lru",
                                   "--shm_listen=unix:" + shm_sock});
  ASSERT_TRUE(shm.ok()) << shm.status();
  for (const std::string& address : {(*tcp)->address(), "shm:unix:" + shm_sock}) {
    SCOPED_TRACE(address);
    gpu_worker::FetchStats all, got;
    int64_t before = NodeFetchedRows(address);
    const auto want = Decode(address, PolicyKind::kInfiniGen, false, nullptr,
                             nullptr, 0.0, &all, 0.25);
    ASSERT_FALSE(want.empty());
    const int64_t gathered = NodeFetchedRows(address) - before;
    before = NodeFetchedRows(address);
    EXPECT_EQ(Decode(address, PolicyKind::kInfiniGen, false, nullptr, nullptr,
                     0.5, &got, 0.25),
              want);
    EXPECT_GT(got.row_cache_hits, 0);
    EXPECT_EQ(got.rows_fetched, all.rows_fetched - got.row_cache_hits);
    EXPECT_EQ(NodeFetchedRows(address) - before, gathered);
  }
}

// Gemma 3's hybrid cache (a tiny random checkpoint, window 4, prefill
// chunks of 2): the sliding-window layers' rows stay on the worker, the
// global layers' go to the memory node; a remote node gives exactly the
// in-process logits, and `full` gives ideal's up to the node's fp16 rows.
TEST(DisaggregatedGemma3, HybridCacheGivesTheSameLogitsOnEveryPlane) {
  auto m = model::LoadModel("tests/testdata/hf_tiny_gemma3", "");
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<int> tokens = {2};
  for (int i = 0; i < 50; ++i) tokens.push_back(3 + (i * 7 + i * i) % 29);
  auto skew = gpu_worker::CalibrateSkew(m->weights, tokens);
  ASSERT_TRUE(skew.ok()) << skew.status();
  auto decode = [&](const std::string& address, const char* policy) {
    std::vector<std::vector<float>> out;
    auto client = kv_memory_service::ConnectKvClient(address);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return out;
    EngineOptions options;
    options.max_seq_len = 64;
    options.max_chunk = 2;
    options.batch = 2;
    EXPECT_TRUE(gpu_worker::ChoosePolicy(policy, options.kv).ok());
    if (options.kv.policy) {
      options.kv.policy->infinigen.skew = &*skew;
      options.kv.kv_client = client->get();
    }
    auto engine =
        Engine::Create(m->weights, gpu_worker::NewCpuBackend(), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return out;
    for (int s = 0; s < 2; ++s) {
      EXPECT_TRUE((*engine)
                      ->Forward(s, absl::MakeConstSpan(tokens).subspan(s, 7),
                                false)
                      .ok());
    }
    for (int i = 7; i < 48; ++i) {
      auto l = (*engine)->DecodeBatch({0, 1}, {tokens[i], tokens[i + 1]});
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) break;
      out.emplace_back(l->begin(), l->end());
    }
    return out;
  };
  auto tcp = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const std::string shm_sock = ServerProcess::SocketPath("dis_gemma.sock");
  auto shm = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm_sock});
  ASSERT_TRUE(shm.ok()) << shm.status();
  const auto ideal = decode("inproc:", "ideal");
  ASSERT_EQ(ideal.size(), 41u);
  for (const char* policy : {"full", "infinigen", "h2o", "int4", "quest"}) {
    SCOPED_TRACE(policy);
    const auto want = decode("inproc:", policy);
    ASSERT_EQ(want.size(), ideal.size());
    EXPECT_EQ(decode((*tcp)->address(), policy), want);
    EXPECT_EQ(decode("shm:unix:" + shm_sock, policy), want);
    if (std::string(policy) == "full") {
      for (size_t i = 0; i < want.size(); ++i) {
        for (size_t j = 0; j < want[i].size(); ++j) {
          ASSERT_NEAR(want[i][j], ideal[i][j], 2e-2) << i << " " << j;
        }
      }
    }
  }
}

TEST_F(Disaggregated, ServerDeathIsAClearErrorNotAHang) {
  for (bool use_shm : {false, true}) {
    SCOPED_TRACE(use_shm ? "shm" : "tcp");
    const std::string shm_sock = ServerProcess::SocketPath("dis_kill.sock");
    std::vector<std::string> flags = {"--listen=127.0.0.1:0"};
    if (use_shm) flags.push_back("--shm_listen=unix:" + shm_sock);
    auto server = ServerProcess::Start(flags);
    ASSERT_TRUE(server.ok()) << server.status();
    kv_memory_service::KvClientOptions copts;
    copts.fetch_timeout = absl::Seconds(3);
    copts.rpc_timeout = absl::Seconds(3);
    auto client = kv_memory_service::ConnectKvClient(
        use_shm ? "shm:unix:" + shm_sock : (*server)->address(), copts);
    ASSERT_TRUE(client.ok()) << client.status();
    EngineOptions options;
    options.max_seq_len = 96;
    options.kv.policy.emplace().kind = PolicyKind::kFull;
    options.kv.kv_client = client->get();
    auto engine = Engine::Create(weights_, gpu_worker::NewCpuBackend(), options);
    ASSERT_TRUE(engine.ok());
    ASSERT_TRUE((*engine)->Forward(absl::MakeConstSpan(tokens_).subspan(0, 8),
                                   false)
                    .ok());
    for (int i = 8; i < 12; ++i) {
      ASSERT_TRUE((*engine)->Forward({tokens_[i]}, false).ok());
    }
    (*server)->Signal(SIGKILL);
    (*server)->WaitExit();
    // Within a few decode steps the worker sees the failure as a status.
    absl::Status status;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 12; i < 20 && status.ok(); ++i) {
      status = (*engine)->Forward({tokens_[i]}, false).status();
    }
    const double secs = std::chrono::duration<double>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
    ASSERT_FALSE(status.ok());
    EXPECT_THAT(status.code(),
                ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                 absl::StatusCode::kDeadlineExceeded,
                                 absl::StatusCode::kAborted));
    EXPECT_LT(secs, 30.0) << "the worker must not hang on a dead server";
    // A SIGKILLed server leaves its shm socket and lock file behind.
    std::remove(shm_sock.c_str());
    std::remove((shm_sock + ".lock").c_str());
  }
}

}  // namespace
}  // namespace infinigen
