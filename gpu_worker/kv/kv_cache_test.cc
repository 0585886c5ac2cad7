// The KV cache seam: what the offloaded cache sends to the memory node and
// when (through a fake KvClient that records every call), what it holds on
// the worker, the worker-memory limit, and the staging path of a device
// backend (through a recording backend).
#include "gpu_worker/kv/kv_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/eval/calibrate.h"
#include "gtest/gtest.h"
#include "absl/synchronization/mutex.h"
#include "kv_memory_service/client/kv_client.h"

namespace infinigen::gpu_worker {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using kv_memory_service::AppendBlock;
using kv_memory_service::AppendResult;
using kv_memory_service::FetchBuffer;
using kv_memory_service::FetchHandle;
using kv_memory_service::FetchPlan;
using kv_memory_service::KvClient;
using kv_memory_service::SequenceGeometry;
using kv_memory_service::SequenceId;
using model::Architecture;
using model::LayerWeights;
using model::ModelConfig;
using model::Weights;

// A memory node in this process (the public `inproc:` client) that records
// every call, and can fail the n-th append or note. The offloaded cache
// appends from its writer thread while the test reads, so every record is
// behind a mutex and read as a copy.
class FakeKvClient final : public kv_memory_service::KvClientWrapper {
 public:
  struct AppendCall {
    int first_layer, n_layers, n_tokens;
    bool operator==(const AppendCall& o) const {
      return first_layer == o.first_layer && n_layers == o.n_layers &&
             n_tokens == o.n_tokens;
    }
  };
  struct FetchCall {
    int layer;
    size_t rows;
    bool leading = false;  // a note by head offsets alone
  };

  // `eviction`: the node's, where its pool is smaller than a sequence.
  explicit FakeKvClient(kv_memory_service::EvictionPolicy eviction =
                            kv_memory_service::EvictionPolicy::kFifo)
      : KvClientWrapper(InprocNode(eviction)) {}

  // The memory node loses every sequence opened so far (a restart, an
  // eviction, a replacement).
  void LoseEverything() {
    std::vector<SequenceId> opened;
    {
      absl::MutexLock lock(&mu_);
      opened = opened_;
    }
    for (SequenceId seq : opened) target()->Close(seq).IgnoreError();
  }
  // The n-th append from now on (counting from 1) fails as a lost node.
  void FailAppendAt(int n) {
    absl::MutexLock lock(&mu_);
    fail_append_at_ = n;
    append_count_ = 0;
  }

  // The n-th note of one-sided reads from now on (counting from 1) is
  // refused as a node that lost the sequence would.
  void FailNoteAt(int n) {
    absl::MutexLock lock(&mu_);
    fail_note_at_ = n;
    note_count_ = 0;
  }

  std::vector<AppendCall> appends() const {
    absl::MutexLock lock(&mu_);
    return appends_;
  }
  void ClearAppends() {
    absl::MutexLock lock(&mu_);
    appends_.clear();
  }
  std::vector<FetchCall> fetches() const {
    absl::MutexLock lock(&mu_);
    return fetches_;
  }
  std::vector<FetchCall> notes() const {
    absl::MutexLock lock(&mu_);
    return notes_;
  }
  int opens() const {
    absl::MutexLock lock(&mu_);
    return opens_;
  }
  int closes() const {
    absl::MutexLock lock(&mu_);
    return closes_;
  }

  // The K then V rows the first sequence opened holds, every layer and
  // head, slots [0, n) (`width` values a row).
  std::vector<uint16_t> StoredRows(int n_layers, int n_kv_heads, int n,
                                   int width) {
    SequenceId seq = FirstOpened();
    if (seq == 0) return {};
    auto rows = target()->GetDirectRows(seq);
    EXPECT_TRUE(rows.ok()) << rows.status();
    if (!rows.ok()) return {};
    std::vector<uint16_t> out;
    for (const uint16_t* kv : {rows->k, rows->v}) {
      for (int l = 0; l < n_layers; ++l) {
        for (int g = 0; g < n_kv_heads; ++g) {
          const uint16_t* head =
              kv + l * rows->layer_values +
              static_cast<size_t>(g) * rows->max_tokens * width;
          out.insert(out.end(), head, head + static_cast<size_t>(n) * width);
        }
      }
    }
    return out;
  }
  // The fetch statistics of every token of the first sequence opened.
  std::vector<kv_memory_service::TokenFetchStats> TokenStats(int n_layers,
                                                             int n_kv_heads) {
    SequenceId seq = FirstOpened();
    if (seq == 0) return {};
    std::vector<kv_memory_service::TokenFetchStats> out;
    for (int l = 0; l < n_layers; ++l) {
      for (int g = 0; g < n_kv_heads; ++g) {
        auto tokens = target()->GetTokenStats(seq, l, g);
        EXPECT_TRUE(tokens.ok()) << tokens.status();
        if (tokens.ok()) out.insert(out.end(), tokens->begin(), tokens->end());
      }
    }
    return out;
  }

  absl::StatusOr<kv_memory_service::OpenedSequence> OpenSequence(
      const SequenceGeometry& g,
      const kv_memory_service::PrefixRequest& prefix) override {
    auto opened = target()->OpenSequence(g, prefix);
    absl::MutexLock lock(&mu_);
    ++opens_;
    if (opened.ok()) opened_.push_back(opened->id);
    return opened;
  }
  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override {
    {
      absl::MutexLock lock(&mu_);
      if (fail_append_at_ > 0 && ++append_count_ == fail_append_at_) {
        return absl::UnavailableError("fake: the memory node went away");
      }
      appends_.push_back({block.first_layer, block.n_layers, block.n_tokens});
    }
    return target()->Append(seq, block);
  }
  FetchHandle FetchAsync(SequenceId seq, int32_t layer, const FetchPlan& plan,
                         FetchBuffer* dest) override {
    {
      absl::MutexLock lock(&mu_);
      fetches_.push_back({layer, plan.indices.size()});
    }
    return target()->FetchAsync(seq, layer, plan, dest);
  }
  absl::StatusOr<kv_memory_service::DirectRows> GetDirectRows(
      SequenceId seq) override {
    return target()->GetDirectRows(seq);
  }
  FetchHandle NoteFetchedAsync(SequenceId seq, int32_t layer,
                               const FetchPlan& plan,
                               FetchBuffer* via) override {
    {
      absl::MutexLock lock(&mu_);
      if (fail_note_at_ > 0 && ++note_count_ == fail_note_at_) {
        return FetchHandle(absl::NotFoundError("fake: no open sequence"));
      }
      notes_.push_back({layer, plan.indices.size()});
    }
    return target()->NoteFetchedAsync(seq, layer, plan, via);
  }
  FetchHandle NoteHeldAsync(SequenceId seq, int32_t layer,
                            const FetchPlan& plan, FetchBuffer* via) override {
    {
      absl::MutexLock lock(&mu_);
      if (fail_note_at_ > 0 && ++note_count_ == fail_note_at_) {
        return FetchHandle(absl::NotFoundError("fake: no open sequence"));
      }
      notes_.push_back({layer, plan.indices.size()});
    }
    return target()->NoteHeldAsync(seq, layer, plan, via);
  }
  FetchHandle NoteLeadingFetchedAsync(SequenceId seq, int32_t layer,
                                      absl::Span<const int32_t> head_offsets,
                                      FetchBuffer* via) override {
    {
      absl::MutexLock lock(&mu_);
      if (fail_note_at_ > 0 && ++note_count_ == fail_note_at_) {
        return FetchHandle(absl::NotFoundError("fake: no open sequence"));
      }
      notes_.push_back(
          {layer, static_cast<size_t>(head_offsets.back()), true});
    }
    return target()->NoteLeadingFetchedAsync(seq, layer, head_offsets, via);
  }
  absl::Status Close(SequenceId seq) override {
    {
      absl::MutexLock lock(&mu_);
      ++closes_;
    }
    return target()->Close(seq);
  }
  std::string data_plane() const override { return "fake"; }

 private:
  // A private in-process node with a 64 MiB prefix cache.
  static std::unique_ptr<KvClient> InprocNode(
      kv_memory_service::EvictionPolicy eviction) {
    kv_memory_service::KvClientOptions o;
    o.inproc_store_options.prefix_cache_bytes = 64 << 20;
    o.inproc_store_options.eviction = eviction;
    auto client = kv_memory_service::ConnectKvClient("inproc:", o);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }
  // 0 before the first sequence opens.
  SequenceId FirstOpened() const {
    absl::MutexLock lock(&mu_);
    return opened_.empty() ? 0 : opened_.front();
  }

  mutable absl::Mutex mu_;
  int opens_ ABSL_GUARDED_BY(mu_) = 0;
  int closes_ ABSL_GUARDED_BY(mu_) = 0;
  int fail_append_at_ ABSL_GUARDED_BY(mu_) = 0;
  int append_count_ ABSL_GUARDED_BY(mu_) = 0;
  int fail_note_at_ ABSL_GUARDED_BY(mu_) = 0;
  int note_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<AppendCall> appends_ ABSL_GUARDED_BY(mu_);
  std::vector<FetchCall> fetches_ ABSL_GUARDED_BY(mu_);
  std::vector<FetchCall> notes_ ABSL_GUARDED_BY(mu_);
  std::vector<SequenceId> opened_ ABSL_GUARDED_BY(mu_);
};

// A random Llama-shaped model with many layers and a small width: worker
// memory per layer is what these tests measure.
Weights ManyLayers(int n_layers, int max_seq, int head_dim = 8) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (float& e : v) e = normal(rng);
    return v;
  };
  Weights w;
  ModelConfig& c = w.config;
  c.arch = Architecture::kLlama;
  c.dim = 32;
  c.hidden_dim = 48;
  c.n_layers = n_layers;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = head_dim;
  c.vocab_size = 64;
  c.max_seq_len = max_seq;
  c.bos_id = 0;
  c.eos_id = 1;
  w.token_embedding = rnd(64 * 32);
  for (int i = 0; i < n_layers; ++i) {
    LayerWeights l;
    l.attn_norm = rnd(32);
    l.wq = rnd(32 * c.q_dim());
    l.wk = rnd(32 * c.kv_dim());
    l.wv = rnd(32 * c.kv_dim());
    l.wo = rnd(c.q_dim() * 32);
    l.ffn_norm = rnd(32);
    l.w1 = rnd(48 * 32);
    l.w2 = rnd(48 * 32);
    l.w3 = rnd(48 * 32);
    w.layers.push_back(l);
  }
  w.final_norm = rnd(32);
  return w;
}

std::vector<int> Tokens(int n) {
  std::vector<int> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + 11) % 64);
  return t;
}

// A 30-token prompt, then 10 decode steps, in both engines: `direct`'s
// logits are `gather`'s bit for bit at every step.
void ExpectSameDecoding(Engine& direct, Engine& gather) {
  const std::vector<int> t = Tokens(40);
  for (Engine* e : {&direct, &gather}) {
    ASSERT_TRUE(e->Forward(absl::MakeConstSpan(t).subspan(0, 30), false).ok());
  }
  for (int i = 30; i < 40; ++i) {
    auto want = gather.Forward({t[i]}, false);
    ASSERT_TRUE(want.ok()) << want.status();
    const std::vector<float> w(want->begin(), want->end());
    auto got = direct.Forward({t[i]}, false);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(std::vector<float>(got->begin(), got->end()), w) << i;
  }
  // The last step's appends and notes are in.
  EXPECT_TRUE(direct.Flush().ok());
  EXPECT_TRUE(gather.Flush().ok());
}

// One-sided reads' node gathered nothing and was told of exactly the rows
// the other node gathered, layer by layer, counting as many fetched rows.
void ExpectNotedAsGathered(FakeKvClient& direct_node,
                           FakeKvClient& gather_node) {
  EXPECT_TRUE(direct_node.fetches().empty());
  const auto notes = direct_node.notes();
  const auto fetches = gather_node.fetches();
  ASSERT_EQ(notes.size(), fetches.size());
  for (size_t j = 0; j < notes.size(); ++j) {
    EXPECT_EQ(notes[j].layer, fetches[j].layer);
    EXPECT_EQ(notes[j].rows, fetches[j].rows);
  }
  auto direct_stats = direct_node.GetStoreStats();
  auto gather_stats = gather_node.GetStoreStats();
  ASSERT_TRUE(direct_stats.ok() && gather_stats.ok());
  EXPECT_EQ(direct_stats->fetched_rows, gather_stats->fetched_rows);
}

