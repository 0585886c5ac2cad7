// Isolation against the real kv_memory_server: ownership of sequences,
// listening without auth, memory that follows the rows stored (not
// positions ever appended, not reservations, not clients' slots),
// eviction cost, the drain, and the shm socket lock. RSS is read from
// /proc/PID/status of the server process; bounds are loose (tens of MiB)
// where the old behaviour was hundreds.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/client/prefix_keys.h"
#include "kv_memory_service/testing/kv_test_data.h"
#include "tests/kv_memory_service/server_process.h"

namespace infinigen::kv_memory_service {
namespace {

using ::testing::HasSubstr;
using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

constexpr int64_t kMiB = 1 << 20;

KvClientOptions Options() {
  KvClientOptions options;
  options.rpc_timeout = absl::Seconds(30);
  options.fetch_timeout = absl::Seconds(10);
  options.connect_timeout = absl::Seconds(10);
  return options;
}

std::unique_ptr<KvClient> Connect(const std::string& address) {
  auto client = ConnectKvClient(address, Options());
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

int ExitCode(const ServerProcess::Result& r) {
  return WIFEXITED(r.wait_status) ? WEXITSTATUS(r.wait_status) : -1;
}

// Ids were sequential, so a second client reached the first
// one's sequence by adding one. Now no id near another is open.
TEST(IsolationTest, AnotherClientCannotReachASequenceByGuessing) {
  auto server = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto a = Connect((*server)->address());
  auto b = Connect((*server)->address());
  ASSERT_TRUE(a != nullptr && b != nullptr);
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 16);
  auto id_a = a->Open(g);
  ASSERT_TRUE(id_a.ok()) << id_a.status();
  testdata::TestBlock rows = MakeTestBlock(7, g, 0, 1, 0, 4);
  ASSERT_TRUE(a->Append(*id_a, rows.block).ok());
  auto id_b = b->Open(g);
  ASSERT_TRUE(id_b.ok()) << id_b.status();
  auto buffer = b->NewFetchBuffer(256);
  ASSERT_TRUE(buffer.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {0});
  for (int64_t d = -16; d <= 16; ++d) {
    const SequenceId guess = *id_b + static_cast<uint64_t>(d);
    if (d == 0) continue;
    EXPECT_NE(guess, *id_a) << "B's id " << *id_b << " is " << d
                            << " from A's";
    EXPECT_EQ(b->Fetch(guess, 0, plan.view(), buffer->get()).code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(b->GetSequenceStats(guess).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(b->Close(guess).code(), absl::StatusCode::kNotFound);
  }
  // A's sequence is untouched.
  auto mine = a->NewFetchBuffer(256);
  ASSERT_TRUE(a->Fetch(*id_a, 0, plan.view(), mine->get()).ok());
  const std::vector<uint16_t> want = ExpectedRows(7, g, 0, plan.view());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*mine)->data()));
}

// With the id known (leaked): control calls from another
// client's session get NOT_FOUND and change nothing.
TEST(IsolationTest, AnotherSessionCannotAppendCloseOrReadStats) {
  auto server = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto a = Connect((*server)->address());
  auto b = Connect((*server)->address());
  ASSERT_TRUE(a != nullptr && b != nullptr);
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 16);
  auto id = a->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(b->Open(g).ok());  // B has a session of its own
  testdata::TestBlock rows = MakeTestBlock(7, g, 0, 1, 0, 4);
  ASSERT_TRUE(a->Append(*id, rows.block).ok());
  testdata::TestBlock other = MakeTestBlock(8, g, 0, 1, 4, 4);
  EXPECT_EQ(b->Append(*id, other.block).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(b->GetSequenceStats(*id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(b->Close(*id).code(), absl::StatusCode::kNotFound);
  auto stats = a->GetSequenceStats(*id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->layer_lengths[0], 4);
  EXPECT_TRUE(a->Close(*id).ok());
}

// On the data planes: with A's id leaked, a fetch from another
// session (B, which has one, or C, which has none) used to return A's rows
// on the TCP fetch socket, the gRPC FetchStream and shared memory, where
// fetches named only the sequence id. Each now names the caller's session
// and gets NOT_FOUND; A still reads its rows.
TEST(IsolationTest, AnotherSessionCannotFetchALeakedIdOnAnyPlane) {
  const std::string shm = ServerProcess::SocketPath("iso_fetch");
  auto server = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm});
  ASSERT_TRUE(server.ok()) << server.status();
  struct Plane {
    std::string name, address;
    bool fetch_socket;
  };
  const Plane planes[] = {
      {"tcp fetch socket", (*server)->address(), true},
      {"gRPC FetchStream", (*server)->address(), false},
      {"shm", "shm:unix:" + shm, true},
  };
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 16);
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{0, 3}, {2}});
  for (const Plane& p : planes) {
    SCOPED_TRACE(p.name);
    KvClientOptions options = Options();
    options.tcp_fetch_socket = p.fetch_socket;
    auto connect = [&]() -> std::unique_ptr<KvClient> {
      auto c = ConnectKvClient(p.address, options);
      EXPECT_TRUE(c.ok()) << c.status();
      return c.ok() ? *std::move(c) : nullptr;
    };
    auto a = connect(), b = connect(), c = connect();
    ASSERT_TRUE(a != nullptr && b != nullptr && c != nullptr);
    auto id = a->Open(g);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(a->Append(*id, MakeTestBlock(9, g, 0, 2, 0, 8).block).ok());
    ASSERT_TRUE(b->Open(g).ok());  // B has a session of its own; C has none
    for (KvClient* intruder : {b.get(), c.get()}) {
      auto buffer = intruder->NewFetchBuffer(256);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      std::fill((*buffer)->data(), (*buffer)->data() + 256, uint16_t{0});
      EXPECT_EQ(intruder->Fetch(*id, 1, plan.view(), buffer->get()).code(),
                absl::StatusCode::kNotFound);
      EXPECT_TRUE(std::all_of((*buffer)->data(), (*buffer)->data() + 256,
                              [](uint16_t v) { return v == 0; }))
          << "rows of A's sequence reached another session";
    }
    auto mine = a->NewFetchBuffer(256);
    ASSERT_TRUE(mine.ok());
    ASSERT_TRUE(a->Fetch(*id, 1, plan.view(), mine->get()).ok());
    const std::vector<uint16_t> want = ExpectedRows(9, g, 1, plan.view());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), (*mine)->data()));
    EXPECT_TRUE(a->Close(*id).ok());
  }
}

