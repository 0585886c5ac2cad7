// Soak of a running kv_memory_server: --clients well-behaved
// clients, each on its own connection, open a sequence, append it in steps
// and after each step fetch a random plan of what it holds, checking every
// returned value against the reference; every few hundred tokens the
// sequence is closed and a new one opened. Meanwhile --garbage threads
// connect to the plain fetch socket and send random bytes (half of them
// after a valid Hello), and --idle connections sit on it saying nothing
// (reconnecting when the server drops them). Samples the server's RSS
// (--server_pid) every second. Prints a table and one JSON line:
//
//   bazel-bin/kv_memory_service/kv_memory_server --listen=127.0.0.1:7070 \
//       --fetch_port=7071 --eviction=fifo &
//   bazel-bin/bench/soak/soak --kv_address=tcp://127.0.0.1:7070 \
//       --fetch_port=7071 --server_pid=$! --clients=32 --seconds=300
//
// Exit status 1 when any row was wrong or any well-behaved call failed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/tcp/fetch_wire.h"
#include "kv_memory_service/testing/kv_test_data.h"

ABSL_FLAG(std::string, kv_address, "tcp://127.0.0.1:7070",
          "The server's client address.");
ABSL_FLAG(int, fetch_port, 0,
          "The server's plain fetch socket port, for the garbage and idle "
          "connections (0: none).");
ABSL_FLAG(int, server_pid, 0, "The server's pid, to sample its RSS (0: no).");
ABSL_FLAG(int, clients, 32, "Well-behaved clients.");
ABSL_FLAG(int, seconds, 60, "How long to run.");
ABSL_FLAG(int, garbage, 2, "Threads sending garbage to the fetch socket.");
ABSL_FLAG(int, idle, 64, "Idle connections held on the fetch socket.");

namespace kvs = infinigen::kv_memory_service;

