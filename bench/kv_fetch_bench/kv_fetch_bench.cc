// Fetch latency of the KV memory service, per data plane, against a
// single-thread memcpy of the same bytes measured in the same run.
//
// One fetch = one layer's K and V rows of `tokens` tokens for each of 3 KV
// heads (head_dim 64, fp16), each head its own random positions out of 8192
// stored: 2 * tokens * 3 * 64 * 2 bytes, gathered into one contiguous
// FetchBuffer. Timed: FetchAsync + Wait, one fetch in flight, so the
// numbers are round trips.
//
//   bazel build //bench/kv_fetch_bench && bazel-bin/bench/kv_fetch_bench/kv_fetch_bench
//       [--kv_address=tcp://HOST:PORT]   also bench an external server
//       [--benchmark_out=FILE.json --benchmark_out_format=json]
//
// Data planes: memcpy (the baseline), inproc, tcp (a KvServer in this
// process on 127.0.0.1:0: real loopback TCP; fetches on its plain fetch
// socket), tcp_stream (the same, fetches on the gRPC FetchStream), unix (a
// server on a unix socket: gRPC FetchStream), shm (that unix server's shared-memory data plane: the rows
// are gathered into a memfd slot by the server's shm thread), rdma (a
// KvServer with --rdma_device=any over the local RDMA port; skipped with
// the reason where there is no RDMA device), and, with --kv_address,
// "external" (any address, e.g. shm:unix:PATH of a kv_memory_server
// process). Counters: p50_us and
// p99_us per fetch, GB/s at the p50, and the memcpy ratio of the p50.
// To add a data plane, add a Plane in Planes().
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "benchmark/benchmark.h"
#include "kv_memory_service/kv_client.h"
#include "kv_memory_service/server/kv_server.h"

