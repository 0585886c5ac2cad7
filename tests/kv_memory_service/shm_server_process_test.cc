// The shared-memory data plane against the real kv_memory_server binary
// (--shm_listen), as a separate process: many concurrent clients with rows
// checked bit for bit, bad input answered with the same codes as the gRPC
// plane, and what a client sees when the server is SIGKILLed or stopped
// mid-stream. No timing assertions except that a dead server is noticed
// well before the (long) fetch timeout, i.e. by the data plane itself.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/testing/kv_test_data.h"
#include "tests/kv_memory_service/server_process.h"

namespace infinigen::kv_memory_service {
namespace {

using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

// A kv_memory_server with gRPC control on one unix socket and the shm data
// plane on another.
struct ShmServer {
  std::unique_ptr<ServerProcess> process;
  std::string grpc_address;  // unix:PATH
  std::string shm_address;   // shm:unix:PATH
};

ShmServer StartServer(std::vector<std::string> extra_flags = {},
                      std::string shm_path = "", std::string grpc_path = "") {
  ShmServer s;
  if (shm_path.empty()) shm_path = ServerProcess::SocketPath("shm_e2e");
  if (grpc_path.empty()) grpc_path = ServerProcess::SocketPath("shm_e2e_grpc");
  std::vector<std::string> flags = {"--listen=unix:" + grpc_path,
                                    "--shm_listen=unix:" + shm_path};
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  auto process = ServerProcess::Start(flags);
  EXPECT_TRUE(process.ok()) << process.status();
  if (!process.ok()) return s;
  s.process = *std::move(process);
  s.grpc_address = s.process->address();
  s.shm_address = "shm:unix:" + shm_path;
  return s;
}

KvClientOptions Options() {
  KvClientOptions options;
  options.connect_timeout = absl::Seconds(10);
  options.rpc_timeout = absl::Seconds(10);
  // Long, so that an error soon after a kill is the data plane noticing,
  // not the timeout.
  options.fetch_timeout = absl::Seconds(30);
  return options;
}

TEST(ShmServerProcessTest, ConcurrentClientsGetBitExactRows) {
  ShmServer server = StartServer();
  ASSERT_NE(server.process, nullptr);
  constexpr int kClients = 8;
  const SequenceGeometry g = MakeGeometry(4, 3, 64, 512);
  std::atomic<int> failures{0};
  std::atomic<int64_t> fetches{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      const uint32_t salt = 1000 + c;
      auto fail = [&](const std::string& what, const absl::Status& s) {
        ADD_FAILURE() << "client " << c << " " << what << ": " << s;
        ++failures;
      };
      auto client = ConnectKvClient(server.shm_address, Options());
      if (!client.ok()) return fail("connect", client.status());
      if ((*client)->data_plane() != "shm") {
        return fail("data plane", absl::InternalError((*client)->data_plane()));
      }
      auto id = (*client)->Open(g);
      if (!id.ok()) return fail("open", id.status());
      // Prefill of 300 tokens in one block, then decode steps of one token.
      int length = 300;
      testdata::TestBlock prefill = MakeTestBlock(salt, g, 0, g.n_layers, 0, length);
      if (auto r = (*client)->Append(*id, prefill.block); !r.ok()) {
        return fail("prefill", r.status());
      }
      std::vector<std::unique_ptr<FetchBuffer>> buffers;
      for (int b = 0; b < 2; ++b) {
        auto buffer = (*client)->NewFetchBuffer(2 * 3 * 64 * 512);
        if (!buffer.ok()) return fail("buffer", buffer.status());
        buffers.push_back(*std::move(buffer));
      }
      std::mt19937 rng(c);
      for (int step = 0; step < 60; ++step) {
        if (step % 3 == 0) {
          testdata::TestBlock t = MakeTestBlock(salt, g, 0, g.n_layers, length, 1);
          if (auto r = (*client)->Append(*id, t.block); !r.ok()) {
            return fail("decode append", r.status());
          }
          ++length;
        }
        OwnedFetchPlan plans[2];
        int layers[2];
        FetchHandle handles[2];
        for (int b = 0; b < 2; ++b) {
          std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
          const int k = step == 0 ? length : 1 + rng() % 200;
          for (auto& p : per_head) {
            for (int i = 0; i < k; ++i) p.push_back(step == 0 ? i : rng() % length);
          }
          plans[b] = OwnedFetchPlan::PerHead(per_head);
          layers[b] = rng() % g.n_layers;
          handles[b] = (*client)->FetchAsync(*id, layers[b], plans[b].view(),
                                             buffers[b].get());
        }
        for (int b = 0; b < 2; ++b) {
          absl::Status s = handles[b].Wait();
          if (!s.ok()) return fail("fetch", s);
          const auto want = ExpectedRows(salt, g, layers[b], plans[b].view());
          if (!std::equal(want.begin(), want.end(), buffers[b]->data())) {
            return fail("rows", absl::DataLossError(absl::StrCat("step ", step)));
          }
          ++fetches;
        }
      }
      auto stats = (*client)->GetSequenceStats(*id);
      if (!stats.ok() || stats->fetches != 120) {
        return fail("stats", stats.status());
      }
      if (absl::Status s = (*client)->Close(*id); !s.ok()) fail("close", s);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(fetches.load(), kClients * 120);
}

// The same bad requests through shm and through the gRPC plane of the same
// server get the same codes; the server keeps serving and nothing changes.
// Each client asks about a sequence of its own session, filled alike (a
// sequence of another session is NotFound on every plane).
TEST(ShmServerProcessTest, BadInputGetsTheSameCodesAsGrpc) {
  ShmServer server = StartServer({"--eviction=fifo"});
  ASSERT_NE(server.process, nullptr);
  auto shm = ConnectKvClient(server.shm_address, Options());
  auto grpc = ConnectKvClient(server.grpc_address, Options());
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(grpc.ok()) << grpc.status();
  const SequenceGeometry g = MakeGeometry(2, 2, 8, 4);
  auto id = (*shm)->Open(g);
  auto grpc_id = (*grpc)->Open(g);
  ASSERT_TRUE(id.ok() && grpc_id.ok());
  testdata::TestBlock b = MakeTestBlock(5, g, 0, 2, 0, 6);  // 0, 1 evicted
  ASSERT_TRUE((*shm)->Append(*id, b.block).ok());
  ASSERT_TRUE((*grpc)->Append(*grpc_id, b.block).ok());
  auto shm_buffer = (*shm)->NewFetchBuffer(64);
  auto grpc_buffer = (*grpc)->NewFetchBuffer(64);
  ASSERT_TRUE(shm_buffer.ok() && grpc_buffer.ok());
  struct Case {
    uint64_t id_offset;  // 1: an id next to the client's own
    int layer;
    OwnedFetchPlan plan;
    absl::StatusCode want;
  };
  const std::vector<Case> cases = {
      {1, 0, OwnedFetchPlan::SameForAllHeads(2, {2}), absl::StatusCode::kNotFound},
      {0, 2, OwnedFetchPlan::SameForAllHeads(2, {2}), absl::StatusCode::kInvalidArgument},
      {0, 0, OwnedFetchPlan::SameForAllHeads(3, {2}), absl::StatusCode::kInvalidArgument},
      {0, 0, OwnedFetchPlan{{2}, {0, 2, 1}}, absl::StatusCode::kInvalidArgument},
      {0, 0, OwnedFetchPlan::SameForAllHeads(2, {6}), absl::StatusCode::kOutOfRange},
      {0, 0, OwnedFetchPlan::SameForAllHeads(2, {-3}), absl::StatusCode::kInvalidArgument},
      {0, 0, OwnedFetchPlan::SameForAllHeads(2, {1}), absl::StatusCode::kFailedPrecondition},
      {0, 0, OwnedFetchPlan::SameForAllHeads(2, {2, 3, 4}), absl::StatusCode::kInvalidArgument},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const absl::Status via_shm = (*shm)->Fetch(*id + c.id_offset, c.layer,
                                               c.plan.view(), shm_buffer->get());
    const absl::Status via_grpc = (*grpc)->Fetch(
        *grpc_id + c.id_offset, c.layer, c.plan.view(), grpc_buffer->get());
    EXPECT_EQ(via_shm.code(), c.want) << "case " << i << ": " << via_shm;
    EXPECT_EQ(via_shm.code(), via_grpc.code()) << "case " << i << ": " << via_grpc;
  }
  // Each plane refuses the other session's sequence alike.
  EXPECT_EQ((*shm)->Fetch(*grpc_id, 1, cases[0].plan.view(), shm_buffer->get())
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ((*grpc)->Fetch(*id, 1, cases[0].plan.view(), grpc_buffer->get())
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ((*shm)->NewFetchBuffer(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*shm)->Fetch(*id, 0, cases[0].plan.view(), grpc_buffer->get()).code(),
            absl::StatusCode::kInvalidArgument);  // another client's buffer
  const OwnedFetchPlan good = OwnedFetchPlan::PerHead({{2, 5}, {3}});
  ASSERT_TRUE((*shm)->Fetch(*id, 1, good.view(), shm_buffer->get()).ok());
  const auto want = ExpectedRows(5, g, 1, good.view());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*shm_buffer)->data()));
  // Statistics of a sequence answer only its own session (the shm client's
  // control connection); the other client is told it does not exist.
  EXPECT_EQ((*grpc)->GetSequenceStats(*id).status().code(),
            absl::StatusCode::kNotFound);
  auto stats = (*shm)->GetSequenceStats(*id);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->fetches, 1);
  EXPECT_EQ(stats->layer_lengths, (std::vector<int32_t>{6, 6}));
}

// SIGKILL under a stream of fetches (four in flight, rows checked): every
// wait ends with Unavailable, soon, long before the 30 s fetch timeout.
TEST(ShmServerProcessTest, SigkillMidStreamFailsEveryWaitQuickly) {
  ShmServer server = StartServer();
  ASSERT_NE(server.process, nullptr);
  auto client = ConnectKvClient(server.shm_address, Options());
  ASSERT_TRUE(client.ok()) << client.status();
  const SequenceGeometry g = MakeGeometry(2, 3, 64, 1024);
  auto id = (*client)->Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock b = MakeTestBlock(9, g, 0, 2, 0, 1024);
  ASSERT_TRUE((*client)->Append(*id, b.block).ok());

  std::atomic<int64_t> good{0};
  std::atomic<int> wrong_rows{0};
  absl::Status first_error;
  absl::Time failed_at;
  std::thread fetcher([&] {
    std::vector<std::unique_ptr<FetchBuffer>> buffers;
    for (int i = 0; i < 4; ++i) {
      buffers.push_back(*(*client)->NewFetchBuffer(2 * 3 * 64 * 1024));
    }
    std::vector<int32_t> all(1024);
    for (int i = 0; i < 1024; ++i) all[i] = i;
    const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, all);
    const std::vector<uint16_t> want = ExpectedRows(9, g, 1, plan.view());
    while (true) {
      std::vector<FetchHandle> handles;
      for (auto& buffer : buffers) {
        handles.push_back((*client)->FetchAsync(*id, 1, plan.view(), buffer.get()));
      }
      absl::Status status;
      for (size_t i = 0; i < handles.size(); ++i) {
        absl::Status one = handles[i].Wait();
        if (one.ok()) {
          if (!std::equal(want.begin(), want.end(), buffers[i]->data())) ++wrong_rows;
          ++good;
        } else if (status.ok()) {
          status = one;
        }
      }
      if (!status.ok()) {
        failed_at = absl::Now();
        first_error = status;
        return;
      }
    }
  });
  for (int i = 0; i < 3000 && good.load() < 200; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GE(good.load(), 200);
  const absl::Time killed_at = absl::Now();
  server.process->Signal(SIGKILL);
  fetcher.join();
  server.process->WaitExit();
  // A SIGKILLed server leaves its socket files behind.
  const std::string shm_path = server.shm_address.substr(9);  // "shm:unix:"
  std::remove(shm_path.c_str());
  std::remove((shm_path + ".lock").c_str());
  std::remove(server.grpc_address.substr(5).c_str());  // "unix:"
  EXPECT_EQ(wrong_rows.load(), 0);
  EXPECT_EQ(first_error.code(), absl::StatusCode::kUnavailable) << first_error;
  EXPECT_LT(failed_at - killed_at, absl::Seconds(5))
      << "the fetch timeout, not the data plane, ended the wait";
  std::cerr << "after " << good.load() << " good fetches, "
            << absl::FormatDuration(failed_at - killed_at)
            << " after SIGKILL: " << first_error << "\n";

  // Later calls fail too, without hanging.
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, {0});
  EXPECT_EQ((*client)->NewFetchBuffer(64).status().code(),
            absl::StatusCode::kUnavailable);
  const absl::Status open = (*client)->Open(g).status();
  EXPECT_TRUE(open.code() == absl::StatusCode::kUnavailable ||
              open.code() == absl::StatusCode::kDeadlineExceeded)
      << open;
}