class KvCacheTest : public ::testing::Test {
 protected:
  KvCacheTest()
      : weights_(ManyLayers(12, 1024)),
        identity_(speculator::SkewMatrices::Identity(12, 2, 8)),
        wide_(ManyLayers(12, 1024, 32)),
        wide_identity_(speculator::SkewMatrices::Identity(12, 2, 32)) {}

  // `policy` by its --policy name: "ideal" is the local cache.
  EngineOptions Options(const std::string& policy, KvClient* client) {
    EngineOptions o;
    o.max_seq_len = 256;
    o.max_chunk = 16;
    EXPECT_TRUE(ChoosePolicy(policy, o.kv).ok()) << policy;
    if (o.kv.policy) o.kv.policy->infinigen.skew = &identity_;
    o.kv.kv_client = client;
    return o;
  }
  // `kind` (infinigen, oracle) at a 0.4 target fetch, where each head takes
  // its top k (what a device selects), reading rows one-sided where
  // `direct_reads`.
  EngineOptions TargetOptions(const std::string& kind, KvClient* client,
                              bool direct_reads) {
    EngineOptions o = Options(kind, client);
    EXPECT_TRUE(SetTargetFetch(0.4, 12, *o.kv.policy).ok());
    o.kv.direct_reads = direct_reads;
    return o;
  }

  Weights weights_;
  speculator::SkewMatrices identity_;
  // Rows of 32 values: a row cache's slots outweigh its maps, as in a
  // real model (for the row cache's tests).
  Weights wide_;
  speculator::SkewMatrices wide_identity_;
  EngineOptions WideOptions(const std::string& policy, KvClient* client) {
    EngineOptions o = Options(policy, client);
    if (o.kv.policy) o.kv.policy->infinigen.skew = &wide_identity_;
    return o;
  }
};

TEST_F(KvCacheTest, PrefillSendsEachLayerBeforeTheNextAndDecodeFetches) {
  FakeKvClient node;
  auto engine =
      Engine::Create(weights_, NewCpuBackend(), Options("full", &node));
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<int> t = Tokens(45);
  ASSERT_TRUE((*engine)->Forward(absl::MakeConstSpan(t).subspan(0, 40), false)
                  .ok());
  // Layer-major: one append per layer, in order, with the whole prompt
  // (three chunks of 16 and one of 8 each).
  std::vector<FakeKvClient::AppendCall> want;
  for (int l = 0; l < 12; ++l) want.push_back({l, 1, 40});
  EXPECT_THAT(node.appends(), ElementsAreArray(want));
  EXPECT_TRUE(node.fetches().empty());  // the prefill reads nothing back
  for (int i = 40; i < 45; ++i) {
    ASSERT_TRUE((*engine)->Forward({t[i]}, false).ok());
  }
  // Each decode step: every layer fetched once with every cached row (full),
  // then one append of the new token's rows of every layer.
  const std::vector<FakeKvClient::FetchCall> fetches = node.fetches();
  ASSERT_EQ(fetches.size(), 5u * 12);
  for (size_t i = 0; i < fetches.size(); ++i) {
    EXPECT_EQ(fetches[i].layer, static_cast<int>(i % 12));
    EXPECT_EQ(fetches[i].rows, 2u * (40 + i / 12)) << i;
  }
  ASSERT_TRUE((*engine)->Reset().ok());  // waits for the last append
  const std::vector<FakeKvClient::AppendCall> appends = node.appends();
  ASSERT_EQ(appends.size(), 12u + 5);
  EXPECT_EQ(appends.back(), (FakeKvClient::AppendCall{0, 12, 1}));
  EXPECT_EQ(node.opens(), 1);
  EXPECT_EQ(node.closes(), 1);
}

TEST_F(KvCacheTest, OffloadedMatchesLocalUpToFp16) {
  FakeKvClient node;
  auto local = Engine::Create(weights_, NewCpuBackend(),
                              Options("ideal", nullptr));
  auto full = Engine::Create(weights_, NewCpuBackend(),
                             Options("full", &node));
  ASSERT_TRUE(local.ok() && full.ok());
  const std::vector<int> t = Tokens(60);
  for (Engine* e : {local->get(), full->get()}) {
    ASSERT_TRUE(e->Forward(absl::MakeConstSpan(t).subspan(0, 50), false).ok());
  }
  for (int i = 50; i < 60; ++i) {
    auto a = (*local)->Forward({t[i]}, false);
    ASSERT_TRUE(a.ok());
    const std::vector<float> want(a->begin(), a->end());
    auto b = (*full)->Forward({t[i]}, false);
    ASSERT_TRUE(b.ok()) << b.status();
    double max_diff = 0, max_abs = 0;
    for (size_t j = 0; j < want.size(); ++j) {
      max_diff = std::max(max_diff, std::fabs(double((*b)[j]) - want[j]));
      max_abs = std::max(max_abs, std::fabs(double(want[j])));
    }
    // Rows pass through fp16 on the memory node: close, not equal.
    EXPECT_LT(max_diff, 2e-2 * std::max(1.0, max_abs)) << i;
    EXPECT_GT(max_diff, 0.0) << i;
  }
}

TEST_F(KvCacheTest, WorkerHoldsABoundedWorkingSet) {
  FakeKvClient node;
  std::map<std::string, int64_t> bytes;
  for (std::string kind : {"ideal", "full",
                          "infinigen", "h2o",
                          "int4"}) {
    SCOPED_TRACE(kind);
    EngineOptions o = Options(kind, &node);
    o.max_seq_len = 1024;
    o.batch = 2;
    auto engine = Engine::Create(weights_, NewCpuBackend(), o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    bytes[kind] = (*engine)->worker_kv_bytes();
    KvCacheOptions kv;
    kv.batch = 2;
    kv.max_seq_len = 1024;
    kv.kv.policy = o.kv.policy;
    kv.kv.kv_client = &node;
    auto planned = KvCache::WorkerBytes(weights_, kv);
    ASSERT_TRUE(planned.ok());
    // The plan is sized for a device backend (with staging); the CPU
    // backend reads fetched rows where they land and holds less.
    EXPECT_LE(bytes[kind], *planned);
    if (kind == "ideal") {
      EXPECT_EQ(bytes[kind], *planned);
    }
  }
  // Ideal: 2 slots x 12 layers x 2 KV heads x 1024 positions x 8 x (K, V)
  // floats. The offloaded caches hold about 2.5 layers' worth on this
  // backend (two fp16 fetch buffers per slot, one layer of decoded fp32
  // rows, one layer of fp16 prefill rows) plus their policy's state.
  EXPECT_EQ(bytes["ideal"], 2LL * 12 * 2 * 1024 * 8 * 2 * 4);
  EXPECT_LE(bytes["full"], bytes["ideal"] / 4);
  EXPECT_LE(bytes["int4"], bytes["ideal"] / 4);
  EXPECT_LE(bytes["h2o"], bytes["ideal"] / 4);
  EXPECT_LE(bytes["infinigen"], bytes["ideal"] / 2);
}

// SmolLM2-135M's shape (30 layers, 3 KV heads of 64) at context 4096 and
// batch 4, sized for a device backend (fetched rows staged on the device):
// the worker's share of the KV memory the issue asks for.
TEST(KvCacheSizing, SmolLm2ShapeAtContext4096Batch4) {
  Weights w;
  ModelConfig& c = w.config;
  c.arch = Architecture::kLlama;
  c.dim = 576;
  c.hidden_dim = 1536;
  c.n_layers = 30;
  c.n_heads = 9;
  c.n_kv_heads = 3;
  c.head_dim = 64;
  c.vocab_size = 49152;
  c.max_seq_len = 8192;
  const auto skew = speculator::SkewMatrices::Identity(30, 3, 64);
  FakeKvClient node;
  auto bytes = [&](const std::string& policy, int max_seq) {
    KvCacheOptions kv;
    kv.batch = 4;
    kv.max_seq_len = max_seq;
    EXPECT_TRUE(ChoosePolicy(policy, kv.kv).ok());
    if (kv.kv.policy) kv.kv.policy->infinigen.skew = &skew;
    kv.kv.kv_client = &node;
    auto b = KvCache::WorkerBytes(w, kv);
    EXPECT_TRUE(b.ok()) << b.status();
    return static_cast<double>(b.value_or(0));
  };
  const double ideal = bytes("ideal", 4096);
  EXPECT_EQ(ideal, 4.0 * 30 * 3 * 4096 * 64 * 2 * 4);
  EXPECT_LE(bytes("full", 4096), 0.10 * ideal);
  EXPECT_LE(bytes("int4", 4096), 0.10 * ideal);
  EXPECT_LE(bytes("h2o", 4096), 0.10 * ideal);
  EXPECT_LE(bytes("infinigen", 4096), 0.25 * ideal);
  // Doubling the context adds a few layers' rows, not thirty.
  const double ideal_growth = bytes("ideal", 8192) - ideal;
  const double full_growth =
      bytes("full", 8192) - bytes("full", 4096);
  EXPECT_GT(full_growth, 0);
  EXPECT_LE(full_growth, 0.10 * ideal_growth);
}

// A backend that counts the bytes its allocations hold (shared and device).
class CountingBackend final : public BackendWrapper {
 public:
  explicit CountingBackend(int64_t* live)
      : BackendWrapper(NewCpuBackend()), live_(live) {}
  std::string name() const override { return "counting-cpu"; }
  void* AllocateShared(size_t bytes) override {
    void* p = BackendWrapper::AllocateShared(bytes);
    sizes_[p] = bytes;
    *live_ += bytes;
    return p;
  }
  void FreeShared(void* p) override {
    if (p == nullptr) return;
    *live_ -= sizes_[p];
    sizes_.erase(p);
    BackendWrapper::FreeShared(p);
  }
  void* AllocateDevice(size_t bytes) override { return AllocateShared(bytes); }
  void FreeDevice(void* p) override { FreeShared(p); }

 private:
  int64_t* live_;
  std::map<void*, size_t> sizes_;
};

// Full offload's KV memory does not grow as the context grows while
// decoding: everything is allocated at creation (its growth with
// max_seq_len: KvCacheSizing below).
TEST_F(KvCacheTest, FullWorkerKvDoesNotGrowWithContext) {
  FakeKvClient node;
  int64_t live = 0;
  EngineOptions o = Options("full", &node);
  auto engine =
      Engine::Create(weights_, std::make_unique<CountingBackend>(&live), o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int64_t after_create = live;
  const std::vector<int> t = Tokens(200);
  ASSERT_TRUE((*engine)->Forward(absl::MakeConstSpan(t).subspan(0, 8), false)
                  .ok());
  for (int i = 8; i < 200; ++i) {
    ASSERT_TRUE((*engine)->Forward({t[i]}, false).ok());
    ASSERT_EQ(live, after_create) << "allocation at context " << i;
  }

}

// A decode step is an object: one at a time per cache, and the local
// cache's schedule fetches nothing.
TEST_F(KvCacheTest, OneDecodeStepAtATime) {
  auto backend = NewCpuBackend();
  KvCacheOptions kv;
  kv.batch = 2;
  kv.max_seq_len = 16;
  auto cache = KvCache::Create(weights_, backend.get(), kv);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::vector<int> slots = {0, 1}, positions = {0, 0};
  auto step = (*cache)->BeginStep(slots, positions);
  ASSERT_TRUE(step.ok()) << step.status();
  for (FetchPoint point : {FetchPoint::kStepStart, FetchPoint::kOwnInput,
                           FetchPoint::kPreviousInput,
                           FetchPoint::kPreviousAttention}) {
    EXPECT_EQ((*step)->schedule().DueAt(point, 0), -1);
  }
  EXPECT_FALSE((*step)->WantsPostAttentionInput());
  auto second = (*cache)->BeginStep(slots, positions);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("already open"));
  ASSERT_TRUE((*step)->End().ok());
  step->reset();  // the step is over when it is dropped
  EXPECT_TRUE((*cache)->BeginStep(slots, positions).ok());
}

TEST_F(KvCacheTest, WorkerKvLimitRefusesIdealAndServesOffloaded) {
  FakeKvClient node;
  KvCacheOptions kv;
  kv.max_seq_len = 256;
  kv.batch = 4;
  kv.kv.policy = Options("ideal", nullptr).kv.policy;
  const int64_t ideal = *KvCache::WorkerBytes(weights_, kv);
  // Below the local cache's need; above what the offloaded policies keep
  // (their staging, plans and policy state: on this tiny model, most of it).
  const int64_t limit = ideal * 2 / 3;
  for (std::string kind :
       {"ideal", "full", "infinigen"}) {
    SCOPED_TRACE(kind);
    EngineOptions o = Options(kind, &node);
    o.batch = 4;
    o.kv.max_worker_bytes = limit;
    auto engine = Engine::Create(weights_, NewCpuBackend(), o);
    if (kind == "ideal") {
      ASSERT_EQ(engine.status().code(), absl::StatusCode::kResourceExhausted);
      const std::string message(engine.status().message());
      EXPECT_THAT(message, HasSubstr("policy ideal needs"));
      EXPECT_THAT(message, HasSubstr("--max_worker_kv_bytes=" +
                                     std::to_string(limit)));
      continue;
    }
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_LE((*engine)->worker_kv_bytes(), limit);
    const std::vector<int> t = Tokens(30);
    for (int slot = 0; slot < 4; ++slot) {
      ASSERT_TRUE((*engine)
                      ->Forward(slot, absl::MakeConstSpan(t).subspan(slot, 20),
                                false)
                      .ok());
    }
    auto step = (*engine)->DecodeBatch({0, 1, 2, 3}, {t[20], t[21], t[22], t[23]});
    ASSERT_TRUE(step.ok()) << step.status();
    // The node holds what the worker does not: every slot's reservation.
    EXPECT_EQ((*engine)->node_kv_bytes(), 4LL * 12 * 2 * 256 * 8 * 2 * 2);
  }
  EngineOptions negative = Options("full", &node);
  negative.kv.max_worker_bytes = -1;
  EXPECT_EQ(Engine::Create(weights_, NewCpuBackend(), negative).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(KvCacheTest, OffloadedPrefillIsOneCallAndAFailedOneLeavesTheSlotEmpty) {
  FakeKvClient node;
  node.FailAppendAt(5);  // layer 4's rows of the first prefill
  EngineOptions o = Options("full", &node);
  o.recompute_on_kv_loss = false;
  auto engine = Engine::Create(weights_, NewCpuBackend(), o);
  ASSERT_TRUE(engine.ok());
  const std::vector<int> t = Tokens(20);
  auto failed = (*engine)->Forward(absl::MakeConstSpan(t).subspan(0, 10), false);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*engine)->position(), 0);
  EXPECT_EQ(node.closes(), 1);  // the half-written sequence is gone
  // The same prompt again, from scratch, then a decode step.
  ASSERT_TRUE((*engine)->Forward(absl::MakeConstSpan(t).subspan(0, 10), false)
                  .ok());
  ASSERT_TRUE((*engine)->Forward({t[10]}, false).ok());
  EXPECT_EQ((*engine)->position(), 11);
  auto more = (*engine)->Forward({t[11], t[12]}, false);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kFailedPrecondition);
}

