// Leases and worker health with the real binaries as separate processes:
// kv_memory_server, `infinigen` (bench-decode, generate, serve) and
// lease_holder (a stand-in worker that only holds sequences). Workers are
// SIGKILLed as OOM kills and node drains do; the memory node must free
// their sequences within its --lease_timeout while live workers keep
// theirs, and `infinigen serve`'s health must follow its memory node.
//
// Every process a test starts is killed by its PID and reaped when the test
// ends; files go to TEST_TMPDIR (or /tmp for sockets whose path would be
// too long), and are removed.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/llama2c.h"
#include "proto/health.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tests/kv_memory_service/server_process.h"

extern char** environ;

namespace infinigen {
namespace {

using kv_memory_service::ServerProcess;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";
constexpr char kStory[] =
    "Once upon a time, there was a little girl named Lily.";
// Short, so that the tests run in seconds; clients renew every third.
constexpr absl::Duration kLease = absl::Seconds(2);
const std::string kLeaseFlag = "--lease_timeout=2s";

std::string Runfile(const std::string& path) {
  const char* dir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(dir != nullptr ? dir : ".", "/",
                      ws != nullptr ? ws : "infinigen", "/", path);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A unix socket path for a test, removed when it goes out of scope (a
// SIGKILLed server leaves its socket file behind).
class SocketFile {
 public:
  explicit SocketFile(const std::string& name)
      : path_(ServerProcess::SocketPath(name)) {}
  ~SocketFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  const std::string path_;
};

// A child process with stdout and stderr in temp files. The destructor
// SIGKILLs it if it still runs, reaps it and removes the files.
class Child {
 public:
  static std::unique_ptr<Child> Start(const std::string& binary,
                                      const std::vector<std::string>& args) {
    std::unique_ptr<Child> c(new Child);
    c->out_ = ServerProcess::TempPath("child_out");
    c->err_ = ServerProcess::TempPath("child_err");
    std::vector<std::string> all = {Runfile(binary)};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, c->out_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, 2, c->err_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (posix_spawn(&c->pid_, argv[0], &actions, nullptr, argv.data(),
                    environ) != 0) {
      c->pid_ = -1;
    }
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_GT(c->pid_, 0) << "cannot spawn " << argv[0];
    return c;
  }

  ~Child() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      Wait(absl::InfiniteDuration());
    }
    std::remove(out_.c_str());
    std::remove(err_.c_str());
  }

  pid_t pid() const { return pid_; }
  void Signal(int signal) {
    if (pid_ > 0 && !exited_) kill(pid_, signal);
  }
  // True once the process has ended (reaped), waiting up to `timeout`.
  bool Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!exited_) {
      const pid_t r = waitpid(pid_, &status_, WNOHANG);
      if (r == pid_) {
        exited_ = true;
      } else if (absl::Now() >= deadline) {
        return false;
      } else {
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    return true;
  }
  bool Running() { return !Wait(absl::ZeroDuration()); }
  int status() const { return status_; }  // waitpid's, once exited
  std::string out() const { return ReadFile(out_); }
  std::string err() const { return ReadFile(err_); }

 private:
  Child() = default;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
  std::string out_, err_;
};

// Runs `infinigen generate` with the full policy against `kv` to the end.
std::unique_ptr<Child> Generate(const std::string& kv) {
  std::unique_ptr<Child> c = Child::Start(
      "gpu_worker/infinigen",
      {"generate", absl::StrCat("--model=", Runfile(kModel)),
       absl::StrCat("--tokenizer=", Runfile(kTokenizer)),
       "--prompt=Once upon a time", "--max_new_tokens=20", "--temperature=0",
       "--policy=full", "--backend=cpu", "--threads=1",
       "--kv_service=" + kv});
  EXPECT_TRUE(c->Wait(absl::Seconds(120))) << "generate did not finish";
  return c;
}

// The memory node's statistics, through a client of its own.
class Stats {
 public:
  explicit Stats(const std::string& address) {
    auto client = kv_memory_service::ConnectKvClient(address);
    EXPECT_TRUE(client.ok()) << client.status();
    if (client.ok()) client_ = *std::move(client);
  }
  kv_memory_service::StoreStats Get() {
    auto s = client_->GetStoreStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.value_or(kv_memory_service::StoreStats());
  }
  kv_memory_service::KvClient& client() { return *client_; }
  // Polls until `done` holds or `limit` passes; returns the time taken.
  template <typename F>
  absl::Duration Until(absl::Duration limit, F done) {
    const absl::Time start = absl::Now();
    while (!done(Get()) && absl::Now() - start < limit) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return absl::Now() - start;
  }

