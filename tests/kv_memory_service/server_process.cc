#include "tests/kv_memory_service/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

extern char** environ;

namespace infinigen::kv_memory_service {
namespace {

std::atomic<int> counter{0};

std::string Env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

std::string BinaryPath() {
  return absl::StrCat(Env("TEST_SRCDIR", "."), "/",
                      Env("TEST_WORKSPACE", "infinigen"),
                      "/kv_memory_service/kv_memory_server");
}

// Spawns the binary; stdout/stderr go to the given files, or are inherited
// when empty. With max_descriptors > 0 the child's RLIMIT_NOFILE (soft and
// hard) is that.
pid_t Spawn(const std::vector<std::string>& args, const std::string& out,
            const std::string& err, int max_descriptors = 0) {
  std::vector<std::string> all = {BinaryPath()};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (max_descriptors > 0) {
    const pid_t pid = fork();
    if (pid == 0) {  // only async-signal-safe calls until exec
      const rlimit limit = {static_cast<rlim_t>(max_descriptors),
                            static_cast<rlim_t>(max_descriptors)};
      if (setrlimit(RLIMIT_NOFILE, &limit) != 0) _exit(127);
      execve(argv[0], argv.data(), environ);
      _exit(127);
    }
    return pid;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!out.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, out.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  if (!err.empty()) {
    posix_spawn_file_actions_addopen(&actions, 2, err.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0) {
    pid = -1;
  }
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::string ServerProcess::TempPath(const std::string& name) {
  return absl::StrCat(Env("TEST_TMPDIR", "/tmp"), "/", name, "-", getpid(),
                      "-", counter++);
}

std::string ServerProcess::SocketPath(const std::string& name) {
  std::string path = TempPath(name) + ".sock";
  if (path.size() >= 100) {
    path = absl::StrCat("/tmp/", name, "-", getpid(), "-", counter++, ".sock");
  }
  return path;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::vector<std::string>& flags, int max_descriptors) {
  const std::string ready = TempPath("ready");
  std::vector<std::string> args = flags;
  args.push_back("--ready_file=" + ready);
  std::unique_ptr<ServerProcess> p(new ServerProcess);
  for (const std::string& flag : flags) {
    for (const char* prefix : {"--listen=unix:", "--shm_listen=unix:"}) {
      if (absl::StartsWith(flag, prefix)) {
        p->socket_files_.push_back(flag.substr(std::strlen(prefix)));
      }
    }
  }
  p->pid_ = Spawn(args, "", "", max_descriptors);
  if (p->pid_ < 0) {
    return absl::UnavailableError("cannot spawn " + BinaryPath());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    if (access(ready.c_str(), F_OK) == 0) {
      p->address_ = std::string(absl::StripAsciiWhitespace(ReadAll(ready)));
      return p;
    }
    int status = 0;
    if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
      p->exited_ = true;
      p->wait_status_ = status;
      return absl::UnavailableError(
          absl::StrCat("kv_memory_server exited before listening (status ",
                       status, ")"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::UnavailableError("kv_memory_server did not listen within 60 s");
}

ServerProcess::~ServerProcess() {
  bool killed = false;
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    WaitExit();
    killed = true;
  } else if (pid_ > 0 && WIFSIGNALED(wait_status_)) {
    killed = true;  // a test killed it
  }
  // A server killed by a signal leaves its socket files (and the shm
  // socket's lock file) behind; the paths are this process's own (pid and
  // counter in the name). One that exited removed its own.
  if (killed) {
    for (const std::string& path : socket_files_) {
      std::remove(path.c_str());
      std::remove((path + ".lock").c_str());
    }
  }
}

void ServerProcess::Signal(int signal) {
  if (pid_ > 0 && !exited_) kill(pid_, signal);
}

void ServerProcess::Stop() {
  if (pid_ <= 0 || exited_) return;
  kill(pid_, SIGSTOP);
  int status = 0;
  while (waitpid(pid_, &status, WUNTRACED) < 0 && errno == EINTR) {
  }
  if (!WIFSTOPPED(status)) {
    exited_ = true;
    wait_status_ = status;
  }
}

void ServerProcess::Continue() { Signal(SIGCONT); }

int ServerProcess::WaitExit() {
  if (!exited_) {
    while (waitpid(pid_, &wait_status_, 0) < 0 && errno == EINTR) {
    }
    exited_ = true;
  }
  return wait_status_;
}

bool ServerProcess::Running() const {
  const std::string stat = ReadAll(absl::StrCat("/proc/", pid_, "/stat"));
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() &&
         stat[paren + 2] != 'Z' && stat[paren + 2] != 'X';
}

int64_t ServerProcess::RssBytes() const {
  std::istringstream in(ReadAll(absl::StrCat("/proc/", pid_, "/status")));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      std::istringstream fields(line.substr(6));
      int64_t kb = -1;
      fields >> kb;
      return kb * 1024;
    }
  }
  return -1;
}

double ServerProcess::CpuSeconds() const {
  const std::string stat = ReadAll(absl::StrCat("/proc/", pid_, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  // After the name: state (field 3), ..., utime (14), stime (15).
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  int64_t utime = -1, stime = -1;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::atoll(field.c_str());
    if (i == 15) stime = std::atoll(field.c_str());
  }
  if (utime < 0 || stime < 0) return -1;
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

ServerProcess::Result ServerProcess::Run(const std::vector<std::string>& args) {
  const std::string out = TempPath("out"), err = TempPath("err");
  Result r;
  const pid_t pid = Spawn(args, out, err);
  if (pid < 0) {
    r.wait_status = -1;
    return r;
  }
  while (waitpid(pid, &r.wait_status, 0) < 0 && errno == EINTR) {
  }
  r.out = ReadAll(out);
  r.err = ReadAll(err);
  return r;
}

}  // namespace infinigen::kv_memory_service