// A bind to every interface without auth started silently.
TEST(IsolationTest, NonLoopbackListenNeedsAuthOrAllowInsecure) {
  for (const char* listen : {"--listen=0.0.0.0:0", "--listen=[::]:0"}) {
    auto refused = ServerProcess::Start({listen});
    ASSERT_FALSE(refused.ok()) << listen << " started without auth";
    ServerProcess::Result r = ServerProcess::Run({listen});
    EXPECT_EQ(ExitCode(r), 2) << listen;
    EXPECT_EQ(std::vector<std::string>(absl::StrSplit(r.err, '\n',
                                                      absl::SkipEmpty()))
                  .size(),
              1u)
        << r.err;
    EXPECT_THAT(r.err, HasSubstr("--allow_insecure"));
  }
  auto insecure = ServerProcess::Start({"--listen=0.0.0.0:0", "--allow_insecure"});
  EXPECT_TRUE(insecure.ok()) << insecure.status();
  const std::string token_file = ServerProcess::TempPath("token");
  {
    std::ofstream out(token_file);
    out << "s3cret\n";
  }
  auto with_auth = ServerProcess::Start(
      {"--listen=0.0.0.0:0", "--auth_token_file=" + token_file});
  EXPECT_TRUE(with_auth.ok()) << with_auth.status();
  auto local = ServerProcess::Start({"--listen=localhost:0"});
  EXPECT_TRUE(local.ok()) << local.status();
  unlink(token_file.c_str());
}

