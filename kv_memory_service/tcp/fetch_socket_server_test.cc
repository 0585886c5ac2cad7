// The fetch socket at the protocol level: what a client that is not our
// KvClient (or a hostile one) gets for each kind of bad frame, and that the
// server keeps serving everyone else; the same over TLS, where peers
// without the right certificate, plaintext peers and stalled handshakes
// are dropped (certificates: kv_memory_service/testing/tls).
#include "kv_memory_service/tcp/fetch_socket_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file.h"
#include "common/server_tls.h"
#include "gtest/gtest.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_wire.h"
#include "kv_memory_service/testing/kv_test_data.h"

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
    options.credentials = Credentials::Single("tok");
    options.max_message_bytes = 1 << 16;
    Configure(&options);
    auto server = FetchSocketServer::Start(store_, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  virtual void Configure(FetchSocketServerOptions* options) {}

  int Dial(int receive_buffer = 0) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (receive_buffer > 0) {
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer,
                 sizeof(receive_buffer));
    }
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(server_->port());
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  }

  // Sends `hello` (its token_bytes set here) with `token` and returns the
  // reply: its code and message; Unknown when none came.
  static absl::Status SendHello(int fd, const std::string& token,
                                fetch_wire::Hello hello = {}) {
    hello.token_bytes = static_cast<uint32_t>(token.size());
    iovec iov[2] = {{&hello, sizeof(hello)},
                    {const_cast<char*>(token.data()), token.size()}};
    EXPECT_TRUE(fetch_wire::SendAll(fd, iov, token.empty() ? 1 : 2).ok());
    fetch_wire::HelloReply reply;
    if (!fetch_wire::RecvAll(fd, &reply, sizeof(reply)).ok()) {
      return absl::UnknownError("no Hello reply");
    }
    std::string message(reply.message_bytes, '\0');
    EXPECT_TRUE(fetch_wire::RecvAll(fd, message.data(), message.size()).ok());
    return absl::Status(static_cast<absl::StatusCode>(reply.status_code),
                        message);
  }

  // Sends a Hello with `token` and returns the reply's code.
  absl::StatusCode Hello(int fd, const std::string& token,
                         uint32_t magic = fetch_wire::kHelloMagic) {
    fetch_wire::Hello hello;
    hello.magic = magic;
    return SendHello(fd, token, hello).code();
  }

  // Sends a request; returns the response header (rows into `rows`).
  fetch_wire::FetchResponseHeader Request(int fd, uint64_t id, SequenceId seq,
                                          int layer,
                                          const OwnedFetchPlan& plan,
                                          std::vector<uint16_t>* rows,
                                          SessionId session = 0,
                                          uint32_t magic =
                                              fetch_wire::kRequestMagic) {
    fetch_wire::FetchRequestHeader q;
    q.magic = magic;
    q.session_id = session;
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

  // Sends `block` as an append (kAppendMagic) with `values` of its K
  // values and as many of its V values (default: all), then `meta` as its
  // annotations; returns the response header (the evicted tokens' triples
  // into `evicted`).
  fetch_wire::FetchResponseHeader Append(int fd, uint64_t id, SequenceId seq,
                                         const AppendBlock& block,
                                         std::vector<int32_t>* evicted,
                                         SessionId session = 0,
                                         int64_t values = -1,
                                         std::string meta = "") {
    fetch_wire::FetchRequestHeader q;
    q.magic = fetch_wire::kAppendMagic;
    q.session_id = session;
    q.n_offsets = static_cast<uint32_t>(block.n_layers);
    q.n_indices = static_cast<uint32_t>(block.n_tokens);
    q.layer = block.first_layer;
    q.request_id = id;
    q.sequence_id = seq;
    q.dest_elements = values < 0 ? block.k.size() : values;
    uint64_t meta_bytes = meta.size();
    iovec iov[5] = {
        {&q, sizeof(q)},
        {&meta_bytes, sizeof(meta_bytes)},
        {const_cast<uint16_t*>(block.k.data()), q.dest_elements * 2},
        {const_cast<uint16_t*>(block.v.data()), q.dest_elements * 2},
        {meta.data(), meta.size()}};
    EXPECT_TRUE(fetch_wire::SendAll(fd, iov, 5).ok());
    std::vector<uint16_t> rows;
    fetch_wire::FetchResponseHeader r = Response(fd, &rows);
    evicted->resize(rows.size() / 2);
    if (!rows.empty()) {
      std::memcpy(evicted->data(), rows.data(), rows.size() * 2);
    }
    return r;
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

// A sequence opened in a session serves its rows to that session
// alone; another session (or none) holding its id gets NotFound, as for an
// id never handed out, and the connection goes on serving.
TEST_F(FetchSocketServerTest, OnlyTheOwningSessionReadsASequence) {
  const SessionId owner = *store_->OpenSession();
  const SessionId other = *store_->OpenSession();
  const SequenceId seq = *store_->Open(g_, owner);
  ASSERT_TRUE(store_->Append(seq, MakeTestBlock(4, g_, 0, 2, 0, 8).block).ok());
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{1, 6}, {2}});
  std::vector<uint16_t> rows;
  for (SessionId intruder : {other, SessionId{0}, owner + 1}) {
    auto r = Request(fd, 1, seq, 0, plan, &rows, intruder);
    EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kNotFound))
        << intruder;
    EXPECT_EQ(r.rows_bytes, 0u);
  }
  auto r = Request(fd, 2, seq, 0, plan, &rows, owner);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(4, g_, 0, plan.view()));
  close(fd);
}

