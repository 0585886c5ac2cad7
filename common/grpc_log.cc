#include "common/grpc_log.h"

#include <atomic>
#include <string>

#include "common/log.h"
#include "grpc/support/log.h"

namespace infinigen {
namespace {

std::atomic<bool> g_starting{false};

// One line: gRPC's message up to its first newline, at most 300 bytes.
std::string OneLine(const char* message) {
  std::string s(message == nullptr ? "" : message);
  const size_t end = s.find('\n');
  if (end != std::string::npos) s.resize(end);
  if (s.size() > 300) s = s.substr(0, 300) + "...";
  return s;
}

extern "C" void RouteGrpcLog(gpr_log_func_args* args) {
  if (args->severity == GPR_LOG_SEVERITY_ERROR && !g_starting.load()) {
    IG_LOG(WARNING) << "grpc: " << OneLine(args->message);
  } else {
    IG_LOG(DEBUG) << "grpc " << args->file << ":" << args->line << ": "
                  << args->message;
  }
}

}  // namespace

void RouteGrpcLogs(bool starting) {
  g_starting.store(starting);
  gpr_set_log_function(RouteGrpcLog);
}

void SetGrpcLogStarting(bool starting) { g_starting.store(starting); }

}  // namespace infinigen