// The soak: 2^20 positions through a 16-token FIFO pool
// raised RSS by 7 bytes per position and head, and kept it after Close.
// Now RSS stays flat once the pool is full, and Close returns it.
TEST(IsolationTest, FifoChurnOfAMillionPositionsKeepsRssFlat) {
  // Fewer malloc arenas in the server: less noise in its RSS from the
  // request buffers of gRPC's threads (the server inherits the variable).
  setenv("MALLOC_ARENA_MAX", "2", 1);
  auto server = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--capacity_bytes=1048576", "--eviction=fifo"});
  unsetenv("MALLOC_ARENA_MAX");
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect((*server)->address());
  ASSERT_NE(client, nullptr);
  const SequenceGeometry g = MakeGeometry(1, 16, 4, 16);
  constexpr int kChunk = 8192;
  constexpr int kPositions = 1 << 20;  // > 10^6
  // One block reused for every append: the server does not care that the
  // rows repeat, and the test stays cheap.
  testdata::TestBlock block = MakeTestBlock(3, g, 0, 1, 0, kChunk);
  int64_t warm = -1, peak = 0;
  for (int round = 0; round < 2; ++round) {
    auto id = client->Open(g);
    ASSERT_TRUE(id.ok()) << id.status();
    for (int pos = 0; pos < kPositions; pos += kChunk) {
      auto r = client->Append(*id, block.block);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->evicted.size(),
                static_cast<size_t>(pos == 0 ? (kChunk - 16) * 16 : kChunk * 16));
      const int64_t rss = (*server)->RssBytes();
      if (round == 0 && pos == 16 * kChunk) warm = rss;
      if (warm > 0) peak = std::max(peak, rss);
      if (pos % (1 << 18) == 0) {
        std::cout << "round " << round << ", " << pos << " positions: RSS "
                  << rss / kMiB << " MiB\n";
      }
    }
    auto stats = client->GetSequenceStats(*id);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->layer_lengths[0], kPositions);
    EXPECT_EQ(stats->present_rows, 16 * 16);
    ASSERT_TRUE(client->Close(*id).ok());
  }
  ASSERT_GT(warm, 0);
  std::cout << "server RSS: " << warm / kMiB << " MiB after 2^17 positions, "
            << "peak " << peak / kMiB << " MiB over 2 x 2^20 (16 heads)\n";
  // The old bookkeeping grew by 4+ bytes per position and head: 64 MiB more
  // by the end of the first round alone (83 MiB measured). What remains is
  // allocator noise from gRPC's buffers (up to 13 MiB seen).
  EXPECT_LT(peak - warm, 40 * kMiB);
}

// An Open that reserves 256 MiB raised RSS to 1.3 GiB. Now the
// reservation is accounted, and memory comes as rows arrive.
TEST(IsolationTest, AReservationCommitsNoMemory) {
  auto server = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--capacity_bytes=268435456"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect((*server)->address());
  ASSERT_NE(client, nullptr);
  // 4 bytes x 4 layers x 4 heads x 4 dims x 2^20 tokens = 256 MiB.
  const SequenceGeometry g = MakeGeometry(4, 4, 4, 1 << 20);
  ASSERT_EQ(ReservedBytes(g), 256 * kMiB);
  const int64_t before = (*server)->RssBytes();
  auto id = client->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  auto store = client->GetStoreStats();
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(store->bytes_reserved, 256 * kMiB);
  // The capacity is spoken for.
  EXPECT_EQ(client->Open(MakeGeometry(1, 1, 4, 16)).status().code(),
            absl::StatusCode::kResourceExhausted);
  const int64_t after = (*server)->RssBytes();
  std::cout << "server RSS " << before / kMiB << " MiB before the Open, "
            << after / kMiB << " MiB after\n";
  EXPECT_LT(after - before, 16 * kMiB);
  ASSERT_TRUE(client->Close(*id).ok());
}

