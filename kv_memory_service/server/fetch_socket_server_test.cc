// The fetch socket at the protocol level: what a client that is not our
// KvClient (or a hostile one) gets for each kind of bad frame, and that the
// server keeps serving everyone else.
#include "kv_memory_service/server/fetch_socket_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kv_memory_service/testing/kv_test_data.h"
#include "kv_memory_service/tcp/fetch_wire.h"

namespace infinigen::kv_memory_service {
namespace {

using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

class FetchSocketServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_shared<KvStore>(KvStoreOptions{});
    seq_ = *store_->Open(g_);
    testdata::TestBlock b = MakeTestBlock(3, g_, 0, 2, 0, 8);
    ASSERT_TRUE(store_->Append(seq_, b.block).ok());
    FetchSocketServerOptions options;
    options.auth_token = "tok";
    options.max_message_bytes = 1 << 16;
    auto server = FetchSocketServer::Start(store_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  int Dial() {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(server_->port());
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  }

  // Sends a Hello with `token` and returns the reply's code.
  absl::StatusCode Hello(int fd, const std::string& token,
                         uint32_t magic = fetch_wire::kHelloMagic) {
    fetch_wire::Hello hello;
    hello.magic = magic;
    hello.token_bytes = static_cast<uint32_t>(token.size());
    iovec iov[2] = {{&hello, sizeof(hello)},
                    {const_cast<char*>(token.data()), token.size()}};
    EXPECT_TRUE(fetch_wire::SendAll(fd, iov, 2).ok());
    fetch_wire::HelloReply reply;
    if (!fetch_wire::RecvAll(fd, &reply, sizeof(reply)).ok()) {
      return absl::StatusCode::kUnknown;
    }
    EXPECT_TRUE(fetch_wire::Discard(fd, reply.message_bytes).ok());
    return static_cast<absl::StatusCode>(reply.status_code);
  }

  // Sends a request; returns the response header (rows into `rows`).
  fetch_wire::FetchResponseHeader Request(int fd, uint64_t id, SequenceId seq,
                                          int layer,
                                          const OwnedFetchPlan& plan,
                                          std::vector<uint16_t>* rows) {
    fetch_wire::FetchRequestHeader q;
    q.n_offsets = static_cast<uint32_t>(plan.head_offsets.size());
    q.n_indices = static_cast<uint32_t>(plan.indices.size());
    q.layer = layer;
    q.request_id = id;
    q.sequence_id = seq;
    iovec iov[3] = {
        {&q, sizeof(q)},
        {const_cast<int32_t*>(plan.head_offsets.data()), q.n_offsets * 4},
        {const_cast<int32_t*>(plan.indices.data()), q.n_indices * 4}};
    EXPECT_TRUE(fetch_wire::SendAll(fd, iov, 3).ok());
    return Response(fd, rows);
  }

  static fetch_wire::FetchResponseHeader Response(int fd,
                                                  std::vector<uint16_t>* rows) {
    fetch_wire::FetchResponseHeader r;
    r.magic = 0;
    if (!fetch_wire::RecvAll(fd, &r, sizeof(r)).ok()) return r;
    EXPECT_TRUE(fetch_wire::Discard(fd, r.message_bytes).ok());
    rows->resize(r.rows_bytes / 2);
    EXPECT_TRUE(fetch_wire::RecvAll(fd, rows->data(), r.rows_bytes).ok());
    return r;
  }

  static bool Closed(int fd) {
    char c;
    return recv(fd, &c, 1, 0) <= 0;  // FIN, or RST when data was unread
  }

  const SequenceGeometry g_ = MakeGeometry(2, 2, 8, 16);
  std::shared_ptr<KvStore> store_;
  SequenceId seq_ = 0;
  std::unique_ptr<FetchSocketServer> server_;
};

TEST_F(FetchSocketServerTest, ServesAndKeepsServingAfterAFailedFetch) {
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{7, 0}, {3}});
  std::vector<uint16_t> rows;
  auto r = Request(fd, 1, seq_ + 1, 0, plan, &rows);
  EXPECT_EQ(r.request_id, 1u);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kNotFound));
  r = Request(fd, 2, seq_, 1, OwnedFetchPlan::PerHead({{8}, {}}), &rows);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kOutOfRange));
  r = Request(fd, 3, seq_, 1, plan, &rows);
  EXPECT_EQ(r.request_id, 3u);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 1, plan.view()));
  close(fd);
}

