// ServerProcess: the real kv_memory_server binary as a child process, for
// integration tests. Start() spawns it (from the test's runfiles) with the
// given flags plus --ready_file, and returns once it listens, with the
// address clients should use. The destructor SIGKILLs a server still
// running and removes the unix socket files its flags name. Not thread-safe: one test thread drives it.
#ifndef INFINIGEN_TESTS_KV_MEMORY_SERVICE_SERVER_PROCESS_H_
#define INFINIGEN_TESTS_KV_MEMORY_SERVICE_SERVER_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace infinigen::kv_memory_service {

class ServerProcess {
 public:
  // Flags such as "--listen=127.0.0.1:0" or "--listen=unix:PATH".
  // Unavailable if the server exits or does not listen within 60 s. With
  // max_descriptors > 0 the server runs with that RLIMIT_NOFILE (soft and
  // hard, so that it cannot raise it).
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::vector<std::string>& flags, int max_descriptors = 0);
  ~ServerProcess();

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

  // Sends `signal` (SIGTERM, SIGKILL, ...).
  void Signal(int signal);
  // SIGSTOP, returning once the process has stopped; SIGCONT.
  void Stop();
  void Continue();
  // Waits for the process to end; returns its waitpid status.
  int WaitExit();

  // From /proc/PID: whether it runs (a killed child is a zombie until
  // reaped), its resident set in bytes (-1 if unreadable), and its user
  // plus system CPU time in seconds (-1 if unreadable).
  bool Running() const;
  int64_t RssBytes() const;
  double CpuSeconds() const;

  // Runs the binary with `args` to completion (for flag tests).
  struct Result {
    int wait_status = 0;
    std::string out, err;
  };
  static Result Run(const std::vector<std::string>& args);

  // A unix socket path for the test: in TEST_TMPDIR when short enough for
  // sockaddr_un, else in /tmp.
  static std::string SocketPath(const std::string& name);
  // A fresh file path in TEST_TMPDIR.
  static std::string TempPath(const std::string& name);

 private:
  ServerProcess() = default;

  pid_t pid_ = -1;
  bool exited_ = false;
  int wait_status_ = 0;
  std::string address_;
  // Unix socket paths from its flags; removed if the destructor kills it.
  std::vector<std::string> socket_files_;
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_TESTS_KV_MEMORY_SERVICE_SERVER_PROCESS_H_