// Prefix blocks cannot be planted for another credential: a node with
// several tokens gives each its namespace. Rows published under team-a's
// token are attached by another client with that token (and by team-a's
// read-only one), never by team-b's; what the read-only token appends is
// never published.
TEST(IsolationTest, PrefixBlocksStayInTheirCredentialsNamespace) {
  const std::string token_file = ServerProcess::TempPath("iso_namespaces");
  std::ofstream(token_file) << "# token namespace [read-only]\n"
                            << "tok-a team-a\n"
                            << "tok-b team-b\n"
                            << "tok-r team-a read-only\n";
  auto server = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--auth_token_file=" + token_file});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = [&](const std::string& token) {
    KvClientOptions options = Options();
    options.auth_token = token;
    auto c = ConnectKvClient((*server)->address(), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  };
  auto a1 = client("tok-a"), a2 = client("tok-a"), b = client("tok-b"),
       r = client("tok-r");
  ASSERT_TRUE(a1 && a2 && b && r);
  const SequenceGeometry g = MakeGeometry(2, 1, 8, 16);
  std::vector<int32_t> tokens(16), other(16);
  for (int i = 0; i < 16; ++i) {
    tokens[i] = i;
    other[i] = 100 + i;
  }
  auto open = [&](KvClient& c, const std::vector<int32_t>& t) {
    PrefixRequest p;
    p.block_tokens = 4;
    p.keys = PrefixKeys("model", 4, t);
    return c.OpenSequence(g, p);
  };
  // team-a publishes four blocks.
  auto published = open(*a1, tokens);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->cached_tokens, 0);
  testdata::TestBlock rows = MakeTestBlock(9, g, 0, 2, 0, 16);
  ASSERT_TRUE(a1->Append(published->id, rows.block).ok());
  // team-b computes the same keys and attaches nothing.
  auto planted_for = open(*b, tokens);
  ASSERT_TRUE(planted_for.ok());
  EXPECT_EQ(planted_for->cached_tokens, 0);
  // Another team-a client, and team-a's read-only one, attach them.
  auto same_team = open(*a2, tokens);
  ASSERT_TRUE(same_team.ok());
  EXPECT_EQ(same_team->cached_tokens, 16);
  auto reader = open(*r, tokens);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->cached_tokens, 16);
  // The read-only token's own rows are never published.
  auto unpublished = open(*r, other);
  ASSERT_TRUE(unpublished.ok());
  testdata::TestBlock more = MakeTestBlock(10, g, 0, 2, 0, 16);
  ASSERT_TRUE(r->Append(unpublished->id, more.block).ok());
  auto after = open(*a1, other);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->cached_tokens, 0);
  std::remove(token_file.c_str());
}

// Prefix annotations waiting for their blocks cannot park memory on the
// node: one larger than twice its block's rows is refused (a 1 MiB one on
// a block of 512 bytes), and those for blocks whose rows are not in are not
// kept, so 25 one-token appends carrying 60 annotations each for blocks
// ahead of the rows leave the server's RSS where it was.
TEST(IsolationTest, WaitingPrefixAnnotationsAreBoundedByTheRowsHeld) {
  auto server = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--capacity_bytes=16777216",
       "--prefix_cache_bytes=16777216"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect((*server)->address());
  ASSERT_NE(client, nullptr);
  // 2 bytes x 1 layer x 1 head x 8 dims x 2^18 tokens x (K, V) = 8 MiB;
  // blocks of 16 tokens: 16384 usable prefix keys, 512 bytes of rows each.
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 1 << 18);
  constexpr int kBlock = 16;
  constexpr size_t kBlockBytes = 2 * kBlock * 8 * sizeof(uint16_t);
  std::vector<int32_t> tokens(1 << 18);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = i % 1000;
  PrefixRequest prefix;
  prefix.block_tokens = kBlock;
  prefix.keys = PrefixKeys("annotations", kBlock, tokens);
  auto opened = client->OpenSequence(g, prefix);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const int64_t before = (*server)->RssBytes();
  testdata::TestBlock one = MakeTestBlock(7, g, 0, 1, 0, 1);
  const std::vector<std::string> big = {std::string(1 << 20, 'x')};
  one.block.prefix_meta = big;
  const absl::Status refused = client->Append(opened->id, one.block).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("exceeds twice its block's 512 bytes of rows"));
  for (int i = 0; i < 25; ++i) {
    testdata::TestBlock b = MakeTestBlock(7, g, 0, 1, i, 1);
    std::vector<std::string> meta(60, std::string(kBlockBytes, 'a' + i % 26));
    b.block.prefix_meta = meta;
    b.block.prefix_meta_first_block = 1 + i * 60;  // ahead of the rows
    ASSERT_TRUE(client->Append(opened->id, b.block).ok()) << i;
  }
  const int64_t after = (*server)->RssBytes();
  std::cout << "server RSS " << before / kMiB << " MiB before, "
            << after / kMiB << " MiB after the annotated appends\n";
  EXPECT_LT(after - before, 8 * kMiB);
  ASSERT_TRUE(client->Close(opened->id).ok());
}