TEST_F(FetchSocketServerTest, WrongOrMissingTokenIsUnauthenticated) {
  for (const std::string token : {"", "Bearer nope", "tok"}) {
    const int fd = Dial();
    EXPECT_EQ(Hello(fd, token), absl::StatusCode::kUnauthenticated) << token;
    EXPECT_TRUE(Closed(fd));
    close(fd);
  }
}

TEST_F(FetchSocketServerTest, BadFramesCloseOnlyTheirConnection) {
  const int good = Dial();
  ASSERT_EQ(Hello(good, "Bearer tok"), absl::StatusCode::kOk);

  const int bad_hello = Dial();
  EXPECT_EQ(Hello(bad_hello, "Bearer tok", 0x12345678),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Closed(bad_hello));
  close(bad_hello);

  const int bad_magic = Dial();
  ASSERT_EQ(Hello(bad_magic, "Bearer tok"), absl::StatusCode::kOk);
  fetch_wire::FetchRequestHeader q;
  q.magic = 0xdeadbeef;
  iovec iov = {&q, sizeof(q)};
  ASSERT_TRUE(fetch_wire::SendAll(bad_magic, &iov, 1).ok());
  std::vector<uint16_t> rows;
  auto r = Response(bad_magic, &rows);
  EXPECT_EQ(r.request_id, 0u);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(Closed(bad_magic));
  close(bad_magic);

  const int oversized = Dial();
  ASSERT_EQ(Hello(oversized, "Bearer tok"), absl::StatusCode::kOk);
  q = fetch_wire::FetchRequestHeader();
  q.n_indices = 1 << 20;  // 4 MiB of indices, over the 64 KiB limit
  iov = {&q, sizeof(q)};
  ASSERT_TRUE(fetch_wire::SendAll(oversized, &iov, 1).ok());
  r = Response(oversized, &rows);
  EXPECT_EQ(r.status_code,
            static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(Closed(oversized));
  close(oversized);

  // Rows over the response limit: 2 heads x 1100 x 8 dims x 2 x 2 bytes.
  std::vector<int32_t> many(1100, 2);
  r = Request(good, 9, seq_, 0, OwnedFetchPlan::SameForAllHeads(2, many), &rows);
  EXPECT_EQ(r.status_code,
            static_cast<int>(absl::StatusCode::kResourceExhausted));
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {5});
  r = Request(good, 10, seq_, 0, plan, &rows);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 0, plan.view()));
  close(good);
}

