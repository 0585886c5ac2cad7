// What a client sees when the real kv_memory_server dies, hangs, restarts
// or is told to stop, and how the binary treats its flags. No timing
// assertions: "bounded" means the client's own timeouts end every wait, so
// these tests finish instead of hanging.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/testing/kv_test_data.h"
#include "tests/kv_memory_service/server_process.h"

namespace infinigen::kv_memory_service {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

constexpr uint32_t kSalt = 5;

std::string ListenFlag(const std::string& transport) {
  return transport == "tcp"
             ? std::string("--listen=127.0.0.1:0")
             : "--listen=unix:" + ServerProcess::SocketPath("kv_fail");
}

KvClientOptions ShortTimeouts() {
  KvClientOptions options;
  options.fetch_timeout = absl::Seconds(3);
  options.rpc_timeout = absl::Seconds(3);
  options.connect_timeout = absl::Seconds(3);
  return options;
}

// A client with one sequence of `length` tokens of 2 layers.
struct Session {
  std::unique_ptr<KvClient> client;
  SequenceId id = 0;
  SequenceGeometry g = MakeGeometry(2, 3, 64, 256);
};
Session OpenSession(const std::string& address, int length) {
  Session s;
  auto client = ConnectKvClient(address, ShortTimeouts());
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return s;
  s.client = *std::move(client);
  auto id = s.client->Open(s.g);
  EXPECT_TRUE(id.ok()) << id.status();
  s.id = id.value_or(0);
  testdata::TestBlock b = MakeTestBlock(kSalt, s.g, 0, 2, 0, length);
  EXPECT_TRUE(s.client->Append(s.id, b.block).ok());
  return s;
}

bool IsConnectionError(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

class ServerDiesTest : public ::testing::TestWithParam<std::string> {};

// A stream of fetches (four in flight at a time, rows checked) runs until
// the server is SIGKILLed under it; every fetch then ends in an error.
TEST_P(ServerDiesTest, FetchStreamFailsWhenTheServerIsKilled) {
  auto server = ServerProcess::Start({ListenFlag(GetParam())});
  ASSERT_TRUE(server.ok()) << server.status();
  Session s = OpenSession((*server)->address(), 64);
  ASSERT_NE(s.client, nullptr);

  std::atomic<int64_t> good{0};
  std::atomic<int> wrong_rows{0};
  absl::Status first_error;
  std::thread fetcher([&] {
    std::vector<std::unique_ptr<FetchBuffer>> buffers;
    for (int i = 0; i < 4; ++i) {
      buffers.push_back(*s.client->NewFetchBuffer(2 * 3 * 64 * 16));
    }
    const OwnedFetchPlan plan =
        OwnedFetchPlan::PerHead({{1, 5, 9}, {63, 0}, {7, 7, 7, 7}});
    const std::vector<uint16_t> want = ExpectedRows(kSalt, s.g, 1, plan.view());
    while (true) {
      std::vector<FetchHandle> handles;
      for (auto& b : buffers) {
        handles.push_back(s.client->FetchAsync(s.id, 1, plan.view(), b.get()));
      }
      absl::Status status;
      for (size_t i = 0; i < handles.size(); ++i) {
        absl::Status one = handles[i].Wait();
        if (one.ok()) {
          if (!std::equal(want.begin(), want.end(), buffers[i]->data())) {
            ++wrong_rows;
          }
          ++good;
        } else if (status.ok()) {
          status = one;
        }
      }
      if (!status.ok()) {
        first_error = status;
        return;
      }
    }
  });
  // Let the stream run a while, then kill the server under it.
  for (int i = 0; i < 3000 && good.load() < 400; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GE(good.load(), 400);
  (*server)->Signal(SIGKILL);
  fetcher.join();
  (*server)->WaitExit();
  EXPECT_EQ(wrong_rows.load(), 0);
  EXPECT_TRUE(IsConnectionError(first_error)) << first_error;
  std::cerr << "after " << good.load() << " good fetches: " << first_error
            << "\n";

  // Later calls fail too, without hanging.
  auto buffer = s.client->NewFetchBuffer(1024);
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, {0});
  absl::Status fetch = s.client->Fetch(s.id, 0, plan.view(), buffer->get());
  EXPECT_TRUE(IsConnectionError(fetch)) << fetch;
  absl::Status open = s.client->Open(s.g).status();
  EXPECT_TRUE(IsConnectionError(open)) << open;
}

INSTANTIATE_TEST_SUITE_P(Transports, ServerDiesTest,
                         ::testing::Values("tcp", "unix"),
                         [](const auto& info) { return info.param; });

TEST(ServerRestartTest, ClientRecoversAndOldSequencesAreNotFound) {
  const std::string listen =
      "--listen=unix:" + ServerProcess::SocketPath("kv_restart");
  auto first = ServerProcess::Start({listen});
  ASSERT_TRUE(first.ok()) << first.status();
  Session s = OpenSession((*first)->address(), 16);
  ASSERT_NE(s.client, nullptr);
  auto buffer = s.client->NewFetchBuffer(2 * 3 * 64 * 4);
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, {2, 15});
  ASSERT_TRUE(s.client->Fetch(s.id, 0, plan.view(), buffer->get()).ok());

  (*first)->Signal(SIGKILL);
  (*first)->WaitExit();
absl::Status down = s.client->Fetch(s.id, 0, plan.view(), buffer->get());
  EXPECT_TRUE(IsConnectionError(down)) << down;

  auto second = ServerProcess::Start({listen});
  ASSERT_TRUE(second.ok()) << second.status();
  // The same client object reconnects by itself.
  absl::StatusOr<SequenceId> reopened;
  for (int attempt = 0; attempt < 100; ++attempt) {
    reopened = s.client->Open(s.g);
    if (reopened.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  // The restarted server knows nothing of the old sequence.
  EXPECT_EQ(s.client->Fetch(s.id, 0, plan.view(), buffer->get()).code(),
            absl::StatusCode::kNotFound);
  testdata::TestBlock b = MakeTestBlock(kSalt, s.g, 0, 2, 0, 16);
  ASSERT_TRUE(s.client->Append(*reopened, b.block).ok());
  ASSERT_TRUE(s.client->Fetch(*reopened, 0, plan.view(), buffer->get()).ok());
  const std::vector<uint16_t> want = ExpectedRows(kSalt, s.g, 0, plan.view());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*buffer)->data()));
}

