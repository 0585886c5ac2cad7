// lease_holder: a stand-in worker for the lease tests (tests/
// worker_lease_test.cc). It holds sequences on a memory node and does
// nothing else, so that only its client's heartbeats keep them alive:
//
//   lease_holder --kv_service=unix:PATH --sequences=4 --ready_file=FILE
//
// Opens --sequences sequences (1 layer, 1 KV head, head_dim 8, 16 tokens),
// appends 3 tokens to each, writes "ready" to --ready_file, then idles until
// SIGTERM or SIGINT. Then it checks that every sequence is still there with
// its 3 tokens and exits 0 if so, 3 if not (one line per missing sequence on
// stderr); 1 when setting up fails, 2 on bad flags.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/testing/kv_test_data.h"

ABSL_FLAG(std::string, kv_service, "", "The memory node's address.");
ABSL_FLAG(int, sequences, 1, "Sequences to open and hold.");
ABSL_FLAG(std::string, ready_file, "",
          "Written once every sequence is open and filled.");

namespace infinigen::kv_memory_service {
namespace {

int Run() {
  if (absl::GetFlag(FLAGS_kv_service).empty() ||
      absl::GetFlag(FLAGS_ready_file).empty() ||
      absl::GetFlag(FLAGS_sequences) < 1) {
    std::fprintf(stderr, "lease_holder: --kv_service, --ready_file and "
                         "--sequences >= 1 are required\n");
    return 2;
  }
  // Before any thread starts, so that only sigwait sees these.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto client = ConnectKvClient(absl::GetFlag(FLAGS_kv_service));
  if (!client.ok()) {
    std::fprintf(stderr, "lease_holder: %s\n", client.status().ToString().c_str());
    return 1;
  }
  const SequenceGeometry g = testdata::MakeGeometry(1, 1, 8, 16);
  std::vector<SequenceId> ids;
  for (int i = 0; i < absl::GetFlag(FLAGS_sequences); ++i) {
    absl::StatusOr<SequenceId> id = (*client)->Open(g);
    if (!id.ok()) {
      std::fprintf(stderr, "lease_holder: %s\n", id.status().ToString().c_str());
      return 1;
    }
    testdata::TestBlock b = testdata::MakeTestBlock(i, g, 0, 1, 0, 3);
    if (auto r = (*client)->Append(*id, b.block); !r.ok()) {
      std::fprintf(stderr, "lease_holder: %s\n", r.status().ToString().c_str());
      return 1;
    }
    ids.push_back(*id);
  }
  {
    const std::string ready = absl::GetFlag(FLAGS_ready_file);
    std::ofstream(ready + ".tmp") << "ready\n";
    std::rename((ready + ".tmp").c_str(), ready.c_str());
  }

  int signal = 0;
  sigwait(&signals, &signal);
  int missing = 0;
  for (SequenceId id : ids) {
    absl::StatusOr<SequenceStats> s = (*client)->GetSequenceStats(id);
    if (!s.ok() || s->layer_lengths.empty() || s->layer_lengths[0] != 3) {
      std::fprintf(stderr, "lease_holder: sequence %llu: %s\n",
                   static_cast<unsigned long long>(id),
                   s.ok() ? "wrong length" : s.status().ToString().c_str());
      ++missing;
    }
  }
  return missing == 0 ? 0 : 3;
}

}  // namespace
}  // namespace infinigen::kv_memory_service

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return infinigen::kv_memory_service::Run();
}