 private:
  std::unique_ptr<kv_memory_service::KvClient> client_;
};

TEST(WorkerLeaseTest, AKilledWorkersSequencesAreFreedAndANewWorkerGetsTheRoom) {
  // Room for exactly the 8 sequences of the worker below (bench-decode,
  // --policy=full: fp16 rows, ctx + decode_tokens = 512 tokens).
  auto weights = model::LoadLlama2cWeights(Runfile(kModel));
  ASSERT_TRUE(weights.ok()) << weights.status();
  kv_memory_service::SequenceGeometry g;
  g.n_layers = weights->config.n_layers;
  g.n_kv_heads = weights->config.n_kv_heads;
  g.head_dim = weights->config.head_dim;
  g.max_tokens = 512;
  const int64_t capacity = 8 * kv_memory_service::ReservedBytes(g);
  const SocketFile socket("lease_kill");
  auto server = ServerProcess::Start(
      {"--listen=unix:" + socket.path(), kLeaseFlag,
       absl::StrCat("--capacity_bytes=", capacity)});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string kv = (*server)->address();
  Stats stats(kv);

  std::unique_ptr<Child> worker = Child::Start(
      "gpu_worker/infinigen",
      {"bench-decode", absl::StrCat("--model=", Runfile(kModel)), "--ctx=128",
       "--decode_tokens=384", "--batch=8", "--policy=full", "--backend=cpu",
       "--threads=1", "--kv_service=" + kv});
  stats.Until(absl::Seconds(60), [&](const kv_memory_service::StoreStats& s) {
    return s.open_sequences == 8 || !worker->Running();
  });
  ASSERT_TRUE(worker->Running()) << "the worker ended early:\n" << worker->err();
  ASSERT_EQ(stats.Get().open_sequences, 8);
  // The node is full: another worker's sequence is refused.
  ASSERT_EQ(stats.Get().bytes_reserved, capacity);
  g.max_tokens = 32;
  EXPECT_EQ(stats.client().Open(g).status().code(),
            absl::StatusCode::kResourceExhausted);

  // Killed mid-decode, holding its 8 sequences.
  worker->Signal(SIGKILL);
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(worker->Wait(absl::Seconds(10)));
  ASSERT_TRUE(WIFSIGNALED(worker->status()) &&
              WTERMSIG(worker->status()) == SIGKILL)
      << "the worker finished before it was killed: " << worker->status();
  stats.Until(absl::Seconds(30), [](const kv_memory_service::StoreStats& s) {
    return s.open_sequences == 0;
  });
  const absl::Duration freed_after = absl::Now() - killed;
  const kv_memory_service::StoreStats after = stats.Get();
  EXPECT_EQ(after.open_sequences, 0);
  EXPECT_EQ(after.bytes_reserved, 0);
  EXPECT_EQ(after.expired_sessions, 1);
  EXPECT_EQ(after.expired_sequences, 8);
  // Freed by the lease: not before a heartbeat could have been missed, and
  // within the lease of the last one (plus the sweep and polling).
  EXPECT_GT(freed_after, kLease / 2);
  EXPECT_LT(freed_after, kLease + absl::Seconds(1));

  // A new worker gets the room.
  std::unique_ptr<Child> next = Generate(kv);
  EXPECT_TRUE(WIFEXITED(next->status()) && WEXITSTATUS(next->status()) == 0)
      << next->err();
  EXPECT_THAT(next->out(), StartsWith(kStory));
  std::fprintf(stderr, "freed %d sequences %s after SIGKILL (lease %s)\n",
               static_cast<int>(after.expired_sequences),
               absl::FormatDuration(freed_after).c_str(),
               absl::FormatDuration(kLease).c_str());
}

TEST(WorkerLeaseTest, ALiveIdleWorkerKeepsItsSequencesAKilledOneDoesNot) {
  const SocketFile socket("lease_idle");
  auto server = ServerProcess::Start(
      {"--listen=unix:" + socket.path(), kLeaseFlag});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string kv = (*server)->address();
  Stats stats(kv);
  const std::string idle_ready = ServerProcess::TempPath("idle_ready");
  const std::string doomed_ready = ServerProcess::TempPath("doomed_ready");
  std::unique_ptr<Child> idle = Child::Start(
      "tests/kv_memory_service/lease_holder",
      {"--kv_service=" + kv, "--sequences=4", "--ready_file=" + idle_ready});
  std::unique_ptr<Child> doomed = Child::Start(
      "tests/kv_memory_service/lease_holder",
      {"--kv_service=" + kv, "--sequences=2", "--ready_file=" + doomed_ready});
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while ((access(idle_ready.c_str(), F_OK) != 0 ||
          access(doomed_ready.c_str(), F_OK) != 0) &&
         absl::Now() < deadline && idle->Running() && doomed->Running()) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(access(idle_ready.c_str(), F_OK), 0) << idle->err();
  ASSERT_EQ(access(doomed_ready.c_str(), F_OK), 0) << doomed->err();
  ASSERT_EQ(stats.Get().open_sequences, 6);

  doomed->Signal(SIGKILL);
  ASSERT_TRUE(doomed->Wait(absl::Seconds(10)));
  // Three leases: the killed holder's session expires, the idle one's is
  // renewed throughout.
  absl::SleepFor(3 * kLease);
  const kv_memory_service::StoreStats s = stats.Get();
  EXPECT_EQ(s.open_sequences, 4);
  EXPECT_EQ(s.expired_sessions, 1);
  EXPECT_EQ(s.expired_sequences, 2);
  // The idle holder finds every sequence intact.
  idle->Signal(SIGTERM);
  ASSERT_TRUE(idle->Wait(absl::Seconds(30)));
  EXPECT_TRUE(WIFEXITED(idle->status()) && WEXITSTATUS(idle->status()) == 0)
      << idle->status() << ": " << idle->err();
  std::remove(idle_ready.c_str());
  std::remove(doomed_ready.c_str());
}

grpc::health::v1::HealthCheckResponse::ServingStatus HealthOf(
    grpc::health::v1::Health::StubInterface& health,
    const std::string& service) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  if (!health.Check(&ctx, request, &response).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return response.status();
}

TEST(ServeHealthTest, NotServingWhileItsMemoryNodeIsDownServingOnceItIsBack) {
  using grpc::health::v1::HealthCheckResponse;
  const SocketFile kv_socket("serve_health_kv");
  const SocketFile serve_socket_file("serve_health");
  const std::string kv_listen = "--listen=unix:" + kv_socket.path();
  auto server = ServerProcess::Start({kv_listen, kLeaseFlag});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string& serve_socket = serve_socket_file.path();
  std::unique_ptr<Child> serve = Child::Start(
      "gpu_worker/infinigen",
      {"serve", absl::StrCat("--model=", Runfile(kModel)),
       absl::StrCat("--tokenizer=", Runfile(kTokenizer)),
       "--listen=unix:" + serve_socket, "--policy=full", "--max_batch=2",
       "--backend=cpu", "--threads=1", "--kv_service=" + (*server)->address()});
  auto channel = grpc::CreateChannel("unix:" + serve_socket,
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  // Polls the readiness status ("") until it is `want`; the time taken.
  auto until = [&](HealthCheckResponse::ServingStatus want,
                   absl::Duration limit) {
    const absl::Time start = absl::Now();
    while (HealthOf(*health, "") != want && absl::Now() - start < limit &&
           serve->Running()) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return absl::Now() - start;
  };
  until(HealthCheckResponse::SERVING, absl::Seconds(60));
  ASSERT_EQ(HealthOf(*health, ""), HealthCheckResponse::SERVING)
      << serve->err();

  (*server)->Signal(SIGKILL);
  (*server)->WaitExit();
  const absl::Duration down = until(HealthCheckResponse::NOT_SERVING,
                                    absl::Seconds(30));
  EXPECT_EQ(HealthOf(*health, ""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(HealthOf(*health, "infinigen.worker.Worker"),
            HealthCheckResponse::NOT_SERVING);
  // Out of rotation, not dead: liveness stays SERVING.
  EXPECT_EQ(HealthOf(*health, "infinigen.worker.Liveness"),
            HealthCheckResponse::SERVING);
  EXPECT_LT(down, absl::Seconds(3));

  auto restarted = ServerProcess::Start({kv_listen, kLeaseFlag});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  const absl::Duration up = until(HealthCheckResponse::SERVING,
                                  absl::Seconds(30));
  EXPECT_EQ(HealthOf(*health, ""), HealthCheckResponse::SERVING);
  EXPECT_LT(up, absl::Seconds(5));
  // And it serves: a generation over the restarted node.
  auto stub = worker::Worker::NewStub(channel);
  worker::GenerateRequest request;
  request.set_prompt("Once upon a time");
  request.set_max_new_tokens(20);
  request.set_temperature(0);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->Generate(&ctx, request);
  std::string text;
  worker::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_token()) text += response.token().text();
  }
  const grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(text, StartsWith(", there was a little girl named Lily."));
  EXPECT_THAT(serve->err(), HasSubstr("health NOT_SERVING"));
  EXPECT_THAT(serve->err(), HasSubstr("health SERVING again"));
  std::fprintf(stderr, "serve: NOT_SERVING %s after its memory node died, "
               "SERVING %s after it restarted\n",
               absl::FormatDuration(down).c_str(),
               absl::FormatDuration(up).c_str());
  serve->Signal(SIGTERM);
  EXPECT_TRUE(serve->Wait(absl::Seconds(60)));
}

// `serve --policy=full` over the shm data plane.
// After its memory node restarted on the same addresses, the next two
// generations failed (UNAVAILABLE on the old data-plane connection, then
// FAILED_PRECONDITION from a fetch buffer the failed step left busy). Now
// the KV client reconnects before the generation's first fetch and a failed
// step leaves nothing behind: the very next generation succeeds, without
// waiting for the worker's health to notice.
TEST(ServeRestartTest, TheGenerationAfterAShmNodeRestartSucceeds) {
  const SocketFile kv_socket("restart_kv");
  const SocketFile shm_socket("restart_shm");
  const SocketFile serve_socket("restart_serve");
  const std::vector<std::string> kv_flags = {
      "--listen=unix:" + kv_socket.path(),
      "--shm_listen=unix:" + shm_socket.path(), kLeaseFlag};
  auto server = ServerProcess::Start(kv_flags);
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<Child> serve = Child::Start(
      "gpu_worker/infinigen",
      {"serve", absl::StrCat("--model=", Runfile(kModel)),
       absl::StrCat("--tokenizer=", Runfile(kTokenizer)),
       "--listen=unix:" + serve_socket.path(), "--policy=full",
       "--max_batch=2", "--backend=cpu", "--threads=1",
       "--kv_service=shm:unix:" + shm_socket.path()});
  auto channel = grpc::CreateChannel("unix:" + serve_socket.path(),
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  const absl::Time start = absl::Now();
  while (HealthOf(*health, "") != grpc::health::v1::HealthCheckResponse::SERVING &&
         absl::Now() - start < absl::Seconds(60) && serve->Running()) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(HealthOf(*health, ""),
            grpc::health::v1::HealthCheckResponse::SERVING)
      << serve->err();
  auto stub = worker::Worker::NewStub(channel);
  auto generate = [&](std::string* text) {
    worker::GenerateRequest request;
    request.set_prompt("Once upon a time");
    request.set_max_new_tokens(20);
    request.set_temperature(0);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(60));
    auto reader = stub->Generate(&ctx, request);
    text->clear();
    worker::GenerateResponse response;
    while (reader->Read(&response)) {
      if (response.has_token()) *text += response.token().text();
    }
    return reader->Finish();
  };
  std::string text;
  grpc::Status status = generate(&text);
  ASSERT_TRUE(status.ok()) << status.error_message() << "\n" << serve->err();
  EXPECT_THAT(text, StartsWith(", there was a little girl named Lily."));

  (*server)->Signal(SIGKILL);
  (*server)->WaitExit();
  auto restarted = ServerProcess::Start(kv_flags);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  for (int i = 0; i < 3; ++i) {
    status = generate(&text);
    EXPECT_TRUE(status.ok()) << "generation " << i << " after the restart: "
                             << status.error_message() << "\n"
                             << serve->err();
    EXPECT_THAT(text, StartsWith(", there was a little girl named Lily."));
  }
  serve->Signal(SIGTERM);
  EXPECT_TRUE(serve->Wait(absl::Seconds(60)));
  (*restarted)->Signal(SIGTERM);
  (*restarted)->WaitExit();
  std::remove((shm_socket.path() + ".lock").c_str());
}

}  // namespace
}  // namespace infinigen