// A note of rows the client holds is answered without rows and counted in
// the rows' fetch statistics as a gather's rows are; a bad one gets the
// gather's error, the owner check included, and the connection goes on
// serving.
TEST_F(FetchSocketServerTest, ANoteIsCountedAndAnsweredWithoutRows) {
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{7, 0}, {3}});
  std::vector<uint16_t> rows = {1, 2, 3};
  auto r = Request(fd, 1, seq_, 1, plan, &rows, 0, fetch_wire::kHeldMagic);
  EXPECT_EQ(r.request_id, 1u);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(r.rows_bytes, 0u);
  absl::StatusOr<std::vector<TokenFetchStats>> head0 =
      store_->GetTokenStats(seq_, 1, 0);
  ASSERT_TRUE(head0.ok()) << head0.status();
  for (const TokenFetchStats& t : *head0) {
    EXPECT_EQ(t.fetch_count, t.position == 7 || t.position == 0 ? 1 : 0)
        << t.position;
  }
  EXPECT_EQ(store_->GetStoreStats().fetched_rows, 3);

  r = Request(fd, 2, seq_, 1, OwnedFetchPlan::PerHead({{8}, {}}), &rows, 0,
              fetch_wire::kHeldMagic);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kOutOfRange));
  const SessionId owner = *store_->OpenSession();
  const SequenceId owned = *store_->Open(g_, owner);
  ASSERT_TRUE(
      store_->Append(owned, MakeTestBlock(4, g_, 0, 2, 0, 8).block).ok());
  r = Request(fd, 3, owned, 0, plan, &rows, owner + 1, fetch_wire::kHeldMagic);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(store_->GetStoreStats().fetched_rows, 3);
  r = Request(fd, 4, seq_, 1, plan, &rows);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 1, plan.view()));
  close(fd);
}