namespace infinigen::kv_memory_service {
namespace {

constexpr int kHeads = 3;
constexpr int kHeadDim = 64;
constexpr int kStored = 8192;  // tokens per (layer, head) in the store
constexpr int kLayers = 2;
constexpr int kTokens[] = {16, 256, 4096};

size_t FetchBytes(int tokens) {
  return size_t{2} * tokens * kHeads * kHeadDim * sizeof(uint16_t);
}

// Each head selects `tokens` distinct random positions, in increasing order.
OwnedFetchPlan MakePlan(int tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> per_head(kHeads);
  std::vector<int32_t> all(kStored);
  for (int i = 0; i < kStored; ++i) all[i] = i;
  for (auto& positions : per_head) {
    std::shuffle(all.begin(), all.end(), rng);
    positions.assign(all.begin(), all.begin() + tokens);
    std::sort(positions.begin(), positions.end());
  }
  return OwnedFetchPlan::PerHead(per_head);
}

// A client with one filled sequence and one buffer for the largest fetch.
struct Plane {
  std::string name;
  std::unique_ptr<KvClient> client;
  SequenceId seq = 0;
  std::unique_ptr<FetchBuffer> buffer;
  std::string error;  // set when the plane could not be set up
};

struct World {
  std::unique_ptr<KvServer> server;       // tcp
  std::unique_ptr<KvServer> unix_server;  // unix socket, and shm
  std::unique_ptr<KvServer> rdma_server;  // with the RDMA data plane
  std::map<std::string, Plane> planes;
  std::vector<uint16_t> k, v;  // [kLayers][kStored][kHeads][kHeadDim]
};

World& TheWorld() {
  static World* world = new World;
  return *world;
}

void SetUpPlane(const std::string& name, const std::string& address,
                const KvClientOptions& options = {}) {
  World& w = TheWorld();
  Plane& p = w.planes[name];
  p.name = name;
  auto client = ConnectKvClient(address, options);
  if (!client.ok()) {
    p.error = client.status().ToString();
    return;
  }
  p.client = *std::move(client);
  SequenceGeometry g;
  g.n_layers = kLayers;
  g.n_kv_heads = kHeads;
  g.head_dim = kHeadDim;
  g.max_tokens = kStored;
  auto seq = p.client->Open(g);
  if (!seq.ok()) {
    p.error = seq.status().ToString();
    return;
  }
  p.seq = *seq;
  // Appended in chunks of 1024 tokens, layer by layer, under the message
  // limit.
  constexpr int kChunk = 1024;
  const size_t token_elems = size_t{kHeads} * kHeadDim;
  for (int l = 0; l < kLayers; ++l) {
    for (int t = 0; t < kStored; t += kChunk) {
      const size_t off = (static_cast<size_t>(l) * kStored + t) * token_elems;
      AppendBlock block;
      block.first_layer = l;
      block.n_layers = 1;
      block.n_tokens = kChunk;
      block.k = absl::MakeConstSpan(w.k.data() + off, kChunk * token_elems);
      block.v = absl::MakeConstSpan(w.v.data() + off, kChunk * token_elems);
      auto r = p.client->Append(p.seq, block);
      if (!r.ok()) {
        p.error = r.status().ToString();
        return;
      }
    }
  }
  auto buffer = p.client->NewFetchBuffer(FetchBytes(4096) / sizeof(uint16_t));
  if (!buffer.ok()) {
    p.error = buffer.status().ToString();
    return;
  }
  p.buffer = *std::move(buffer);
}

void SetUpWorld(const std::string& external) {
  World& w = TheWorld();
  const size_t n = size_t{kLayers} * kStored * kHeads * kHeadDim;
  std::mt19937 rng(1);
  w.k.resize(n);
  w.v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    w.k[i] = static_cast<uint16_t>(rng());
    w.v[i] = static_cast<uint16_t>(rng());
  }
  SetUpPlane("inproc", "inproc:");
  KvServerOptions options;
  options.listen = "127.0.0.1:0";
  auto server = KvServer::Start(options);
  if (server.ok()) {
    w.server = *std::move(server);
    SetUpPlane("tcp", w.server->client_address());
    KvClientOptions stream;
    stream.tcp_fetch_socket = false;
    SetUpPlane("tcp_stream", w.server->client_address(), stream);
  } else {
    w.planes["tcp"].error = server.status().ToString();
  }
  options.listen = absl::StrCat("unix:/tmp/kv_fetch_bench-", getpid(), ".sock");
  options.shm_listen =
      absl::StrCat("unix:/tmp/kv_fetch_bench-", getpid(), ".shm.sock");
  auto unix_server = KvServer::Start(options);
  if (unix_server.ok()) {
    w.unix_server = *std::move(unix_server);
    SetUpPlane("unix", w.unix_server->client_address());
    SetUpPlane("shm", w.unix_server->shm_client_address());
  } else {
    w.planes["unix"].error = unix_server.status().ToString();
    w.planes["shm"].error = unix_server.status().ToString();
  }
  KvServerOptions rdma_options;
  rdma_options.listen = "127.0.0.1:0";
  rdma_options.rdma_device = "any";
  auto rdma_server = KvServer::Start(rdma_options);
  if (rdma_server.ok()) {
    w.rdma_server = *std::move(rdma_server);
    SetUpPlane("rdma", absl::StrCat("rdma://127.0.0.1:", w.rdma_server->port()));
  } else {
    w.planes["rdma"].error = rdma_server.status().ToString();
  }
  if (!external.empty()) SetUpPlane("external", external);
}

// The row a fetch must return at its K or V half, checked once per case.
bool Verify(const OwnedFetchPlan& plan, int layer, const uint16_t* got) {
  const World& w = TheWorld();
  const size_t n = plan.indices.size();
  for (int h = 0; h < kHeads; ++h) {
    for (int j = plan.head_offsets[h]; j < plan.head_offsets[h + 1]; ++j) {
      const size_t src =
          ((static_cast<size_t>(layer) * kStored + plan.indices[j]) * kHeads + h) * kHeadDim;
      if (std::memcmp(got + j * kHeadDim, w.k.data() + src, kHeadDim * 2) != 0 ||
          std::memcmp(got + (n + j) * kHeadDim, w.v.data() + src,
                      kHeadDim * 2) != 0) {
        return false;
      }
    }
  }
  return true;
}

// p50 of the memcpy baseline per size, for the ratio counter.
std::map<int, double>& MemcpyP50() {
  static auto* m = new std::map<int, double>;
  return *m;
}

void Report(benchmark::State& state, std::vector<double>& samples_us,
            int tokens, bool baseline) {
  if (samples_us.empty()) return;
  std::sort(samples_us.begin(), samples_us.end());
  const double p50 = samples_us[samples_us.size() / 2];
  const double p99 = samples_us[std::min(samples_us.size() - 1,
                                         samples_us.size() * 99 / 100)];
  state.counters["p50_us"] = p50;
  state.counters["p99_us"] = p99;
  state.counters["GB/s"] = FetchBytes(tokens) / (p50 * 1e3);
  state.counters["KiB"] = FetchBytes(tokens) / 1024.0;
  if (baseline) {
    MemcpyP50()[tokens] = p50;
  } else if (MemcpyP50().count(tokens)) {
    state.counters["x_memcpy"] = p50 / MemcpyP50()[tokens];
  }
}

void BM_Memcpy(benchmark::State& state, int tokens) {
  const size_t bytes = FetchBytes(tokens);
  // Source larger than the last-level cache, read at a moving offset, so the
  // copy reads memory as a gather from a big pool would.
  static std::vector<char>* src = new std::vector<char>(size_t{256} << 20, 1);
  std::vector<char> dst(bytes);
  std::vector<double> samples;
  size_t offset = 0;
  for (auto _ : state) {
    if (offset + bytes > src->size()) offset = 0;
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src->data() + offset, bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    offset += bytes;
  }
  Report(state, samples, tokens, /*baseline=*/true);
}

void BM_Fetch(benchmark::State& state, const std::string& plane_name,
              int tokens) {
  Plane& p = TheWorld().planes[plane_name];
  if (!p.error.empty() || p.client == nullptr) {
    state.SkipWithError(("set-up failed: " + p.error).c_str());
    for (auto _ : state) {
    }
    return;
  }
  const OwnedFetchPlan plan = MakePlan(tokens, 7 + tokens);
  const FetchPlan view = plan.view();
  // Warm up (opens streams, grows reused messages) and check the rows.
  for (int i = 0; i < 3; ++i) {
    absl::Status s = p.client->Fetch(p.seq, 1, view, p.buffer.get());
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      for (auto _ : state) {
      }
      return;
    }
  }
  if (!Verify(plan, 1, p.buffer->data())) {
    state.SkipWithError("fetched rows differ from the appended ones");
    for (auto _ : state) {
    }
    return;
  }
  std::vector<double> samples;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = p.client->FetchAsync(p.seq, 1, view, p.buffer.get()).Wait();
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  Report(state, samples, tokens, /*baseline=*/false);
}