// Greedy decoding of `steps` tokens after `prompt`; `before_step(i)` runs
// before step i.
std::vector<int> Greedy(Engine& e, const std::vector<int>& prompt, int steps,
                        const std::function<void(int)>& before_step = {}) {
  std::vector<int> out;
  auto logits = e.Forward(prompt, false);
  for (int i = 0; i < steps && logits.ok(); ++i) {
    const int next = static_cast<int>(
        std::max_element(logits->begin(), logits->end()) - logits->begin());
    out.push_back(next);
    if (before_step) before_step(i);
    logits = e.Forward({next}, false);
  }
  if (!logits.ok()) out.push_back(-static_cast<int>(logits.status().code()));
  return out;
}

// Prefix reuse: a second prefill of a prompt sharing a long prefix with an
// earlier one (here from another engine: another worker on the same node)
// fetches the prefix's rows instead of computing them, and decodes as
// without reuse: the same greedy tokens, and for infinigen the same rows
// fetched at every step (its column ranking sees the reused tokens' query
// sums, carried with the blocks).
TEST_F(KvCacheTest, APrefixReusedFromTheNodeDecodesAsWithoutReuse) {
  for (std::string kind : {"full", "infinigen"}) {
    SCOPED_TRACE(kind);
    FakeKvClient node;
    EngineOptions o = Options(kind, &node);
    o.kv.prefix_block_tokens = 8;
    o.kv.model_identity = "test-model";
    const std::vector<int> shared = Tokens(70);
    std::vector<int> prompt = shared;
    prompt.push_back(5);
    prompt.push_back(9);
    auto first = Engine::Create(weights_, NewCpuBackend(), o);
    ASSERT_TRUE(first.ok());
    ASSERT_TRUE((*first)->Forward(shared, false).ok());
    EXPECT_EQ((*first)->cached_tokens(), 0);
    // Another worker, another prompt with the same first 70 tokens.
    auto second = Engine::Create(weights_, NewCpuBackend(), o);
    ASSERT_TRUE(second.ok());
    node.ClearAppends();
    const std::vector<int> reused = Greedy(**second, prompt, 12);
    EXPECT_EQ((*second)->cached_tokens(), 64);  // 8 whole blocks of 8
    // Each layer appended only the 8 tokens after the reused ones.
    const std::vector<FakeKvClient::AppendCall> appended = node.appends();
    ASSERT_FALSE(appended.empty());
    EXPECT_EQ(appended[0].n_tokens, 8);
    // The same without reuse.
    EngineOptions plain = o;
    plain.kv.prefix_block_tokens = 0;
    auto third = Engine::Create(weights_, NewCpuBackend(), plain);
    ASSERT_TRUE(third.ok());
    const std::vector<int> computed = Greedy(**third, prompt, 12);
    EXPECT_EQ((*third)->cached_tokens(), 0);
    EXPECT_EQ(reused, computed);
    EXPECT_EQ((*second)->fetch_stats().rows_fetched,
              (*third)->fetch_stats().rows_fetched);
    // Another model identity: nothing reused.
    EngineOptions other = o;
    other.kv.model_identity = "another-model";
    auto fourth = Engine::Create(weights_, NewCpuBackend(), other);
    ASSERT_TRUE(fourth.ok());
    ASSERT_TRUE((*fourth)->Forward(prompt, false).ok());
    EXPECT_EQ((*fourth)->cached_tokens(), 0);
  }
}

// A reused prefix and the row cache: the decode of a prompt whose prefix
// the node held, through the row cache, is the decode computed in full
// without one: the same tokens, the same selection, and the rows held
// noted to the node, whose prefix block's rows they include.
TEST_F(KvCacheTest, TheRowCacheDecodesAReusedPrefixAsWithoutEither) {
  for (std::string kind : {"infinigen", "oracle", "quest"}) {
    SCOPED_TRACE(kind);
    FakeKvClient node;
    EngineOptions o = WideOptions(kind, &node);
    o.kv.prefix_block_tokens = 8;
    o.kv.model_identity = "test-model";
    o.kv.row_cache = 0.5;
    const std::vector<int> shared = Tokens(70);
    std::vector<int> prompt = shared;
    prompt.push_back(5);
    prompt.push_back(9);
    auto first = Engine::Create(wide_, NewCpuBackend(), o);
    ASSERT_TRUE(first.ok());
    ASSERT_TRUE((*first)->Forward(shared, false).ok());
    auto second = Engine::Create(wide_, NewCpuBackend(), o);
    ASSERT_TRUE(second.ok());
    const std::vector<int> reused = Greedy(**second, prompt, 12);
    EXPECT_EQ((*second)->cached_tokens(), 64);
    EngineOptions plain = o;
    plain.kv.prefix_block_tokens = 0;
    plain.kv.row_cache = 0;
    auto third = Engine::Create(wide_, NewCpuBackend(), plain);
    ASSERT_TRUE(third.ok());
    EXPECT_EQ(reused, Greedy(**third, prompt, 12));
    const FetchStats& got = (*second)->fetch_stats();
    const FetchStats& want = (*third)->fetch_stats();
    EXPECT_EQ(got.fraction_sum, want.fraction_sum);
    EXPECT_EQ(got.row_cache_lookups, want.rows_fetched);
    EXPECT_GT(got.row_cache_hits, 0);
    long noted = 0;
    for (const auto& n : node.notes()) noted += n.rows;
    EXPECT_EQ(noted, got.row_cache_hits);
  }
}

// h2o ranks by the prompt's own attention, and int4's stored rows are far
// from the exact ones its prefill attends over: neither reuses.
TEST_F(KvCacheTest, H2OAndInt4NeverReuseAPrefix) {
  for (std::string kind : {"h2o", "int4"}) {
    SCOPED_TRACE(kind);
    FakeKvClient node;
    EngineOptions o = Options(kind, &node);
    o.kv.prefix_block_tokens = 8;
    o.kv.model_identity = "test-model";
    const std::vector<int> prompt = Tokens(40);
    for (int i = 0; i < 2; ++i) {
      auto e = Engine::Create(weights_, NewCpuBackend(), o);
      ASSERT_TRUE(e.ok());
      ASSERT_TRUE((*e)->Forward(prompt, false).ok());
      EXPECT_EQ((*e)->cached_tokens(), 0);
    }
  }
}

// Teacher-forced decoding of `next` after `prompt`: the logits of every
// step; `before_step(i)` runs before step i. Stops at the first error,
// returned as the last entry's status.
struct ForcedRun {
  std::vector<std::vector<float>> logits;
  absl::Status status;
};
ForcedRun Forced(Engine& e, const std::vector<int>& prompt,
           const std::vector<int>& next,
           const std::function<void(int)>& before_step = {}) {
  ForcedRun run;
  auto logits = e.Forward(prompt, false);
  for (size_t i = 0; logits.ok(); ++i) {
    run.logits.emplace_back(logits->begin(), logits->end());
    if (i == next.size()) break;
    if (before_step) before_step(static_cast<int>(i));
    logits = e.Forward({next[i]}, false);
  }
  run.status = logits.status();
  return run;
}

// Reuse never changes an answer: every policy that reuses a prefix gives,
// when its prompt's rows come from the node (twice, from two workers), the
// logits it gives when it computes them, bit for bit, at every step; a
// prefill attends over its rows as stored, as a reused prefix's are.
// InfiniGen both with a given skew (as from a --skew file) and with one
// calibrated on the prompt (as without one).
TEST_F(KvCacheTest, EveryPolicyGivesTheSameLogitsWithAndWithoutReuse) {
  const std::vector<int> shared = Tokens(70);
  std::vector<int> prompt = shared;
  prompt.push_back(5);
  prompt.push_back(9);
  const std::vector<int> next = {3, 17, 40, 2, 57, 12, 6, 33};
  auto calibrated = CalibrateSkew(weights_, prompt);
  ASSERT_TRUE(calibrated.ok()) << calibrated.status();
  struct Config {
    std::string policy;
    const speculator::SkewMatrices* skew;
  };
  for (const Config& config :
       {Config{"full", &identity_},
        Config{"quest", &identity_}, Config{"oracle", &identity_},
        Config{"infinigen", &identity_}, Config{"infinigen", &*calibrated}}) {
    SCOPED_TRACE(config.policy + (config.skew == &identity_
                                      ? " (given skew)"
                                      : " (skew calibrated on the prompt)"));
    FakeKvClient node;
    EngineOptions o = Options(config.policy, &node);
    o.kv.policy->infinigen.skew = config.skew;
    o.kv.prefix_block_tokens = 8;
    o.kv.model_identity = "test-model";
    EngineOptions plain = o;
    plain.kv.prefix_block_tokens = 0;
    auto computed = Engine::Create(weights_, NewCpuBackend(), plain);
    ASSERT_TRUE(computed.ok()) << computed.status();
    const ForcedRun want = Forced(**computed, prompt, next);
    ASSERT_TRUE(want.status.ok()) << want.status;
    // The first worker computes and publishes the shared prefix.
    auto first = Engine::Create(weights_, NewCpuBackend(), o);
    ASSERT_TRUE(first.ok());
    const ForcedRun published = Forced(**first, shared, {});
    ASSERT_TRUE(published.status.ok()) << published.status;
    EXPECT_EQ((*first)->cached_tokens(), 0);
    for (int worker = 0; worker < 2; ++worker) {
      auto e = Engine::Create(weights_, NewCpuBackend(), o);
      ASSERT_TRUE(e.ok());
      const ForcedRun got = Forced(**e, prompt, next);
      ASSERT_TRUE(got.status.ok()) << got.status;
      EXPECT_EQ((*e)->cached_tokens(), 64) << worker;
      ASSERT_EQ(got.logits.size(), want.logits.size());
      for (size_t i = 0; i < want.logits.size(); ++i) {
        EXPECT_EQ(got.logits[i], want.logits[i])
            << "worker " << worker << ", step " << i;
      }
    }
  }
}

