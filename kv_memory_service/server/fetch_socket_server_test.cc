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