// A prefill's chunks and decode steps cross the socket as appends: the
// rows are stored as sent, and the response names the tokens evicted to
// make room, exactly as the store's own Append does.
TEST_F(FetchSocketServerTest, AnAppendStoresItsRowsAndNamesTheEvictions) {
  auto ref = std::make_shared<KvStore>(KvStoreOptions{});
  const SequenceId ref_seq = *ref->Open(g_);
  ASSERT_TRUE(
      ref->Append(ref_seq, MakeTestBlock(3, g_, 0, 2, 0, 8).block).ok());
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  int position = 8;
  uint64_t id = 1;
  size_t evictions = 0;
  for (const int tokens : {5, 1, 4, 1}) {  // past max_tokens 16: evicts
    SCOPED_TRACE(tokens);
    testdata::TestBlock b = MakeTestBlock(3, g_, 0, 2, position, tokens);
    std::vector<int32_t> evicted;
    auto r = Append(fd, id, seq_, b.block, &evicted);
    EXPECT_EQ(r.request_id, id);
    ASSERT_EQ(r.status_code, 0);
    absl::StatusOr<AppendResult> want = ref->Append(ref_seq, b.block);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(evicted.size(), 3 * want->evicted.size());
    for (size_t i = 0; i < want->evicted.size(); ++i) {
      EXPECT_EQ(evicted[3 * i], want->evicted[i].layer);
      EXPECT_EQ(evicted[3 * i + 1], want->evicted[i].kv_head);
      EXPECT_EQ(evicted[3 * i + 2], want->evicted[i].position);
    }
    evictions += want->evicted.size();
    position += tokens;
    ++id;
  }
  EXPECT_EQ(evictions, 2u * 2 * 3);  // 19 tokens in 16: 3 per layer and head
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {12, 18, 9});
  std::vector<uint16_t> rows;
  auto r = Request(fd, id, seq_, 1, plan, &rows);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 1, plan.view()));
  close(fd);
}