std::string Machine() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line)) {
    if (absl::StartsWith(line, "model name")) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return absl::StrCat(sysconf(_SC_NPROCESSORS_ONLN), " cores, ", model);
}

}  // namespace
}  // namespace infinigen::kv_memory_service

int main(int argc, char** argv) {
  using namespace infinigen::kv_memory_service;
  std::string external;
  std::vector<char*> args;
  std::vector<std::string> command;
  for (int i = 0; i < argc; ++i) {
    command.push_back(argv[i]);
    if (absl::StartsWith(argv[i], "--kv_address=")) {
      external = std::string(argv[i]).substr(13);
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 2;
  benchmark::AddCustomContext("command", absl::StrJoin(command, " "));
  benchmark::AddCustomContext("machine", Machine());
  SetUpWorld(external);

  std::vector<std::string> planes = {"inproc", "tcp",  "tcp_stream",
                                     "unix",   "shm",  "rdma"};
  if (!external.empty()) planes.push_back("external");
  for (int tokens : kTokens) {
    benchmark::RegisterBenchmark(absl::StrCat("memcpy/", tokens).c_str(),
                                 BM_Memcpy, tokens)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    for (const std::string& plane : planes) {
      benchmark::RegisterBenchmark(
          absl::StrCat(plane, "/", tokens).c_str(),
          [plane, tokens](benchmark::State& s) { BM_Fetch(s, plane, tokens); })
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