// Issue 18, finding 3: a header announcing a large body is judged before
// the body arrives. The server used to allocate the announced frame and
// wait for it; now a frame the sequence cannot need is answered at once.
TEST_F(FetchSocketServerTest, HeadersAreJudgedBeforeTheirBodies) {
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  std::vector<uint16_t> rows;
  // Each header is answered before its body is sent; the body, dropped as
  // it arrives, then keeps the stream in step.
  auto judge = [&](SequenceId seq, uint32_t n_offsets, uint32_t n_indices,
                   uint64_t id) {
    fetch_wire::FetchRequestHeader q;
    q.sequence_id = seq;
    q.n_offsets = n_offsets;
    q.n_indices = n_indices;
    q.request_id = id;
    iovec iov = {&q, sizeof(q)};
    EXPECT_TRUE(fetch_wire::SendAll(fd, &iov, 1).ok());
    auto r = Response(fd, &rows);
    EXPECT_EQ(r.request_id, id);
    std::vector<int32_t> body(size_t{n_offsets} + n_indices, 0);
    iov = {body.data(), body.size() * 4};
    EXPECT_TRUE(fetch_wire::SendAll(fd, &iov, 1).ok());
    return static_cast<absl::StatusCode>(r.status_code);
  };
  // 60 KiB of indices (under the frame limit) for an unknown sequence.
  EXPECT_EQ(judge(seq_ + 1, 3, 15000, 5), absl::StatusCode::kNotFound);
  // More indices than one response may carry rows for.
  EXPECT_EQ(judge(seq_, 3, 15000, 6), absl::StatusCode::kResourceExhausted);
  // Head offsets that do not match the sequence's heads.
  EXPECT_EQ(judge(seq_, 7, 1, 7), absl::StatusCode::kInvalidArgument);
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {1, 4});
  auto r = Request(fd, 8, seq_, 1, plan, &rows);
  EXPECT_EQ(r.request_id, 8u);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 1, plan.view()));
  close(fd);
}

// A legitimate but large frame: the buffer grows with the bytes that came,
// not with the size the header announced.
TEST_F(FetchSocketServerTest, BuffersGrowOnlyAsBytesArrive) {
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  // 2 x 1000 indices: an 8 KiB body whose rows just fit the 64 KiB limit.
  std::vector<int32_t> positions(1000);
  for (int i = 0; i < 1000; ++i) positions[i] = (i * 5) % 8;
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, positions);
  std::vector<int32_t> body = plan.head_offsets;
  body.insert(body.end(), plan.indices.begin(), plan.indices.end());
  fetch_wire::FetchRequestHeader q;
  q.sequence_id = seq_;
  q.n_offsets = 3;
  q.n_indices = plan.indices.size();
  q.layer = 1;
  q.request_id = 1;
  iovec iov[2] = {{&q, sizeof(q)}, {body.data(), 64}};
  ASSERT_TRUE(fetch_wire::SendAll(fd, iov, 2).ok());
  // Wait until the server has read what was sent (no time bound: the test
  // only looks at what is buffered once it has).
  while (server_->GetStats().body_bytes_received < 64) usleep(1000);
  const FetchSocketStats stats = server_->GetStats();
  EXPECT_GE(stats.buffer_bytes, 64);
  EXPECT_LE(stats.buffer_bytes, 4096);  // the first chunk, not the 8 KiB
  // The rest, in pieces: the rows come back bit for bit.
  for (size_t off = 64; off < body.size() * 4; off += 1000) {
    iov[0] = {reinterpret_cast<char*>(body.data()) + off,
              std::min<size_t>(1000, body.size() * 4 - off)};
    ASSERT_TRUE(fetch_wire::SendAll(fd, iov, 1).ok());
  }
  std::vector<uint16_t> rows;
  auto r = Response(fd, &rows);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 1, plan.view()));
  r = Request(fd, 2, seq_, 0, plan, &rows);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 0, plan.view()));
  close(fd);
}