// An append whose header does not describe a block of its sequence is
// refused before its body, which is then dropped as it comes, with
// nothing appended and the connection serving on; one announcing more
// than a frame may hold closes the connection, as any oversized frame.
TEST_F(FetchSocketServerTest, AnAppendsHeaderIsJudgedAgainstItsSequence) {
  const int fd = Dial();
  ASSERT_EQ(Hello(fd, "Bearer tok"), absl::StatusCode::kOk);
  const SessionId owner = *store_->OpenSession();
  const SequenceId owned = *store_->Open(g_, owner);
  testdata::TestBlock b = MakeTestBlock(3, g_, 0, 2, 8, 2);
  std::vector<int32_t> evicted;
  auto code = [](const fetch_wire::FetchResponseHeader& r) {
    return static_cast<absl::StatusCode>(r.status_code);
  };
  EXPECT_EQ(code(Append(fd, 1, seq_ + 99, b.block, &evicted)),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(code(Append(fd, 2, owned, b.block, &evicted, owner + 1)),
            absl::StatusCode::kNotFound);
  // K values that are not layers x tokens x heads x head_dim.
  EXPECT_EQ(
      code(Append(fd, 3, seq_, b.block, &evicted, 0, b.block.k.size() - 2)),
      absl::StatusCode::kInvalidArgument);
  testdata::TestBlock past = MakeTestBlock(3, g_, 1, 2, 8, 2);  // layers 1-2
  EXPECT_EQ(code(Append(fd, 4, seq_, past.block, &evicted)),
            absl::StatusCode::kInvalidArgument);
  // Annotations whose sizes do not add up.
  std::string bad_meta(12, '\0');
  bad_meta[0] = 1;    // one annotation,
  bad_meta[8] = 100;  // of 100 bytes, in none
  EXPECT_EQ(code(Append(fd, 41, seq_, b.block, &evicted, 0, -1, bad_meta)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->GetSequenceStats(seq_)->geometry.n_layers, 2);
  EXPECT_EQ(store_->GetSequenceStats(seq_)->present_rows, 2 * 2 * 8);
  // The stream is still in step: a fetch, then a good append.
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {7});
  std::vector<uint16_t> rows;
  auto r = Request(fd, 5, seq_, 0, plan, &rows);
  EXPECT_EQ(r.status_code, 0);
  EXPECT_EQ(rows, ExpectedRows(3, g_, 0, plan.view()));
  EXPECT_EQ(code(Append(fd, 6, seq_, b.block, &evicted)),
            absl::StatusCode::kOk);
  EXPECT_EQ(store_->GetSequenceStats(seq_)->present_rows, 2 * 2 * 10);

  fetch_wire::FetchRequestHeader q;
  q.magic = fetch_wire::kAppendMagic;
  q.sequence_id = seq_;
  q.n_offsets = 2;
  q.n_indices = 1;
  q.dest_elements = uint64_t{1} << 62;  // 2^64 bytes and more
  uint64_t no_meta = 0;
  iovec iov[2] = {{&q, sizeof(q)}, {&no_meta, sizeof(no_meta)}};
  ASSERT_TRUE(fetch_wire::SendAll(fd, iov, 2).ok());
  r = Response(fd, &rows);
  EXPECT_EQ(r.status_code,
            static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(Closed(fd));
  close(fd);
  EXPECT_EQ(store_->GetSequenceStats(seq_)->present_rows, 2 * 2 * 10);
}

// A client of another protocol version (one whose requests name no
// session) is told so at the Hello, not misread.
TEST_F(FetchSocketServerTest, AnOlderProtocolVersionIsRefusedByName) {
  const int fd = Dial();
  fetch_wire::Hello hello;
  hello.version = fetch_wire::kVersion - 1;
  const absl::Status reply = SendHello(fd, "Bearer tok", hello);
  EXPECT_EQ(reply.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(
      reply.message(), absl::StrCat("protocol version ", hello.version)))
      << reply;
  EXPECT_TRUE(Closed(fd));
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

// A header announcing a large body is judged before
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

// Silent peers that never say Hello used to hold a
// thread and a connection slot each, forever; max_connections of them
// locked every worker out. Now they wait in a small handshake pool (oldest
// dropped first) and an authenticated client always gets in.
TEST(FetchSocketLimitsTest, SilentPeersCannotLockOutAClient) {
  auto store = std::make_shared<KvStore>(KvStoreOptions{});
  const SequenceGeometry g = MakeGeometry(1, 2, 8, 16);
  const SequenceId seq = *store->Open(g);
  ASSERT_TRUE(store->Append(seq, MakeTestBlock(4, g, 0, 1, 0, 4).block).ok());
  FetchSocketServerOptions options;
  options.credentials = Credentials::Single("tok");
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

std::string Pem(const std::string& name) {
  absl::StatusOr<std::string> text =
      ReadFileToString("kv_memory_service/testing/tls/" + name);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.value_or("");
}

using fetch_tls::TlsClientStream;

// A TLS client's end: a session, or why the handshake failed.
struct TlsPeer {
  int fd = -1;
  std::unique_ptr<TlsClientStream> stream;
  absl::Status error;
  ~TlsPeer() {
    stream.reset();
    if (fd >= 0) close(fd);
  }
};

// The fetch socket under mutual TLS: the node's certificate, clients'
// certificates from the test CA.
class TlsFetchSocketServerTest : public FetchSocketServerTest {
 protected:
  void Configure(FetchSocketServerOptions* options) override {
    auto ctx = NewServerTlsContext(
        ServerTlsPem{Pem("server.pem"), Pem("server.key"), Pem("ca.pem")});
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    options->tls = *std::move(ctx);
  }

  // A TLS session as a client that trusts `ca` and presents `cert` (none
  // when empty), checking the server's certificate against 127.0.0.1;
  // `receive_buffer` bytes of SO_RCVBUF (0: the system's).
  std::unique_ptr<TlsPeer> TlsDial(const std::string& ca = "ca.pem",
                                   const std::string& cert = "client",
                                   int receive_buffer = 0) {
    auto peer = std::make_unique<TlsPeer>();
    peer->fd = Dial(receive_buffer);
    auto ctx =
        NewClientTlsContext(Pem(ca), cert.empty() ? "" : Pem(cert + ".pem"),
                            cert.empty() ? "" : Pem(cert + ".key"));
    EXPECT_TRUE(ctx.ok()) << ctx.status();
    if (!ctx.ok()) return peer;
    auto stream = TlsClientStream::Connect(peer->fd, ctx->get(), "127.0.0.1",
                                           absl::Seconds(10));
    if (stream.ok()) {
      peer->stream = *std::move(stream);
    } else {
      peer->error = stream.status();
    }
    return peer;
  }

  // A Hello through the session: the reply's code and message, or the
  // error that ended the connection.
  static absl::Status TlsHello(TlsClientStream* s, const std::string& token) {
    fetch_wire::Hello hello;
    hello.token_bytes = static_cast<uint32_t>(token.size());
    iovec iov[2] = {{&hello, sizeof(hello)},
                    {const_cast<char*>(token.data()), token.size()}};
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    absl::Status status = s->Send(iov, 2, absl::Seconds(10));
    fetch_wire::HelloReply reply;
    if (status.ok()) status = s->Recv(&reply, sizeof(reply), deadline);
    if (!status.ok()) return status;
    std::string message(reply.message_bytes, '\0');
    status = s->Recv(message.data(), message.size(), deadline);
    if (!status.ok()) return status;
    return absl::Status(static_cast<absl::StatusCode>(reply.status_code),
                        message);
  }

  // Sends the requests of `plan`, ids first_id.., all in one Send.
  static void TlsSendRequests(TlsClientStream* s, uint64_t first_id, int count,
                              SequenceId seq, int layer,
                              const OwnedFetchPlan& plan) {
    std::string frames;
    for (int i = 0; i < count; ++i) {
      fetch_wire::FetchRequestHeader q;
      q.n_offsets = static_cast<uint32_t>(plan.head_offsets.size());
      q.n_indices = static_cast<uint32_t>(plan.indices.size());
      q.layer = layer;
      q.request_id = first_id + i;
      q.sequence_id = seq;
      frames.append(reinterpret_cast<const char*>(&q), sizeof(q));
      frames.append(reinterpret_cast<const char*>(plan.head_offsets.data()),
                    q.n_offsets * 4);
      frames.append(reinterpret_cast<const char*>(plan.indices.data()),
                    q.n_indices * 4);
    }
    iovec iov = {frames.data(), frames.size()};
    EXPECT_TRUE(s->Send(&iov, 1, absl::Seconds(10)).ok());
  }

  static fetch_wire::FetchResponseHeader TlsResponse(
      TlsClientStream* s, std::vector<uint16_t>* rows) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    fetch_wire::FetchResponseHeader r;
    r.magic = 0;
    if (!s->Recv(&r, sizeof(r), deadline).ok()) return r;
    std::string message(r.message_bytes, '\0');
    EXPECT_TRUE(s->Recv(message.data(), message.size(), deadline).ok());
    rows->resize(r.rows_bytes / 2);
    EXPECT_TRUE(s->Recv(rows->data(), r.rows_bytes, deadline).ok());
    return r;
  }

  // A client with the right certificate says Hello and gets bit-exact rows.
  void ExpectServed() {
    std::unique_ptr<TlsPeer> peer = TlsDial();
    ASSERT_NE(peer->stream, nullptr) << peer->error;
    ASSERT_TRUE(TlsHello(peer->stream.get(), "Bearer tok").ok());
    const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{7, 0}, {3}});
    TlsSendRequests(peer->stream.get(), 1, 1, seq_, 1, plan);
    std::vector<uint16_t> rows;
    auto r = TlsResponse(peer->stream.get(), &rows);
    EXPECT_EQ(r.status_code, 0);
    EXPECT_EQ(r.request_id, 1u);
    EXPECT_EQ(rows, ExpectedRows(3, g_, 1, plan.view()));
  }
};

TEST_F(TlsFetchSocketServerTest, ServesBitExactRowsOverTls) {
  ExpectServed();
  // Pipelined requests whose 64000-byte responses span several TLS records,
  // sent on one thread and read on another: every response, in order, bit
  // for bit.
  std::vector<int32_t> positions(1000);
  for (int i = 0; i < 1000; ++i) positions[i] = (i * 3) % 8;
  const OwnedFetchPlan big = OwnedFetchPlan::SameForAllHeads(2, positions);
  const std::vector<uint16_t> want = ExpectedRows(3, g_, 0, big.view());
  constexpr int kRequests = 40;
  std::unique_ptr<TlsPeer> peer = TlsDial();
  ASSERT_NE(peer->stream, nullptr) << peer->error;
  ASSERT_TRUE(TlsHello(peer->stream.get(), "Bearer tok").ok());
  std::thread sender([&] {
    TlsSendRequests(peer->stream.get(), 1, kRequests, seq_, 0, big);
  });
  std::vector<uint16_t> rows;
  for (int i = 0; i < kRequests; ++i) {
    auto r = TlsResponse(peer->stream.get(), &rows);
    ASSERT_EQ(r.status_code, 0) << i;
    ASSERT_EQ(r.request_id, static_cast<uint64_t>(i + 1));
    ASSERT_EQ(rows, want) << i;
  }
  sender.join();
  // A failed fetch keeps the session up.
  TlsSendRequests(peer->stream.get(), 99, 1, seq_ + 1, 0, big);
  auto r = TlsResponse(peer->stream.get(), &rows);
  EXPECT_EQ(r.request_id, 99u);
  EXPECT_EQ(r.status_code, static_cast<int>(absl::StatusCode::kNotFound));
}

// Small requests for large replies, from a client with a small receive
// buffer that starts reading late: the server's session has taken every
// request off the socket when its replies stall (6 MB, over what its send
// buffer grows to), so epoll has nothing more to say about them; they are
// served once the stalled reply goes out.
TEST_F(TlsFetchSocketServerTest, RequestsTheSessionHoldsAreServedAfterAStall) {
  // One index brings 1 KiB of rows: 60 of them, 60 KiB for 288 bytes.
  const SequenceGeometry wide = MakeGeometry(1, 1, 256, 64);
  const SequenceId seq = *store_->Open(wide);
  ASSERT_TRUE(store_->Append(seq, MakeTestBlock(5, wide, 0, 1, 0, 64).block)
                  .ok());
  std::vector<int32_t> positions(60);
  for (int i = 0; i < 60; ++i) positions[i] = (i * 7) % 64;
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, positions);
  const std::vector<uint16_t> want = ExpectedRows(5, wide, 0, plan.view());
  constexpr int kRequests = 100;
  std::unique_ptr<TlsPeer> peer =
      TlsDial("ca.pem", "client", /*receive_buffer=*/4096);
  ASSERT_NE(peer->stream, nullptr) << peer->error;
  ASSERT_TRUE(TlsHello(peer->stream.get(), "Bearer tok").ok());
  TlsSendRequests(peer->stream.get(), 1, kRequests, seq, 0, plan);
  absl::SleepFor(absl::Milliseconds(300));
  std::vector<uint16_t> rows;
  for (int i = 0; i < kRequests; ++i) {
    auto r = TlsResponse(peer->stream.get(), &rows);
    ASSERT_EQ(r.status_code, 0) << i;
    ASSERT_EQ(r.request_id, static_cast<uint64_t>(i + 1));
    ASSERT_EQ(rows, want) << i;
  }
}

