// infinigen: the GPU worker's command line. It only dispatches; each
// command lives in gpu_worker/commands/ over library code:
//
//   infinigen generate     --model=PATH [--tokenizer=PATH] --prompt=TEXT ...
//   infinigen perplexity   --model=PATH --text=FILE --ctx=N ...
//   infinigen bench-decode --model=PATH --ctx=N --batch=B --policy=P,Q ...
//   infinigen skew         --model=PATH --text=FILE --out=FILE
//   infinigen serve        --model=PATH --listen=HOST:PORT ...
//   infinigen kv-check     --kv_service=ADDRESS ...
//   infinigen health       --address=HOST:PORT [--service=NAME]
//
// Program output goes to stdout, logs and progress to stderr. Bad flags or
// inputs exit with status 2 and one line saying why; runtime failures exit 1.
#include <cblas.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "common/flag_check.h"
#include "common/grpc_log.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "gpu_worker/backend/cpu/blas_kernels.h"
#include "gpu_worker/commands/common.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/policies/registry.h"
#include "grpc/support/log.h"

namespace infinigen::commands {
namespace {

const std::vector<const Command*>& Commands() {
  static const auto* commands = new std::vector<const Command*>{
      &BenchDecodeCommand(), &GenerateCommand(), &HealthCommand(),
      &KvCheckCommand(),     &PerplexityCommand(), &ServeCommand(),
      &SkewCommand()};
  return *commands;
}

const Command* FindCommand(const std::string& name) {
  for (const Command* c : Commands()) {
    if (name == c->name) return c;
  }
  return nullptr;
}

std::string MainUsage() {
  std::string s =
      "infinigen: LLM inference with an offloaded KV cache (InfiniGen).\n\n"
      "Usage: infinigen COMMAND [--flag=value ...]\n\nCommands:\n";
  for (const Command* c : Commands()) {
    s += absl::StrFormat("  %-11s %s\n", c->name, c->summary);
  }
  s += "\n'infinigen COMMAND --help' lists a command's flags.\n";
  return s;
}

// The --policy choices from the registry: each policy's summary and the
// flags that set its options.
std::string PolicyUsage() {
  std::string s = absl::StrFormat(
      "\nPolicies (--policy):\n  %-10s the whole cache on the worker; "
      "nothing is fetched (the bound of every other)\n",
      gpu_worker::kLocalCacheName);
  for (const gpu_worker::PolicyEntry* entry : gpu_worker::Policies()) {
    s += absl::StrFormat("  %-10s %s\n", entry->name, entry->summary);
    if (entry->flags.empty()) continue;
    s += absl::StrFormat(
        "             flags: --%s\n",
        absl::StrJoin(entry->flags.begin(), entry->flags.end(), " --"));
  }
  return s;
}

std::string CommandUsage(const Command& cmd) {
  std::string s = absl::StrFormat(
      "Usage: infinigen %s [flags]\n\n%s\n\nFlags:\n", cmd.name, cmd.summary);
  bool takes_policy = false;
  for (const char* f : cmd.flags) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(f);
    s += absl::StrFormat("  --%s (default: \"%s\")\n      %s\n", f,
                         flag->DefaultValue(), flag->Help());
    takes_policy = takes_policy || std::string(f) == "policy";
  }
  if (takes_policy) s += PolicyUsage();
  return s;
}

extern "C" void GrpcLogAsDebug(gpr_log_func_args* args) {
  IG_LOG(DEBUG) << "grpc " << args->file << ":" << args->line << ": "
                << args->message;
}

bool IsHelp(const std::string& a) {
  return a == "--help" || a == "-h" || a == "--helpfull" || a == "help";
}

}  // namespace
}  // namespace infinigen::commands

int main(int argc, char** argv) {
  using namespace infinigen::commands;
  infinigen::gpu_worker::SelectBlasKernels(argv);
  IG_LOG(DEBUG) << "OpenBLAS kernels: "
                << infinigen::gpu_worker::BlasCoreName();
  absl::SetProgramUsageMessage(MainUsage());
  if (argc < 2 || (IsHelp(argv[1]) && std::string(argv[1]) != "--helpfull")) {
    std::fputs(MainUsage().c_str(), argc < 2 ? stderr : stdout);
    return argc < 2 ? kExitUsage : 0;
  }
  const Command* command = FindCommand(argv[1]);
  if (command == nullptr) {
    std::fprintf(stderr,
                 "infinigen: unknown command '%s' (try 'infinigen --help')\n",
                 argv[1]);
    return kExitUsage;
  }
  for (int i = 2; i < argc; ++i) {
    if (IsHelp(argv[i]) && std::string(argv[i]) != "help") {
      std::fputs(CommandUsage(*command).c_str(), stdout);
      return 0;
    }
  }
  // Parse everything after the command name; positional leftovers are errors.
  std::vector<char*> args = {argv[0]};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  if (absl::Status flags =
          infinigen::CheckFlags(absl::MakeConstSpan(args).subspan(1));
      !flags.ok()) {
    std::fprintf(stderr, "infinigen %s: %s\n", command->name,
                 std::string(flags.message()).c_str());
    return kExitUsage;
  }
  std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (rest.size() > 1) {
    std::fprintf(stderr, "infinigen %s: unexpected argument '%s'\n",
                 command->name, rest[1]);
    return kExitUsage;
  }
  const int threads = ReadEngineFlags().threads;
  if (threads > 0) openblas_set_num_threads(threads);
  // The one-shot commands report every memory node failure in their own
  // last line (a failed TLS handshake with gRPC's reason included), so
  // gRPC's own log lines are debug output there; serve keeps them (a
  // client's failed handshake is news to its operator).
  if (std::string(command->name) != "serve") {
    gpr_set_log_function(GrpcLogAsDebug);
  } else {
    // serve: one line per gRPC error (a client's failed handshake is news
    // to its operator), none while the servers start (a failed bind is
    // serve's own one line).
    infinigen::RouteGrpcLogs(/*starting=*/true);
  }
  return command->run();
}
