// Fetch latency of the KV memory service, per data plane, against a
// single-thread memcpy of the same bytes measured in the same run.
//
// Two shapes, each one layer's K and V rows gathered into one contiguous
// FetchBuffer; timed: FetchAsync + Wait, one fetch in flight, so the numbers
// are round trips.
//  - <plane>/<tokens>: `tokens` tokens for each of 3 KV heads (head_dim 64,
//    fp16, SmolLM2's layer), each head its own random positions out of 8192
//    stored: 2 * tokens * 3 * 64 * 2 bytes.
//  - <plane>/7b_layer/all and <plane>/7b_layer/10pct: a 7B-class layer
//    (8 KV heads x 128 dims, fp16, 32,768 tokens stored per head): every
//    row of the layer (128 MiB, what `full` reads), or 10% of the rows of
//    each head at random positions (12.8 MiB, an InfiniGen step).
// Baselines in the same run: memcpy/<case>, one thread copying the same
// bytes from a source larger than the last-level cache; memcpy_mt/<case>,
// the same copy split over every core. note_inproc/<7b case> and
// note_shm/<7b case>: NoteFetched of the same plan, what a one-sided read
// (the worker reads the rows in place) costs the node;
// note_leading_inproc/7b_layer/all and note_leading_shm/...: the same
// whole-layer read noted by its head offsets alone (NoteLeadingFetched).
// append_inproc/llama2_7b_layer/all: a prefill's append of a whole layer of
// llama-2-7b's shape (32 KV heads x 128 dims, 32,768 tokens: 512 MiB of K
// and V) in one token-major block into a fresh sequence (the rows' first
// writes), against memcpy/llama2_7b_layer/all; append_resident_inproc/...:
// the same into rows already in memory (as a device's registration for
// one-sided reads leaves them). append_inproc/7b_layer/all, append_shm/...
// and append_tcp/...: the same append of the 7B-class layer (128 MiB) over
// each plane on this host, against memcpy/7b_layer/all.
// sequence_inproc/7b_layer/all and
// sequence_shm/...: a one-sided reader's whole sequence, Open, the prompt's
// append of the 7B-class layer, GetDirectRows, one word read of every page
// of the rows, Close, against memcpy/7b_layer/all.
//
//   bazel build //bench/kv_fetch_bench
//   bazel-bin/bench/kv_fetch_bench/kv_fetch_bench
//       [--kv_address=tcp://HOST:PORT]   also bench an external server
//       [--planes=inproc,shm,...]        set up only these planes (default:
//                                        all; the others report set-up skipped)
//       [--benchmark_out=FILE.json --benchmark_out_format=json]
//
// Data planes: memcpy (the baseline), inproc, tcp (a KvServer in this
// process on 127.0.0.1:0: real loopback TCP; fetches on its plain fetch
// socket), tcp_stream (the same, fetches on the gRPC FetchStream), unix (a
// server on a unix socket: gRPC FetchStream), shm (that unix server's
// shared-memory data plane: the rows are gathered into a memfd slot by the
// server's shm thread), rdma (a KvServer with --rdma_device=any over the local
// RDMA port; skipped with the reason where there is no RDMA device), and, with
// --kv_address, "external" (any address, e.g. shm:unix:PATH of a
// kv_memory_server process). Counters: p50_us and p99_us per fetch, GB/s at the
// p50, and x_memcpy: the p50 over the single-thread memcpy p50 of the same
// case. To add a data plane, add a Plane in Planes().
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "benchmark/benchmark.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/server/kv_server.h"