namespace {

struct ClientResult {
  int64_t appends = 0;
  int64_t fetches = 0;
  int64_t rows = 0;
  int64_t wrong_values = 0;
  int64_t errors = 0;
  std::string first_error;
  std::vector<double> fetch_us;
};

void RunClient(int index, absl::Time end, ClientResult* r) {
  auto client = kvs::ConnectKvClient(absl::GetFlag(FLAGS_kv_address));
  if (!client.ok()) {
    ++r->errors;
    r->first_error = std::string(client.status().message());
    return;
  }
  const kvs::SequenceGeometry g = kvs::testdata::MakeGeometry(4, 2, 64, 1024);
  std::mt19937 rng(index);
  auto buffer = (*client)->NewFetchBuffer(2 * 2 * 64 * 64);
  if (!buffer.ok()) {
    ++r->errors;
    r->first_error = std::string(buffer.status().message());
    return;
  }
  auto fail = [&](const absl::Status& s) {
    ++r->errors;
    if (r->first_error.empty()) r->first_error = s.ToString();
  };
  for (uint32_t cycle = 0; absl::Now() < end; ++cycle) {
    const uint32_t salt = static_cast<uint32_t>(index) * 100000 + cycle;
    auto id = (*client)->Open(g);
    if (!id.ok()) {
      fail(id.status());
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    for (int length = 0; length < 512 && absl::Now() < end; length += 16) {
      kvs::testdata::TestBlock b =
          kvs::testdata::MakeTestBlock(salt, g, 0, g.n_layers, length, 16);
      auto appended = (*client)->Append(*id, b.block);
      if (!appended.ok()) {
        fail(appended.status());
        break;
      }
      ++r->appends;
      std::vector<std::vector<int32_t>> per_head(g.n_kv_heads);
      for (auto& p : per_head) {
        for (int i = 0, n = 1 + rng() % 64; i < n; ++i) {
          p.push_back(rng() % (length + 16));
        }
      }
      const kvs::OwnedFetchPlan plan = kvs::OwnedFetchPlan::PerHead(per_head);
      const int layer = rng() % g.n_layers;
      const absl::Time start = absl::Now();
      const absl::Status fetched =
          (*client)->Fetch(*id, layer, plan.view(), buffer->get());
      r->fetch_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
      if (!fetched.ok()) {
        fail(fetched);
        continue;
      }
      ++r->fetches;
      r->rows += plan.indices.size();
      const std::vector<uint16_t> want =
          kvs::testdata::ExpectedRows(salt, g, layer, plan.view());
      for (size_t i = 0; i < want.size(); ++i) {
        r->wrong_values += (*buffer)->data()[i] != want[i];
      }
    }
    const absl::Status closed = (*client)->Close(*id);
    if (!closed.ok()) fail(closed);
  }
}

int Dial(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  timeval tv = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

void RunGarbage(int port, int seed, absl::Time end,
                std::atomic<int64_t>* connections) {
  std::mt19937 rng(seed);
  while (absl::Now() < end) {
    const int fd = Dial(port);
    if (fd < 0) continue;
    ++*connections;
    std::string bytes;
    if (rng() % 2 == 0) {
      kvs::fetch_wire::Hello hello;
      bytes.assign(reinterpret_cast<const char*>(&hello), sizeof(hello));
    }
    for (int i = 0, n = 1 + rng() % 4096; i < n; ++i) {
      bytes.push_back(static_cast<char>(rng()));
    }
    (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    shutdown(fd, SHUT_WR);
    char sink[4096];
    while (recv(fd, sink, sizeof(sink), 0) > 0) {
    }
    const linger reset = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    close(fd);
  }
}

void HoldIdle(int port, int n, absl::Time end,
              std::atomic<int64_t>* reconnects) {
  std::vector<int> fds(n, -1);
  while (absl::Now() < end) {
    for (int& fd : fds) {
      char c;
      if (fd >= 0 && recv(fd, &c, 1, MSG_DONTWAIT) == 0) {  // dropped
        close(fd);
        fd = -1;
        ++*reconnects;
      }
      if (fd < 0) fd = Dial(port);
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

int64_t RssKib(int pid, const char* field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + strlen(field));
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_clients);
  const int port = absl::GetFlag(FLAGS_fetch_port);
  const int pid = absl::GetFlag(FLAGS_server_pid);
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(absl::GetFlag(FLAGS_seconds));

  std::vector<ClientResult> results(n);
  std::vector<std::thread> threads;
  std::atomic<int64_t> garbage_connections{0}, idle_reconnects{0};
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([i, end, &results] { RunClient(i, end, &results[i]); });
  }
  if (port > 0) {
    for (int i = 0; i < absl::GetFlag(FLAGS_garbage); ++i) {
      threads.emplace_back([=, &garbage_connections] {
        RunGarbage(port, 1000 + i, end, &garbage_connections);
      });
    }
    threads.emplace_back([=, &idle_reconnects] {
      HoldIdle(port, absl::GetFlag(FLAGS_idle), end, &idle_reconnects);
    });
  }
  int64_t rss_first = -1, rss_max = -1, rss_last = -1;
  while (pid > 0 && absl::Now() < end) {
    const int64_t rss = RssKib(pid, "VmRSS:");
    if (rss_first < 0) rss_first = rss;
    rss_max = std::max(rss_max, rss);
    rss_last = rss;
    absl::SleepFor(absl::Seconds(1));
  }
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);

  ClientResult total;
  for (const ClientResult& r : results) {
    total.appends += r.appends;
    total.fetches += r.fetches;
    total.rows += r.rows;
    total.wrong_values += r.wrong_values;
    total.errors += r.errors;
    if (total.first_error.empty()) total.first_error = r.first_error;
    total.fetch_us.insert(total.fetch_us.end(), r.fetch_us.begin(),
                          r.fetch_us.end());
  }
  std::sort(total.fetch_us.begin(), total.fetch_us.end());
  auto pct = [&](double p) {
    return total.fetch_us.empty()
               ? 0.0
               : total.fetch_us[static_cast<size_t>(p * (total.fetch_us.size() - 1))];
  };
  const int64_t hwm = pid > 0 ? RssKib(pid, "VmHWM:") : -1;
  std::printf("soak: %d clients, %.0f s, %s, garbage threads %d, idle %d\n", n,
              seconds, absl::GetFlag(FLAGS_kv_address).c_str(),
              absl::GetFlag(FLAGS_garbage), absl::GetFlag(FLAGS_idle));
  std::printf("| appends | fetches | fetches/s | rows checked | wrong values | "
              "errors | fetch p50 us | fetch p99 us | garbage conns | idle "
              "drops | server RSS MiB first/max/last (peak) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %lld | %lld | %.0f | %lld | %lld | %lld | %.0f | %.0f | %lld | "
              "%lld | %.0f / %.0f / %.0f (%.0f) |\n",
              static_cast<long long>(total.appends),
              static_cast<long long>(total.fetches), total.fetches / seconds,
              static_cast<long long>(total.rows),
              static_cast<long long>(total.wrong_values),
              static_cast<long long>(total.errors), pct(0.5), pct(0.99),
              static_cast<long long>(garbage_connections.load()),
              static_cast<long long>(idle_reconnects.load()), rss_first / 1024.0,
              rss_max / 1024.0, rss_last / 1024.0, hwm / 1024.0);
  std::printf(
      "{\"clients\": %d, \"seconds\": %.1f, \"appends\": %lld, \"fetches\": "
      "%lld, \"rows\": %lld, \"wrong_values\": %lld, \"errors\": %lld, "
      "\"p50_us\": %.1f, \"p99_us\": %.1f, \"garbage_connections\": %lld, "
      "\"idle_drops\": %lld, \"rss_kib_first\": %lld, \"rss_kib_max\": %lld, "
      "\"rss_kib_last\": %lld, \"rss_kib_peak\": %lld}\n",
      n, seconds, static_cast<long long>(total.appends),
      static_cast<long long>(total.fetches), static_cast<long long>(total.rows),
      static_cast<long long>(total.wrong_values),
      static_cast<long long>(total.errors), pct(0.5), pct(0.99),
      static_cast<long long>(garbage_connections.load()),
      static_cast<long long>(idle_reconnects.load()),
      static_cast<long long>(rss_first), static_cast<long long>(rss_max),
      static_cast<long long>(rss_last), static_cast<long long>(hwm));
  if (!total.first_error.empty()) {
    std::printf("first error: %s\n", total.first_error.c_str());
  }
  return total.wrong_values == 0 && total.errors == 0 ? 0 : 1;
}