// An LRU append that evicts from a full 2^16-token head
// scanned the head once per eviction (seconds per append, tens of seconds
// for 2^18 tokens), holding the sequence's lock, and SIGTERM waited for it.
TEST(IsolationTest, LargeLruEvictionsAreFastAndTheDrainIsBounded) {
  auto server = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--eviction=lru", "--drain_timeout=1s"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect((*server)->address());
  ASSERT_NE(client, nullptr);
  const SequenceGeometry g = MakeGeometry(1, 1, 4, 1 << 16);
  auto id = client->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  testdata::TestBlock fill = MakeTestBlock(9, g, 0, 1, 0, 1 << 16);
  ASSERT_TRUE(client->Append(*id, fill.block).ok());
  testdata::TestBlock more = MakeTestBlock(9, g, 0, 1, 1 << 16, 1 << 18);
  const absl::Time start = absl::Now();
  auto r = client->Append(*id, more.block);
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->evicted.size(), size_t{1} << 18);
  EXPECT_LT(took, absl::Seconds(5));
  auto buffer = client->NewFetchBuffer(64);
  const int32_t last = (1 << 16) + (1 << 18) - 1;
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {last});
  ASSERT_TRUE(client->Fetch(*id, 0, plan.view(), buffer->get()).ok());
  EXPECT_EQ(std::vector<uint16_t>((*buffer)->data(), (*buffer)->data() + 8),
            ExpectedRows(9, g, 0, plan.view()));

  // SIGTERM with appends in flight: the process ends within the drain and
  // its one-second grace.
  std::thread appender([&] {
    for (int i = 0; i < 8; ++i) {
      testdata::TestBlock b =
          MakeTestBlock(9, g, 0, 1, (1 << 16) + (1 << 18) * (i + 1), 1 << 18);
      if (!client->Append(*id, b.block).ok()) break;
    }
  });
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time signalled = absl::Now();
  (*server)->Signal(SIGTERM);
  (*server)->WaitExit();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(4));
  appender.join();
}

// The server mapped a client's slots with MAP_POPULATE, so
// memory the client declared cost the server RSS. Now slots cost the server
// only what it writes.
TEST(IsolationTest, ShmSlotsCostTheServerNothingUntilUsed) {
  const std::string shm = ServerProcess::SocketPath("iso_shm");
  auto server = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect("shm:unix:" + shm);
  ASSERT_NE(client, nullptr);
  const int64_t before = (*server)->RssBytes();
  // 2^26 values: 128 MiB of rows.
  auto buffer = client->NewFetchBuffer(size_t{1} << 26);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const int64_t after = (*server)->RssBytes();
  std::cout << "server RSS " << before / kMiB << " MiB before a 128 MiB slot, "
            << after / kMiB << " MiB after\n";
  EXPECT_LT(after - before, 32 * kMiB);
  // And it works.
  const SequenceGeometry g = MakeGeometry(1, 2, 8, 32);
  auto id = client->Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock rows = MakeTestBlock(4, g, 0, 1, 0, 32);
  ASSERT_TRUE(client->Append(*id, rows.block).ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {1, 31});
  ASSERT_TRUE(client->Fetch(*id, 0, plan.view(), buffer->get()).ok());
  const std::vector<uint16_t> want = ExpectedRows(4, g, 0, plan.view());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*buffer)->data()));
}