// 200 small requests in one TLS record: the server's session decrypts them
// all at once, more than one turn of its loop serves, and the socket has
// nothing more to say; every one is answered.
TEST_F(TlsFetchSocketServerTest, ARecordOfManyRequestsIsServedWhole) {
  std::unique_ptr<TlsPeer> peer = TlsDial();
  ASSERT_NE(peer->stream, nullptr) << peer->error;
  ASSERT_TRUE(TlsHello(peer->stream.get(), "Bearer tok").ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::PerHead({{1}, {2}});
  const std::vector<uint16_t> want = ExpectedRows(3, g_, 1, plan.view());
  // 68 bytes each (a 48-byte header, 3 offsets, 2 indices): 13600 bytes,
  // one record (at most 16 KiB).
  constexpr int kRequests = 200;
  static_assert(sizeof(fetch_wire::FetchRequestHeader) + 5 * 4 == 68);
  TlsSendRequests(peer->stream.get(), 1, kRequests, seq_, 1, plan);
  std::vector<uint16_t> rows;
  for (int i = 0; i < kRequests; ++i) {
    auto r = TlsResponse(peer->stream.get(), &rows);
    ASSERT_EQ(r.status_code, 0) << i;
    ASSERT_EQ(r.request_id, static_cast<uint64_t>(i + 1));
    ASSERT_EQ(rows, want) << i;
  }
}

TEST_F(TlsFetchSocketServerTest, AWrongTokenIsStillRefusedAtTheHello) {
  std::unique_ptr<TlsPeer> peer = TlsDial();
  ASSERT_NE(peer->stream, nullptr) << peer->error;
  EXPECT_EQ(TlsHello(peer->stream.get(), "Bearer nope").code(),
            absl::StatusCode::kUnauthenticated);
  ExpectServed();
}

TEST_F(TlsFetchSocketServerTest, PeersWithoutTheRightCertificateAreRefused) {
  // Held open across the refusals: an authenticated client is not harmed.
  std::unique_ptr<TlsPeer> held = TlsDial();
  ASSERT_NE(held->stream, nullptr) << held->error;
  ASSERT_TRUE(TlsHello(held->stream.get(), "Bearer tok").ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(2, {5, 1});
  auto held_fetch = [&] {
    std::vector<uint16_t> rows;
    TlsSendRequests(held->stream.get(), 7, 1, seq_, 0, plan);
    auto r = TlsResponse(held->stream.get(), &rows);
    EXPECT_EQ(r.status_code, 0);
    EXPECT_EQ(rows, ExpectedRows(3, g_, 0, plan.view()));
  };
  int64_t refused = server_->GetStats().refused;

  // Plaintext: a Hello is answered, in plaintext, that the socket speaks TLS.
  {
    const int fd = Dial();
    const absl::Status reply = SendHello(fd, "");
    EXPECT_EQ(reply.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(reply.message(), "speaks TLS")) << reply;
    EXPECT_TRUE(Closed(fd));
    close(fd);
    EXPECT_EQ(server_->GetStats().refused, ++refused);
  }
  held_fetch();
  ExpectServed();

  // Garbage that is neither TLS nor a Hello.
  {
    const int fd = Dial();
    const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    iovec iov = {const_cast<char*>(junk), sizeof(junk) - 1};
    ASSERT_TRUE(fetch_wire::SendAll(fd, &iov, 1).ok());
    fetch_wire::HelloReply reply;
    ASSERT_TRUE(fetch_wire::RecvAll(fd, &reply, sizeof(reply)).ok());
    ASSERT_TRUE(fetch_wire::Discard(fd, reply.message_bytes).ok());
    EXPECT_EQ(reply.status_code,
              static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_TRUE(Closed(fd));
    close(fd);
    EXPECT_EQ(server_->GetStats().refused, ++refused);
  }
  held_fetch();
  ExpectServed();

  // No client certificate; a certificate from another CA. Under TLS 1.3
  // the client's handshake ends before the server has judged its
  // certificate: the refusal arrives as an alert in place of the reply.
  for (const std::string cert : {"", "other"}) {
    std::unique_ptr<TlsPeer> peer = TlsDial("ca.pem", cert);
    absl::Status status = peer->error;
    if (peer->stream != nullptr) {
      status = TlsHello(peer->stream.get(), "Bearer tok");
    }
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable)
        << "cert '" << cert << "': " << status;
    // Counted once the server's loop has seen it.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (server_->GetStats().refused == refused && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(server_->GetStats().refused, ++refused) << cert;
    held_fetch();
    ExpectServed();
  }

  // A client that does not trust the server's CA gives up itself.
  {
    std::unique_ptr<TlsPeer> peer = TlsDial("other.pem", "client");
    EXPECT_EQ(peer->stream, nullptr);
    EXPECT_EQ(peer->error.code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(peer->error.message().find("certificate verify failed"),
              std::string::npos)
        << peer->error;
  }
  held_fetch();
  ExpectServed();
  // Every refused peer leaves the handshake pool (each once its loop has
  // closed it).
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (server_->GetStats().handshakes > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(server_->GetStats().handshakes, 0);
}

// The client checks the server's certificate against the name it dials
// (or the one it is told to check): the test certificate names localhost
// and 127.0.0.1.
TEST_F(TlsFetchSocketServerTest, TheClientChecksTheServersName) {
  auto ctx =
      NewClientTlsContext(Pem("ca.pem"), Pem("client.pem"), Pem("client.key"));
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  for (const std::string name : {"localhost", "127.0.0.1"}) {
    const int fd = Dial();
    auto stream =
        TlsClientStream::Connect(fd, ctx->get(), name, absl::Seconds(10));
    EXPECT_TRUE(stream.ok()) << name << ": " << stream.status();
    if (stream.ok()) {
      EXPECT_TRUE(TlsHello(stream->get(), "Bearer tok").ok()) << name;
    }
    stream = absl::UnavailableError("");
    close(fd);
  }
  for (const std::string name : {"example.com", "127.0.0.2"}) {
    const int fd = Dial();
    auto stream =
        TlsClientStream::Connect(fd, ctx->get(), name, absl::Seconds(10));
    EXPECT_EQ(stream.status().code(), absl::StatusCode::kUnavailable) << name;
    EXPECT_NE(stream.status().message().find("mismatch"), std::string::npos)
        << stream.status();
    close(fd);
  }
  ExpectServed();
}

// A peer that opens a connection and never finishes the TLS handshake
// (silent, or stalled after the first bytes of a ClientHello), or finishes
// it and never says Hello, is closed after the handshake timeout.
TEST(TlsFetchSocketLimitsTest, UnfinishedHandshakesAreDropped) {
  auto store = std::make_shared<KvStore>(KvStoreOptions{});
  FetchSocketServerOptions options;
  auto ctx = NewServerTlsContext(
      ServerTlsPem{Pem("server.pem"), Pem("server.key"), Pem("ca.pem")});
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  options.tls = *ctx;
  options.handshake_timeout = absl::Milliseconds(300);
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
  const absl::Time start = absl::Now();
  const int silent = dial();
  const int stalled = dial();
  const unsigned char partial[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01};
  ASSERT_EQ(send(stalled, partial, sizeof(partial), 0),
            static_cast<ssize_t>(sizeof(partial)));
  const int no_hello = dial();
  auto client_ctx =
      NewClientTlsContext(Pem("ca.pem"), Pem("client.pem"), Pem("client.key"));
  ASSERT_TRUE(client_ctx.ok()) << client_ctx.status();
  auto session = TlsClientStream::Connect(no_hello, client_ctx->get(),
                                          "127.0.0.1", absl::Seconds(10));
  ASSERT_TRUE(session.ok()) << session.status();
  char c;
  EXPECT_EQ(recv(silent, &c, 1, 0), 0);  // blocks until the server closes
  EXPECT_LE(recv(stalled, &c, 1, 0), 0);
  EXPECT_EQ((*session)->Recv(&c, 1, absl::Now() + absl::Seconds(10)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
  // The session's close_notify leaves before the server uncounts it.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((*server)->GetStats().timed_out < 3 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const FetchSocketStats stats = (*server)->GetStats();
  EXPECT_EQ(stats.handshakes, 0);
  EXPECT_EQ(stats.connections, 0);
  EXPECT_EQ(stats.timed_out, 3);
  session->reset();
  close(silent);
  close(stalled);
  close(no_hello);
}

}  // namespace
}  // namespace infinigen::kv_memory_service