// The node loses the sequence mid-generation: with recompute the engine
// prefills the prompt again and replays the decoded tokens, so every
// later step's logits are the uninterrupted run's, bit for bit (InfiniGen
// included: its partial columns rank over the same prompt); without, the
// step fails with the node's NotFound.
TEST_F(KvCacheTest, ASequenceTheNodeLostIsRecomputed) {
  for (std::string kind : {"full", "infinigen"}) {
    SCOPED_TRACE(kind);
    const std::vector<int> prompt = Tokens(30);
    std::vector<int> next;
    for (int i = 0; i < 16; ++i) next.push_back((i * 13 + 5) % 64);
    FakeKvClient clean_node;
    auto clean = Engine::Create(weights_, NewCpuBackend(),
                                Options(kind, &clean_node));
    ASSERT_TRUE(clean.ok());
    const ForcedRun want = Forced(**clean, prompt, next);
    ASSERT_TRUE(want.status.ok());
    auto expect_close = [&](const ForcedRun& got) {
      ASSERT_TRUE(got.status.ok()) << got.status;
      ASSERT_EQ(got.logits.size(), want.logits.size());
      for (size_t i = 0; i < got.logits.size(); ++i) {
        double max_diff = 0, max_abs = 0;
        for (size_t j = 0; j < got.logits[i].size(); ++j) {
          max_diff = std::max(max_diff, std::fabs(double(got.logits[i][j]) -
                                                  want.logits[i][j]));
          max_abs = std::max(max_abs, std::fabs(double(want.logits[i][j])));
        }
        EXPECT_EQ(max_diff, 0.0) << "step " << i << " of logits up to " << max_abs;
      }
    };

    FakeKvClient node;
    auto engine = Engine::Create(weights_, NewCpuBackend(), Options(kind, &node));
    ASSERT_TRUE(engine.ok());
    expect_close(Forced(**engine, prompt, next, [&](int i) {
      if (i == 6) node.LoseEverything();
    }));
    EXPECT_EQ((*engine)->kv_recoveries(), 1);
    EXPECT_EQ(node.opens(), 2);

    // A step's rows that never reached the node: recomputed too.
    FakeKvClient flaky;
    flaky.FailAppendAt(12 + 4);  // the prefill's 12, then step 4's
    auto again = Engine::Create(weights_, NewCpuBackend(), Options(kind, &flaky));
    ASSERT_TRUE(again.ok());
    expect_close(Forced(**again, prompt, next));
    EXPECT_EQ((*again)->kv_recoveries(), 1);

    EngineOptions strict = Options(kind, &node);
    strict.recompute_on_kv_loss = false;
    auto failing = Engine::Create(weights_, NewCpuBackend(), strict);
    ASSERT_TRUE(failing.ok());
    const ForcedRun cut = Forced(**failing, prompt, next, [&](int i) {
      if (i == 6) node.LoseEverything();
    });
    EXPECT_EQ(cut.logits.size(), 7u);
    EXPECT_EQ(cut.status.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*failing)->kv_recoveries(), 0);
  }
}

// A device-like backend whose device memory the host cannot touch: it is
// mapped PROT_NONE except while one of the backend's own operations or
// copies runs, so any host access to it by the engine, the cache or a
// policy crashes the test. Fetched rows must reach it by CopyFromHost and
// results leave it by CopyToHost; the operations that decode fetched rows
// must read them there, not in the host's fetch buffers.
class GuardedDeviceBackend final : public Backend {
 public:
  explicit GuardedDeviceBackend(std::vector<std::string>* violations)
      : cpu_(NewCpuBackend()), violations_(violations) {}
  ~GuardedDeviceBackend() override {
    for (auto& [p, size] : device_) munmap(p, size);
  }
  std::string name() const override { return "guarded-device"; }
  void* AllocateShared(size_t bytes) override {
    ++shared_allocations;
    return Backend::AllocateShared(bytes);
  }
  void* AllocateDevice(size_t bytes) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t size = std::max<size_t>(1, (bytes + page - 1) / page) * page;
    void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                   0);
    if (p == MAP_FAILED) return nullptr;
    device_[static_cast<char*>(p)] = size;
    return p;
  }
  void FreeDevice(void* p) override {
    auto it = device_.find(static_cast<char*>(p));
    if (it == device_.end()) return;
    munmap(it->first, it->second);
    device_.erase(it);
  }
  void Linear(const float* x, int n, int in, const float* w, const float* b,
              int out, float* y) override {
    Open open(this);
    cpu_->Linear(x, n, in, w, b, out, y);
  }
  void RmsNorm(const float* x, int n, int dim, const float* g, float eps,
               float* y) override {
    Open open(this);
    cpu_->RmsNorm(x, n, dim, g, eps, y);
  }
  void LayerNorm(const float* x, int n, int dim, const float* g,
                 const float* b, float eps, float* y) override {
    Open open(this);
    cpu_->LayerNorm(x, n, dim, g, b, eps, y);
  }
  void Rope(float* x, int n, int h, int d, const int* pos,
            float theta) override {
    Open open(this);
    cpu_->Rope(x, n, h, d, pos, theta);
  }
  void Attention(const AttentionParams& p) override {
    Open open(this);
    const bool half = p.k_half != nullptr;
    if (half && !half_kv_) {
      violations_->push_back("fp16 K/V on a backend that keeps fp32");
    }
    half_attentions += half;
    if (half ? !InDevice(p.k_half) || !InDevice(p.v_half)
             : !InDevice(p.k) || !InDevice(p.v)) {
      violations_->push_back("attention reads K/V outside device memory");
    }
    cpu_->Attention(p);
  }
  void CopyRowsToHalf(uint16_t* dst, long dst_stride, const float* src,
                      long src_stride, int rows, long width) override {
    Open open(this);
    cpu_->CopyRowsToHalf(dst, dst_stride, src, src_stride, rows, width);
  }
  bool HalfKvCache() const override { return half_kv_; }
  void SwiGlu(float* g, const float* u, long n) override {
    Open open(this);
    cpu_->SwiGlu(g, u, n);
  }
  void GeluTanhGate(float* g, const float* u, long n) override {
    Open open(this);
    cpu_->GeluTanhGate(g, u, n);
  }
  void Scale(float* x, long n, float s) override {
    Open open(this);
    cpu_->Scale(x, n, s);
  }
  void Relu(float* x, long n) override {
    Open open(this);
    cpu_->Relu(x, n);
  }
  void Add(float* x, const float* y, long n) override {
    Open open(this);
    cpu_->Add(x, y, n);
  }
  void Copy(float* d, const float* s, long n) override {
    Open open(this);
    cpu_->Copy(d, s, n);
  }
  void DecodeKvRows(const uint16_t* in, int n_rows, int head_dim,
                    KvRowFormat format, float* rows) override {
    Open open(this);
    ++decodes;
    if (!InDevice(in)) {
      violations_->push_back("fetched rows decoded from host memory");
    }
    cpu_->DecodeKvRows(in, n_rows, head_dim, format, rows);
  }
  // As CUDA's: the host reference over device memory.
  bool AttendStagedRows(const StagedRowsAttention& p) override {
    Open open(this);
    ++staged_attentions;
    if (!InDevice(p.q) || !InDevice(p.k_rows) || !InDevice(p.v_rows) ||
        !InDevice(p.head_offsets) || !InDevice(p.k_new) ||
        !InDevice(p.v_new) || !InDevice(p.out)) {
      violations_->push_back("staged attention outside device memory");
    }
    if (p.slots != nullptr) {
      ++slotted_attentions;
      if (!InDevice(p.slots) || !InDevice(p.slot_k) || !InDevice(p.slot_v)) {
        violations_->push_back("attention over slots outside device memory");
      }
    }
    int most = 0;
    for (int g = 0; g < p.n_kv_heads; ++g) {
      most = std::max(most, p.head_offsets[g + 1] - p.head_offsets[g]);
    }
    if (most != p.max_head_rows || p.head_offsets[p.n_kv_heads] != p.rows) {
      violations_->push_back("staged attention's host bounds are not its "
                             "offsets'");
    }
    AttendStagedRowsOnHost(p);
    return true;
  }
  void ScatterRows(const ScatterRowsParams& p) override {
    Open open(this);
    ++scatters;
    if (!InDevice(p.k_rows) || !InDevice(p.v_rows) || !InDevice(p.slots) ||
        !InDevice(p.slot_k) || !InDevice(p.slot_v)) {
      violations_->push_back("row cache scatter outside device memory");
    }
    Backend::ScatterRows(p);
  }
  bool EncodeKvRows(const float* rows, int n_rows, int head_dim,
                    KvRowFormat format, uint16_t* out) override {
    if (format != KvRowFormat::kHalf) return false;  // as CUDA's
    Open open(this);
    ++encodes;
    if (!InDevice(rows) || !InDevice(out)) {
      violations_->push_back("rows encoded outside device memory");
    }
    return cpu_->EncodeKvRows(rows, n_rows, head_dim, format, out);
  }
  void SpeculateScores(const SpeculationParams& p) override {
    Open open(this);
    cpu_->SpeculateScores(p);
  }
  void AddSkewedColumnSums(const float* x, int n, int heads, int per_kv,
                           int d, const float* skew_t, float* sums) override {
    Open open(this);
    ++column_sums;
    if (!InDevice(x) || !InDevice(skew_t) || !InDevice(sums)) {
      violations_->push_back("prompt column sums outside device memory");
    }
    cpu_->AddSkewedColumnSums(x, n, heads, per_kv, d, skew_t, sums);
  }
  void QuantizePartialKeys(const float* keys, int n_rows, int n_cols,
                           uint8_t* rows, size_t row_stride) override {
    Open open(this);
    if (!InDevice(keys) || !InDevice(rows)) {
      violations_->push_back("partial keys quantized outside device memory");
    }
    cpu_->QuantizePartialKeys(keys, n_rows, n_cols, rows, row_stride);
  }
  void CopyFromHost(void* dst, const void* src, size_t bytes,
                    Mark after) override {
    Open open(this);
    ++copies_in;
    if (!InDevice(dst)) violations_->push_back("a copy into host memory");
    if (!Pinned(src, static_cast<long>(bytes))) {
      largest_unpinned_copy_in = std::max(largest_unpinned_copy_in, bytes);
    }
    std::memcpy(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    Open open(this);
    ++copies_out;
    if (!InDevice(src)) violations_->push_back("a copy out of host memory");
    std::memcpy(dst, src, bytes);
    return Synchronize();
  }
  // As a device: the bytes as they were when queued, in host memory only
  // once Synchronize or CopyToHost returns.
  void QueueCopyToHost(void* dst, const void* src, size_t bytes) override {
    Open open(this);
    ++queued_copies_out;
    if (!InDevice(src)) violations_->push_back("a queued copy out of host memory");
    if (!Pinned(dst, static_cast<long>(bytes))) {
      violations_->push_back("a queued copy into unpinned memory");
    }
    const char* from = static_cast<const char*>(src);
    queued_.push_back({static_cast<char*>(dst), {from, from + bytes}});
  }
  absl::Status Synchronize() override {
    for (auto& [dst, bytes] : queued_) {
      std::memcpy(dst, bytes.data(), bytes.size());
    }
    queued_.clear();
    return absl::OkStatus();
  }
  void SelectTopK(const TopKParams& p) override {
    Open open(this);
    ++selections;
    if (!InDevice(p.scores) || !InDevice(p.indices) ||
        (p.combined != nullptr && !InDevice(p.combined))) {
      violations_->push_back("a selection outside device memory");
    }
    cpu_->SelectTopK(p);
  }
  // One-sided reads: rows read from pinned host memory into device memory.
  bool GatherRows(const GatherRowsParams& p) override {
    if (!gathers_rows_) return false;
    Open open(this);
    ++gathers;
    const long span = static_cast<long>(p.n_heads) * p.head_stride *
                      p.row_bytes;
    if (!Pinned(p.k_rows, span) || !Pinned(p.v_rows, span)) {
      violations_->push_back("rows read in place outside pinned memory");
    }
    if (p.indices == nullptr) ++leading_gathers;
    if ((p.indices != nullptr &&
         (!InDevice(p.indices) || !InDevice(p.head_offsets))) ||
        !InDevice(p.out)) {
      violations_->push_back("a one-sided read's plan or destination is "
                             "not in device memory");
    }
    GatherRowsOnHost(p);
    return true;
  }
  absl::Status PinHost(void* p, size_t bytes) override {
    pinned_[static_cast<char*>(p)] = bytes;
    ++pins;
    return absl::OkStatus();
  }
  void UnpinHost(void* p) override {
    if (pinned_.erase(static_cast<char*>(p)) > 0) ++unpins;
  }
  // false: GatherRows refuses, as a backend without one-sided reads.
  void set_gathers_rows(bool on) { gathers_rows_ = on; }
  // true: the local cache keeps fp16 K/V (HalfKvCache), as an fp16 device.
  void set_half_kv(bool on) { half_kv_ = on; }
  long copies_in = 0, decodes = 0, shared_allocations = 0;
  long gathers = 0, leading_gathers = 0, pins = 0, unpins = 0;
  long copies_out = 0, queued_copies_out = 0, selections = 0, encodes = 0;
  long staged_attentions = 0, half_attentions = 0;
  long slotted_attentions = 0, scatters = 0, column_sums = 0;
  size_t largest_unpinned_copy_in = 0;

 private:
  // Device memory readable and writable for the life of this object.
  class Open {
   public:
    explicit Open(GuardedDeviceBackend* b) : b_(b) { b_->Protect(true); }
    ~Open() { b_->Protect(false); }

   private:
    GuardedDeviceBackend* b_;
  };
  void Protect(bool open) {
    for (auto& [p, size] : device_) {
      mprotect(p, size, open ? PROT_READ | PROT_WRITE : PROT_NONE);
    }
  }
  bool Pinned(const void* p, long bytes) const {
    const char* c = static_cast<const char*>(p);
    auto it = pinned_.upper_bound(const_cast<char*>(c));
    if (it == pinned_.begin()) return false;
    --it;
    return c + bytes <= it->first + it->second;
  }
  bool InDevice(const void* p) const {
    const char* c = static_cast<const char*>(p);
    auto it = device_.upper_bound(const_cast<char*>(c));
    if (it == device_.begin()) return false;
    --it;
    return c < it->first + it->second;
  }
  std::unique_ptr<Backend> cpu_;
  std::vector<std::string>* violations_;
  std::map<char*, size_t> device_;
  std::map<char*, size_t> pinned_;
  bool gathers_rows_ = true;
  bool half_kv_ = false;
  // QueueCopyToHost's copies not yet landed: where, and the bytes.
  std::vector<std::pair<char*, std::vector<char>>> queued_;
};