TEST(ServerHangsTest, FetchesEndWithDeadlineExceeded) {
  auto server = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  KvClientOptions options = ShortTimeouts();
  options.fetch_timeout = absl::Milliseconds(500);
  auto client = ConnectKvClient((*server)->address(), options);
  ASSERT_TRUE(client.ok());
  const SequenceGeometry g = MakeGeometry(1, 1, 8, 8);
  auto id = (*client)->Open(g);
  ASSERT_TRUE(id.ok());
  testdata::TestBlock b = MakeTestBlock(kSalt, g, 0, 1, 0, 4);
  ASSERT_TRUE((*client)->Append(*id, b.block).ok());
  auto buffer = (*client)->NewFetchBuffer(64);
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(1, {3});
  ASSERT_TRUE((*client)->Fetch(*id, 0, plan.view(), buffer->get()).ok());

  (*server)->Stop();
  EXPECT_EQ((*client)->Fetch(*id, 0, plan.view(), buffer->get()).code(),
            absl::StatusCode::kDeadlineExceeded);
  // Known not to answer: the next calls fail at once, saying so, rather
  // than each waiting its own timeout.
  absl::Status append = (*client)->Append(*id, b.block).status();
  EXPECT_EQ(append.code(), absl::StatusCode::kUnavailable) << append;
  EXPECT_THAT(std::string(append.message()), HasSubstr("not answering"));
  EXPECT_EQ((*client)->Fetch(*id, 0, plan.view(), buffer->get()).code(),
            absl::StatusCode::kUnavailable);
  (*server)->Continue();
  // The stream was dropped; the next fetch opens a new one.
  absl::Status again;
  for (int attempt = 0; attempt < 50; ++attempt) {
    again = (*client)->Fetch(*id, 0, plan.view(), buffer->get());
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(again.ok()) << again;
  const std::vector<uint16_t> want = ExpectedRows(kSalt, g, 0, plan.view());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*buffer)->data()));
}

