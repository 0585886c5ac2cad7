// libFuzzer target: the plain-socket fetch plane (kv_memory_service/tcp/
// fetch_wire.h) as a hostile peer drives it: a real FetchSocketServer on
// loopback, over a store holding one sequence, gets the input's frames on
// a fresh connection; the harness then reads whatever comes back until the
// server closes. Any crash, sanitizer report or hang is a bug.
//
// Input: byte 0 holds flags; the rest is cut into frames. Without flag 1 a
// valid Hello goes first. Each frame is a 48-byte request header (an
// append's: and its 8-byte annotation size) followed by the body it
// announces (as much of it as the input has); unless flag
// 2, the header's magic is made a valid one (a fetch, a note of held rows
// or an append, by its value modulo 3), and a sequence id whose low two
// bits are not 0 becomes the stored sequence's (ids are random, so the
// fuzzer could not find it).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "kv_memory_service/store/kv_store.h"
#include "kv_memory_service/tcp/fetch_socket_server.h"
#include "kv_memory_service/tcp/fetch_wire.h"

namespace kv = infinigen::kv_memory_service;

namespace {

struct Fixture {
  std::shared_ptr<kv::KvStore> store;
  std::unique_ptr<kv::FetchSocketServer> server;
  kv::SequenceId seq = 0;

  Fixture() {
    store = std::make_shared<kv::KvStore>(kv::KvStoreOptions{});
    kv::SequenceGeometry g;
    g.n_layers = 2;
    g.n_kv_heads = 2;
    g.head_dim = 4;
    g.max_tokens = 8;
    seq = *store->Open(g);
    std::vector<uint16_t> k(2 * 6 * 2 * 4), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<uint16_t>(i);
      v[i] = static_cast<uint16_t>(~i);
    }
    kv::AppendBlock block;
    block.first_layer = 0;
    block.n_layers = 2;
    block.n_tokens = 6;
    block.k = k;
    block.v = v;
    if (!store->Append(seq, block).ok()) std::abort();
    kv::FetchSocketServerOptions options;
    options.credentials = kv::Credentials::Single("fuzz");
    options.max_message_bytes = 1 << 16;
    options.threads = 1;
    options.handshake_timeout = absl::Seconds(2);
    options.idle_timeout = absl::Seconds(2);
    auto started = kv::FetchSocketServer::Start(store, options);
    if (!started.ok()) std::abort();
    server = *std::move(started);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* fixture = new Fixture;  // lives as long as the process
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  std::string wire;
  if ((flags & 1) == 0) {
    namespace fw = kv::fetch_wire;
    fw::Hello hello;
    const std::string token = "Bearer fuzz";
    hello.token_bytes = token.size();
    wire.append(reinterpret_cast<const char*>(&hello), sizeof(hello));
    wire += token;
  }
  size_t at = 1;
  while (at < size) {
    kv::fetch_wire::FetchRequestHeader q;
    const size_t take = std::min(sizeof(q), size - at);
    std::memcpy(&q, data + at, take);
    at += take;
    if ((flags & 2) == 0) {
      constexpr uint32_t kMagics[] = {kv::fetch_wire::kRequestMagic,
                                      kv::fetch_wire::kHeldMagic,
                                      kv::fetch_wire::kAppendMagic};
      q.magic = kMagics[q.magic % 3];
    }
    if ((q.sequence_id & 3) != 0) q.sequence_id = fixture->seq;
    wire.append(reinterpret_cast<const char*>(&q), take);
    uint64_t announced = (uint64_t{q.n_offsets} + q.n_indices) * 4;
    if (q.magic == kv::fetch_wire::kAppendMagic) {
      // The annotations' size after the header; the body: K and V,
      // dest_elements 2-byte values each, then the annotations.
      uint64_t meta_bytes = 0;
      const size_t tail = std::min(sizeof(meta_bytes), size - at);
      std::memcpy(&meta_bytes, data + at, tail);
      at += tail;
      wire.append(reinterpret_cast<const char*>(&meta_bytes), tail);
      announced = std::min<uint64_t>(q.dest_elements, uint64_t{1} << 40) * 4 +
                  std::min<uint64_t>(meta_bytes, uint64_t{1} << 40);
    }
    const size_t body = std::min<uint64_t>(announced, size - at);
    wire.append(reinterpret_cast<const char*>(data + at), body);
    at += body;
  }

  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(fixture->server->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int fd = -1;
  // Thousands of connections a second can run the loopback out of
  // ephemeral ports for a moment (EADDRNOTAVAIL): wait, that is the
  // harness, not the server.
  for (int attempt = 0;; ++attempt) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      break;
    }
    const int err = errno;
    close(fd);
    if (err != EADDRNOTAVAIL || attempt == 10000) {
      std::fprintf(stderr, "connect: %s\n", std::strerror(err));
      std::abort();
    }
    usleep(1000);
  }
  // Reset on close: no TIME_WAIT left to hold the port.
  const linger reset = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  timeval tv = {10, 0};  // a hang is a bug: the server must answer or close
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  size_t sent = 0;
  char sink[65536];
  while (sent < wire.size()) {
    const ssize_t n =
        send(fd, wire.data() + sent, wire.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server closed on a bad frame
    sent += static_cast<size_t>(n);
  }
  shutdown(fd, SHUT_WR);
  while (true) {
    const ssize_t n = recv(fd, sink, sizeof(sink), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) std::abort();  // hung
      break;  // reset
    }
  }
  close(fd);
  return 0;
}