// An engine of `options` on a new GuardedDeviceBackend recording into
// `violations`; *device, where given, is that backend.
absl::StatusOr<std::unique_ptr<Engine>> OnDevice(
    const Weights& weights, const EngineOptions& options,
    std::vector<std::string>* violations,
    GuardedDeviceBackend** device = nullptr) {
  auto backend = std::make_unique<GuardedDeviceBackend>(violations);
  if (device != nullptr) *device = backend.get();
  return Engine::Create(weights, std::move(backend), options);
}

// A device computing in fp16 keeps the local cache's K and V in fp16: half
// the bytes, and logits within fp16 rounding of the fp32 cache's, through
// chunked prefill, decode steps and sliding-window layers whose rows move
// to the buffer's start; every attention reads the fp16 rows in device
// memory.
TEST_F(KvCacheTest, AnFp16DeviceKeepsTheLocalCacheInHalf) {
  Weights w = ManyLayers(4, 256);
  w.config.sliding_window = 8;  // layers 0 and 2 see the last 8 positions
  w.config.sliding_window_pattern = 2;
  const std::vector<int> t = Tokens(60);
  std::vector<std::vector<float>> logits[2];
  int64_t bytes[2] = {0, 0};
  for (const bool half : {false, true}) {
    SCOPED_TRACE(half ? "fp16" : "fp32");
    std::vector<std::string> violations;
    auto backend = std::make_unique<GuardedDeviceBackend>(&violations);
    backend->set_half_kv(half);
    EngineOptions o;
    o.max_seq_len = 64;
    o.max_chunk = 16;
    auto engine = Engine::Create(w, std::move(backend), o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    bytes[half] = (*engine)->worker_kv_bytes();
    const ForcedRun run =
        Forced(**engine, std::vector<int>(t.begin(), t.begin() + 40),
               std::vector<int>(t.begin() + 40, t.end()));
    ASSERT_TRUE(run.status.ok()) << run.status;
    logits[half] = run.logits;
    EXPECT_THAT(violations, ::testing::IsEmpty());
  }
  EXPECT_EQ(bytes[true] * 2, bytes[false]);
  ASSERT_EQ(logits[true].size(), logits[false].size());
  float largest = 0.0f;
  for (size_t i = 0; i < logits[true].size(); ++i) {
    ASSERT_EQ(logits[true][i].size(), logits[false][i].size());
    for (size_t j = 0; j < logits[true][i].size(); ++j) {
      largest = std::max(largest,
                         std::fabs(logits[true][i][j] - logits[false][i][j]));
    }
  }
  EXPECT_LT(largest, 2e-2f);
  EXPECT_GT(largest, 0.0f);  // the rows were rounded: fp16 was used
}

// On an fp16 device the offloaded prefill of a policy that attends over
// its rows as stored (full, InfiniGen) reads the layer's fp16 rows: the
// same values as the decoded fp32 ones, so the logits are those of an fp32
// device bit for bit; h2o (probability sums) and int4 (int4 rows) keep
// the fp32 rows.
TEST_F(KvCacheTest, OffloadedPrefillAttendsOverFp16RowsOnAnFp16Device) {
  const std::vector<int> t = Tokens(40);
  for (std::string kind : {"full", "infinigen", "h2o", "int4"}) {
    SCOPED_TRACE(kind);
    std::vector<std::vector<float>> logits[2];
    int64_t bytes[2] = {0, 0};
    long half_attentions = 0;
    for (const bool half : {false, true}) {
      FakeKvClient node;
      std::vector<std::string> violations;
      auto backend = std::make_unique<GuardedDeviceBackend>(&violations);
      backend->set_half_kv(half);
      GuardedDeviceBackend* d = backend.get();
      auto engine =
          Engine::Create(weights_, std::move(backend), Options(kind, &node));
      ASSERT_TRUE(engine.ok()) << engine.status();
      bytes[half] = (*engine)->worker_kv_bytes();
      const ForcedRun run =
          Forced(**engine, std::vector<int>(t.begin(), t.begin() + 30),
                 std::vector<int>(t.begin() + 30, t.end()));
      ASSERT_TRUE(run.status.ok()) << run.status;
      logits[half] = run.logits;
      EXPECT_THAT(violations, ::testing::IsEmpty());
      if (half) half_attentions = d->half_attentions;
    }
    EXPECT_EQ(logits[true], logits[false]);
    const bool fp16 = kind == "full" || kind == "infinigen";
    // Every layer's prefill chunks (30 tokens in chunks of 16: two).
    EXPECT_EQ(half_attentions, fp16 ? 2 * 12 : 0);
    EXPECT_EQ(bytes[true] > bytes[false], fp16);
  }
}

TEST_F(KvCacheTest, DeviceBackendsReadFetchedRowsFromTheirOwnMemory) {
  for (std::string kind : {"ideal", "full",
                          "int4", "h2o",
                          "infinigen"}) {
    SCOPED_TRACE(kind);
    FakeKvClient a, b;
    std::vector<std::string> violations;
    auto device = std::make_unique<GuardedDeviceBackend>(&violations);
    GuardedDeviceBackend* d = device.get();
    auto on_device = Engine::Create(weights_, std::move(device),
                                    Options(kind, &a));
    auto on_cpu = Engine::Create(weights_, NewCpuBackend(), Options(kind, &b));
    ASSERT_TRUE(on_device.ok()) << on_device.status();
    ASSERT_TRUE(on_cpu.ok());
    const std::vector<int> t = Tokens(40);
    // A prompt of two chunks and a half.
    for (Engine* e : {on_device->get(), on_cpu->get()}) {
      ASSERT_TRUE(e->Forward(absl::MakeConstSpan(t).subspan(0, 30), false).ok());
    }
    const long copies_after_prefill = d->copies_in;
    for (int i = 30; i < 40; ++i) {
      auto want = (*on_cpu)->Forward({t[i]}, false);
      ASSERT_TRUE(want.ok());
      const std::vector<float> w(want->begin(), want->end());
      auto got = (*on_device)->Forward({t[i]}, false);
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<float> g(got->begin(), got->end());
      if (kind == "ideal") {
        // Attended the same way on both: bit for bit.
        EXPECT_EQ(g, w);
      } else {
        // The CPU attends over fp16 rows where they lie (AttendStoredRows)
        // or decodes int4 ones, the device over every head's staged rows
        // in one operation (h2o: decoded rows): the same values summed in
        // another order.
        ASSERT_EQ(g.size(), w.size());
        for (size_t j = 0; j < w.size(); ++j) {
          ASSERT_NEAR(g[j], w[j], 1e-4f * (1.0f + std::fabs(w[j]))) << j;
        }
      }
    }
    EXPECT_THAT(violations, ::testing::IsEmpty());
    EXPECT_EQ(d->shared_allocations, 0);  // no memory both sides touch
    // InfiniGen's prompt column sums ran where the prefill's rows are.
    EXPECT_EQ(d->column_sums > 0, kind == "infinigen");
    if (kind != "ideal") {
      // At least one copy of fetched rows per layer and step.
      EXPECT_GE(d->copies_in - copies_after_prefill, 10L * 12);
      if (kind != "h2o") {
        // One attention over every head's staged rows per layer and step.
        EXPECT_EQ(d->staged_attentions, 10 * 12);
      } else {
        // h2o sums probabilities: each head's rows decoded, K and V.
        EXPECT_EQ(d->staged_attentions, 0);
        EXPECT_GE(d->decodes, 2L * 2 * 10 * 12);
      }
    }
  }
}

// One-sided reads give exactly the node's gather: the same rows reach the
// same decode, so the logits agree bit for bit; the node is told of every
// read (its fetch counts match the gather's) and gathers nothing; the rows
// are pinned while the sequence is open. Where the backend cannot read in
// place, or the node may evict, the node gathers as before.
TEST_F(KvCacheTest, OneSidedReadsGiveTheGathersAnswers) {
  for (std::string kind : {"full", "int4", "h2o", "infinigen"}) {
    SCOPED_TRACE(kind);
    FakeKvClient direct_node, gather_node;
    std::vector<std::string> violations;
    auto direct_backend = std::make_unique<GuardedDeviceBackend>(&violations);
    auto gather_backend = std::make_unique<GuardedDeviceBackend>(&violations);
    GuardedDeviceBackend* d = direct_backend.get();
    EngineOptions direct_options = Options(kind, &direct_node);
    direct_options.kv.direct_reads = true;
    auto direct = Engine::Create(weights_, std::move(direct_backend),
                                 direct_options);
    auto gather = Engine::Create(weights_, std::move(gather_backend),
                                 Options(kind, &gather_node));
    ASSERT_TRUE(direct.ok()) << direct.status();
    ASSERT_TRUE(gather.ok()) << gather.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSameDecoding(**direct, **gather));
    // The prefill's K and V row stages, the two fetch buffers, the two plan
    // buffers, and the K and V rows of the one sequence.
    EXPECT_EQ(d->pins, 8);
    EXPECT_THAT(violations, ::testing::IsEmpty());
    ExpectNotedAsGathered(direct_node, gather_node);
    EXPECT_GT(d->gathers, 0);
    EXPECT_EQ(d->unpins, 0);  // all pinned while the sequence is open
  }
}

