// The same KvClient tests on every data plane: in-process, and gRPC over
// loopback TCP and a unix socket to a KvServer in this process. A new data
// plane joins by adding its name to the INSTANTIATE line and a branch to
// SetUp. (Tests against the real server binary are in
// tests/kv_memory_service/.)
#include "kv_memory_service/client/kv_client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "grpcpp/client_context.h"
#include "kv_memory_service/client/prefix_keys.h"
#include "kv_memory_service/control/proto_convert.h"
#include "kv_memory_service/server/kv_server.h"
#include "proto/kv_memory.grpc.pb.h"
#include "kv_memory_service/testing/fault_injection_client.h"
#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

#define EXPECT_CODE(expr, code_name) \
  EXPECT_EQ((expr).code(), absl::StatusCode::code_name) << (expr)
#define EXPECT_OK(expr) EXPECT_TRUE((expr).ok()) << (expr)
#define ASSERT_OK(expr)             \
  do {                              \
    const absl::Status s_ = (expr); \
    ASSERT_TRUE(s_.ok()) << s_;     \
  } while (0)

// A unix socket path in TEST_TMPDIR, or /tmp when that is too long for
// sockaddr_un (108 bytes).
std::string SocketPath(const std::string& name) {
  static std::atomic<int> n{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, "-",
                                  getpid(), "-", n++, ".sock");
  if (path.size() >= 100) {
    path = absl::StrCat("/tmp/", name, "-", getpid(), "-", n++, ".sock");
  }
  return path;
}

class KvClientTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    store_options_.eviction = EvictionPolicy::kFifo;
    store_options_.max_sequences = 64;
    store_options_.prefix_cache_bytes = 1 << 20;
    if (GetParam() == "inproc") {
      inproc_store_ = std::make_shared<KvStore>(store_options_);
      client_options_.inproc_store = inproc_store_;
      address_ = "inproc:";
    } else {
      KvServerOptions server_options;
      server_options.store = store_options_;
      server_options.listen = absl::StartsWith(GetParam(), "tcp")
                                  ? "127.0.0.1:0"
                                  : "unix:" + SocketPath("kv_client_test");
      // tcp: fetches over the plain fetch socket; tcp_stream: over the
      // gRPC FetchStream.
      client_options_.tcp_fetch_socket = GetParam() != "tcp_stream";
      if (GetParam() == "shm") {
        server_options.shm_listen = "unix:" + SocketPath("kv_client_test_shm");
      }
      auto server = KvServer::Start(server_options);
      ASSERT_TRUE(server.ok()) << server.status();
      server_ = *std::move(server);
      address_ = GetParam() == "shm" ? server_->shm_client_address()
                                     : server_->client_address();
    }
    client_ = Connect();
    ASSERT_NE(client_, nullptr);
  }

  std::unique_ptr<KvClient> Connect() {
    auto client = ConnectKvClient(address_, client_options_);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // Opens a sequence and appends `length` tokens of every layer.
  SequenceId OpenFilled(const SequenceGeometry& g, uint32_t salt, int length) {
    auto id = client_->Open(g);
    EXPECT_TRUE(id.ok()) << id.status();
    if (length > 0) {
      testdata::TestBlock b = MakeTestBlock(salt, g, 0, g.n_layers, 0, length);
      auto r = client_->Append(*id, b.block);
      EXPECT_TRUE(r.ok()) << r.status();
    }
    return id.value_or(0);
  }

  std::unique_ptr<FetchBuffer> Buffer(size_t elements) {
    auto b = client_->NewFetchBuffer(elements);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : nullptr;
  }

  static std::vector<uint16_t> Rows(const FetchBuffer& b, size_t n) {
    return std::vector<uint16_t>(b.data(), b.data() + n);
  }

  KvStoreOptions store_options_;
  KvClientOptions client_options_;
  std::shared_ptr<KvStore> inproc_store_;
  std::unique_ptr<KvServer> server_;
  std::string address_;
  std::unique_ptr<KvClient> client_;
};

