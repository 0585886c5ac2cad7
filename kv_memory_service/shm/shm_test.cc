// The shared-memory data plane against a ShmServer in this process, with
// in-process control calls (the gRPC control path and the real server
// process are covered by kv_client_test and tests/kv_memory_service/), and
// against fake servers that hang, to check the timeout paths.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/address.h"
#include "gtest/gtest.h"
#include "kv_memory_service/inproc/inproc_client.h"
#include "kv_memory_service/shm/shm_client.h"
#include "kv_memory_service/shm/shm_append.h"
#include "kv_memory_service/shm/shm_protocol.h"
#include "kv_memory_service/shm/shm_server.h"
#include "kv_memory_service/testing/kv_test_data.h"

namespace infinigen::kv_memory_service {
namespace {

using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

#define EXPECT_CODE(expr, code_name) \
  EXPECT_EQ((expr).code(), absl::StatusCode::code_name) << (expr)
#define ASSERT_OK(expr)             \
  do {                              \
    const absl::Status s_ = (expr); \
    ASSERT_TRUE(s_.ok()) << s_;     \
  } while (0)

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

// Control calls go straight to `store`, whatever the server announces.
ControlConnector InprocControl(std::shared_ptr<KvStore> store) {
  return [store](const std::string&, const KvClientOptions&)
             -> absl::StatusOr<std::unique_ptr<KvClient>> {
    return NewInprocKvClient(store);
  };
}

class ShmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvStoreOptions store_options;
    store_options.eviction = EvictionPolicy::kFifo;
    store_ = std::make_shared<KvStore>(store_options);
    StartServer("");
  }

