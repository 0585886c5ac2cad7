// idle_client: a worker stand-in that uses a memory node and then stays
// connected and idle, for the drain tests (tests/drain_test.py):
//
//   idle_client --kv_service=tcp://HOST:PORT --ready_file=FILE
//       [--append_bytes=4194304] [--fetch_rounds=1]
//       [--then=stay|close_sequence|disconnect] [--watch_health=ADDRESS]
//
// Opens a session and a sequence, appends about --append_bytes of K/V rows
// (over gRPC, in a few appends), fetches every row back (over the address's
// data plane: the fetch socket for tcp://, the gRPC stream for unix:, shared
// memory for shm:unix:) and checks them --fetch_rounds times, optionally
// opens a health Watch stream (--watch_health) and keeps it open, then, per
// --then:
//   stay            keeps the session, the sequence, its fetch connection
//                   and its fetch buffer (the default);
//   close_sequence  closes the sequence, keeps the rest;
//   disconnect      destroys its client (session closed, connections cut);
// writes "ready" to --ready_file and idles until SIGTERM or SIGINT, when it
// exits 0 without calling the node again. Exits 1 when a step before
// "ready" fails (one line on stderr), 2 on bad flags.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/testing/kv_test_data.h"
#include "proto/health.grpc.pb.h"

ABSL_FLAG(std::string, kv_service, "", "The memory node's address.");
ABSL_FLAG(std::string, ready_file, "",
          "Written once the rows are appended and fetched back.");
ABSL_FLAG(int64_t, append_bytes, int64_t{4} << 20,
          "About how many bytes of K and V rows to append.");
ABSL_FLAG(int, fetch_rounds, 1,
          "How many times to fetch every row back (each time, every layer).");
ABSL_FLAG(std::string, watch_health, "",
          "Also open a grpc.health.v1 Watch stream on this gRPC address "
          "(tcp://HOST:PORT or unix:PATH), read its first answer (SERVING) "
          "and keep the stream open. Empty: none.");
ABSL_FLAG(std::string, then, "stay",
          "What to do before idling: stay, close_sequence or disconnect.");

namespace infinigen::kv_memory_service {
namespace {

// 2 layers, 4 KV heads, head_dim 64: 2 KiB of K and V rows per token and
// layer.
constexpr int kLayers = 2;
constexpr int kHeads = 4;
constexpr int kHeadDim = 64;
constexpr int kBytesPerToken = kLayers * kHeads * kHeadDim * 2 * 2;
// Tokens per append: 512 KiB a call.
constexpr int kTokensPerAppend = 256;
constexpr uint32_t kSalt = 17;

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "idle_client: %s: %s\n", what.c_str(),
               status.ToString().c_str());
  return 1;
}

// The open Watch stream of --watch_health.
struct HealthWatch {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>>
      reader;
};

absl::Status WatchHealth(const std::string& address, HealthWatch* watch) {
  const std::string target = absl::StartsWith(address, "tcp://")
                                 ? address.substr(6)
                                 : address;
  watch->channel =
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  watch->stub = grpc::health::v1::Health::NewStub(watch->channel);
  grpc::health::v1::HealthCheckRequest req;
  watch->reader = watch->stub->Watch(&watch->ctx, req);
  grpc::health::v1::HealthCheckResponse resp;
  if (!watch->reader->Read(&resp)) {
    return absl::UnavailableError("the Watch stream ended at once");
  }
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::FailedPreconditionError(
        absl::StrCat("the node is not SERVING: ", resp.status()));
  }
  return absl::OkStatus();
}

int Run() {
  const std::string address = absl::GetFlag(FLAGS_kv_service);
  const std::string ready_file = absl::GetFlag(FLAGS_ready_file);
  const std::string then = absl::GetFlag(FLAGS_then);
  const int64_t append_bytes = absl::GetFlag(FLAGS_append_bytes);
  if (address.empty() || ready_file.empty() || append_bytes < 1 ||
      absl::GetFlag(FLAGS_fetch_rounds) < 1 ||
      (then != "stay" && then != "close_sequence" && then != "disconnect")) {
    std::fprintf(stderr,
                 "idle_client: --kv_service, --ready_file, positive "
                 "--append_bytes and --fetch_rounds and "
                 "--then=stay|close_sequence|disconnect are required\n");
    return 2;
  }
  // Before any thread starts, so that only sigwait sees these.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<KvClient>> client = ConnectKvClient(address);
  if (!client.ok()) return Fail("connect", client.status());
  const int tokens = static_cast<int>(std::max<int64_t>(
      kTokensPerAppend,
      (append_bytes + kBytesPerToken - 1) / kBytesPerToken / kTokensPerAppend *
          kTokensPerAppend));
  const SequenceGeometry g =
      testdata::MakeGeometry(kLayers, kHeads, kHeadDim, tokens);
  absl::StatusOr<SequenceId> id = (*client)->Open(g);
  if (!id.ok()) return Fail("open", id.status());
  for (int first = 0; first < tokens; first += kTokensPerAppend) {
    testdata::TestBlock b = testdata::MakeTestBlock(
        kSalt, g, 0, kLayers, first, std::min(kTokensPerAppend, tokens - first));
    if (auto r = (*client)->Append(*id, b.block); !r.ok()) {
      return Fail("append", r.status());
    }
  }
  // Every token of every head of each layer: tokens * heads * head_dim * 2
  // values a fetch.
  std::vector<int32_t> all(tokens);
  for (int i = 0; i < tokens; ++i) all[i] = i;
  const OwnedFetchPlan plan = OwnedFetchPlan::SameForAllHeads(kHeads, all);
  absl::StatusOr<std::unique_ptr<FetchBuffer>> buffer =
      (*client)->NewFetchBuffer(FetchElements(plan.view(), kHeadDim));
  if (!buffer.ok()) return Fail("fetch buffer", buffer.status());
  const int rounds = absl::GetFlag(FLAGS_fetch_rounds);
  for (int round = 0; round < rounds; ++round) {
    for (int layer = 0; layer < kLayers; ++layer) {
      const std::string what = absl::StrCat("fetch of layer ", layer);
      if (absl::Status s =
              (*client)->Fetch(*id, layer, plan.view(), buffer->get());
          !s.ok()) {
        return Fail(what, s);
      }
      const std::vector<uint16_t> want =
          testdata::ExpectedRows(kSalt, g, layer, plan.view());
      if (!std::equal(want.begin(), want.end(), (*buffer)->data())) {
        return Fail(what, absl::DataLossError("wrong rows"));
      }
    }
  }
  HealthWatch watch;
  if (const std::string watched = absl::GetFlag(FLAGS_watch_health);
      !watched.empty()) {
    if (absl::Status s = WatchHealth(watched, &watch); !s.ok()) {
      return Fail("health Watch", s);
    }
  }
  if (then == "close_sequence") {
    if (absl::Status s = (*client)->Close(*id); !s.ok()) return Fail("close", s);
  } else if (then == "disconnect") {
    buffer->reset();
    client->reset();
  }
  {
    std::ofstream(ready_file + ".tmp") << "ready\n";
    std::rename((ready_file + ".tmp").c_str(), ready_file.c_str());
  }
  int signal = 0;
  sigwait(&signals, &signal);
  // Out at once: the node may be gone, and a clean goodbye is not what the
  // tests look at.
  std::fflush(stdout);
  std::_Exit(0);
}

}  // namespace
}  // namespace infinigen::kv_memory_service

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return infinigen::kv_memory_service::Run();
}