TEST_P(KvClientTest, FetchesAreBitExact) {
  const SequenceGeometry g = MakeGeometry(4, 3, 64, 512);
  const SequenceId id = OpenFilled(g, 17, 100);
  // Decode steps, one token of every layer at a time.
  for (int t = 100; t < 110; ++t) {
    testdata::TestBlock b = MakeTestBlock(17, g, 0, g.n_layers, t, 1);
    auto r = client_->Append(id, b.block);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->evicted, IsEmpty());
  }
  std::mt19937 rng(3);
  std::vector<std::unique_ptr<FetchBuffer>> buffers;
  for (int l = 0; l < g.n_layers; ++l) buffers.push_back(Buffer(2 * 3 * 64 * 64));
  for (int round = 0; round < 20; ++round) {
    std::vector<OwnedFetchPlan> plans;
    std::vector<FetchHandle> handles;
    // Every layer in flight at once, each head its own tokens and count.
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
      for (auto& p : per_head) {
        for (int i = 0, k = rng() % 64; i < k; ++i) p.push_back(rng() % 110);
      }
      plans.push_back(OwnedFetchPlan::PerHead(per_head));
    }
    for (int l = 0; l < g.n_layers; ++l) {
      handles.push_back(
          client_->FetchAsync(id, l, plans[l].view(), buffers[l].get()));
    }
    for (int l = 0; l < g.n_layers; ++l) {
      ASSERT_OK(handles[l].Wait());
      const std::vector<uint16_t> want = ExpectedRows(17, g, l, plans[l].view());
      ASSERT_EQ(Rows(*buffers[l], want.size()), want)
          << "round " << round << " layer " << l;
    }
  }
}

// A note of rows the caller holds (NoteHeldAsync): the node counts them
// as fetched, nothing is written into the buffer it went through, the
// buffer takes the next fetch, and a bad note gets a gather's error.
TEST_P(KvClientTest, ANoteOfHeldRowsCountsThemAndWritesNothing) {
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 64);
  const SequenceId id = OpenFilled(g, 5, 20);
  std::unique_ptr<FetchBuffer> buffer = Buffer(2 * 2 * 8 * 8);
  std::fill(buffer->data(), buffer->data() + buffer->size(), uint16_t{0xabcd});
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{3, 11, 3}, {19}});
  ASSERT_OK(client_->NoteHeldAsync(id, 1, plan.view(), buffer.get()).Wait());
  EXPECT_TRUE(std::all_of(buffer->data(), buffer->data() + buffer->size(),
                          [](uint16_t v) { return v == 0xabcd; }));
  auto head0 = client_->GetTokenStats(id, 1, 0);
  ASSERT_TRUE(head0.ok()) << head0.status();
  for (const TokenFetchStats& t : *head0) {
    EXPECT_EQ(t.fetch_count, t.position == 3 ? 2 : t.position == 11 ? 1 : 0)
        << t.position;
  }
  auto head1 = client_->GetTokenStats(id, 1, 1);
  ASSERT_TRUE(head1.ok()) << head1.status();
  for (const TokenFetchStats& t : *head1) {
    EXPECT_EQ(t.fetch_count, t.position == 19 ? 1 : 0) << t.position;
  }
  EXPECT_CODE(client_
                  ->NoteHeldAsync(id, 1,
                                     OwnedFetchPlan::PerHead({{20}, {}}).view(),
                                     buffer.get())
                  .Wait(),
              kOutOfRange);
  ASSERT_OK(client_->FetchAsync(id, 1, plan.view(), buffer.get()).Wait());
  const std::vector<uint16_t> want = ExpectedRows(5, g, 1, plan.view());
  EXPECT_EQ(Rows(*buffer, want.size()), want);
}