// On the CPU, one-sided reads attend over the node's fp16 rows where they
// lie, by index: the same rows in the same order as the node's gather, so
// the logits agree bit for bit; the node gathers nothing, is told of every
// read, and nothing is pinned. int4 rows are gathered by the node.
TEST_F(KvCacheTest, OneSidedReadsOnTheCpuAttendOverTheNodesRowsInPlace) {
  for (std::string kind : {"full", "h2o", "infinigen", "oracle", "quest",
                           "int4"}) {
    SCOPED_TRACE(kind);
    FakeKvClient direct_node, gather_node;
    EngineOptions direct_options = Options(kind, &direct_node);
    direct_options.kv.direct_reads = true;
    auto direct = Engine::Create(weights_, NewCpuBackend(), direct_options);
    auto gather = Engine::Create(weights_, NewCpuBackend(),
                                 Options(kind, &gather_node));
    ASSERT_TRUE(direct.ok()) << direct.status();
    ASSERT_TRUE(gather.ok()) << gather.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSameDecoding(**direct, **gather));
    const auto fetches = gather_node.fetches();
    ASSERT_FALSE(fetches.empty());
    if (kind == "int4") {
      // The CPU reads int4 rows only as fetched: the node gathers.
      EXPECT_EQ(direct_node.fetches().size(), fetches.size());
      EXPECT_TRUE(direct_node.notes().empty());
      continue;
    }
    ExpectNotedAsGathered(direct_node, gather_node);
  }
}

// The row cache: each step fetches only the selected rows the worker does
// not hold, and attention over the held and fetched rows gives the logits
// of a cache that fetches every selected row, bit for bit. The node hears
// of the held rows too (a note): it counts every token's fetches as the
// other node does. The policies that read every row fetch as before.
// Either replacement, with room to spare (0.5) and at a bound the steps
// reach (0.15), where rows are replaced.
TEST_F(KvCacheTest, TheRowCacheFetchesOnlyWhatChangedWithTheSameLogits) {
  for (const auto& [replacement, fraction] :
       std::vector<std::pair<RowCacheReplacement, double>>{
           {RowCacheReplacement::kRecency, 0.5},
           {RowCacheReplacement::kRecency, 0.15},
           {RowCacheReplacement::kFrequency, 0.15}})
  for (std::string kind : {"infinigen", "oracle", "quest", "h2o", "full",
                           "int4"}) {
    SCOPED_TRACE(kind + (replacement == RowCacheReplacement::kFrequency
                             ? " by frequency at "
                             : " by recency at ") +
                 std::to_string(fraction));
    FakeKvClient cached_node, gather_node;
    EngineOptions cached_options = WideOptions(kind, &cached_node);
    cached_options.kv.row_cache = fraction;
    cached_options.kv.row_cache_replacement = replacement;
    auto cached = Engine::Create(wide_, NewCpuBackend(), cached_options);
    auto gather = Engine::Create(wide_, NewCpuBackend(),
                                 WideOptions(kind, &gather_node));
    ASSERT_TRUE(cached.ok()) << cached.status();
    ASSERT_TRUE(gather.ok()) << gather.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSameDecoding(**cached, **gather));
    const FetchStats& got = (*cached)->fetch_stats();
    const FetchStats& want = (*gather)->fetch_stats();
    EXPECT_EQ(got.fraction_sum, want.fraction_sum);  // the same selection
    long node_rows = 0, node_rows_gathered = 0;
    for (const auto& f : cached_node.fetches()) node_rows += f.rows;
    for (const auto& f : gather_node.fetches()) node_rows_gathered += f.rows;
    if (kind == "full" || kind == "int4") {
      EXPECT_EQ(got.row_cache_lookups, 0);
      EXPECT_EQ(node_rows, node_rows_gathered);
      EXPECT_TRUE(cached_node.notes().empty());
      continue;
    }
    EXPECT_EQ(got.row_cache_lookups, want.rows_fetched);
    EXPECT_GT(got.row_cache_hits, 0);
    EXPECT_EQ(got.rows_fetched, want.rows_fetched - got.row_cache_hits);
    EXPECT_EQ(got.bytes_fetched * want.rows_fetched,
              want.bytes_fetched * got.rows_fetched);
    EXPECT_EQ(node_rows, got.rows_fetched);
    ASSERT_EQ(got.row_cache_layer_hits.size(), 12u);
    long layer_hits = 0, layer_lookups = 0;
    for (int l = 0; l < 12; ++l) {
      layer_hits += got.row_cache_layer_hits[l];
      layer_lookups += got.row_cache_layer_lookups[l];
    }
    EXPECT_EQ(layer_hits, got.row_cache_hits);
    EXPECT_EQ(layer_lookups, got.row_cache_lookups);
    EXPECT_GT(got.row_cache_bytes, 0);
    // Each step's held rows were noted: every token counted as often.
    long noted = 0;
    for (const auto& n : cached_node.notes()) noted += n.rows;
    EXPECT_EQ(noted, got.row_cache_hits);
    const auto want_tokens = gather_node.TokenStats(12, 2);
    const auto got_tokens = cached_node.TokenStats(12, 2);
    ASSERT_EQ(got_tokens.size(), want_tokens.size());
    for (size_t j = 0; j < got_tokens.size(); ++j) {
      EXPECT_EQ(got_tokens[j].position, want_tokens[j].position) << j;
      EXPECT_EQ(got_tokens[j].fetch_count, want_tokens[j].fetch_count) << j;
    }
  }
}

// On a device the row cache's slots lie in its memory: the misses are
// staged and moved into their slots there, and one attention per layer
// reads every planned row by slot, with the logits of a device that
// fetches every selected row. h2o, whose attention sums probabilities,
// and the policies that read every row fetch as before.
TEST_F(KvCacheTest, TheRowCacheOnADeviceKeepsItsRowsInDeviceMemory) {
  for (const auto& [replacement, fraction] :
       std::vector<std::pair<RowCacheReplacement, double>>{
           {RowCacheReplacement::kRecency, 0.5},
           {RowCacheReplacement::kFrequency, 0.15}})
  for (std::string kind : {"infinigen", "oracle", "quest", "h2o", "full"}) {
    SCOPED_TRACE(kind + " at " + std::to_string(fraction));
    FakeKvClient cached_node, gather_node;
    std::vector<std::string> violations;
    auto device = std::make_unique<GuardedDeviceBackend>(&violations);
    GuardedDeviceBackend* d = device.get();
    EngineOptions cached_options = WideOptions(kind, &cached_node);
    cached_options.kv.row_cache = fraction;
    cached_options.kv.row_cache_replacement = replacement;
    auto cached = Engine::Create(wide_, std::move(device), cached_options);
    auto gather =
        Engine::Create(wide_, std::make_unique<GuardedDeviceBackend>(&violations),
                       WideOptions(kind, &gather_node));
    ASSERT_TRUE(cached.ok()) << cached.status();
    ASSERT_TRUE(gather.ok()) << gather.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSameDecoding(**cached, **gather));
    EXPECT_THAT(violations, ::testing::IsEmpty());
    const FetchStats& got = (*cached)->fetch_stats();
    const FetchStats& want = (*gather)->fetch_stats();
    EXPECT_EQ(got.fraction_sum, want.fraction_sum);
    if (kind == "full" || kind == "h2o") {
      EXPECT_EQ(got.row_cache_lookups, 0);
      EXPECT_EQ(got.rows_fetched, want.rows_fetched);
      EXPECT_EQ(d->scatters, 0);
      continue;
    }
    EXPECT_EQ(got.row_cache_lookups, want.rows_fetched);
    EXPECT_GT(got.row_cache_hits, 0);
    EXPECT_EQ(got.rows_fetched, want.rows_fetched - got.row_cache_hits);
    long node_rows = 0;
    for (const auto& f : cached_node.fetches()) node_rows += f.rows;
    EXPECT_EQ(node_rows, got.rows_fetched);
    EXPECT_GT(got.row_cache_bytes, 0);
    // Every selecting layer of every step read its rows by slot, after
    // its misses went to their slots.
    EXPECT_GT(d->slotted_attentions, 0);
    EXPECT_EQ(d->scatters, d->slotted_attentions);
  }
}

// A reused prefix's rows reach a device's prefill through the cache's
// staging as they came; the steps after use its slots: the text of
// neither reuse nor cache.
TEST_F(KvCacheTest, TheRowCacheOnADeviceDecodesAReusedPrefixAsWithoutEither) {
  for (std::string kind : {"infinigen", "oracle", "quest"}) {
    SCOPED_TRACE(kind);
    std::vector<std::string> violations;
    auto device = [&] {
      return std::make_unique<GuardedDeviceBackend>(&violations);
    };
    FakeKvClient node;
    EngineOptions o = WideOptions(kind, &node);
    o.kv.prefix_block_tokens = 8;
    o.kv.model_identity = "test-model";
    o.kv.row_cache = 0.5;
    const std::vector<int> shared = Tokens(70);
    std::vector<int> prompt = shared;
    prompt.push_back(5);
    prompt.push_back(9);
    auto first = Engine::Create(wide_, device(), o);
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE((*first)->Forward(shared, false).ok());
    auto second = Engine::Create(wide_, device(), o);
    ASSERT_TRUE(second.ok());
    const std::vector<int> reused = Greedy(**second, prompt, 12);
    EXPECT_EQ((*second)->cached_tokens(), 64);
    EngineOptions plain = o;
    plain.kv.prefix_block_tokens = 0;
    plain.kv.row_cache = 0;
    auto third = Engine::Create(wide_, device(), plain);
    ASSERT_TRUE(third.ok());
    EXPECT_EQ(reused, Greedy(**third, prompt, 12));
    const FetchStats& got = (*second)->fetch_stats();
    const FetchStats& want = (*third)->fetch_stats();
    EXPECT_EQ(got.fraction_sum, want.fraction_sum);
    EXPECT_EQ(got.row_cache_lookups, want.rows_fetched);
    EXPECT_GT(got.row_cache_hits, 0);
    EXPECT_THAT(violations, ::testing::IsEmpty());
  }
}

// A node that evicts (a pool of half the context, by LRU or counter): the
// cache holds rows wherever the node keeps them, and its notes of the rows
// held leave the node's statistics, clocks and so its evictions as
// fetching every row does: the same tokens present, counted and dated
// alike, the same logits.
TEST_F(KvCacheTest, TheRowCacheLeavesAnEvictingNodeAsFetchingEveryRow) {
  using kv_memory_service::EvictionPolicy;
  for (EvictionPolicy eviction : {EvictionPolicy::kLru, EvictionPolicy::kCounter})
  for (std::string kind : {"infinigen", "h2o"}) {
    SCOPED_TRACE(kind + " " + std::string(kv_memory_service::EvictionPolicyName(eviction)));
    FakeKvClient cached_node(eviction), gather_node(eviction);
    EngineOptions with = WideOptions(kind, &cached_node);
    with.kv.kv_capacity = 0.5;
    EngineOptions without = WideOptions(kind, &gather_node);
    without.kv.kv_capacity = 0.5;
    with.kv.row_cache = 0.5;
    auto cached = Engine::Create(wide_, NewCpuBackend(), with);
    auto gather = Engine::Create(wide_, NewCpuBackend(), without);
    ASSERT_TRUE(cached.ok() && gather.ok());
    // Past the pool's 128 tokens: 40 decode steps that evict.
    const std::vector<int> t = Tokens(140);
    for (Engine* e : {cached->get(), gather->get()}) {
      ASSERT_TRUE(e->Forward(absl::MakeConstSpan(t).subspan(0, 100), false)
                      .ok());
    }
    for (int i = 100; i < 140; ++i) {
      auto w = (*gather)->Forward({t[i]}, false);
      ASSERT_TRUE(w.ok()) << w.status();
      const std::vector<float> want_logits(w->begin(), w->end());
      auto g = (*cached)->Forward({t[i]}, false);
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(std::vector<float>(g->begin(), g->end()), want_logits) << i;
    }
    ASSERT_TRUE((*cached)->Flush().ok());
    ASSERT_TRUE((*gather)->Flush().ok());
    const FetchStats& got = (*cached)->fetch_stats();
    const FetchStats& want = (*gather)->fetch_stats();
    EXPECT_EQ(got.fraction_sum, want.fraction_sum);
    EXPECT_EQ(got.row_cache_lookups, want.rows_fetched);
    EXPECT_GT(got.row_cache_hits, 0);
    EXPECT_EQ(got.rows_fetched, want.rows_fetched - got.row_cache_hits);
    long noted = 0;
    for (const auto& n : cached_node.notes()) noted += n.rows;
    EXPECT_EQ(noted, got.row_cache_hits);
    const auto want_tokens = gather_node.TokenStats(12, 2);
    const auto got_tokens = cached_node.TokenStats(12, 2);
    EXPECT_LE(want_tokens.size(), 12u * 2 * 128);  // the node evicted
    ASSERT_EQ(got_tokens.size(), want_tokens.size());
    for (size_t j = 0; j < got_tokens.size(); ++j) {
      EXPECT_EQ(got_tokens[j].position, want_tokens[j].position) << j;
      EXPECT_EQ(got_tokens[j].fetch_count, want_tokens[j].fetch_count) << j;
      EXPECT_EQ(got_tokens[j].last_fetch, want_tokens[j].last_fetch) << j;
    }
  }
}