  void StartServer(const std::string& token, std::string path = "") {
    server_.reset();
    ShmServerOptions options;
    options.listen_address =
        "unix:" + (path.empty() ? SocketPath("shm_test") : path);
    options.control_address = "inproc:";
    options.credentials = Credentials::Single(token);
    auto server = ShmServer::Start(store_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  std::unique_ptr<KvClient> Connect(KvClientOptions options = {}) {
    auto client = ConnectShmKvClient(server_->client_address(), options,
                                     InprocControl(store_));
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  SequenceId OpenFilled(KvClient& client, const SequenceGeometry& g,
                        uint32_t salt, int length) {
    auto id = client.Open(g);
    EXPECT_TRUE(id.ok()) << id.status();
    testdata::TestBlock b = MakeTestBlock(salt, g, 0, g.n_layers, 0, length);
    EXPECT_TRUE(client.Append(*id, b.block).ok());
    return id.value_or(0);
  }

  static std::vector<uint16_t> Rows(const FetchBuffer& b, size_t n) {
    return std::vector<uint16_t>(b.data(), b.data() + n);
  }

  std::shared_ptr<KvStore> store_;
  std::unique_ptr<ShmServer> server_;
};

// One-sided reads over shm: the client maps the node's rows read-only
// (MapRows) and reads a plan's rows where the node keeps them, the same
// values a gather gives; rows appended later show through the mapping; a
// note through a buffer's slot counts the fetch on the node, checked as a
// gather is. A node whose rows are private answers FailedPrecondition.
TEST_F(ShmTest, OneSidedReadsMapTheNodesRowsReadOnly) {
  KvStoreOptions store_options;
  store_options.max_shared_sequences = 8;
  store_ = std::make_shared<KvStore>(store_options);
  StartServer("");
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  const SequenceGeometry g = MakeGeometry(2, 3, 64, 512);
  const SequenceId id = OpenFilled(*client, g, 21, 300);
  auto rows = client->GetDirectRows(id);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->max_tokens, 512);
  EXPECT_EQ(rows->layer_values, size_t{3} * 512 * 64);
  // The mapping cannot be made writable.
  EXPECT_NE(mprotect(const_cast<uint16_t*>(rows->k), 4096,
                     PROT_READ | PROT_WRITE),
            0);
  testdata::TestBlock more = MakeTestBlock(21, g, 0, g.n_layers, 300, 20);
  ASSERT_OK(client->Append(id, more.block).status());
  auto buffer = client->NewFetchBuffer(2 * 3 * 64 * 512);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::mt19937 rng(3);
  for (int l = 0; l < g.n_layers; ++l) {
    std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
    for (auto& p : per_head) {
      for (int i = 0; i < 50; ++i) p.push_back(rng() % 320);
    }
    const OwnedFetchPlan plan = OwnedFetchPlan::PerHead(per_head);
    const std::vector<uint16_t> want = ExpectedRows(21, g, l, plan.view());
    // K rows of every head in plan order, then V rows (FetchPlan).
    std::vector<uint16_t> read;
    for (const uint16_t* base : {rows->k, rows->v}) {
      for (int h = 0; h < g.n_kv_heads; ++h) {
        for (int32_t pos : per_head[h]) {
          const uint16_t* row = base + l * rows->layer_values +
                                (static_cast<size_t>(h) * 512 + pos) * 64;
          read.insert(read.end(), row, row + 64);
        }
      }
    }
    ASSERT_EQ(read, want) << l;
    ASSERT_OK(client->NoteFetched(id, l, plan.view(), buffer->get()));
  }
  // A whole layer read: its head offsets alone.
  ASSERT_OK(client->NoteLeadingFetchedAsync(id, 1, {0, 320, 640, 960},
                                            buffer->get())
                .Wait());
  auto stats = client->GetSequenceStats(id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->fetches, 3);
  EXPECT_EQ(stats->fetched_rows, 2 * 3 * 50 + 960);
  auto tokens = store_->GetTokenStats(id, 1, 2);
  ASSERT_TRUE(tokens.ok());
  ASSERT_EQ(tokens->size(), 320u);
  EXPECT_EQ((*tokens)[319].last_fetch, 3u);
  // A position never appended: refused as a gather would be.
  const OwnedFetchPlan past = OwnedFetchPlan::SameForAllHeads(3, {400});
  EXPECT_CODE(client->NoteFetched(id, 0, past.view(), buffer->get()),
              kOutOfRange);
  EXPECT_CODE(client->NoteLeadingFetchedAsync(id, 0, {0, 320, 640, 961},
                                              buffer->get())
                  .Wait(),
              kOutOfRange);
  ASSERT_OK(client->Close(id));
  // Private rows: the node gathers.
  store_ = std::make_shared<KvStore>(KvStoreOptions{});
  StartServer("");
  auto plain = Connect();
  ASSERT_NE(plain, nullptr);
  const SequenceId other = OpenFilled(*plain, g, 22, 10);
  EXPECT_CODE(plain->GetDirectRows(other).status(), kFailedPrecondition);
}

TEST_F(ShmTest, FetchesAreBitExact) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->data_plane(), "shm");
  const SequenceGeometry g = MakeGeometry(3, 3, 64, 1024);
  const SequenceId id = OpenFilled(*client, g, 11, 1000);
  std::vector<std::unique_ptr<FetchBuffer>> buffers;
  for (int l = 0; l < g.n_layers; ++l) {
    auto b = client->NewFetchBuffer(2 * 3 * 64 * 1024);
    ASSERT_TRUE(b.ok()) << b.status();
    buffers.push_back(*std::move(b));
  }
  std::mt19937 rng(1);
  for (int round = 0; round < 30; ++round) {
    std::vector<OwnedFetchPlan> plans;
    std::vector<FetchHandle> handles;
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
      const int k = round == 0 ? 1024 : rng() % 300;  // once: a whole layer
      for (auto& p : per_head) {
        for (int i = 0; i < k; ++i) p.push_back(round == 0 ? i % 1000 : rng() % 1000);
      }
      plans.push_back(OwnedFetchPlan::PerHead(per_head));
      handles.push_back(client->FetchAsync(id, l, plans[l].view(), buffers[l].get()));
    }
    for (int l = 0; l < g.n_layers; ++l) {
      ASSERT_OK(handles[l].Wait());
      const std::vector<uint16_t> want = ExpectedRows(11, g, l, plans[l].view());
      ASSERT_EQ(Rows(*buffers[l], want.size()), want) << round << " " << l;
    }
  }
  auto stats = client->GetSequenceStats(id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->fetches, 30 * 3);
}