// Fetches of whole layers (queued to the in-process client's fetch
// thread, and split across the node's gather threads) in flight together
// with a scattered one: each lands bit for bit; an error found by a queued
// gather reaches Wait; a busy buffer is refused.
TEST_P(KvClientTest, LargeFetchesInFlightTogetherAreBitExact) {
  const SequenceGeometry g = MakeGeometry(2, 3, 64, 4096);
  const SequenceId id = OpenFilled(g, 23, 4096);
  std::vector<int32_t> all(4096);
  for (int p = 0; p < 4096; ++p) all[p] = p;
  const OwnedFetchPlan whole = OwnedFetchPlan::SameForAllHeads(3, all);
  std::mt19937 rng(8);
  std::vector<std::vector<int32_t>> per_head(3);
  for (auto& p : per_head) {
    for (int i = 0; i < 700; ++i) p.push_back(rng() % 4096);
  }
  const OwnedFetchPlan scattered = OwnedFetchPlan::PerHead(per_head);
  auto a = Buffer(FetchElements(whole.view(), 64));
  auto b = Buffer(FetchElements(whole.view(), 64));
  for (int round = 0; round < 3; ++round) {
    FetchHandle first = client_->FetchAsync(id, 0, whole.view(), a.get());
    FetchHandle second = client_->FetchAsync(id, 1, scattered.view(), b.get());
    EXPECT_CODE(client_->FetchAsync(id, 1, whole.view(), a.get()).Wait(),
                kFailedPrecondition);
    ASSERT_OK(second.Wait());
    ASSERT_OK(first.Wait());
    std::vector<uint16_t> want = ExpectedRows(23, g, 0, whole.view());
    ASSERT_EQ(Rows(*a, want.size()), want) << round;
    want = ExpectedRows(23, g, 1, scattered.view());
    ASSERT_EQ(Rows(*b, want.size()), want) << round;
  }
  OwnedFetchPlan bad = scattered;
  bad.indices.back() = 5000;
  EXPECT_CODE(client_->Fetch(id, 1, bad.view(), b.get()), kOutOfRange);
  auto stats = client_->GetSequenceStats(id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->fetches, 6);
}

TEST_P(KvClientTest, ErrorsKeepTheirCodes) {
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 4);
  const SequenceId id = OpenFilled(g, 5, 6);  // positions 0, 1 evicted (FIFO)
  auto buffer = Buffer(64);
  auto fetch = [&](SequenceId seq, int layer, const OwnedFetchPlan& plan) {
    return client_->Fetch(seq, layer, plan.view(), buffer.get());
  };
  EXPECT_CODE(fetch(id + 1, 0, OwnedFetchPlan::SameForAllHeads(2, {2})),
              kNotFound);
  EXPECT_CODE(fetch(id, 2, OwnedFetchPlan::SameForAllHeads(2, {2})),
              kInvalidArgument);
  EXPECT_CODE(fetch(id, 0, OwnedFetchPlan::SameForAllHeads(3, {2})),
              kInvalidArgument);
  EXPECT_CODE(fetch(id, 0, OwnedFetchPlan::SameForAllHeads(2, {6})),
              kOutOfRange);
  EXPECT_CODE(fetch(id, 0, OwnedFetchPlan::SameForAllHeads(2, {-3})),
              kInvalidArgument);
  EXPECT_CODE(fetch(id, 0, OwnedFetchPlan::SameForAllHeads(2, {1})),
              kFailedPrecondition);
  // 2 heads x 3 rows x 8 dims x K and V = 96 values > 64.
  EXPECT_CODE(fetch(id, 0, OwnedFetchPlan::SameForAllHeads(2, {2, 3, 4})),
              kInvalidArgument);
  EXPECT_CODE(client_->Open(MakeGeometry(0, 2, 8, 4)).status(),
              kInvalidArgument);
  testdata::TestBlock b = MakeTestBlock(5, g, 0, 1, 6, 1);
  b.block.v = b.block.v.subspan(1);
  EXPECT_CODE(client_->Append(id, b.block).status(), kInvalidArgument);
  EXPECT_CODE(client_->GetSequenceStats(id + 1).status(), kNotFound);
  // Still serving, nothing changed.
  const OwnedFetchPlan good = OwnedFetchPlan::PerHead({{2, 5}, {3}});
  ASSERT_OK(fetch(id, 1, good));
  const std::vector<uint16_t> want = ExpectedRows(5, g, 1, good.view());
  EXPECT_EQ(Rows(*buffer, want.size()), want);
  auto stats = client_->GetSequenceStats(id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_THAT(stats->layer_lengths, ElementsAre(6, 6));
  EXPECT_EQ(stats->fetches, 1);
  ASSERT_OK(client_->Close(id));
  EXPECT_CODE(client_->Close(id), kNotFound);
  EXPECT_CODE(fetch(id, 0, good), kNotFound);
}