// The caps: a client that asks for more slot memory than
// --shm_max_client_bytes gets RESOURCE_EXHAUSTED; smaller buffers work.
// 300 peers that connect to the shm socket and never say who they are (no
// token, no Attach) do not fill its 256 client places: those in their
// handshake are counted apart and the oldest dropped for newer ones, so a
// client with the token still attaches and fetches.
TEST(IsolationTest, SilentShmPeersDoNotHoldTheClientPlaces) {
  const std::string shm = ServerProcess::SocketPath("iso_silent");
  const std::string token_file = ServerProcess::TempPath("iso_token");
  std::ofstream(token_file) << "s3cret\n";
  auto server = ServerProcess::Start({"--listen=127.0.0.1:0",
                                      "--shm_listen=unix:" + shm,
                                      "--auth_token_file=" + token_file});
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> silent;
  for (int i = 0; i < 300; ++i) {
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", shm.c_str());
    // A full listen backlog says EAGAIN: wait for the accept loop.
    int rc = -1;
    for (int attempt = 0; attempt < 200 && rc != 0; ++attempt) {
      rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      if (rc != 0) absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(rc, 0) << i << ": " << std::strerror(errno);
    silent.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(300));  // all accepted by now
  KvClientOptions options;
  options.auth_token = "s3cret";
  auto client = ConnectKvClient("shm:unix:" + shm, options);
  ASSERT_TRUE(client.ok()) << client.status();
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 16);
  auto id = (*client)->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  testdata::TestBlock b = MakeTestBlock(3, g, 0, 1, 0, 4);
  ASSERT_TRUE((*client)->Append(*id, b.block).ok());
  auto buffer = (*client)->NewFetchBuffer(64);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {2});
  EXPECT_TRUE((*client)->Fetch(*id, 0, plan.view(), buffer->get()).ok());
  for (int fd : silent) close(fd);
  std::remove(token_file.c_str());
}

TEST(IsolationTest, ShmSlotsAreCappedPerClient) {
  const std::string shm = ServerProcess::SocketPath("iso_cap");
  auto server = ServerProcess::Start({"--listen=127.0.0.1:0",
                                      "--shm_listen=unix:" + shm,
                                      "--shm_max_client_bytes=1048576"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect("shm:unix:" + shm);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->NewFetchBuffer(size_t{1} << 28).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client->NewFetchBuffer(size_t{1} << 20).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto small = client->NewFetchBuffer(1024);
  ASSERT_TRUE(small.ok()) << small.status();
  ServerProcess::Result r = ServerProcess::Run({"--shm_max_client_bytes=0"});
  EXPECT_EQ(ExitCode(r), 2);
}

// A second server on the same --shm_listen took the socket
// over silently. Now it exits with a reason; the first keeps serving.
TEST(IsolationTest, ASecondServerCannotTakeTheShmSocket) {
  const std::string shm = ServerProcess::SocketPath("iso_lock");
  auto first = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm});
  ASSERT_FALSE(second.ok()) << "the second server took " << shm;
  ServerProcess::Result r = ServerProcess::Run(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm});
  EXPECT_EQ(ExitCode(r), 1);
  EXPECT_THAT(r.err, HasSubstr("another kv_memory_server"));
  auto client = Connect("shm:unix:" + shm);
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->data_plane(), "shm");
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 8);
  auto id = client->Open(g);
  ASSERT_TRUE(id.ok()) << id.status();
  // SIGKILL leaves the socket and the lock file: the next server takes
  // them over.
  client.reset();
  (*first)->Signal(SIGKILL);
  (*first)->WaitExit();
  auto third = ServerProcess::Start(
      {"--listen=127.0.0.1:0", "--shm_listen=unix:" + shm});
  ASSERT_TRUE(third.ok()) << third.status();
  (*third)->Signal(SIGTERM);
  (*third)->WaitExit();
  EXPECT_NE(access(shm.c_str(), F_OK), 0);
  EXPECT_NE(access((shm + ".lock").c_str(), F_OK), 0);
}

}  // namespace
}  // namespace infinigen::kv_memory_service
