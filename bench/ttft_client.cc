// ttft_client: sends generation requests to one or more `infinigen serve`
// workers at once and reports, per request, the time to first token seen
// by the client with the server's own figures (prefill seconds, prompt
// and cached tokens). One JSON line per request on stdout, in request
// order. bench/prefix_reuse.py drives it.
//
//   ttft_client --workers=127.0.0.1:8001,127.0.0.1:8002 \
//     --prompt_file=prefix.txt --suffixes="Q1|Q2|Q3" --max_new_tokens=8
//
// Request i goes to worker i % len(workers) with the prompt file's text
// followed by suffix i; all requests are sent together.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "common/file.h"
#include "proto/worker.grpc.pb.h"

ABSL_FLAG(std::string, workers, "", "Comma-separated HOST:PORT of serve workers.");
ABSL_FLAG(std::string, prompt_file, "", "The shared part of every prompt.");
ABSL_FLAG(std::string, suffixes, "",
          "'|'-separated text appended to the shared part, one per request.");
ABSL_FLAG(int, max_new_tokens, 8, "Tokens generated per request.");
ABSL_FLAG(int, timeout_s, 600, "Deadline of each request.");

namespace {

struct Result {
  std::string worker;
  bool ok = false;
  std::string error;
  double ttft_seconds = 0, total_seconds = 0;
  infinigen::worker::Finished finished;
};

Result Send(const std::string& worker, const std::string& prompt) {
  Result r;
  r.worker = worker;
  auto channel = grpc::CreateChannel(worker, grpc::InsecureChannelCredentials());
  auto stub = infinigen::worker::Worker::NewStub(channel);
  infinigen::worker::GenerateRequest req;
  req.set_prompt(prompt);
  req.set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)));
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub->Generate(&ctx, req);
  infinigen::worker::GenerateResponse resp;
  bool first = true;
  while (reader->Read(&resp)) {
    const double t = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - start)
                         .count();
    if (first) {
      r.ttft_seconds = t;
      first = false;
    }
    if (resp.has_finished()) {
      r.finished = resp.finished();
      r.total_seconds = t;
    }
  }
  const grpc::Status s = reader->Finish();
  r.ok = s.ok();
  if (!s.ok()) r.error = s.error_message();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Sends requests sharing a prompt prefix to serve workers at once and "
      "prints each one's time to first token as a JSON line.");
  absl::ParseCommandLine(argc, argv);
  const std::vector<std::string> workers =
      absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty());
  const std::vector<std::string> suffixes =
      absl::StrSplit(absl::GetFlag(FLAGS_suffixes), '|', absl::SkipEmpty());
  if (workers.empty() || suffixes.empty()) {
    std::fprintf(stderr, "ttft_client: --workers and --suffixes are required\n");
    return 2;
  }
  auto shared = infinigen::ReadFileToString(absl::GetFlag(FLAGS_prompt_file));
  if (!shared.ok()) {
    std::fprintf(stderr, "ttft_client: --prompt_file: %s\n",
                 std::string(shared.status().message()).c_str());
    return 2;
  }
  std::vector<Result> results(suffixes.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < suffixes.size(); ++i) {
    threads.emplace_back([&, i] {
      results[i] = Send(workers[i % workers.size()], *shared + suffixes[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  int failed = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    nlohmann::json j;
    j["request"] = i;
    j["worker"] = r.worker;
    j["ok"] = r.ok;
    if (!r.ok) {
      j["error"] = r.error;
      ++failed;
    }
    j["ttft_seconds"] = r.ttft_seconds;
    j["total_seconds"] = r.total_seconds;
    j["prompt_tokens"] = r.finished.prompt_tokens();
    j["cached_tokens"] = r.finished.cached_tokens();
    j["queue_seconds"] = r.finished.queue_seconds();
    j["prefill_seconds"] = r.finished.prefill_seconds();
    std::printf("%s\n", j.dump().c_str());
  }
  return failed == 0 ? 0 : 1;
}