TEST_P(KvClientTest, ABufferCarriesOneFetchAtATime) {
  const SequenceGeometry g = MakeGeometry(1, 1, 4, 16);
  const SequenceId id = OpenFilled(g, 1, 4);
  auto buffer = Buffer(16);
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {0, 3});
  FetchHandle first = client_->FetchAsync(id, 0, plan.view(), buffer.get());
  FetchHandle second = client_->FetchAsync(id, 0, plan.view(), buffer.get());
  EXPECT_CODE(second.Wait(), kFailedPrecondition);
  ASSERT_OK(first.Wait());
  EXPECT_OK(first.Wait());  // a second Wait repeats the status
  FetchHandle third = client_->FetchAsync(id, 0, plan.view(), buffer.get());
  FetchHandle moved = std::move(third);
  ASSERT_OK(moved.Wait());
  const std::vector<uint16_t> want = ExpectedRows(1, g, 0, plan.view());
  EXPECT_EQ(Rows(*buffer, want.size()), want);
  // A handle dropped without Wait waits by itself; the buffer is free after.
  { FetchHandle dropped = client_->FetchAsync(id, 0, plan.view(), buffer.get()); }
  ASSERT_OK(client_->Fetch(id, 0, plan.view(), buffer.get()));
}

TEST_P(KvClientTest, RejectsAnotherClientsBuffer) {
  const SequenceGeometry g = MakeGeometry(1, 1, 4, 16);
  const SequenceId id = OpenFilled(g, 1, 4);
  std::unique_ptr<KvClient> other = Connect();
  auto foreign = other->NewFetchBuffer(16);
  ASSERT_TRUE(foreign.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {0});
  EXPECT_CODE(client_->Fetch(id, 0, plan.view(), foreign->get()),
              kInvalidArgument);
  EXPECT_CODE(client_->Fetch(id, 0, plan.view(), nullptr), kInvalidArgument);
  EXPECT_CODE(client_->NewFetchBuffer(0).status(), kInvalidArgument);
  // In-process, every client shares one store with no sessions; through a
  // server the sequence belongs to this client's session, and another
  // client holding its id reads nothing.
  if (GetParam() == "inproc") {
    ASSERT_OK(other->Fetch(id, 0, plan.view(), foreign->get()));
  } else {
    EXPECT_CODE(other->Fetch(id, 0, plan.view(), foreign->get()), kNotFound);
  }
}

TEST_P(KvClientTest, ReportsEvictions) {
  const SequenceGeometry g = MakeGeometry(2, 2, 4, 3);
  const SequenceId id = OpenFilled(g, 9, 3);
  testdata::TestBlock b = MakeTestBlock(9, g, 0, 2, 3, 2);
  auto r = client_->Append(id, b.block);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->evicted,
              ElementsAre(EvictedToken{0, 0, 0}, EvictedToken{0, 1, 0},
                          EvictedToken{0, 0, 1}, EvictedToken{0, 1, 1},
                          EvictedToken{1, 0, 0}, EvictedToken{1, 1, 0},
                          EvictedToken{1, 0, 1}, EvictedToken{1, 1, 1}));
  auto stats = client_->GetSequenceStats(id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->evicted_rows, 8);
  EXPECT_EQ(stats->present_rows, 2 * 2 * 3);
  EXPECT_EQ(stats->bytes_reserved, ReservedBytes(g));
  EXPECT_EQ(stats->geometry.max_tokens, 3);
  auto store = client_->GetStoreStats();
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(store->open_sequences, 1);
  EXPECT_EQ(store->eviction, EvictionPolicy::kFifo);
  EXPECT_EQ(store->evicted_rows, 8);
  EXPECT_EQ(store->max_sequences, 64);
}