// Watched positions (a needle's rows): per layer, the (head, position)
// pairs a step could select and those its plan selected. Full reads every
// row; the oracle at 0.4 reads some of them, out of the same candidates.
TEST_F(KvCacheTest, WatchedPositionsCountWhatEachPlanSelects) {
  FakeKvClient full_node, oracle_node;
  EngineOptions full = Options("full", &full_node);
  full.kv.watch_positions = {3, 5, 7, 29, 200};
  EngineOptions oracle = TargetOptions("oracle", &oracle_node, false);
  oracle.kv.watch_positions = full.kv.watch_positions;
  auto a = Engine::Create(weights_, NewCpuBackend(), full);
  auto b = Engine::Create(weights_, NewCpuBackend(), oracle);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const std::vector<int> t = Tokens(40);
  for (Engine* e : {a->get(), b->get()}) {
    ASSERT_TRUE(e->Forward(absl::MakeConstSpan(t).subspan(0, 30), false).ok());
    for (int i = 30; i < 40; ++i) ASSERT_TRUE(e->Forward({t[i]}, false).ok());
  }
  const FetchStats& all = (*a)->fetch_stats();
  const FetchStats& some = (*b)->fetch_stats();
  ASSERT_EQ(all.watched_layer_candidates.size(), 12u);
  ASSERT_EQ(some.watched_layer_candidates, all.watched_layer_candidates);
  long selected = 0, candidates = 0;
  for (int l = 0; l < 12; ++l) {
    // 4 positions below 30 in each of 2 heads, 10 steps.
    EXPECT_EQ(all.watched_layer_candidates[l], 4 * 2 * 10) << l;
    EXPECT_EQ(all.watched_layer_selected[l], all.watched_layer_candidates[l]);
    EXPECT_LE(some.watched_layer_selected[l], some.watched_layer_candidates[l]);
    selected += some.watched_layer_selected[l];
    candidates += some.watched_layer_candidates[l];
  }
  EXPECT_GT(selected, 0);
  EXPECT_LT(selected, candidates);

  EngineOptions unsorted = Options("full", &full_node);
  unsorted.kv.watch_positions = {5, 3};
  EXPECT_EQ(Engine::Create(weights_, NewCpuBackend(), unsorted).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The row cache is worker memory: its bound counts in worker_kv_bytes.
TEST_F(KvCacheTest, TheRowCacheCountsInTheWorkersBytes) {
  FakeKvClient a, b;
  EngineOptions with = WideOptions("infinigen", &a);
  with.kv.row_cache = 0.5;
  auto cached = Engine::Create(wide_, NewCpuBackend(), with);
  auto plain = Engine::Create(wide_, NewCpuBackend(),
                              WideOptions("infinigen", &b));
  ASSERT_TRUE(cached.ok() && plain.ok());
  // Half of 12 layers x 2 KV heads x 256 tokens: 3072 rows of K and V in
  // fp16 (32 values); two maps per position of each (layer, head), three
  // per row.
  EXPECT_EQ((*cached)->worker_kv_bytes() - (*plain)->worker_kv_bytes(),
            3072 * 2 * 32 * 2 + (12 * 2 * 2 * 256 + 3 * 3072) * 4);
  // Under a limit it takes what is left: all of it.
  KvCacheOptions no_cache;
  no_cache.max_seq_len = with.max_seq_len;
  no_cache.max_chunk = with.max_chunk;
  no_cache.kv = WideOptions("infinigen", &b).kv;
  auto limit = KvCache::WorkerBytes(wide_, no_cache);
  ASSERT_TRUE(limit.ok());
  ASSERT_GT((*cached)->worker_kv_bytes(), *limit);
  EngineOptions limited = with;
  limited.kv.max_worker_bytes = *limit;
  FakeKvClient c;
  limited.kv.kv_client = &c;
  auto fitted = Engine::Create(wide_, NewCpuBackend(), limited);
  ASSERT_TRUE(fitted.ok()) << fitted.status();
  EXPECT_LE((*fitted)->worker_kv_bytes(), *limit);
  EXPECT_GT((*fitted)->worker_kv_bytes(), (*plain)->worker_kv_bytes());
  with.kv.row_cache = 1.5;
  auto refused = Engine::Create(wide_, NewCpuBackend(), with);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("row_cache"));
}

// A plan of every row (full, int4, InfiniGen's dense layers) is read with
// one-sided reads as each head's first rows, whole: no indices are written,
// copied to the device or sent; the node hears of each such layer by its
// head offsets and counts every token's fetches and clocks as the
// gathering node does (what its LRU and counter eviction rank by).
TEST_F(KvCacheTest, WholeLayersAreReadWithoutIndices) {
  for (std::string kind : {"full", "int4", "infinigen"}) {
    for (bool on_device : {true, false}) {
      if (kind == "int4" && !on_device) continue;  // the CPU: node gathers
      SCOPED_TRACE(kind + (on_device ? " on a device" : " on the CPU"));
      FakeKvClient direct_node, gather_node;
      std::vector<std::string> violations;
      auto guarded = std::make_unique<GuardedDeviceBackend>(&violations);
      GuardedDeviceBackend* d = guarded.get();
      // Both engines on the same kind of backend.
      std::unique_ptr<Backend> backend, gather_backend;
      if (on_device) {
        backend = std::move(guarded);
        gather_backend = std::make_unique<GuardedDeviceBackend>(&violations);
      } else {
        backend = NewCpuBackend();
        gather_backend = NewCpuBackend();
      }
      EngineOptions direct_options = Options(kind, &direct_node);
      direct_options.kv.direct_reads = true;
      auto direct =
          Engine::Create(weights_, std::move(backend), direct_options);
      auto gather = Engine::Create(weights_, std::move(gather_backend),
                                   Options(kind, &gather_node));
      ASSERT_TRUE(direct.ok()) << direct.status();
      ASSERT_TRUE(gather.ok()) << gather.status();
      ASSERT_NO_FATAL_FAILURE(ExpectSameDecoding(**direct, **gather));
      ExpectNotedAsGathered(direct_node, gather_node);
      long leading = 0;
      for (const FakeKvClient::FetchCall& n : direct_node.notes()) {
        // Every row of every layer, or of InfiniGen's two dense layers.
        EXPECT_EQ(n.leading, kind != "infinigen" || n.layer < 2) << n.layer;
        leading += n.leading;
      }
      EXPECT_EQ(leading, 10 * (kind == "infinigen" ? 2 : 12));
      if (on_device) {
        EXPECT_EQ(d->leading_gathers, leading);
        EXPECT_THAT(violations, ::testing::IsEmpty());
      }
      const auto want = gather_node.TokenStats(12, 2);
      const auto got = direct_node.TokenStats(12, 2);
      ASSERT_EQ(got.size(), want.size());
      ASSERT_EQ(got.size(), size_t{12} * 2 * 40);
      for (size_t j = 0; j < got.size(); ++j) {
        EXPECT_EQ(got[j].position, want[j].position) << j;
        EXPECT_EQ(got[j].fetch_count, want[j].fetch_count) << j;
        EXPECT_EQ(got[j].last_fetch, want[j].last_fetch) << j;
      }
    }
  }
}

// InfiniGen and the oracle at a target fetch rank each head's top k, which
// a device selects where the scores are: with one-sided reads nothing
// comes back to the host inside a step (as many copies out per step as
// full's: the step's new rows and the logits), the node hears of every
// layer's plan after the step's last layer, exactly the rows a node's
// gather fetched, and the logits are the gather's.
TEST_F(KvCacheTest, PlansMadeOnTheDeviceReachTheNodeAfterTheStep) {
  const std::vector<int> t = Tokens(40);
  // Copies out of the device over 10 decode steps after a 30-token prompt.
  auto decode_copies_out = [&](Engine& e, GuardedDeviceBackend& d) {
    EXPECT_TRUE(e.Forward(absl::MakeConstSpan(t).subspan(0, 30), false).ok());
    const long before = d.copies_out;
    for (int i = 30; i < 40; ++i) EXPECT_TRUE(e.Forward({t[i]}, false).ok());
    return d.copies_out - before;
  };
  std::vector<std::string> violations;
  long full_copies = 0;
  {
    FakeKvClient node;
    EngineOptions o = Options("full", &node);
    o.kv.direct_reads = true;
    GuardedDeviceBackend* d = nullptr;
    auto full = OnDevice(weights_, o, &violations, &d);
    ASSERT_TRUE(full.ok()) << full.status();
    full_copies = decode_copies_out(**full, *d);
    EXPECT_EQ(d->selections, 0);
  }
  for (std::string kind : {"infinigen", "oracle"}) {
    SCOPED_TRACE(kind);
    FakeKvClient direct_node, gather_node, counted_node;
    GuardedDeviceBackend *d = nullptr, *g = nullptr, *c = nullptr;
    auto direct = OnDevice(weights_, TargetOptions(kind, &direct_node, true),
                           &violations, &d);
    auto gather = OnDevice(weights_, TargetOptions(kind, &gather_node, false),
                           &violations, &g);
    ASSERT_TRUE(direct.ok()) << direct.status();
    ASSERT_TRUE(gather.ok()) << gather.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSameDecoding(**direct, **gather));
    EXPECT_THAT(violations, ::testing::IsEmpty());
    ExpectNotedAsGathered(direct_node, gather_node);
    // The worker reports what it read as a gathering worker does: every
    // step's fraction of the cached rows.
    const FetchStats& read = (*direct)->fetch_stats();
    const FetchStats& gathered = (*gather)->fetch_stats();
    EXPECT_GT(read.steps, 0);
    EXPECT_EQ(read.steps, gathered.steps);
    EXPECT_GT(read.fraction_mean(), 0.0);
    EXPECT_DOUBLE_EQ(read.fraction_sum, gathered.fraction_sum);
    EXPECT_DOUBLE_EQ(read.fraction_max, gathered.fraction_max);
    EXPECT_EQ(read.rows_fetched, gathered.rows_fetched);
    // Every selecting layer of every step: 10 of 12 layers, 10 steps.
    EXPECT_EQ(d->selections, 10 * 10);
    // The prompt's K and V rows, 2 chunks of 12 layers, and one plan note
    // per selection; the node's gather needs the plan on the host: copied,
    // not queued.
    EXPECT_EQ(g->selections, 10 * 10);
    EXPECT_EQ(g->queued_copies_out, 2 * 2 * 12);
    EXPECT_EQ(d->queued_copies_out, 2 * 2 * 12 + 10 * 10);

    auto counted = OnDevice(
        weights_, TargetOptions(kind, &counted_node, true), &violations, &c);
    ASSERT_TRUE(counted.ok()) << counted.status();
    EXPECT_EQ(decode_copies_out(**counted, *c), full_copies);
  }
  // Sink tokens are added on the host: the scores come back.
  FakeKvClient node;
  EngineOptions o = TargetOptions("infinigen", &node, true);
  o.kv.policy->selection.sink_tokens = 2;
  GuardedDeviceBackend* d = nullptr;
  auto sinks = OnDevice(weights_, o, &violations, &d);
  ASSERT_TRUE(sinks.ok()) << sinks.status();
  EXPECT_EQ(decode_copies_out(**sinks, *d), full_copies + 10 * 10);
  EXPECT_EQ(d->selections, 0);
}