// The server is killed and started again at the same addresses: the same
// client picks it up (gRPC control and shm both reconnect by themselves);
// the old sequence is gone (NotFound), a new one works, rows bit-exact.
TEST(ShmServerProcessTest, ClientReconnectsToARestartedServer) {
  const std::string shm_path = ServerProcess::SocketPath("shm_restart");
  const std::string grpc_path = ServerProcess::SocketPath("shm_restart_grpc");
  ShmServer first = StartServer({}, shm_path, grpc_path);
  ASSERT_NE(first.process, nullptr);
  auto client = ConnectKvClient(first.shm_address, Options());
  ASSERT_TRUE(client.ok()) << client.status();
  const SequenceGeometry g = MakeGeometry(2, 3, 64, 64);
  auto id = (*client)->Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock b = MakeTestBlock(4, g, 0, 2, 0, 32);
  ASSERT_TRUE((*client)->Append(*id, b.block).ok());
  auto buffer = (*client)->NewFetchBuffer(2 * 3 * 64 * 32);
  ASSERT_TRUE(buffer.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, {0, 31, 17});
  ASSERT_TRUE((*client)->Fetch(*id, 1, plan.view(), buffer->get()).ok());

  first.process->Signal(SIGKILL);
  first.process->WaitExit();
  EXPECT_EQ((*client)->Fetch(*id, 1, plan.view(), buffer->get()).code(),
            absl::StatusCode::kUnavailable);

  ShmServer second = StartServer({}, shm_path, grpc_path);
  ASSERT_NE(second.process, nullptr);
  EXPECT_EQ((*client)->Fetch(*id, 1, plan.view(), buffer->get()).code(),
            absl::StatusCode::kNotFound);  // reconnected; a new, empty store
  absl::StatusOr<SequenceId> reopened;
  for (int attempt = 0; attempt < 100; ++attempt) {
    reopened = (*client)->Open(g);
    if (reopened.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  testdata::TestBlock again = MakeTestBlock(6, g, 0, 2, 0, 32);
  ASSERT_TRUE((*client)->Append(*reopened, again.block).ok());
  ASSERT_TRUE((*client)->Fetch(*reopened, 1, plan.view(), buffer->get()).ok());
  const auto want = ExpectedRows(6, g, 1, plan.view());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*buffer)->data()));
}