// Appends cross the data plane the client fetches over: the fetch socket
// (tcp), the shm slot (shm), gRPC for the gRPC stream and unix sockets.
TEST_P(KvClientTest, AppendsCrossTheirDataPlane) {
  OpenFilled(MakeGeometry(2, 2, 4, 8), 9, 5);
  if (GetParam() == "inproc") return;  // no server: nothing crosses
  const std::string text = MetricsText({server_->request_metrics()});
  const std::string plane = GetParam() == "tcp"   ? "tcp"
                            : GetParam() == "shm" ? "shm"
                                                  : "grpc";
  for (const char* p : {"grpc", "tcp", "shm"}) {
    const std::string key = absl::StrCat(
        "infinigen_kv_request_seconds_count{op=\"append\",plane=\"", p,
        "\"} ");
    const size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << text;
    EXPECT_EQ(std::stoll(text.substr(at + key.size())), p == plane ? 1 : 0)
        << p;
  }
}

// A second client's sequence with the same prefix keys attaches the first
// one's blocks on every data plane: the cached length comes back through
// the control plane and the shared rows through the fetch path.
TEST_P(KvClientTest, ASecondClientReusesAPrefixAnotherPublished) {
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 64);
  std::vector<int32_t> tokens(20);
  for (int i = 0; i < 20; ++i) tokens[i] = 3 * i + 1;
  PrefixRequest prefix;
  prefix.block_tokens = 8;
  prefix.keys = PrefixKeys("test-model", 8, tokens);  // 2 blocks
  auto first = client_->OpenSequence(g, prefix);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->cached_tokens, 0);
  testdata::TestBlock rows = MakeTestBlock(7, g, 0, g.n_layers, 0, 20);
  const std::vector<std::string> meta = {"block zero", "block one"};
  rows.block.prefix_meta = meta;
  ASSERT_TRUE(client_->Append(first->id, rows.block).ok());
  ASSERT_TRUE(client_->Close(first->id).ok());

  std::unique_ptr<KvClient> other = Connect();
  ASSERT_NE(other, nullptr);
  auto second = other->OpenSequence(g, prefix);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->cached_tokens, 16);
  EXPECT_EQ(second->prefix_meta, meta);
  const OwnedFetchPlan plan =
      OwnedFetchPlan::SameForAllHeads(2, {0, 7, 8, 15});
  auto buffer = other->NewFetchBuffer(FetchElements(plan.view(), 8));
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE(other->Fetch(second->id, 1, plan.view(), buffer->get()).ok());
  EXPECT_EQ(Rows(**buffer, FetchElements(plan.view(), 8)),
            ExpectedRows(7, g, 1, plan.view()));
  auto stats = other->GetStoreStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->prefix_blocks, 2);
  EXPECT_EQ(stats->prefix_hit_tokens, 16);
  // Other tokens: a miss.
  tokens[0] += 1;
  prefix.keys = PrefixKeys("test-model", 8, tokens);
  auto third = other->OpenSequence(g, prefix);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->cached_tokens, 0);
  buffer->reset();
}