TEST(SigtermTest, DrainsAndExitsZero) {
  for (const std::string transport : {"tcp", "unix"}) {
    auto server = ServerProcess::Start({ListenFlag(transport),
                                        "--drain_timeout=1s"});
    ASSERT_TRUE(server.ok()) << server.status();
    Session s = OpenSession((*server)->address(), 8);
    ASSERT_NE(s.client, nullptr);
    auto buffer = s.client->NewFetchBuffer(1024);
    const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(3, {0, 7});
    // The fetch stream stays open across the SIGTERM.
    ASSERT_TRUE(s.client->Fetch(s.id, 1, plan.view(), buffer->get()).ok());
    (*server)->Signal(SIGTERM);
    const int status = (*server)->WaitExit();
    ASSERT_TRUE(WIFEXITED(status)) << transport << " status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0) << transport;
    absl::Status after = s.client->Fetch(s.id, 1, plan.view(), buffer->get());
    EXPECT_TRUE(IsConnectionError(after)) << after;
  }
}

TEST(SigtermTest, IdleServerExitsZero) {
  auto server = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->Signal(SIGTERM);
  const int status = (*server)->WaitExit();
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// ---- Flags -------------------------------------------------------------------

int ExitCode(const ServerProcess::Result& r) {
  return WIFEXITED(r.wait_status) ? WEXITSTATUS(r.wait_status) : -1;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST(FlagsTest, HelpListsTheFlagsAndExitsZero) {
  ServerProcess::Result r = ServerProcess::Run({"--help"});
  EXPECT_EQ(ExitCode(r), 0);
  for (const char* flag : {"--listen", "--capacity_bytes", "--eviction",
                           "--auth_token_file", "--max_message_bytes",
                           "--max_sequences", "--lease_timeout"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
}

TEST(FlagsTest, BadFlagsExitNonZeroWithOneLine) {
  const std::vector<std::vector<std::string>> cases = {
      {"--no_such_flag=1"},
      {"--eviction=random"},
      {"--capacity_bytes=lots"},
      {"--capacity_bytes=-5"},
      {"--listen=no-port-here"},
      {"--max_message_bytes=10"},
      {"--max_sequences=0"},
      {"--auth_token_file=/nonexistent/token"},
      {"--lease_timeout=-1s"},
      {"--lease_timeout=soon"},
      {"stray-argument"},
  };
  for (const auto& args : cases) {
    ServerProcess::Result r = ServerProcess::Run(args);
    EXPECT_THAT(ExitCode(r), AnyOf(1, 2)) << args[0];
    EXPECT_EQ(Lines(r.err).size(), 1u) << args[0] << ":\n" << r.err;
  }
}

TEST(FlagsTest, PortInUseFails) {
  auto server = ServerProcess::Start({"--listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();  // tcp://127.0.0.1:PORT
  ServerProcess::Result r = ServerProcess::Run(
      {"--listen=" + address.substr(6), "--ready_file=/dev/null"});
  EXPECT_EQ(ExitCode(r), 1);
  // One line, the kernel's reason, no gRPC dump before it.
  EXPECT_EQ(Lines(r.err).size(), 1u) << r.err;
  EXPECT_THAT(r.err, HasSubstr("cannot listen on '" + address.substr(6) +
                               "': Address already in use"));
  // Not an address at all: a usage error, not "non-loopback".
  ServerProcess::Result garbage = ServerProcess::Run({"--listen=garbage"});
  EXPECT_EQ(ExitCode(garbage), 2);
  EXPECT_THAT(garbage.err, HasSubstr("--listen: listen address 'garbage' is "
                                     "not HOST:PORT or unix:PATH"));
}

}  // namespace
}  // namespace infinigen::kv_memory_service