namespace infinigen::kv_memory_service {
namespace {

// The stored cache of one shape: n_layers x stored tokens x heads x dims.
struct Shape {
  const char* name;
  int heads;
  int head_dim;
  int stored;  // tokens per (layer, head) in the store
  int layers;
};
constexpr Shape kSmall = {"small", 3, 64, 8192, 2};
constexpr Shape k7b = {"7b_layer", 8, 128, 32768, 1};
// llama-2-7b's layer (32 KV heads), for the prefill's append.
constexpr Shape kLlama2 = {"llama2_7b_layer", 32, 128, 32768, 1};
constexpr int kTokens[] = {16, 256, 4096};

// One benchmark case: `tokens` rows of each head of layer `layer`; every
// row in order when `all`, else distinct random positions, increasing.
struct Case {
  std::string name;  // "4096", "7b_layer/all", ...
  const Shape* shape;
  int tokens;
  bool all;
  size_t bytes() const {
    return size_t{2} * tokens * shape->heads * shape->head_dim *
           sizeof(uint16_t);
  }
  int layer() const { return shape->layers - 1; }
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int tokens : kTokens) {
    cases.push_back({absl::StrCat(tokens), &kSmall, tokens, false});
  }
  cases.push_back({"7b_layer/all", &k7b, k7b.stored, true});
  cases.push_back({"7b_layer/10pct", &k7b, k7b.stored / 10, false});
  return cases;
}

OwnedFetchPlan MakePlan(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> per_head(c.shape->heads);
  std::vector<int32_t> all(c.shape->stored);
  for (int i = 0; i < c.shape->stored; ++i) all[i] = i;
  for (auto& positions : per_head) {
    if (!c.all) std::shuffle(all.begin(), all.end(), rng);
    positions.assign(all.begin(), all.begin() + c.tokens);
    std::sort(positions.begin(), positions.end());
  }
  return OwnedFetchPlan::PerHead(per_head);
}

// A client with one filled sequence per shape and one buffer for the
// largest fetch of each.
struct Plane {
  std::string name;
  std::unique_ptr<KvClient> client;
  std::map<const Shape*, SequenceId> seq;
  std::map<const Shape*, std::unique_ptr<FetchBuffer>> buffer;
  std::string error;  // set when the plane could not be set up
};

// The rows appended to every plane, per shape:
// [layers][stored][heads][head_dim].
struct Rows {
  std::vector<uint16_t> k, v;
};

struct World {
  std::unique_ptr<KvServer> server;       // tcp
  std::unique_ptr<KvServer> unix_server;  // unix socket, and shm
  std::unique_ptr<KvServer> rdma_server;  // with the RDMA data plane
  std::map<std::string, Plane> planes;
  std::map<const Shape*, Rows> rows;
  std::vector<std::string> socket_paths;  // removed before exit
};

// Room for the whole 7B-class layer in one fetch over gRPC and the fetch
// socket.
constexpr int32_t kMaxMessageBytes = 256 << 20;

World& TheWorld() {
  static World* world = new World;
  return *world;
}

// Opens and fills the sequence of `shape`, and makes its buffer, sized for
// the shape's largest case.
absl::Status SetUpShape(Plane& p, const Shape& shape) {
  const Rows& rows = TheWorld().rows[&shape];
  SequenceGeometry g;
  g.n_layers = shape.layers;
  g.n_kv_heads = shape.heads;
  g.head_dim = shape.head_dim;
  g.max_tokens = shape.stored;
  absl::StatusOr<SequenceId> seq = p.client->Open(g);
  if (!seq.ok()) return seq.status();
  p.seq[&shape] = *seq;
  // Appended in chunks of 1024 tokens, layer by layer, under the message
  // limit.
  constexpr int kChunk = 1024;
  const size_t token_elems = size_t{1} * shape.heads * shape.head_dim;
  for (int l = 0; l < shape.layers; ++l) {
    for (int t = 0; t < shape.stored; t += kChunk) {
      const size_t off =
          (static_cast<size_t>(l) * shape.stored + t) * token_elems;
      AppendBlock block;
      block.first_layer = l;
      block.n_layers = 1;
      block.n_tokens = kChunk;
      block.k = absl::MakeConstSpan(rows.k.data() + off, kChunk * token_elems);
      block.v = absl::MakeConstSpan(rows.v.data() + off, kChunk * token_elems);
      absl::StatusOr<AppendResult> r = p.client->Append(*seq, block);
      if (!r.ok()) return r.status();
    }
  }
  size_t largest = 0;
  for (const Case& c : Cases()) {
    if (c.shape == &shape) largest = std::max(largest, c.bytes());
  }
  auto buffer = p.client->NewFetchBuffer(largest / sizeof(uint16_t));
  if (!buffer.ok()) return buffer.status();
  p.buffer[&shape] = *std::move(buffer);
  return absl::OkStatus();
}

// The planes to set up: empty = all.
std::vector<std::string>& Wanted() {
  static auto* planes = new std::vector<std::string>;
  return *planes;
}
bool WantPlane(const std::string& name) {
  return Wanted().empty() ||
         std::find(Wanted().begin(), Wanted().end(), name) != Wanted().end();
}

void SetUpPlane(const std::string& name, const std::string& address,
                KvClientOptions options = {}) {
  World& w = TheWorld();
  Plane& p = w.planes[name];
  p.name = name;
  if (!WantPlane(name)) {
    p.error = "not in --planes";
    return;
  }
  options.max_message_bytes = kMaxMessageBytes;
  auto client = ConnectKvClient(address, options);
  if (!client.ok()) {
    p.error = client.status().ToString();
    return;
  }
  p.client = *std::move(client);
  for (const Shape* shape : {&kSmall, &k7b}) {
    absl::Status s = SetUpShape(p, *shape);
    if (!s.ok()) {
      p.error = s.ToString();
      return;
    }
  }
}

void SetUpWorld(const std::string& external) {
  World& w = TheWorld();
  std::mt19937 rng(1);
  for (const Shape* shape : {&kSmall, &k7b}) {
    Rows& rows = w.rows[shape];
    const size_t n = size_t{1} * shape->layers * shape->stored * shape->heads *
                     shape->head_dim;
    rows.k.resize(n);
    rows.v.resize(n);
    for (size_t i = 0; i < n; ++i) {
      rows.k[i] = static_cast<uint16_t>(rng());
      rows.v[i] = static_cast<uint16_t>(rng());
    }
  }
  SetUpPlane("inproc", "inproc:");
  KvServerOptions options;
  options.max_message_bytes = kMaxMessageBytes;
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
  const std::string base = absl::StrCat("/tmp/kv_fetch_bench-", getpid());
  options.listen = "unix:" + base + ".sock";
  options.shm_listen = "unix:" + base + ".shm.sock";
  // The shm server's lock file too: the servers are not stopped at exit.
  w.socket_paths = {base + ".sock", base + ".shm.sock",
                    base + ".shm.sock.lock"};
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

// The rows a fetch must return at its K and V halves, checked once per case.
bool Verify(const Case& c, const OwnedFetchPlan& plan, const uint16_t* got) {
  const Shape& sh = *c.shape;
  const Rows& rows = TheWorld().rows[c.shape];
  const size_t n = plan.indices.size();
  const size_t row_bytes = sh.head_dim * sizeof(uint16_t);
  for (int h = 0; h < sh.heads; ++h) {
    for (int j = plan.head_offsets[h]; j < plan.head_offsets[h + 1]; ++j) {
      const size_t src =
          ((static_cast<size_t>(c.layer()) * sh.stored + plan.indices[j]) *
               sh.heads +
           h) *
          sh.head_dim;
      if (std::memcmp(got + j * sh.head_dim, rows.k.data() + src, row_bytes) !=
              0 ||
          std::memcmp(got + (n + j) * sh.head_dim, rows.v.data() + src,
                      row_bytes) != 0) {
        return false;
      }
    }
  }
  return true;
}

// p50 of the single-thread memcpy baseline per case, for the ratio counter.
std::map<std::string, double>& MemcpyP50() {
  static auto* m = new std::map<std::string, double>;
  return *m;
}

void Report(benchmark::State& state, std::vector<double>& samples_us,
            const Case& c, bool baseline) {
  if (samples_us.empty()) return;
  std::sort(samples_us.begin(), samples_us.end());
  const double p50 = samples_us[samples_us.size() / 2];
  const double p99 = samples_us[std::min(samples_us.size() - 1,
                                         samples_us.size() * 99 / 100)];
  state.counters["p50_us"] = p50;
  state.counters["p99_us"] = p99;
  state.counters["GB/s"] = c.bytes() / (p50 * 1e3);
  state.counters["KiB"] = c.bytes() / 1024.0;
  if (baseline) {
    MemcpyP50()[c.name] = p50;
  } else if (MemcpyP50().count(c.name)) {
    state.counters["x_memcpy"] = p50 / MemcpyP50()[c.name];
  }
}

// Copies `bytes` from a source larger than the last-level cache, read at a
// moving offset, so that the copy reads memory as a gather from a big pool
// would; over `threads` threads, each its share.
void BM_Memcpy(benchmark::State& state, const Case& c, int threads) {
  const size_t bytes = c.bytes();
  static std::vector<char>* src = new std::vector<char>(size_t{512} << 20, 1);
  std::vector<char> dst(bytes, 0);
  std::vector<double> samples;
  size_t offset = 0;
  const size_t share = (bytes + threads - 1) / threads;
  for (auto _ : state) {
    if (offset + bytes > src->size()) offset = 0;
    const char* from = src->data() + offset;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> helpers;
    for (int t = 1; t < threads; ++t) {
      helpers.emplace_back([&, t] {
        const size_t begin = std::min(bytes, t * share);
        const size_t end = std::min(bytes, begin + share);
        std::memcpy(dst.data() + begin, from + begin, end - begin);
      });
    }
    std::memcpy(dst.data(), from, std::min(bytes, share));
    for (std::thread& h : helpers) h.join();
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    offset += bytes;
  }
  Report(state, samples, c, /*baseline=*/threads == 1);
  state.counters["threads"] = threads;
}

// Ends the benchmark with `why` (every iteration skipped).
void Skip(benchmark::State& state, const std::string& why) {
  state.SkipWithError(why.c_str());
  for (auto _ : state) {
  }
}

// Times op, a round trip of the case's plan on a plane, once an iteration.
void TimeRoundTrips(benchmark::State& state, const Case& c,
                    absl::FunctionRef<absl::Status()> op) {
  std::vector<double> samples;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = op();
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  Report(state, samples, c, /*baseline=*/false);
}

// What a plane's fetch and note benchmarks read: its client, the case's
// sequence and buffer, and the case's plan. Null (the benchmark skipped)
// where the plane's set-up failed.
struct Target {
  KvClient* client;
  SequenceId seq;
  FetchBuffer* buffer;
  OwnedFetchPlan plan;
};
std::optional<Target> TargetOf(benchmark::State& state,
                               const std::string& plane_name, const Case& c) {
  Plane& p = TheWorld().planes[plane_name];
  if (!p.error.empty() || p.client == nullptr) {
    Skip(state, "set-up failed: " + p.error);
    return std::nullopt;
  }
  return Target{p.client.get(), p.seq[c.shape], p.buffer[c.shape].get(),
                MakePlan(c, 7 + c.tokens)};
}

void BM_Fetch(benchmark::State& state, const std::string& plane_name,
              const Case& c) {
  const std::optional<Target> t = TargetOf(state, plane_name, c);
  if (!t) return;
  const FetchPlan view = t->plan.view();
  // Warm up (opens streams, grows reused messages) and check the rows.
  for (int i = 0; i < 3; ++i) {
    absl::Status s = t->client->Fetch(t->seq, c.layer(), view, t->buffer);
    if (!s.ok()) return Skip(state, s.ToString());
  }
  if (!Verify(c, t->plan, t->buffer->data())) {
    return Skip(state, "fetched rows differ from the appended ones");
  }
  TimeRoundTrips(state, c, [&] {
    return t->client->FetchAsync(t->seq, c.layer(), view, t->buffer).Wait();
  });
}

// What a one-sided read costs the node: NoteFetched of the same plan (the
// worker read the rows itself; the node checks the positions and counts
// the fetch for its statistics and eviction), a round trip per note.
void BM_Note(benchmark::State& state, const std::string& plane_name,
             const Case& c) {
  const std::optional<Target> t = TargetOf(state, plane_name, c);
  if (!t) return;
  const FetchPlan view = t->plan.view();
  TimeRoundTrips(state, c, [&] {
    return t->client->NoteFetched(t->seq, c.layer(), view, t->buffer);
  });
}

// A whole layer read in place, noted by its head offsets alone
// (NoteLeadingFetchedAsync): what full's one-sided read costs the node.
void BM_NoteLeading(benchmark::State& state, const std::string& plane_name,
                    const Case& c) {
  const std::optional<Target> t = TargetOf(state, plane_name, c);
  if (!t) return;
  const std::vector<int32_t>& offsets = t->plan.head_offsets;
  TimeRoundTrips(state, c, [&] {
    return t->client
        ->NoteLeadingFetchedAsync(t->seq, c.layer(), offsets, t->buffer)
        .Wait();
  });
}

// A prefill's append of a whole layer, as the worker sends it (every token
// of the layer in one block, token-major): into a fresh sequence each time,
// so the node's rows are written for the first time, as a prompt's are.
// resident: the sequence's rows are in memory before the append (written
// once through GetDirectRows), as a device's registration for one-sided
// reads leaves them; else the append is their first write.
// A sequence of one layer of `shape`.
SequenceGeometry OneLayer(const Shape& shape) {
  SequenceGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = shape.heads;
  g.head_dim = shape.head_dim;
  g.max_tokens = shape.stored;
  return g;
}

// The whole of that layer in one token-major block of `rows`
// ([stored][heads][head_dim]).
AppendBlock WholeLayer(const Shape& shape, const Rows& rows) {
  AppendBlock block;
  block.first_layer = 0;
  block.n_layers = 1;
  block.n_tokens = shape.stored;
  block.k = absl::MakeConstSpan(rows.k);
  block.v = absl::MakeConstSpan(rows.v);
  return block;
}

void BM_Append(benchmark::State& state, const std::string& plane_name,
               const Case& c, bool resident) {
  Plane& p = TheWorld().planes[plane_name];
  if (!p.error.empty() || p.client == nullptr) {
    return Skip(state, "set-up failed: " + p.error);
  }
  const Shape& shape = *c.shape;
  const size_t layer_elems =
      size_t{1} * shape.stored * shape.heads * shape.head_dim;
  // The block's rows, made once a shape: any values (the fetch benchmarks
  // check theirs).
  static auto* made = new std::map<const Shape*, Rows>;
  Rows* rows = &(*made)[&shape];
  if (rows->k.size() != layer_elems) {
    rows->k.resize(layer_elems);
    rows->v.resize(layer_elems);
    for (size_t i = 0; i < layer_elems; ++i) {
      rows->k[i] = static_cast<uint16_t>(i);
      rows->v[i] = static_cast<uint16_t>(~i);
    }
  }
  const SequenceGeometry g = OneLayer(shape);
  const AppendBlock block = WholeLayer(shape, *rows);
  std::vector<double> samples;
  for (auto _ : state) {
    absl::StatusOr<SequenceId> seq = p.client->Open(g);
    if (!seq.ok()) {
      state.SkipWithError(seq.status().ToString().c_str());
      break;
    }
    if (resident) {
      absl::StatusOr<DirectRows> rows = p.client->GetDirectRows(*seq);
      if (!rows.ok()) {
        state.SkipWithError(rows.status().ToString().c_str());
        break;
      }
      std::memset(const_cast<uint16_t*>(rows->k), 0,
                  rows->layer_values * sizeof(uint16_t));
      std::memset(const_cast<uint16_t*>(rows->v), 0,
                  rows->layer_values * sizeof(uint16_t));
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<AppendResult> r = p.client->Append(*seq, block);
    const auto t1 = std::chrono::steady_clock::now();
    const absl::Status closed = p.client->Close(*seq);
    if (!r.ok() || !closed.ok()) {
      state.SkipWithError((r.ok() ? closed : r.status()).ToString().c_str());
      break;
    }
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  Report(state, samples, c, /*baseline=*/false);
}

// A sequence's life for a worker that reads one-sided over `plane`: Open,
// the prompt's append of the whole layer, GetDirectRows, one word read of
// every page of the rows (what a device's first touch of them costs: the
// pages' faults), Close. A node that opens the next sequence in the last
// one's rows, which the client kept mapped, takes neither new pages nor
// faults.
void BM_Sequence(benchmark::State& state, const std::string& plane_name,
                 const Case& c) {
  Plane& p = TheWorld().planes[plane_name];
  if (!p.error.empty() || p.client == nullptr) {
    return Skip(state, "set-up failed: " + p.error);
  }
  const Shape& shape = *c.shape;
  const Rows& rows = TheWorld().rows[&shape];
  const SequenceGeometry g = OneLayer(shape);
  const AppendBlock block = WholeLayer(shape, rows);
  const long page = sysconf(_SC_PAGESIZE) / static_cast<long>(sizeof(uint16_t));
  std::vector<double> samples;
  uint64_t sink = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<SequenceId> seq = p.client->Open(g);
    if (!seq.ok()) {
      state.SkipWithError(seq.status().ToString().c_str());
      break;
    }
    absl::StatusOr<AppendResult> r = p.client->Append(*seq, block);
    absl::StatusOr<DirectRows> direct =
        r.ok() ? p.client->GetDirectRows(*seq)
               : absl::StatusOr<DirectRows>(r.status());
    if (direct.ok()) {
      for (const uint16_t* half : {direct->k, direct->v}) {
        for (size_t i = 0; i < direct->layer_values; i += page) sink += half[i];
      }
    }
    const absl::Status closed = p.client->Close(*seq);
    const auto t1 = std::chrono::steady_clock::now();
    if (!direct.ok() || !closed.ok()) {
      state.SkipWithError(
          (direct.ok() ? closed : direct.status()).ToString().c_str());
      break;
    }
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  benchmark::DoNotOptimize(sink);
  Report(state, samples, c, /*baseline=*/false);
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
    } else if (absl::StartsWith(argv[i], "--planes=")) {
      Wanted() = absl::StrSplit(std::string(argv[i]).substr(9), ',',
                                absl::SkipEmpty());
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
  const int cores =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  for (const Case& c : Cases()) {
    benchmark::RegisterBenchmark(
        absl::StrCat("memcpy/", c.name).c_str(),
        [c](benchmark::State& s) { BM_Memcpy(s, c, 1); })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    if (c.shape == &k7b) {
      benchmark::RegisterBenchmark(
          absl::StrCat("memcpy_mt/", c.name).c_str(),
          [c, cores](benchmark::State& s) { BM_Memcpy(s, c, cores); })
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
    for (const std::string& plane : planes) {
      benchmark::RegisterBenchmark(
          absl::StrCat(plane, "/", c.name).c_str(),
          [plane, c](benchmark::State& s) { BM_Fetch(s, plane, c); })
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
    if (c.shape == &k7b) {
      for (const std::string plane : {"inproc", "shm"}) {
        benchmark::RegisterBenchmark(
            absl::StrCat("note_", plane, "/", c.name).c_str(),
            [plane, c](benchmark::State& s) { BM_Note(s, plane, c); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
        if (!c.all) continue;
        benchmark::RegisterBenchmark(
            absl::StrCat("note_leading_", plane, "/", c.name).c_str(),
            [plane, c](benchmark::State& s) { BM_NoteLeading(s, plane, c); })
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  for (const Case& c : Cases()) {
    if (c.shape != &k7b || !c.all) continue;
    for (const std::string plane : {"inproc", "shm"}) {
      benchmark::RegisterBenchmark(
          absl::StrCat("sequence_", plane, "/", c.name).c_str(),
          [plane, c](benchmark::State& s) { BM_Sequence(s, plane, c); })
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  const Case append = {"llama2_7b_layer/all", &kLlama2, kLlama2.stored, true};
  benchmark::RegisterBenchmark(
      absl::StrCat("memcpy/", append.name).c_str(),
      [append](benchmark::State& s) { BM_Memcpy(s, append, 1); })
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
  for (const bool resident : {false, true}) {
    benchmark::RegisterBenchmark(
        absl::StrCat(resident ? "append_resident_inproc/" : "append_inproc/",
                     append.name)
            .c_str(),
        [append, resident](benchmark::State& s) {
          BM_Append(s, "inproc", append, resident);
        })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  // A prompt's append of the 7B-class layer over each plane on this host.
  const Case append_7b = {"7b_layer/all", &k7b, k7b.stored, true};
  for (const std::string plane : {"inproc", "shm", "tcp"}) {
    benchmark::RegisterBenchmark(
        absl::StrCat("append_", plane, "/", append_7b.name).c_str(),
        [plane, append_7b](benchmark::State& s) {
          BM_Append(s, plane, append_7b, false);
        })
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  for (const std::string& path : TheWorld().socket_paths) unlink(path.c_str());
  return 0;
}