TEST_P(KvClientTest, ThreadsShareAClient) {
  const SequenceGeometry g = MakeGeometry(3, 3, 32, 256);
  constexpr int kThreads = 4;
  std::vector<SequenceId> ids;
  for (int t = 0; t < kThreads; ++t) ids.push_back(OpenFilled(g, 100 + t, 200));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      auto buffer = client_->NewFetchBuffer(2 * 3 * 32 * 40);
      if (!buffer.ok()) {
        ++failures;
        return;
      }
      for (int i = 0; i < 100; ++i) {
        std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
        for (auto& p : per_head) {
          for (int j = 0, k = rng() % 40; j < k; ++j) p.push_back(rng() % 200);
        }
        const OwnedFetchPlan plan = OwnedFetchPlan::PerHead(per_head);
        const int layer = rng() % g.n_layers;
        const std::vector<uint16_t> want =
            ExpectedRows(100 + t, g, layer, plan.view());
        if (!client_->Fetch(ids[t], layer, plan.view(), buffer->get()).ok() ||
            Rows(**buffer, want.size()) != want) {
          ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(DataPlanes, KvClientTest,
                         ::testing::Values("inproc", "tcp", "tcp_stream", "unix",
                                           "shm"),
                         [](const auto& info) { return info.param; });

// Leases on the remote data planes, against a KvServer with a short lease.
class KvClientLeaseTest : public ::testing::TestWithParam<std::string> {
 protected:
  static constexpr absl::Duration kLease = absl::Milliseconds(900);

  void SetUp() override { StartServer(); }

  void StartServer() {
    KvServerOptions options;
    options.store.lease_timeout = kLease;
    options.store.clock = [this] { return Now(); };
    if (listen_.empty()) {
      listen_ = GetParam() == "tcp" ? "127.0.0.1:0"
                                    : "unix:" + SocketPath("kv_lease_test");
      if (GetParam() == "shm") {
        shm_listen_ = "unix:" + SocketPath("kv_lease_test_shm");
      }
    }
    options.listen = listen_;
    options.shm_listen = shm_listen_;
    auto server = KvServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    // A restart listens where the first server did.
    if (absl::EndsWith(listen_, ":0")) {
      listen_ = absl::StrCat("127.0.0.1:", server_->port());
    }
    address_ = GetParam() == "shm" ? server_->shm_client_address()
                                   : server_->client_address();
  }

  std::unique_ptr<KvClient> Connect() {
    KvClientOptions options;
    options.heartbeat_interval = absl::Milliseconds(100);
    options.connect_timeout = absl::Seconds(2);
    auto client = ConnectKvClient(address_, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // The store's clock: real time plus what the test skipped.
  absl::Time Now() {
    absl::MutexLock lock(&clock_mu_);
    return absl::Now() + skipped_;
  }
  void Skip(absl::Duration d) {
    absl::MutexLock lock(&clock_mu_);
    skipped_ += d;
  }

  // Waits up to `limit` for `done`; returns how long it took, or limit.
  template <typename F>
  absl::Duration Within(absl::Duration limit, F done) {
    const absl::Time start = absl::Now();
    while (!done() && absl::Now() - start < limit) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return absl::Now() - start;
  }

  std::string listen_, shm_listen_, address_;
  std::unique_ptr<KvServer> server_;
  absl::Mutex clock_mu_;
  absl::Duration skipped_ ABSL_GUARDED_BY(clock_mu_);
};

TEST_P(KvClientLeaseTest, AnIdleClientKeepsItsSequences) {
  std::unique_ptr<KvClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 16);
  std::vector<SequenceId> ids;
  for (int i = 0; i < 3; ++i) {
    auto id = client->Open(g);
    ASSERT_TRUE(id.ok()) << id.status();
    testdata::TestBlock b = MakeTestBlock(i, g, 0, 2, 0, 4);
    ASSERT_TRUE(client->Append(*id, b.block).ok());
    ids.push_back(*id);
  }
  absl::SleepFor(4 * kLease);  // idle: only heartbeats
  EXPECT_OK(client->Health());
  const StoreStats stats = server_->store().GetStoreStats();
  EXPECT_EQ(stats.open_sequences, 3);
  EXPECT_EQ(stats.expired_sessions, 0);
  auto buffer = client->NewFetchBuffer(2 * 2 * 8 * 4);
  ASSERT_TRUE(buffer.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {0, 3});
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(client->Fetch(ids[i], 1, plan.view(), buffer->get()));
    const std::vector<uint16_t> want = ExpectedRows(i, g, 1, plan.view());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), (*buffer)->data()));
  }
}