// Two sequences decoding together on a device, each with its plans made
// on the device and read one-sided, get the logits each gets alone (within
// float rounding), and the node hears of each one's own plans (as many
// fetched rows).
TEST_F(KvCacheTest, DevicePlansOfABatchStayWithTheirSequences) {
  const std::vector<int> t = Tokens(48);
  auto options = [&](FakeKvClient* node, int batch) {
    EngineOptions o = TargetOptions("infinigen", node, true);
    o.batch = batch;
    return o;
  };
  const int prefix[2] = {20, 27}, steps = 8;
  const int vocab = weights_.config.vocab_size;
  std::vector<std::string> violations;
  std::vector<std::vector<float>> want[2];
  long want_rows = 0;
  for (int s = 0; s < 2; ++s) {
    FakeKvClient node;
    auto single = OnDevice(weights_, options(&node, 1), &violations);
    ASSERT_TRUE(single.ok()) << single.status();
    ASSERT_TRUE((*single)->Forward(0, absl::MakeConstSpan(t).subspan(
                                          s * 5, prefix[s]),
                                   false).ok());
    for (int i = 0; i < steps; ++i) {
      const int slot = 0, token = t[s * 5 + prefix[s] + i];
      auto logits = (*single)->DecodeBatch({slot}, {token});
      ASSERT_TRUE(logits.ok()) << logits.status();
      want[s].emplace_back(logits->begin(), logits->end());
    }
    // The last step's notes go with its appends, in the background.
    ASSERT_TRUE((*single)->Flush().ok());
    auto stats = node.GetStoreStats();
    ASSERT_TRUE(stats.ok());
    want_rows += stats->fetched_rows;
  }
  FakeKvClient node;
  GuardedDeviceBackend* d = nullptr;
  auto batched = OnDevice(weights_, options(&node, 2), &violations, &d);
  ASSERT_TRUE(batched.ok()) << batched.status();
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE((*batched)->Forward(s, absl::MakeConstSpan(t).subspan(
                                           s * 5, prefix[s]),
                                    false).ok());
  }
  for (int i = 0; i < steps; ++i) {
    const int tokens[2] = {t[prefix[0] + i], t[5 + prefix[1] + i]};
    auto logits = (*batched)->DecodeBatch({0, 1}, tokens);
    ASSERT_TRUE(logits.ok()) << logits.status();
    // The batch's matrix products round differently from one row's: the
    // same selection is within float rounding, another one far off.
    for (int s = 0; s < 2; ++s) {
      for (int j = 0; j < vocab; ++j) {
        const float w = want[s][i][j];
        ASSERT_NEAR((*logits)[s * vocab + j], w, 1e-4f * (1 + std::fabs(w)))
            << "slot " << s << " step " << i << " logit " << j;
      }
    }
  }
  // The last step's notes go with its appends, in the background.
  ASSERT_TRUE((*batched)->Flush().ok());
  auto stats = node.GetStoreStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->fetched_rows, want_rows);
  EXPECT_EQ(d->selections, 2 * steps * 10);
  EXPECT_THAT(violations, ::testing::IsEmpty());
}

// A device's one-sided reads take their plans from pinned memory: a copy
// from pageable memory would hold the host until the device reached it,
// every layer. What a decode step copies from pageable memory is small
// (head offsets, the position).
TEST_F(KvCacheTest, OneSidedReadPlansReachTheDeviceFromPinnedMemory) {
  FakeKvClient node;
  std::vector<std::string> violations;
  EngineOptions o = Options("full", &node);
  o.kv.direct_reads = true;
  GuardedDeviceBackend* d = nullptr;
  auto engine = OnDevice(weights_, o, &violations, &d);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<int> t = Tokens(40);
  ASSERT_TRUE((*engine)->Forward(absl::MakeConstSpan(t).subspan(0, 30), false)
                  .ok());
  d->largest_unpinned_copy_in = 0;
  for (int i = 30; i < 40; ++i) {
    ASSERT_TRUE((*engine)->Forward({t[i]}, false).ok());
  }
  EXPECT_GT(d->gathers, 0);
  // Each plan names 2 heads x 30-odd rows: 240 bytes or more.
  EXPECT_LE(d->largest_unpinned_copy_in, 3 * sizeof(int32_t));
  EXPECT_THAT(violations, ::testing::IsEmpty());
}

// A device encodes the prompt's fp16 rows for the memory node itself (the
// host's bits: the node holds what a CPU engine stores) and queues them to
// the host: for a policy that does not observe the prompt's queries and
// keys, nothing else leaves the device during the prefill (as many copies
// out as the local cache's: the logits). int4 rows, which it does not
// encode, are encoded on the host.
TEST_F(KvCacheTest, PrefillRowsAreEncodedOnTheDevice) {
  const std::vector<int> t = Tokens(40);
  // The engine, kept: its sequence closes with it.
  auto prefill = [&](const std::string& kind, std::unique_ptr<Backend> b,
                     FakeKvClient* node) -> std::unique_ptr<Engine> {
    auto e = Engine::Create(weights_, std::move(b), Options(kind, node));
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    EXPECT_TRUE((*e)->Forward(t, false).ok());
    return std::move(*e);
  };
  std::vector<std::string> violations;
  FakeKvClient unused;
  auto ideal_backend = std::make_unique<GuardedDeviceBackend>(&violations);
  GuardedDeviceBackend* ideal = ideal_backend.get();
  auto ideal_engine = prefill("ideal", std::move(ideal_backend), &unused);
  for (std::string kind : {"full", "h2o", "infinigen", "int4"}) {
    SCOPED_TRACE(kind);
    FakeKvClient device_node, cpu_node;
    auto device = std::make_unique<GuardedDeviceBackend>(&violations);
    GuardedDeviceBackend* d = device.get();
    auto on_device = prefill(kind, std::move(device), &device_node);
    auto on_cpu = prefill(kind, NewCpuBackend(), &cpu_node);
    const int width = KvRowWidth(
        kind == "int4" ? KvRowFormat::kInt4 : KvRowFormat::kHalf, 8);
    const std::vector<uint16_t> stored =
        device_node.StoredRows(12, 2, 40, width);
    ASSERT_EQ(stored.size(), 2u * 12 * 2 * 40 * width);
    EXPECT_EQ(stored, cpu_node.StoredRows(12, 2, 40, width));
    if (kind == "int4") {
      EXPECT_EQ(d->encodes, 0);
      continue;
    }
    // K and V of 3 chunks (16, 16, 8), 12 layers.
    EXPECT_EQ(d->encodes, 2 * 3 * 12);
    if (kind == "full") EXPECT_EQ(d->copies_out, ideal->copies_out);
  }
  // InfiniGen keeping every column observes nothing of the prompt: it
  // copies out of the device what full does. Choosing a part of the
  // columns, it sums each chunk's skewed queries (and keys) on the device
  // and copies out one layer's sums at the layer's end, never the chunks'
  // queries and keys.
  for (const float ratio : {1.0f, 0.3f}) {
    SCOPED_TRACE(ratio);
    FakeKvClient node;
    auto device = std::make_unique<GuardedDeviceBackend>(&violations);
    GuardedDeviceBackend* d = device.get();
    EngineOptions o = Options("infinigen", &node);
    o.kv.policy->infinigen.partial_ratio = ratio;
    auto e = Engine::Create(weights_, std::move(device), o);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE((*e)->Forward(t, false).ok());
    EXPECT_EQ(d->copies_out, ideal->copies_out + (ratio < 1.0f ? 12 : 0));
    if (ratio < 1.0f) {
      EXPECT_GE(d->column_sums, 3 * 12);  // each chunk of each layer
    } else {
      EXPECT_EQ(d->column_sums, 0);
    }
  }
  EXPECT_THAT(violations, ::testing::IsEmpty());
}

// The notes of a step's plans made on a device go to the node in the
// background, after the step returned: a note the node refuses marks the
// sequence lost, so the next step recomputes it (the logits are an
// uninterrupted run's, bit for bit) or, without recompute, fails with the
// node's error.
TEST_F(KvCacheTest, ARefusedBackgroundNoteLosesTheSequence) {
  const std::vector<int> prompt = Tokens(30);
  std::vector<int> next;
  for (int i = 0; i < 10; ++i) next.push_back((i * 13 + 5) % 64);
  std::vector<std::string> violations;
  FakeKvClient clean_node;
  auto clean = OnDevice(weights_, TargetOptions("infinigen", &clean_node, true),
                        &violations);
  ASSERT_TRUE(clean.ok()) << clean.status();
  const ForcedRun want = Forced(**clean, prompt, next);
  ASSERT_TRUE(want.status.ok()) << want.status;

  FakeKvClient node;
  auto engine = OnDevice(weights_, TargetOptions("infinigen", &node, true),
                         &violations);
  ASSERT_TRUE(engine.ok()) << engine.status();
  // Each step notes its 2 dense layers during the step and its 10
  // selecting layers in the background: the 3rd step's 5th background note.
  node.FailNoteAt(2 * 12 + 2 + 5);
  const ForcedRun got = Forced(**engine, prompt, next);
  ASSERT_TRUE(got.status.ok()) << got.status;
  ASSERT_EQ(got.logits.size(), want.logits.size());
  for (size_t i = 0; i < want.logits.size(); ++i) {
    EXPECT_EQ(got.logits[i], want.logits[i]) << "step " << i;
  }
  EXPECT_EQ((*engine)->kv_recoveries(), 1);
  EXPECT_EQ(node.opens(), 2);

  FakeKvClient strict_node;
  EngineOptions strict = TargetOptions("infinigen", &strict_node, true);
  strict.recompute_on_kv_loss = false;
  auto failing = OnDevice(weights_, strict, &violations);
  ASSERT_TRUE(failing.ok());
  strict_node.FailNoteAt(2 * 12 + 2 + 5);
  const ForcedRun cut = Forced(**failing, prompt, next);
  // The prompt's logits and 3 steps', then the 4th step fails.
  EXPECT_EQ(cut.logits.size(), 4u);
  EXPECT_EQ(cut.status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(cut.status.message()), HasSubstr("no open sequence"));
  EXPECT_THAT(violations, ::testing::IsEmpty());
}

TEST_F(KvCacheTest, OneSidedReadsFallBackToTheNodesGather) {
  const std::vector<int> t = Tokens(36);
  // A backend that cannot read host memory in place: the node gathers,
  // from the first read on, the same rows (the logits are the gather's),
  // those of the layer planned for one-sided reads before the refusal
  // included. InfiniGen with no dense layer plans layers 0 and 1 on the
  // device before layer 0's read is refused.
  for (const bool selects : {false, true}) {
    SCOPED_TRACE(selects ? "infinigen" : "full");
    auto options = [&](FakeKvClient* node, bool direct) {
      EngineOptions o = Options(selects ? "infinigen" : "full", node);
      if (selects) {
        o.kv.policy->selection.dense_layers = 0;
        EXPECT_TRUE(SetTargetFetch(0.4, 12, *o.kv.policy).ok());
      }
      o.kv.direct_reads = direct;
      return o;
    };
    FakeKvClient node, gather_node;
    std::vector<std::string> violations;
    auto backend = std::make_unique<GuardedDeviceBackend>(&violations);
    GuardedDeviceBackend* d = backend.get();
    d->set_gathers_rows(false);
    auto engine = Engine::Create(weights_, std::move(backend),
                                 options(&node, true));
    ASSERT_TRUE(engine.ok()) << engine.status();
    auto gather = Engine::Create(
        weights_, std::make_unique<GuardedDeviceBackend>(&violations),
        options(&gather_node, false));
    ASSERT_TRUE(gather.ok()) << gather.status();
    ASSERT_NO_FATAL_FAILURE(ExpectSameDecoding(**engine, **gather));
    EXPECT_EQ(node.fetches().size(), gather_node.fetches().size());
    EXPECT_TRUE(node.notes().empty());
    EXPECT_EQ(d->selections > 0, selects);
    // The node's rows were given back once refused; the fetch and plan
    // buffers (and InfiniGen's plan notes) stay.
    EXPECT_EQ(d->pins, selects ? 9 : 8);
    EXPECT_EQ(d->unpins, 2);
    EXPECT_THAT(violations, ::testing::IsEmpty());
  }
  // A node that may evict (a pool smaller than the context): positions
  // move, so the node gathers, and nothing is pinned.
  {
    FakeKvClient node;
    std::vector<std::string> violations;
    auto backend = std::make_unique<GuardedDeviceBackend>(&violations);
    GuardedDeviceBackend* d = backend.get();
    EngineOptions o = Options("full", &node);
    o.kv.direct_reads = true;
    o.kv.kv_capacity = 0.5;
    auto engine = Engine::Create(weights_, std::move(backend), o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_TRUE((*engine)->Forward(absl::MakeConstSpan(t).subspan(0, 30),
                                   false).ok());
    ASSERT_TRUE((*engine)->Forward({t[30]}, false).ok());
    EXPECT_FALSE(node.fetches().empty());
    EXPECT_TRUE(node.notes().empty());
    EXPECT_EQ(d->pins, 6);  // the fetch and plan buffers, the row stages
  }
}

}  // namespace
}  // namespace infinigen::gpu_worker
