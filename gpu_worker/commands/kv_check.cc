// infinigen kv-check: a round trip through each memory node of --kv_service
// (CheckKvService), and infinigen health: one grpc.health.v1 Check.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "gpu_worker/commands/common.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kv_memory_service/client/kv_check.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/sharded/sharded_kv_client.h"
#include "proto/health.grpc.pb.h"

ABSL_FLAG(int, check_tokens, 256,
          "kv-check: tokens appended per layer and KV head of the scratch "
          "sequence.");
ABSL_FLAG(int, check_rows, 32,
          "kv-check: rows fetched per KV head and fetch, at random positions.");
ABSL_FLAG(int, check_fetches, 20, "kv-check: fetches per layer.");
ABSL_FLAG(std::string, address, "",
          "health: the gRPC server, HOST:PORT or unix:PATH (plaintext, as a "
          "kubelet's gRPC probe).");
ABSL_FLAG(std::string, service, "",
          "health: the service to ask about; empty: the server as a whole "
          "(the worker's liveness: infinigen.worker.Liveness).");
ABSL_FLAG(double, timeout_s, 5, "health: the call's deadline in seconds.");

namespace infinigen::commands {
namespace {

int RunKvCheck() {
  kv_memory_service::KvCheckOptions check;
  check.tokens = absl::GetFlag(FLAGS_check_tokens);
  check.rows_per_head = absl::GetFlag(FLAGS_check_rows);
  check.fetches = absl::GetFlag(FLAGS_check_fetches);
  if (check.tokens < 1 || check.rows_per_head < 1 ||
      check.rows_per_head > check.tokens || check.fetches < 1) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(
                    "--check_tokens and --check_fetches must be at least 1, "
                    "--check_rows in [1, --check_tokens]"));
  }
  absl::StatusOr<kv_memory_service::KvClientOptions> options =
      KvClientOptionsFromFlags();
  if (!options.ok()) return Fail(kExitUsage, options.status());
  const std::string kv_service = ReadMemoryNodeFlags().kv_service;
  absl::StatusOr<std::vector<std::string>> nodes =
      kv_memory_service::ExpandMemoryTierAddress(kv_service);
  if (!nodes.ok()) return Fail(kExitUsage, nodes.status());
  int failed = 0;
  for (const std::string& node : *nodes) {
    absl::StatusOr<std::unique_ptr<kv_memory_service::KvClient>> client =
        kv_memory_service::ConnectKvClient(node, *options);
    if (!client.ok() && client.status().code() ==
                            absl::StatusCode::kInvalidArgument) {
      return Fail(kExitUsage, client.status());
    }
    absl::StatusOr<kv_memory_service::KvCheckReport> report =
        client.ok() ? kv_memory_service::CheckKvService(**client, check)
                    : absl::StatusOr<kv_memory_service::KvCheckReport>(
                          client.status());
    if (report.ok()) {
      std::printf("memory node %s: OK, %s\n", node.c_str(),
                  kv_memory_service::FormatKvCheckReport(*report, check)
                      .c_str());
    } else {
      ++failed;
      std::printf("memory node %s: FAILED, %s: %s\n", node.c_str(),
                  absl::StatusCodeToString(report.status().code()).c_str(),
                  std::string(report.status().message()).c_str());
    }
    std::fflush(stdout);
  }
  return failed == 0 ? 0 : kExitFailure;
}

int RunHealth() {
  const std::string address = absl::GetFlag(FLAGS_address);
  const double timeout = absl::GetFlag(FLAGS_timeout_s);
  if (address.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--address is required"));
  }
  if (!(timeout > 0)) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError("--timeout_s must be positive"));
  }
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(absl::GetFlag(FLAGS_service));
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::microseconds(
                       static_cast<int64_t>(timeout * 1e6)));
  const grpc::Status status = stub->Check(&ctx, request, &response);
  const std::string who =
      request.service().empty()
          ? address
          : absl::StrFormat("%s service %s", address, request.service());
  if (!status.ok()) {
    std::printf("%s: no answer: %s\n", who.c_str(),
                status.error_message().c_str());
    return kExitFailure;
  }
  const std::string state =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
          response.status());
  std::printf("%s: %s\n", who.c_str(), state.c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING
             ? 0
             : kExitFailure;
}

}  // namespace

const Command& KvCheckCommand() {
  static const Command* command = new Command{
      "kv-check",
      "Checks each memory node of --kv_service as a worker uses it: opens a "
      "scratch sequence, appends --check_tokens rows per layer and KV head "
      "of random content, fetches --check_rows random rows per head "
      "--check_fetches times per layer, compares every row with the one "
      "appended, and closes the sequence. One line per node on stdout, OK "
      "with the calls' times or FAILED with the error; exits 1 when a node "
      "fails.",
      {"kv_service", "kv_auth_token_file", "kv_tls_ca", "kv_tls_cert",
       "kv_tls_key", "kv_tls_server_name", "check_tokens", "check_rows",
       "check_fetches"},
      RunKvCheck};
  return *command;
}

const Command& HealthCommand() {
  static const Command* command = new Command{
      "health",
      "Asks a gRPC server (the memory node's --listen, the worker's serve "
      "--listen) for its grpc.health.v1 status, as a kubelet's gRPC probe "
      "does, and prints it: SERVING exits 0; NOT_SERVING, an unknown "
      "--service or no answer within --timeout_s exits 1.",
      {"address", "service", "timeout_s"},
      RunHealth};
  return *command;
}

}  // namespace infinigen::commands