TEST_P(KvClientLeaseTest, ASilentClientsSequencesAreFreedWithinTheLease) {
  std::unique_ptr<KvClient> live = Connect();
  ASSERT_NE(live, nullptr);
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 8);
  auto kept = live->Open(g);
  ASSERT_TRUE(kept.ok()) << kept.status();
  // A client that opens a session and two sequences, then never renews,
  // as a killed worker: the raw RPCs, without the client library.
  std::unique_ptr<kv::KvMemory::Stub> raw =
      kv::KvMemory::NewStub(server_->InProcessChannel());
  kv::OpenSessionResponse session;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(raw->OpenSession(&ctx, {}, &session).ok());
    EXPECT_EQ(session.lease_timeout_ms(), absl::ToInt64Milliseconds(kLease));
  }
  for (int i = 0; i < 2; ++i) {
    kv::OpenSequenceRequest req;
    ToProto(g, req.mutable_geometry());
    req.set_session_id(session.session_id());
    kv::OpenSequenceResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(raw->OpenSequence(&ctx, req, &resp).ok());
  }
  ASSERT_EQ(server_->store().GetStoreStats().open_sequences, 3);
  const absl::Duration took = Within(kLease + absl::Seconds(5), [&] {
    return server_->store().GetStoreStats().open_sequences == 1;
  });
  EXPECT_LT(took, kLease + absl::Seconds(1));
  const StoreStats stats = server_->store().GetStoreStats();
  EXPECT_EQ(stats.open_sequences, 1);
  EXPECT_EQ(stats.expired_sessions, 1);
  EXPECT_EQ(stats.expired_sequences, 2);
  EXPECT_EQ(stats.bytes_reserved, ReservedBytes(g));
  EXPECT_TRUE(live->GetSequenceStats(*kept).ok());
  // Renewing too late: the session is gone.
  kv::HeartbeatRequest beat;
  beat.set_session_id(session.session_id());
  kv::HeartbeatResponse beat_resp;
  grpc::ClientContext ctx;
  EXPECT_EQ(raw->Heartbeat(&ctx, beat, &beat_resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_P(KvClientLeaseTest, DestroyingAClientEndsItsSessionAtOnce) {
  std::unique_ptr<KvClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 8);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(client->Open(g).ok());
  ASSERT_EQ(server_->store().GetStoreStats().open_sessions, 1);
  ASSERT_EQ(server_->store().GetStoreStats().open_sequences, 2);
  client.reset();  // without closing its sequences
  const StoreStats stats = server_->store().GetStoreStats();
  EXPECT_EQ(stats.open_sessions, 0);
  EXPECT_EQ(stats.open_sequences, 0);
  EXPECT_EQ(stats.bytes_reserved, 0);
  EXPECT_EQ(stats.expired_sessions, 0);  // ended, not expired
}

TEST_P(KvClientLeaseTest, AClientCutOffPastItsLeaseGetsNotFoundThenRecovers) {
  std::unique_ptr<KvClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 8);
  auto old = client->Open(g);
  ASSERT_TRUE(old.ok()) << old.status();
  // As if the client had been cut off for two leases.
  Skip(2 * kLease);
  Within(absl::Seconds(5), [&] {
    return server_->store().GetStoreStats().expired_sessions == 1;
  });
  ASSERT_EQ(server_->store().GetStoreStats().expired_sessions, 1);
  EXPECT_CODE(client->GetSequenceStats(*old).status(), kNotFound);
  testdata::TestBlock b = MakeTestBlock(1, g, 0, 1, 0, 2);
  EXPECT_CODE(client->Append(*old, b.block).status(), kNotFound);
  // New sequences go into a new session, which stays alive.
  auto fresh = client->Open(g);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  absl::SleepFor(2 * kLease);
  EXPECT_TRUE(client->Append(*fresh, b.block).ok());
  EXPECT_OK(client->Health());
  EXPECT_EQ(server_->store().GetStoreStats().expired_sessions, 1);
}

TEST_P(KvClientLeaseTest, HealthFollowsTheServer) {
  std::unique_ptr<KvClient> client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_OK(client->Health());
  server_.reset();  // stops it
  const absl::Duration down =
      Within(absl::Seconds(10), [&] { return !client->Health().ok(); });
  EXPECT_LT(down, absl::Seconds(3));
  EXPECT_FALSE(client->Health().ok());
  EXPECT_THAT(std::string(client->Health().message()),
              ::testing::HasSubstr("heartbeat"));

  StartServer();  // the same address, an empty store
  const absl::Duration up =
      Within(absl::Seconds(10), [&] { return client->Health().ok(); });
  EXPECT_LT(up, absl::Seconds(5));
  EXPECT_OK(client->Health());
  // The new server gave the client a new session.
  EXPECT_EQ(server_->store().GetStoreStats().open_sessions, 1);
  EXPECT_TRUE(client->Open(MakeGeometry(1, 1, 8, 8)).ok());
}