// Every bad request gets the code the in-process plane gives.
TEST_F(ShmTest, ErrorsMatchTheInprocPlane) {
  auto shm = Connect();
  ASSERT_NE(shm, nullptr);
  std::unique_ptr<KvClient> inproc = NewInprocKvClient(store_);
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 4);
  const SequenceId id = OpenFilled(*shm, g, 5, 6);  // 0, 1 evicted (FIFO)
  auto shm_buffer = shm->NewFetchBuffer(64);
  auto inproc_buffer = inproc->NewFetchBuffer(64);
  ASSERT_TRUE(shm_buffer.ok() && inproc_buffer.ok());
  struct Case {
    SequenceId seq;
    int layer;
    OwnedFetchPlan plan;
    absl::StatusCode want;
  };
  std::vector<Case> cases;
  cases.push_back({id + 1, 0, OwnedFetchPlan::SameForAllHeads(2, {2}),
                   absl::StatusCode::kNotFound});
  cases.push_back({id, 2, OwnedFetchPlan::SameForAllHeads(2, {2}),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({id, -1, OwnedFetchPlan::SameForAllHeads(2, {2}),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({id, 0, OwnedFetchPlan::SameForAllHeads(3, {2}),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({id, 0, OwnedFetchPlan{{2}, {0, 2, 1}},
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({id, 0, OwnedFetchPlan{{2}, {}},
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({id, 0, OwnedFetchPlan::SameForAllHeads(2, {6}),
                   absl::StatusCode::kOutOfRange});
  cases.push_back({id, 0, OwnedFetchPlan::SameForAllHeads(2, {-3}),
                   absl::StatusCode::kInvalidArgument});
  cases.push_back({id, 0, OwnedFetchPlan::SameForAllHeads(2, {1}),
                   absl::StatusCode::kFailedPrecondition});
  cases.push_back({id, 0, OwnedFetchPlan::SameForAllHeads(2, {2, 3, 4}),
                   absl::StatusCode::kInvalidArgument});  // 96 > 64 values
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const absl::Status got =
        shm->Fetch(c.seq, c.layer, c.plan.view(), shm_buffer->get());
    const absl::Status ref =
        inproc->Fetch(c.seq, c.layer, c.plan.view(), inproc_buffer->get());
    EXPECT_EQ(got.code(), c.want) << "case " << i << ": " << got;
    EXPECT_EQ(got.code(), ref.code()) << "case " << i;
    EXPECT_EQ(got.message(), ref.message()) << "case " << i;
  }
  // A plan far larger than the buffer could ever hold.
  std::vector<int32_t> many(10000, 2);
  const OwnedFetchPlan huge{many, {0, 5000, 10000}};
  EXPECT_CODE(shm->Fetch(id, 0, huge.view(), shm_buffer->get()),
              kInvalidArgument);
  EXPECT_CODE(shm->Fetch(id, 0, huge.view(), nullptr), kInvalidArgument);
  EXPECT_CODE(shm->NewFetchBuffer(0).status(), kInvalidArgument);
  EXPECT_CODE(shm->NewFetchBuffer(size_t{1} << 40).status(), kResourceExhausted);
  auto other = Connect();
  EXPECT_CODE(other->Fetch(id, 0, huge.view(), shm_buffer->get()),
              kInvalidArgument);
  // Still serving, and nothing changed.
  const OwnedFetchPlan good = OwnedFetchPlan::PerHead({{2, 5}, {3}});
  ASSERT_OK(shm->Fetch(id, 1, good.view(), shm_buffer->get()));
  EXPECT_EQ(Rows(**shm_buffer, 2 * 3 * 8), ExpectedRows(5, g, 1, good.view()));
  auto stats = shm->GetSequenceStats(id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->fetches, 1);
}

// Counts the appends that reach the control client.
class AppendCounter : public KvClientWrapper {
 public:
  AppendCounter(std::unique_ptr<KvClient> target, std::atomic<int>* appends)
      : KvClientWrapper(std::move(target)), appends_(appends) {}
  absl::StatusOr<AppendResult> Append(SequenceId seq,
                                      const AppendBlock& block) override {
    ++*appends_;
    return KvClientWrapper::Append(seq, block);
  }

 private:
  std::atomic<int>* const appends_;
};

// Appends cross the data plane, not the control client: the rows land bit
// for bit, the node's evictions come back as the in-process plane reports
// them, bad blocks get the in-process plane's codes, and a block with
// prefix annotations (which the slot does not carry) goes through the
// control client.
TEST_F(ShmTest, AppendsCrossTheSlotAndReturnTheEvictions) {
  std::atomic<int> control_appends{0};
  auto store = store_;
  auto client = ConnectShmKvClient(
      server_->client_address(), {},
      [store, &control_appends](const std::string&, const KvClientOptions&)
          -> absl::StatusOr<std::unique_ptr<KvClient>> {
        return std::unique_ptr<KvClient>(
            new AppendCounter(NewInprocKvClient(store), &control_appends));
      });
  ASSERT_TRUE(client.ok()) << client.status();
  KvStoreOptions ref_options;
  ref_options.eviction = EvictionPolicy::kFifo;
  auto ref_store = std::make_shared<KvStore>(ref_options);
  std::unique_ptr<KvClient> ref = NewInprocKvClient(ref_store);
  const SequenceGeometry g = MakeGeometry(3, 2, 16, 24);  // evicts past 24
  auto id = (*client)->Open(g);
  auto ref_id = ref->Open(g);
  ASSERT_TRUE(id.ok() && ref_id.ok());
  // A prefill's chunks of every layer, then decode steps of one token.
  int position = 0;
  for (const int tokens : {10, 12, 1, 1, 7, 1}) {
    SCOPED_TRACE(tokens);
    testdata::TestBlock b = MakeTestBlock(8, g, 0, g.n_layers, position, tokens);
    auto got = (*client)->Append(*id, b.block);
    auto want = ref->Append(*ref_id, b.block);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->evicted, want->evicted);
    position += tokens;
  }
  EXPECT_EQ(control_appends.load(), 0);
  auto stats = (*client)->GetSequenceStats(*id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->evicted_rows, g.n_layers * g.n_kv_heads * (position - 24));
  // What is present comes back bit for bit.
  std::vector<int32_t> present;
  for (int p = position - 24; p < position; ++p) present.push_back(p);
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, present);
  auto buffer = (*client)->NewFetchBuffer(FetchElements(plan.view(), 16));
  ASSERT_TRUE(buffer.ok());
  for (int l = 0; l < g.n_layers; ++l) {
    ASSERT_OK((*client)->Fetch(*id, l, plan.view(), buffer->get()));
    EXPECT_EQ(Rows(**buffer, FetchElements(plan.view(), 16)),
              ExpectedRows(8, g, l, plan.view()));
  }

  // Bad blocks: the in-process plane's codes, nothing appended.
  testdata::TestBlock one = MakeTestBlock(8, g, 0, 1, position, 1);
  AppendBlock past = one.block;
  past.first_layer = 3;  // past the last layer
  AppendBlock short_k = one.block;
  short_k.k = short_k.k.subspan(1);
  AppendBlock short_both = short_k;
  short_both.v = short_both.v.subspan(1);
  for (const auto& [seq, block, code] :
       std::vector<std::tuple<SequenceId, AppendBlock, absl::StatusCode>>{
           {*id + 1, one.block, absl::StatusCode::kNotFound},
           {*id, past, absl::StatusCode::kInvalidArgument},
           {*id, short_k, absl::StatusCode::kInvalidArgument},
           {*id, short_both, absl::StatusCode::kInvalidArgument}}) {
    const absl::Status got = (*client)->Append(seq, block).status();
    EXPECT_EQ(got.code(), code) << got;
    EXPECT_EQ(got.code(),
              ref->Append(seq == *id ? *ref_id : seq, block).status().code());
  }
  stats = (*client)->GetSequenceStats(*id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->layer_lengths, std::vector<int32_t>(3, position));

  // Prefix annotations cross the slot with the rows (that the node keeps
  // them: KvClientTest.ASecondClientReusesAPrefixAnotherPublished).
  const std::vector<std::string> meta = {"m"};
  AppendBlock annotated = one.block;
  annotated.prefix_meta = absl::MakeConstSpan(meta);
  EXPECT_TRUE((*client)->Append(*id, annotated).ok());
  EXPECT_EQ(control_appends.load(), 1);  // short_k alone
}

// A hostile client's append fields, served straight: shapes whose values
// overflow, disagree with the block's values, or pass the slot or its room
// for evictions are refused, and nothing is appended.
TEST_F(ShmTest, AnAppendsFieldsAreCheckedAgainstTheSlot) {
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 16);
  auto id = store_->Open(g);
  ASSERT_TRUE(id.ok());
  std::vector<uint16_t> data(2 * 2 * 4 * 16);  // 2 layers x 4 tokens, K and V
  std::vector<int32_t> plan(3 * 2 * 4 * 2);
  AppendFields a;
  a.sequence = *id;
  a.first_layer = 0;
  a.n_layers = 2;
  a.n_tokens = 4;
  a.values = 2 * 4 * 16;
  uint32_t evicted = 99;
  struct Bad {
    uint32_t n_layers, n_tokens;
    uint64_t values;
    size_t elements, plan_capacity;
  };
  for (const Bad& b : std::vector<Bad>{
           {0, 4, 0, data.size(), plan.size()},
           {2, 0, 0, data.size(), plan.size()},
           {2, 5, a.values, data.size(), plan.size()},  // disagrees
           // 2^31 x 2^31 x 16 wraps 64 bits to 0.
           {1u << 31, 1u << 31, 0, data.size(), plan.size()},
           {4, 0x80000000u, uint64_t{4} * 0x80000000u * 16, data.size(),
            plan.size()},
           {2, 4, a.values, data.size() - 1, plan.size()},  // past the slot
           {2, 4, a.values, data.size(), plan.size() - 1}}) {  // no room
    AppendFields bad = a;
    bad.n_layers = b.n_layers;
    bad.n_tokens = b.n_tokens;
    bad.values = b.values;
    EXPECT_CODE(shm::ServeAppend(*store_, bad, 0, data.data(), b.elements,
                                 plan.data(), b.plan_capacity, &evicted),
                kInvalidArgument);
    EXPECT_EQ(evicted, 0u);
  }
  // Annotations past the slot's end, or whose bytes do not decode (zeros
  // in a slot of 1 more value: a header of 0 annotations, 2 bytes left).
  for (const uint64_t meta_bytes : {uint64_t{3}, ~uint64_t{0}, uint64_t{10}}) {
    std::vector<uint16_t> roomy(data.size() + 5, 0);
    EXPECT_CODE(shm::ServeAppend(*store_, a, meta_bytes, roomy.data(),
                                 meta_bytes == 10 ? roomy.size()
                                                  : data.size() + 1,
                                 plan.data(), plan.size(), &evicted),
                kInvalidArgument)
        << meta_bytes;
    EXPECT_EQ(evicted, 0u);
  }
  EXPECT_CODE(shm::ServeAppend(*store_, {*id + 1}, 0, data.data(), data.size(),
                               plan.data(), plan.size(), &evicted),
              kNotFound);
  auto stats = store_->GetSequenceStats(*id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->layer_lengths, std::vector<int32_t>(2, 0));
  ASSERT_OK(shm::ServeAppend(*store_, a, 0, data.data(), data.size(),
                             plan.data(), plan.size(), &evicted));
  stats = store_->GetSequenceStats(*id);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->layer_lengths, std::vector<int32_t>(2, 4));
}

TEST_F(ShmTest, ABufferCarriesOneFetchAtATime) {
  auto client = Connect();
  const SequenceGeometry g = MakeGeometry(1, 1, 4, 16);
  const SequenceId id = OpenFilled(*client, g, 1, 4);
  auto buffer = client->NewFetchBuffer(16);
  ASSERT_TRUE(buffer.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {0, 3});
  FetchHandle first = client->FetchAsync(id, 0, plan.view(), buffer->get());
  FetchHandle second = client->FetchAsync(id, 0, plan.view(), buffer->get());
  EXPECT_CODE(second.Wait(), kFailedPrecondition);
  ASSERT_OK(first.Wait());
  EXPECT_EQ(Rows(**buffer, 16), ExpectedRows(1, g, 0, plan.view()));
  { FetchHandle dropped = client->FetchAsync(id, 0, plan.view(), buffer->get()); }
  ASSERT_OK(client->Fetch(id, 0, plan.view(), buffer->get()));
}

// Many clients, each with several threads and buffers, all at once; then
// buffers are freed and their slots reused.
TEST_F(ShmTest, ManyClientsAndBuffersAtOnce) {
  constexpr int kClients = 6;
  constexpr int kThreadsPerClient = 3;
  const SequenceGeometry g = MakeGeometry(4, 3, 64, 512);
  std::vector<std::unique_ptr<KvClient>> clients;
  std::vector<SequenceId> ids;
  for (int c = 0; c < kClients; ++c) {
    clients.push_back(Connect());
    ASSERT_NE(clients.back(), nullptr);
    ids.push_back(OpenFilled(*clients.back(), g, 200 + c, 500));
  }
  EXPECT_EQ(server_->active_connections(), kClients);
  std::atomic<int> failures{0};
  std::atomic<int> fetches{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    for (int t = 0; t < kThreadsPerClient; ++t) {
      threads.emplace_back([&, c, t] {
        std::mt19937 rng(c * 100 + t);
        for (int generation = 0; generation < 3; ++generation) {
          std::vector<std::unique_ptr<FetchBuffer>> buffers;
          for (int b = 0; b < 2; ++b) {
            auto buffer = clients[c]->NewFetchBuffer(2 * 3 * 64 * 128);
            if (!buffer.ok()) {
              ++failures;
              return;
            }
            buffers.push_back(*std::move(buffer));
          }
          for (int i = 0; i < 40; ++i) {
            OwnedFetchPlan plans[2];
            FetchHandle handles[2];
            int layers[2];
            for (int b = 0; b < 2; ++b) {
              std::vector<std::vector<int32_t>> per_head(3);
              for (auto& p : per_head) {
                for (int j = 0, k = rng() % 128; j < k; ++j) p.push_back(rng() % 500);
              }
              plans[b] = OwnedFetchPlan::PerHead(per_head);
              layers[b] = rng() % g.n_layers;
              handles[b] = clients[c]->FetchAsync(ids[c], layers[b],
                                                  plans[b].view(), buffers[b].get());
            }
            for (int b = 0; b < 2; ++b) {
              const auto want = ExpectedRows(200 + c, g, layers[b], plans[b].view());
              if (!handles[b].Wait().ok() || Rows(*buffers[b], want.size()) != want) {
                ++failures;
              }
              ++fetches;
            }
          }
        }
      });
    }
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(fetches.load(), kClients * kThreadsPerClient * 3 * 40 * 2);
  clients.clear();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (server_->active_connections() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_->active_connections(), 0);
}

TEST_F(ShmTest, SlotsRunOutAndComeBack) {
  auto client = Connect();
  std::vector<std::unique_ptr<FetchBuffer>> buffers;
  for (uint32_t i = 0; i < shm::kMaxSlots; ++i) {
    auto b = client->NewFetchBuffer(8);
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    buffers.push_back(*std::move(b));
  }
  EXPECT_CODE(client->NewFetchBuffer(8).status(), kResourceExhausted);
  buffers.pop_back();
  auto again = client->NewFetchBuffer(8);
  ASSERT_TRUE(again.ok()) << again.status();
}

// A client could map slots of up to 256 x 2^40
// values. Now its slots are capped per client and for all clients, and the
// server keeps serving what is already mapped.
TEST_F(ShmTest, SlotBytesAreCappedPerClientAndInTotal) {
  server_.reset();
  ShmServerOptions options;
  options.listen_address = "unix:" + SocketPath("shm_caps");
  options.control_address = "inproc:";
  // A slot of 2^16 values takes 128 KiB of rows and 144 KiB of plan.
  constexpr size_t kElements = size_t{1} << 16;
  const int64_t slot_bytes = static_cast<int64_t>(
      shm::SlotDataBytes(kElements) + shm::SlotPlanBytes(kElements));
  options.max_client_slot_bytes = 2 * slot_bytes;
  options.max_total_slot_bytes = 3 * slot_bytes;
  auto server = ShmServer::Start(store_, options);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);

  auto a = Connect();
  ASSERT_NE(a, nullptr);
  auto a1 = a->NewFetchBuffer(kElements);
  auto a2 = a->NewFetchBuffer(kElements);
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_CODE(a->NewFetchBuffer(kElements).status(), kResourceExhausted);
  EXPECT_CODE(a->NewFetchBuffer(size_t{1} << 28).status(), kResourceExhausted);
  auto b = Connect();
  ASSERT_NE(b, nullptr);
  auto b1 = b->NewFetchBuffer(kElements);
  ASSERT_TRUE(b1.ok()) << b1.status();
  EXPECT_CODE(b->NewFetchBuffer(kElements).status(), kResourceExhausted);

  // What is mapped still serves.
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 16);
  const SequenceId id = OpenFilled(*a, g, 3, 16);
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {0, 7, 15});
  ASSERT_OK(a->Fetch(id, 0, plan.view(), a1->get()));
  EXPECT_EQ(Rows(**a1, FetchElements(plan.view(), 8)),
            ExpectedRows(3, g, 0, plan.view()));
  // Freed slots count no more.
  a2->reset();
  a1->reset();
  auto b2 = b->NewFetchBuffer(kElements);
  EXPECT_TRUE(b2.ok()) << b2.status();
}

// A second server on the same path took the socket
// over silently. Now it is refused while the first lives, and a socket left
// by a dead server is taken over.
TEST_F(ShmTest, ASecondServerOnTheSamePathIsRefused) {
  server_.reset();
  const std::string path = SocketPath("shm_lock");
  ShmServerOptions options;
  options.listen_address = "unix:" + path;
  options.control_address = "inproc:";
  auto first = ShmServer::Start(store_, options);
  ASSERT_TRUE(first.ok()) << first.status();
  server_ = *std::move(first);
  auto second = ShmServer::Start(store_, options);
  EXPECT_CODE(second.status(), kFailedPrecondition);
  // The first still serves on its socket.
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(client->NewFetchBuffer(64).ok());
  client.reset();
  server_.reset();
  EXPECT_NE(access(path.c_str(), F_OK), 0);
  EXPECT_NE(access((path + ".lock").c_str(), F_OK), 0);

  // A stale socket file and lock file (their server died) are taken over.
  const int stale = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(bind(stale, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  close(stale);
  const int lock = open((path + ".lock").c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(lock, 0);
  close(lock);
  auto third = ShmServer::Start(store_, options);
  ASSERT_TRUE(third.ok()) << third.status();
  server_ = *std::move(third);
  EXPECT_NE(Connect(), nullptr);
  server_.reset();
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

TEST_F(ShmTest, AuthToken) {
  StartServer("s3cret");
  KvClientOptions options;
  options.auth_token = "wrong";
  EXPECT_CODE(ConnectShmKvClient(server_->client_address(), options,
                                 InprocControl(store_))
                  .status(),
              kUnauthenticated);
  options.auth_token = "";
  EXPECT_CODE(ConnectShmKvClient(server_->client_address(), options,
                                 InprocControl(store_))
                  .status(),
              kUnauthenticated);
  options.auth_token = "s3cret";
  EXPECT_NE(Connect(options), nullptr);
}

TEST_F(ShmTest, BadAddresses) {
  auto connect = [&](const std::string& address) {
    KvClientOptions options;
    return ConnectShmKvClient(address, options, InprocControl(store_)).status();
  };
  EXPECT_CODE(connect("shm:"), kInvalidArgument);
  EXPECT_CODE(connect("shm:unix:"), kInvalidArgument);
  EXPECT_CODE(connect("shm:tcp://127.0.0.1:1"), kInvalidArgument);
  EXPECT_CODE(connect("shm:unix:" + std::string(200, 'x')), kInvalidArgument);
  EXPECT_CODE(connect("shm:unix:/nonexistent/kv.sock"), kUnavailable);
  ShmServerOptions options;
  options.listen_address = "tcp://127.0.0.1:1";
  EXPECT_CODE(ShmServer::Start(store_, options).status(), kInvalidArgument);
}

// The server goes away under a client that keeps fetching: every wait
// returns (Unavailable) in bounded time, and later calls fail the same way.
TEST_F(ShmTest, ServerGoneMidStream) {
  auto client = Connect();
  const SequenceGeometry g = MakeGeometry(2, 3, 64, 256);
  const SequenceId id = OpenFilled(*client, g, 3, 256);
  std::atomic<bool> failed{false};
  std::atomic<int> ok_fetches{0};
  absl::Status last;
  absl::Time failed_at;
  std::thread fetcher([&] {
    auto buffer = client->NewFetchBuffer(2 * 3 * 64 * 256);
    if (!buffer.ok()) return;
    std::vector<int32_t> all(256);
    for (int i = 0; i < 256; ++i) all[i] = i;
    const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, all);
    while (true) {
      absl::Status s = client->Fetch(id, 1, plan.view(), buffer->get());
      if (!s.ok()) {
        last = s;
        failed_at = absl::Now();
        failed = true;
        return;
      }
      ++ok_fetches;
    }
  });
  while (ok_fetches.load() < 50) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time stopped_at = absl::Now();
  server_.reset();
  fetcher.join();
  ASSERT_TRUE(failed.load());
  EXPECT_CODE(last, kUnavailable);
  EXPECT_LT(failed_at - stopped_at, absl::Seconds(2));
  auto buffer = client->NewFetchBuffer(64);
  EXPECT_CODE(buffer.status(), kUnavailable);
}

// A server that goes away and comes back at the same path (here with the
// same store, so the sequence is still there): the client reconnects on its
// next call, re-sending its buffers, and fetches work again.
TEST_F(ShmTest, ReconnectsToARestartedServer) {
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  const SequenceGeometry g = MakeGeometry(2, 3, 64, 64);
  const SequenceId id = OpenFilled(*client, g, 21, 64);
  auto buffer = client->NewFetchBuffer(2 * 3 * 64 * 64);
  ASSERT_TRUE(buffer.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{0, 63}, {5}, {9, 9, 1}});
  ASSERT_OK(client->Fetch(id, 1, plan.view(), buffer->get()));
  const std::string path = server_->client_address().substr(9);  // shm:unix:
  server_.reset();
  EXPECT_CODE(client->Fetch(id, 1, plan.view(), buffer->get()), kUnavailable);
  EXPECT_CODE(client->Fetch(id, 1, plan.view(), buffer->get()), kUnavailable);
  StartServer("", path);
  ASSERT_OK(client->Fetch(id, 1, plan.view(), buffer->get()));
  const std::vector<uint16_t> want = ExpectedRows(21, g, 1, plan.view());
  EXPECT_EQ(Rows(**buffer, want.size()), want);
  auto second = client->NewFetchBuffer(2 * 3 * 64);
  ASSERT_TRUE(second.ok()) << second.status();
  const OwnedFetchPlan small = OwnedFetchPlan::SameForAllHeads(3, {7});
  ASSERT_OK(client->Fetch(id, 0, small.view(), second->get()));
  EXPECT_EQ(Rows(**second, 2 * 3 * 64), ExpectedRows(21, g, 0, small.view()));
}

// A fake server: handshakes and maps slots like a ShmServer, then either
// never looks at requests (claim = false) or claims them and never
// finishes, scribbling into the slot afterwards (claim = true). With
// answer_maps = false it never answers a slot's mapping either.
class HungServer {
 public:
  explicit HungServer(bool claim, bool answer_maps = true)
      : claim_(claim), answer_maps_(answer_maps), path_(SocketPath("hung")) {
    listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, path_.c_str());
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(listen_fd_, 1);
    thread_ = std::thread([this] { Run(); });
  }
  ~HungServer() {
    stop_ = true;
    thread_.join();
    close(listen_fd_);
    unlink(path_.c_str());
  }
  std::string address() const { return "shm:unix:" + path_; }

 private:
  void Run() {
    const int s = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    shm::SocketMessage hello;
    hello.type = shm::MessageType::kHello;
    hello.text = "inproc:";
    shm::SendMessage(s, hello).IgnoreError();
    shm::SetReceiveTimeout(s, absl::Milliseconds(5)).IgnoreError();
    void* region = nullptr;
    uint16_t* data = nullptr;
    while (!stop_) {
      int fd = -1;
      auto m = shm::ReceiveMessage(s, &fd);
      if (m.ok()) {
        if (m->type == shm::MessageType::kAttach) {
          region = mmap(nullptr, shm::ControlRegionBytes(m->max_slots),
                        PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        } else if (m->type == shm::MessageType::kMapSlot && m->slot == 0) {
          data = static_cast<uint16_t*>(mmap(nullptr, shm::SlotDataBytes(m->elements),
                                             PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
        }
        if (fd >= 0) close(fd);
        if (answer_maps_ || m->type != shm::MessageType::kMapSlot) {
          shm::SendMessage(s, shm::ReplyFor(absl::OkStatus())).IgnoreError();
        }
      } else if (absl::IsUnavailable(m.status())) {
        break;
      }
      if (claim_ && region != nullptr && data != nullptr) {
        uint32_t expected = shm::kRequested;
        if (shm::SlotAt(region, 0)->state.compare_exchange_strong(expected,
                                                                   shm::kServing)) {
          claimed_ = true;
        }
        if (claimed_) data[0] = 0xBEEF;  // a late write, after the timeout
      }
    }
    close(s);
  }

  const bool claim_;
  const bool answer_maps_;
  const std::string path_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  bool claimed_ = false;
  std::thread thread_;
};

TEST_F(ShmTest, UnservedFetchTimesOutAndTheBufferStaysUsable) {
  HungServer hung(/*claim=*/false);
  KvClientOptions options;
  options.fetch_timeout = absl::Milliseconds(200);
  auto client = ConnectShmKvClient(hung.address(), options, InprocControl(store_));
  ASSERT_TRUE(client.ok()) << client.status();
  auto buffer = (*client)->NewFetchBuffer(64);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {0});
  const absl::Time start = absl::Now();
  EXPECT_CODE((*client)->Fetch(1, 0, plan.view(), buffer->get()),
              kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // Never claimed: cancelled cleanly, so the client still works.
  EXPECT_CODE((*client)->Fetch(1, 0, plan.view(), buffer->get()),
              kDeadlineExceeded);
}

// A generation waits on an append's slot as on the append: a node that
// stops answering fails it within the fetch timeout (not the setup
// requests' rpc_timeout), saying so, and the append is not sent again
// through the control path to wait there too.
TEST_F(ShmTest, AnAppendWaitsForItsSlotNoLongerThanTheFetchTimeout) {
  HungServer hung(/*claim=*/false, /*answer_maps=*/false);
  std::atomic<int> control_appends{0};
  auto store = store_;
  KvClientOptions options;
  options.fetch_timeout = absl::Milliseconds(200);
  auto client = ConnectShmKvClient(
      hung.address(), options,
      [store, &control_appends](const std::string&, const KvClientOptions&)
          -> absl::StatusOr<std::unique_ptr<KvClient>> {
        return std::unique_ptr<KvClient>(
            new AppendCounter(NewInprocKvClient(store), &control_appends));
      });
  ASSERT_TRUE(client.ok()) << client.status();
  const SequenceGeometry g = MakeGeometry(3, 2, 16, 24);
  testdata::TestBlock b = MakeTestBlock(8, g, 0, g.n_layers, 0, 4);
  const absl::Time start = absl::Now();
  auto got = (*client)->Append(1, b.block);
  EXPECT_CODE(got.status(), kDeadlineExceeded);
  EXPECT_NE(got.status().message().find("within 200ms"), std::string::npos)
      << got.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_EQ(control_appends.load(), 0);
}

TEST_F(ShmTest, FetchAbandonedMidGatherProtectsTheBuffer) {
  HungServer hung(/*claim=*/true);
  KvClientOptions options;
  options.fetch_timeout = absl::Milliseconds(200);
  auto client = ConnectShmKvClient(hung.address(), options, InprocControl(store_));
  ASSERT_TRUE(client.ok()) << client.status();
  auto buffer = (*client)->NewFetchBuffer(64);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {0});
  EXPECT_CODE((*client)->Fetch(1, 0, plan.view(), buffer->get()),
              kDeadlineExceeded);
  // The caller's memory is still there, and the server's writes no longer
  // reach it.
  uint16_t* data = (*buffer)->data();
  data[0] = 7;
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(data[0], 7);
  EXPECT_CODE((*client)->Fetch(1, 0, plan.view(), buffer->get()), kUnavailable);
  EXPECT_CODE((*client)->NewFetchBuffer(8).status(), kUnavailable);
}

// The server maps only memfds sealed against shrinking.
TEST_F(ShmTest, ServerRejectsAnUnsealedRegion) {
  const int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  auto path = ParseUnixPath(server_->client_address().substr(4));
  ASSERT_TRUE(path.ok());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path->c_str());
  ASSERT_EQ(connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_OK(shm::SetReceiveTimeout(s, absl::Seconds(5)));
  auto hello = shm::ReceiveMessage(s, nullptr);
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(hello->type, shm::MessageType::kHello);
  EXPECT_EQ(hello->text, "inproc:");
  const int fd = memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_EQ(ftruncate(fd, shm::ControlRegionBytes(4)), 0);
  shm::SocketMessage attach;
  attach.type = shm::MessageType::kAttach;
  attach.max_slots = 4;
  ASSERT_OK(shm::SendMessage(s, attach, fd));
  auto reply = shm::ReceiveMessage(s, nullptr);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_CODE(shm::StatusOfReply(*reply), kInvalidArgument);
  close(fd);
  close(s);
}

}  // namespace
}  // namespace infinigen::kv_memory_service
