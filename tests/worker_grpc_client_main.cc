// worker_grpc_client: one greedy Worker.Generate call against `infinigen
// serve`, for tests that drive the binaries from Python (which has no gRPC
// here). Prints the streamed text on stdout and exits 0; a failed call
// prints "worker_grpc_client: CODE: message" on stderr and exits 1.
//
//   worker_grpc_client --target=127.0.0.1:8080 --prompt="Once upon a time"
//       [--tls_ca=CA.pem [--tls_cert=CLIENT.pem --tls_key=CLIENT.key]]
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/file.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/worker.grpc.pb.h"

ABSL_FLAG(std::string, target, "", "HOST:PORT of infinigen serve --listen.");
ABSL_FLAG(std::string, prompt, "Once upon a time", "The prompt.");
ABSL_FLAG(int, max_new_tokens, 20, "Tokens to generate (greedy).");
ABSL_FLAG(std::string, tls_ca, "", "PEM: the server's CA; empty: plaintext.");
ABSL_FLAG(std::string, tls_cert, "", "PEM: this client's certificate.");
ABSL_FLAG(std::string, tls_key, "", "PEM: this client's key.");
ABSL_FLAG(int, deadline_s, 60, "The call's deadline in seconds.");

namespace {

std::string Pem(const std::string& path) {
  if (path.empty()) return "";
  absl::StatusOr<std::string> text = infinigen::ReadFileToString(path);
  if (!text.ok()) {
    std::fprintf(stderr, "worker_grpc_client: %s\n",
                 std::string(text.status().message()).c_str());
    std::exit(2);
  }
  return *text;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (const std::string ca = Pem(absl::GetFlag(FLAGS_tls_ca)); !ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ca;
    ssl.pem_cert_chain = Pem(absl::GetFlag(FLAGS_tls_cert));
    ssl.pem_private_key = Pem(absl::GetFlag(FLAGS_tls_key));
    credentials = grpc::SslCredentials(ssl);
  }
  auto stub = infinigen::worker::Worker::NewStub(
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), credentials));
  infinigen::worker::GenerateRequest request;
  request.set_prompt(absl::GetFlag(FLAGS_prompt));
  request.set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  request.set_temperature(0);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(absl::GetFlag(FLAGS_deadline_s)));
  auto reader = stub->Generate(&ctx, request);
  std::string text;
  infinigen::worker::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_token()) text += response.token().text();
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    std::fprintf(stderr, "worker_grpc_client: %d: %s\n",
                 static_cast<int>(status.error_code()),
                 status.error_message().c_str());
    return 1;
  }
  std::fputs(text.c_str(), stdout);
  return 0;
}