INSTANTIATE_TEST_SUITE_P(RemotePlanes, KvClientLeaseTest,
                         ::testing::Values("tcp", "unix", "shm"),
                         [](const auto& info) { return info.param; });

TEST(KvClientHealthTest, InProcessIsAlwaysHealthy) {
  auto client = ConnectKvClient("inproc:");
  ASSERT_TRUE(client.ok());
  EXPECT_OK((*client)->Health());
  FaultInjectionKvClient wrapped(*std::move(client));
  EXPECT_OK(wrapped.Health());
}

TEST(ConnectKvClientTest, RejectsUnknownAndUnbuiltAddresses) {
  EXPECT_CODE(ConnectKvClient("ftp://x").status(), kInvalidArgument);
  EXPECT_CODE(ConnectKvClient("").status(), kInvalidArgument);
  EXPECT_CODE(ConnectKvClient("tcp://").status(), kInvalidArgument);
  // Without an RDMA device (these machines): "no RDMA device: ...".
  EXPECT_CODE(ConnectKvClient("rdma://127.0.0.1:1").status(), kUnavailable);
}

TEST(ConnectKvClientTest, NoServerIsUnavailable) {
  KvClientOptions options;
  options.connect_timeout = absl::Milliseconds(300);
  EXPECT_CODE(ConnectKvClient("unix:/nonexistent/kv.sock", options).status(),
              kUnavailable);
}

// A refused connection fails at once with its reason, not after
// connect_timeout (which only an attempt that hangs waits out).
TEST(ConnectKvClientTest, ARefusedConnectionFailsAtOnce) {
  for (const std::string address : {"tcp://127.0.0.1:1", "unix:/nonexistent/kv.sock"}) {
    KvClientOptions options;
    options.connect_timeout = absl::Seconds(20);
    const absl::Time start = absl::Now();
    const absl::Status status = ConnectKvClient(address, options).status();
    const absl::Duration took = absl::Now() - start;
    EXPECT_CODE(status, kUnavailable);
    EXPECT_THAT(std::string(status.message()),
                ::testing::HasSubstr("cannot connect to the KV memory server at " +
                                     address))
        << address;
    EXPECT_THAT(std::string(status.message()),
                ::testing::Not(::testing::HasSubstr("within")))
        << status;
    EXPECT_LT(took, absl::Seconds(10)) << address << ": " << status;
  }
}

TEST(FaultInjectionKvClientTest, FailsTheChosenCalls) {
  auto inner = ConnectKvClient("inproc:");
  ASSERT_TRUE(inner.ok());
  FaultInjectionKvClient client(*std::move(inner));
  const SequenceGeometry g = MakeGeometry(1, 1, 4, 8);
  auto id = client.Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock b = MakeTestBlock(1, g, 0, 1, 0, 2);
  client.FailAppends(absl::UnavailableError("injected"));
  EXPECT_CODE(client.Append(*id, b.block).status(), kUnavailable);
  client.ClearFaults();
  ASSERT_TRUE(client.Append(*id, b.block).ok());
  auto buffer = client.NewFetchBuffer(8);
  ASSERT_TRUE(buffer.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {1});
  client.FailFetches(absl::DeadlineExceededError("injected"), /*skip=*/1);
  ASSERT_OK(client.Fetch(*id, 0, plan.view(), buffer->get()));
  EXPECT_CODE(client.Fetch(*id, 0, plan.view(), buffer->get()),
              kDeadlineExceeded);
  EXPECT_CODE(client.Fetch(*id, 0, plan.view(), buffer->get()),
              kDeadlineExceeded);
  EXPECT_EQ(client.fetches(), 3);
  EXPECT_EQ(client.appends(), 2);
  EXPECT_EQ(client.data_plane(), "inproc");
}

}  // namespace
}  // namespace infinigen::kv_memory_service