// Issue 18, finding 4: silent peers that never say Hello used to hold a
// thread and a connection slot each, forever; max_connections of them
// locked every worker out. Now they wait in a small handshake pool (oldest
// dropped first) and an authenticated client always gets in.
TEST(FetchSocketLimitsTest, SilentPeersCannotLockOutAClient) {
  auto store = std::make_shared<KvStore>(KvStoreOptions{});
  const SequenceGeometry g = MakeGeometry(1, 2, 8, 16);
  const SequenceId seq = *store->Open(g);
  ASSERT_TRUE(store->Append(seq, MakeTestBlock(4, g, 0, 1, 0, 4).block).ok());
  FetchSocketServerOptions options;
  options.auth_token = "tok";
  options.max_connections = 4;
  options.max_handshakes = 4;
  auto server = FetchSocketServer::Start(store, options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto dial = [&] {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((*server)->port());
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  };
  std::vector<int> silent;
  for (int i = 0; i < 32; ++i) silent.push_back(dial());
  for (int round = 0; round < 3; ++round) {
    const int fd = dial();
    fetch_wire::Hello hello;
    const std::string token = "Bearer tok";
    hello.token_bytes = token.size();
    iovec iov[2] = {{&hello, sizeof(hello)},
                    {const_cast<char*>(token.data()), token.size()}};
    ASSERT_TRUE(fetch_wire::SendAll(fd, iov, 2).ok());
    fetch_wire::HelloReply reply;
    ASSERT_TRUE(fetch_wire::RecvAll(fd, &reply, sizeof(reply)).ok());
    ASSERT_TRUE(fetch_wire::Discard(fd, reply.message_bytes).ok());
    ASSERT_EQ(reply.status_code, 0) << "round " << round;
    const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {0, 3});
    fetch_wire::FetchRequestHeader q;
    q.n_offsets = 3;
    q.n_indices = plan.indices.size();
    q.sequence_id = seq;
    q.request_id = 1;
    iovec req[3] = {
        {&q, sizeof(q)},
        {const_cast<int32_t*>(plan.head_offsets.data()), 12},
        {const_cast<int32_t*>(plan.indices.data()), q.n_indices * 4}};
    ASSERT_TRUE(fetch_wire::SendAll(fd, req, 3).ok());
    fetch_wire::FetchResponseHeader r;
    ASSERT_TRUE(fetch_wire::RecvAll(fd, &r, sizeof(r)).ok());
    ASSERT_EQ(r.status_code, 0);
    std::vector<uint16_t> rows(r.rows_bytes / 2);
    ASSERT_TRUE(fetch_wire::RecvAll(fd, rows.data(), r.rows_bytes).ok());
    EXPECT_EQ(rows, ExpectedRows(4, g, 0, plan.view()));
    close(fd);
    for (int i = 0; i < 8; ++i) silent.push_back(dial());
  }
  const FetchSocketStats stats = (*server)->GetStats();
  EXPECT_LE(stats.handshakes, 4);
  EXPECT_GE(stats.dropped_handshakes, 32 + 16 - 4);
  for (int fd : silent) close(fd);
}

// A peer that connects and says nothing is closed after the handshake
// timeout; one that says Hello and then nothing, after the idle timeout.
TEST(FetchSocketLimitsTest, SilentAndIdlePeersAreClosed) {
  auto store = std::make_shared<KvStore>(KvStoreOptions{});
  FetchSocketServerOptions options;
  options.handshake_timeout = absl::Milliseconds(50);
  options.idle_timeout = absl::Milliseconds(50);
  auto server = FetchSocketServer::Start(store, options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int silent = socket(AF_INET, SOCK_STREAM, 0);
  const int idle = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons((*server)->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(silent, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(connect(idle, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  fetch_wire::Hello hello;
  iovec iov = {&hello, sizeof(hello)};
  ASSERT_TRUE(fetch_wire::SendAll(idle, &iov, 1).ok());
  fetch_wire::HelloReply reply;
  ASSERT_TRUE(fetch_wire::RecvAll(idle, &reply, sizeof(reply)).ok());
  ASSERT_EQ(reply.status_code, 0);
  char c;
  EXPECT_EQ(recv(silent, &c, 1, 0), 0);  // blocks until the server closes
  EXPECT_EQ(recv(idle, &c, 1, 0), 0);
  const FetchSocketStats stats = (*server)->GetStats();
  EXPECT_EQ(stats.handshakes, 0);
  EXPECT_EQ(stats.connections, 0);
  EXPECT_EQ(stats.timed_out, 2);
  close(silent);
  close(idle);
}

TEST_F(FetchSocketServerTest, StopClosesConnections) {
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  server_->Stop();
  EXPECT_TRUE(Closed(fd));
  close(fd);
  server_->Stop();  // idempotent
}

}  // namespace
}  // namespace infinigen::kv_memory_service