// A stopped (SIGSTOP) server: the fetch ends at the fetch timeout with
// DeadlineExceeded, naming nothing it cannot know; the node is then taken
// as unresponsive, so the next fetch fails at once (Unavailable, "not
// answering") instead of waiting out another timeout. The request was
// never taken: once the server runs again and answers a heartbeat, the same
// client and buffer work.
TEST(ShmServerProcessTest, StoppedServerTimesOutThenRecovers) {
  ShmServer server = StartServer();
  ASSERT_NE(server.process, nullptr);
  KvClientOptions options = Options();
  options.fetch_timeout = absl::Milliseconds(500);
  auto client = ConnectKvClient(server.shm_address, options);
  ASSERT_TRUE(client.ok()) << client.status();
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 8);
  auto id = (*client)->Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock b = MakeTestBlock(3, g, 0, 1, 0, 4);
  ASSERT_TRUE((*client)->Append(*id, b.block).ok());
  auto buffer = (*client)->NewFetchBuffer(64);
  ASSERT_TRUE(buffer.ok());
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {3});
  ASSERT_TRUE((*client)->Fetch(*id, 0, plan.view(), buffer->get()).ok());

  server.process->Stop();
  absl::Time start = absl::Now();
  const absl::Status timed_out =
      (*client)->Fetch(*id, 0, plan.view(), buffer->get());
  EXPECT_EQ(timed_out.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(timed_out.message()),
              ::testing::HasSubstr("no answer to a shm fetch within 500ms"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  start = absl::Now();
  const absl::Status next =
      (*client)->Fetch(*id, 0, plan.view(), buffer->get());
  EXPECT_EQ(next.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(next.message()),
              ::testing::HasSubstr("not answering (a fetch timed out after "
                                   "500ms)"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  server.process->Continue();
  // The heartbeat asked for at the timeout is answered now.
  const absl::Time limit = absl::Now() + absl::Seconds(15);
  while (!(*client)->Unanswered().ok() && absl::Now() < limit) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE((*client)->Unanswered().ok()) << (*client)->Unanswered();
  ASSERT_TRUE((*client)->Fetch(*id, 0, plan.view(), buffer->get()).ok());
  const auto want = ExpectedRows(3, g, 0, plan.view());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*buffer)->data()));
}

TEST(ShmServerProcessTest, AuthTokenIsChecked) {
  const std::string token_file = ServerProcess::TempPath("token");
  std::ofstream(token_file) << "s3cret\n";
  ShmServer server = StartServer({"--auth_token_file=" + token_file});
  ASSERT_NE(server.process, nullptr);
  KvClientOptions options = Options();
  EXPECT_EQ(ConnectKvClient(server.shm_address, options).status().code(),
            absl::StatusCode::kUnauthenticated);
  options.auth_token = "s3cret";
  auto client = ConnectKvClient(server.shm_address, options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->Open(MakeGeometry(1, 1, 8, 8)).ok());
}

TEST(ShmServerProcessTest, BadShmFlagIsAUsageError) {
  ServerProcess::Result r = ServerProcess::Run(
      {"--listen=127.0.0.1:0", "--shm_listen=tcp://127.0.0.1:1"});
  ASSERT_TRUE(WIFEXITED(r.wait_status));
  EXPECT_EQ(WEXITSTATUS(r.wait_status), 2);
  EXPECT_NE(r.err.find("unix:PATH"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace infinigen::kv_memory_service
