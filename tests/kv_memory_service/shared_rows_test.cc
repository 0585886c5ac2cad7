// One-sided reads (MapRows over the shm data plane) against the real
// kv_memory_server, probed as a hostile client on the node's host would:
//  - a descriptor of the node's rows reopened writable through /proc, as
//    root and as an unprivileged uid that only inherited it, then written,
//    truncated, grown and punched;
//  - descriptors and mappings hoarded past their sequences' close, against
//    --capacity_bytes and --shm_max_pinned_sequences;
//  - the node held at its descriptor limit with a connection pending.
// Each time the node keeps serving, another session's canary rows come back
// bit for bit, and the memory the node holds stays within what it counts.
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kv_memory_service/client/kv_client.h"
#include "kv_memory_service/shm/shm_protocol.h"
#include "kv_memory_service/testing/kv_test_data.h"
#include "tests/kv_memory_service/server_process.h"

namespace infinigen::kv_memory_service {
namespace {

using testdata::ExpectedRows;
using testdata::MakeGeometry;
using testdata::MakeTestBlock;

#define ASSERT_OK(expr)                              \
  do {                                               \
    const absl::Status s_ = (expr);                  \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_;     \
  } while (0)

// A client of the shm socket that speaks the protocol itself: Hello, an
// Attach with a sealed control region of one slot, then MapRows.
class RawShmPeer {
 public:
  static absl::StatusOr<std::unique_ptr<RawShmPeer>> Connect(
      const std::string& path, absl::Duration timeout = absl::Seconds(5)) {
    std::unique_ptr<RawShmPeer> p(new RawShmPeer);
    p->socket_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    if (connect(p->socket_, reinterpret_cast<sockaddr*>(&addr),
                sizeof(addr)) != 0) {
      return absl::UnavailableError(absl::StrCat("connect: ", errno));
    }
    IG_RETURN_IF_ERROR(shm::SetReceiveTimeout(p->socket_, timeout));
    auto hello = shm::ReceiveMessage(p->socket_, nullptr);
    if (!hello.ok()) return hello.status();
    const int fd =
        memfd_create("raw-peer-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    p->region_bytes_ = shm::ControlRegionBytes(1);
    if (fd < 0 || ftruncate(fd, p->region_bytes_) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
      return absl::InternalError("control region");
    }
    p->region_ = mmap(nullptr, p->region_bytes_, PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
    auto* header = static_cast<shm::RegionHeader*>(p->region_);
    header->magic = shm::kRegionMagic;
    header->version = shm::kProtocolVersion;
    header->max_slots = 1;
    shm::SocketMessage attach;
    attach.type = shm::MessageType::kAttach;
    attach.max_slots = 1;
    const absl::Status sent = shm::SendMessage(p->socket_, attach, fd);
    close(fd);
    IG_RETURN_IF_ERROR(sent);
    auto reply = shm::ReceiveMessage(p->socket_, nullptr);
    if (!reply.ok()) return reply.status();
    IG_RETURN_IF_ERROR(shm::StatusOfReply(*reply));
    return p;
  }

  ~RawShmPeer() {
    if (region_ != nullptr) munmap(region_, region_bytes_);
    close(socket_);
  }

  // A descriptor of K (part 0) or V (part 1) of `seq`'s rows; the caller
  // owns it.
  absl::StatusOr<int> MapRows(SequenceId seq, SessionId session,
                              uint32_t part) {
    shm::SocketMessage request;
    request.type = shm::MessageType::kMapRows;
    request.sequence = seq;
    request.session = session;
    request.slot = part;
    IG_RETURN_IF_ERROR(shm::SendMessage(socket_, request));
    auto* header = static_cast<shm::RegionHeader*>(region_);
    header->control_seq.fetch_add(1);
    header->doorbell.fetch_add(1);
    shm::FutexWakeAll(&header->doorbell);
    int fd = -1;
    auto reply = shm::ReceiveMessage(socket_, &fd);
    if (!reply.ok()) return reply.status();
    absl::Status status = shm::StatusOfReply(*reply);
    if (!status.ok()) {
      if (fd >= 0) close(fd);
      return status;
    }
    if (fd < 0) return absl::InternalError("MapRows carried no descriptor");
    return fd;
  }

 private:
  RawShmPeer() = default;
  int socket_ = -1;
  void* region_ = nullptr;
  size_t region_bytes_ = 0;
};

// A node with gRPC on loopback TCP and the shm plane on a unix socket.
struct Node {
  std::unique_ptr<ServerProcess> process;
  std::string shm_path;
  std::string shm_address;
  int metrics_port = 0;
};

// A loopback port free now.
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

Node StartNode(std::vector<std::string> flags, int max_descriptors = 0) {
  Node n;
  n.shm_path = ServerProcess::SocketPath("shared_rows");
  n.shm_address = "shm:unix:" + n.shm_path;
  n.metrics_port = FreePort();
  flags.push_back("--listen=127.0.0.1:0");
  flags.push_back("--shm_listen=unix:" + n.shm_path);
  flags.push_back(absl::StrCat("--metrics_listen=127.0.0.1:", n.metrics_port));
  auto p = ServerProcess::Start(flags, max_descriptors);
  EXPECT_TRUE(p.ok()) << p.status();
  if (p.ok()) n.process = *std::move(p);
  return n;
}

KvClientOptions Options() {
  KvClientOptions options;
  options.connect_timeout = absl::Seconds(10);
  options.rpc_timeout = absl::Seconds(10);
  options.fetch_timeout = absl::Seconds(10);
  return options;
}

// A sequence of its own session, filled with `salt`'s rows: what each test
// checks comes back bit for bit.
struct Tenant {
  std::unique_ptr<KvClient> client;
  SequenceId id = 0;
  SequenceGeometry g;
  uint32_t salt = 0;
  int length = 0;
};

Tenant NewTenant(const Node& node, uint32_t salt, int length = 100) {
  Tenant t;
  t.g = MakeGeometry(2, 2, 64, 256);
  t.salt = salt;
  t.length = length;
  auto client = ConnectKvClient(node.shm_address, Options());
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return t;
  t.client = *std::move(client);
  auto id = t.client->Open(t.g);
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return t;
  t.id = *id;
  testdata::TestBlock block =
      MakeTestBlock(salt, t.g, 0, t.g.n_layers, 0, length);
  auto appended = t.client->Append(t.id, block.block);
  EXPECT_TRUE(appended.ok()) << appended.status();
  return t;
}

// Every row of every layer of the tenant's sequence, fetched and compared.
absl::Status CheckRows(Tenant& t) {
  if (t.client == nullptr) return absl::InternalError("no client");
  std::vector<int32_t> all(t.length);
  for (int i = 0; i < t.length; ++i) all[i] = i;
  const OwnedFetchPlan plan =
      OwnedFetchPlan::SameForAllHeads(t.g.n_kv_heads, all);
  auto buffer =
      t.client->NewFetchBuffer(FetchElements(plan.view(), t.g.head_dim));
  if (!buffer.ok()) return buffer.status();
  for (int l = 0; l < t.g.n_layers; ++l) {
    IG_RETURN_IF_ERROR(t.client->Fetch(t.id, l, plan.view(), buffer->get()));
    const auto want = ExpectedRows(t.salt, t.g, l, plan.view());
    if (!std::equal(want.begin(), want.end(), (*buffer)->data())) {
      return absl::DataLossError(absl::StrCat("layer ", l, " differs"));
    }
  }
  return absl::OkStatus();
}

// The pages a memfd holds (the same for every holder: one file).
int64_t CommittedBytes(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_blocks) * 512 : -1;
}

// The node's /metrics page.
std::string Metrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string get = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if (write(fd, get.data(), get.size()) == static_cast<ssize_t>(get.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

// The value of an unlabelled metric on the page, or -1.
double MetricValue(const std::string& page, const std::string& name) {
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + " ", 0) == 0) {
      double v = -1;
      if (absl::SimpleAtod(line.substr(name.size() + 1), &v)) return v;
    }
  }
  return -1;
}

// The node's stats once at most `sequences` closed sequences stay pinned:
// the kernel reports a freed inode a jiffy or so after its last holder
// lets go.
absl::StatusOr<StoreStats> UntilUnpinned(KvClient& client,
                                         int64_t sequences = 0) {
  absl::StatusOr<StoreStats> stats = client.GetStoreStats();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (stats.ok() && stats->pinned_sequences > sequences &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    stats = client.GetStoreStats();
  }
  return stats;
}

// What the attacks that worked did, as bits (0: none worked).
enum Attack : int {
  kWrote = 1,
  kShrank = 2,
  kGrew = 4,
  kPunched = 8,
  kMappedWritable = 16,
};

// In a child process (as `uid`, which only inherits the descriptors):
// reopens each of `fds` read-write through /proc and tries every way to
// change or shrink the file. Exits with the Attack bits that worked, or
// 100 + errno's value when it could not become `uid`.
int AttackInChild(const std::vector<int>& fds, uid_t uid) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (uid != 0) {
      if (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
        _exit(100 + errno % 100);
      }
      prctl(PR_SET_DUMPABLE, 1);
    }
    int worked = 0;
    for (int fd : fds) {
      const int rw =
          open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
      const int target = rw >= 0 ? rw : fd;
      const uint16_t junk[32] = {0xdead, 0xbeef};
      if (pwrite(target, junk, sizeof(junk), 0) > 0) worked |= kWrote;
      void* w = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, target,
                     0);
      if (w != MAP_FAILED) {
        worked |= kMappedWritable;
        static_cast<uint16_t*>(w)[1] = 0xdead;
        munmap(w, 4096);
      }
      if (fallocate(target, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                    1 << 16) == 0) {
        worked |= kPunched;
      }
      struct stat st {};
      fstat(target, &st);
      if (ftruncate(target, st.st_size + (1 << 20)) == 0) worked |= kGrew;
      if (ftruncate(target, 0) == 0) worked |= kShrank;
      if (rw >= 0) close(rw);
    }
    _exit(worked);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 200;
}

// Finding: a memfd's inode is mode 0777, so a "read-only" descriptor could
// be reopened writable; a client rewrote its rows, and truncating the file
// killed the node with SIGBUS at the next fetch. Sealed rows refuse it all.
TEST(SharedRowsTest, AReopenedDescriptorCannotChangeOrShrinkTheRows) {
  Node node = StartNode({});
  ASSERT_NE(node.process, nullptr);
  Tenant owner = NewTenant(node, 71);
  Tenant canary = NewTenant(node, 72);
  ASSERT_NE(owner.id, 0u);
  ASSERT_NE(canary.id, 0u);
  auto peer = RawShmPeer::Connect(node.shm_path);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto k = (*peer)->MapRows(owner.id, owner.client->session(), 0);
  auto v = (*peer)->MapRows(owner.id, owner.client->session(), 1);
  ASSERT_TRUE(k.ok()) << k.status();
  ASSERT_TRUE(v.ok()) << v.status();
  // Another session's sequence is not handed out at all.
  EXPECT_EQ((*peer)->MapRows(canary.id, owner.client->session(), 0)
                .status()
                .code(),
            absl::StatusCode::kNotFound);

  for (uid_t uid : {uid_t{0}, uid_t{65534}}) {
    if (uid == 0 && geteuid() != 0) continue;
    if (uid != 0 && geteuid() != 0) continue;  // cannot become another uid
    const int worked = AttackInChild({*k, *v}, uid);
    EXPECT_EQ(worked, 0) << "as uid " << uid << ": attacks that worked "
                         << worked << " (1 wrote, 2 shrank, 4 grew, "
                         << "8 punched, 16 mapped writable; 100+: setuid)";
    ASSERT_TRUE(node.process->Running()) << "the node died after uid " << uid;
    EXPECT_TRUE(CheckRows(owner).ok()) << CheckRows(owner);
    EXPECT_TRUE(CheckRows(canary).ok()) << CheckRows(canary);
  }
  // A mapping through the descriptor still reads the true rows.
  const size_t layer_values = size_t{2} * 256 * 64;
  struct stat st {};
  ASSERT_EQ(fstat(*k, &st), 0);
  ASSERT_EQ(static_cast<size_t>(st.st_size), 2 * layer_values * 2);
  void* rows =
      mmap(nullptr, 2 * layer_values * 2, PROT_READ, MAP_SHARED, *k, 0);
  ASSERT_NE(rows, MAP_FAILED);
  const OwnedFetchPlan first = OwnedFetchPlan::SameForAllHeads(2, {0});
  const auto want = ExpectedRows(71, owner.g, 0, first.view());
  EXPECT_EQ(static_cast<const uint16_t*>(rows)[0], want[0]);
  munmap(rows, 2 * layer_values * 2);
  close(*k);
  close(*v);
  EXPECT_TRUE(node.process->Running());
}

// Finding: closed sequences whose descriptors a client keeps stayed
// committed (8.8x --capacity_bytes) while the node counted only the live
// ones and accepted new Opens. Now they count as pinned until released.
TEST(SharedRowsTest, RowsHoardedAfterCloseCountAgainstCapacityUntilReleased) {
  constexpr int64_t kCapacity = int64_t{16} << 20;
  // No spares: each sequence takes fresh rows, as a hoarder's would.
  Node node = StartNode({absl::StrCat("--capacity_bytes=", kCapacity),
                         "--lease_timeout=0", "--shm_spare_rows=0"});
  ASSERT_NE(node.process, nullptr);
  auto hoarder = ConnectKvClient(node.shm_address, Options());
  ASSERT_TRUE(hoarder.ok()) << hoarder.status();
  auto peer = RawShmPeer::Connect(node.shm_path);
  ASSERT_TRUE(peer.ok()) << peer.status();
  // 4 MiB reserved a sequence, every row written.
  const SequenceGeometry g = MakeGeometry(1, 4, 128, 2048);
  const size_t half = size_t{1} * 4 * 2048 * 128 * 2;  // K (or V) bytes
  int64_t hoarded = 0;  // the pages the hoarder keeps alive
  std::vector<int> fds;
  std::vector<void*> maps;
  int opened = 0;
  // Open, fill, map and close until the node refuses; far more than fit
  // if closed rows were not counted.
  for (int i = 0; i < 12; ++i) {
    auto id = (*hoarder)->Open(g);
    if (!id.ok()) {
      EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted)
          << id.status();
      EXPECT_THAT(std::string(id.status().message()),
                  testing::HasSubstr("still held by the clients"));
      continue;
    }
    ++opened;
    testdata::TestBlock block = MakeTestBlock(90 + i, g, 0, 1, 0, 2048);
    ASSERT_TRUE((*hoarder)->Append(*id, block.block).ok());
    auto k = (*peer)->MapRows(*id, (*hoarder)->session(), 0);
    auto v = (*peer)->MapRows(*id, (*hoarder)->session(), 1);
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_TRUE(v.ok()) << v.status();
    // K kept as a mapping alone, V as a descriptor alone.
    hoarded += CommittedBytes(*k) + CommittedBytes(*v);
    void* m = mmap(nullptr, half, PROT_READ, MAP_SHARED, *k, 0);
    ASSERT_NE(m, MAP_FAILED);
    close(*k);
    maps.push_back(m);
    fds.push_back(*v);
    ASSERT_OK((*hoarder)->Close(*id));
  }
  EXPECT_EQ(opened, 4);  // 16 MiB of capacity, 4 MiB each
  ASSERT_TRUE(node.process->Running());
  auto stats = (*hoarder)->GetStoreStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->bytes_reserved, 0);
  EXPECT_EQ(stats->pinned_sequences, 4);
  EXPECT_GE(stats->pinned_bytes, 4 * int64_t{2} * half);
  const std::string page = Metrics(node.metrics_port);
  EXPECT_EQ(MetricValue(page, "infinigen_kv_pinned_bytes"),
            static_cast<double>(stats->pinned_bytes))
      << page;
  EXPECT_EQ(MetricValue(page, "infinigen_kv_pinned_sequences"), 4) << page;
  // What the node holds, its resident memory plus the rows the hoarder
  // keeps alive, stays within the capacity (the slack: the node's own
  // code, heap and gRPC buffers).
  EXPECT_EQ(hoarded, stats->pinned_bytes);
  EXPECT_LE(hoarded, kCapacity);
  EXPECT_LE(node.process->RssBytes() + hoarded,
            kCapacity + (int64_t{48} << 20));

  // Another tenant is refused too: the memory is really taken.
  auto other = ConnectKvClient(node.shm_address, Options());
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->Open(g).status().code(),
            absl::StatusCode::kResourceExhausted);

  // Released: the node sees it and the capacity is back.
  for (void* m : maps) munmap(m, half);
  for (int fd : fds) close(fd);
  stats = UntilUnpinned(**hoarder);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pinned_bytes, 0);
  EXPECT_EQ(stats->pinned_sequences, 0);
  auto again = (*other)->Open(g);
  EXPECT_TRUE(again.ok()) << again.status();
}

// The worker's own one-sided reads unmap a sequence's rows before closing
// it: nothing stays pinned, and the rows it read were the true ones.
TEST(SharedRowsTest, AWorkersOwnOneSidedReadsPinNothing) {
  Node node = StartNode({});
  ASSERT_NE(node.process, nullptr);
  for (int i = 0; i < 3; ++i) {
    Tenant t = NewTenant(node, 40 + i);
    ASSERT_NE(t.id, 0u);
    auto rows = t.client->GetDirectRows(t.id);
    ASSERT_TRUE(rows.ok()) << rows.status();
    const OwnedFetchPlan first = OwnedFetchPlan::SameForAllHeads(2, {0});
    EXPECT_EQ(rows->k[0], ExpectedRows(40 + i, t.g, 0, first.view())[0]);
    ASSERT_OK(t.client->Close(t.id));
    auto stats = t.client->GetStoreStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    stats = UntilUnpinned(*t.client);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->pinned_bytes, 0);
    EXPECT_EQ(stats->pinned_sequences, 0);
  }
}

// A worker that serves one sequence after another reads each where it read
// the last: the node opens the session's next sequence of the same size in
// the closed one's rows, which the client kept mapped (and registered with
// CUDA, where there is a device), so nothing is mapped or pinned again.
// Each sequence reads its own rows, nothing stays pinned, and without
// spares (--shm_spare_rows=0) every sequence takes fresh rows.
TEST(SharedRowsTest, ASessionsNextSequenceIsReadWhereItsLastWas) {
  for (const int spares : {1, 0}) {
    SCOPED_TRACE(spares);
    Node node = StartNode({absl::StrCat("--shm_spare_rows=", spares)});
    ASSERT_NE(node.process, nullptr);
    auto client = ConnectKvClient(node.shm_address, Options());
    ASSERT_TRUE(client.ok()) << client.status();
    const SequenceGeometry g = MakeGeometry(2, 2, 64, 256);
    const OwnedFetchPlan first = OwnedFetchPlan::SameForAllHeads(2, {0, 99});
    const uint16_t* last_k = nullptr;
    for (int i = 0; i < 3; ++i) {
      auto id = (*client)->Open(g);
      ASSERT_TRUE(id.ok()) << id.status();
      testdata::TestBlock block = MakeTestBlock(60 + i, g, 0, 2, 0, 100);
      ASSERT_TRUE((*client)->Append(*id, block.block).ok());
      auto rows = (*client)->GetDirectRows(*id);
      ASSERT_TRUE(rows.ok()) << rows.status();
      if (spares > 0 && i > 0) {
        EXPECT_EQ(rows->k, last_k);
      }
      last_k = rows->k;
      // Its own rows, not the last sequence's: head 0's positions 0 and 99
      // of layer 1, where the plan's layout puts them.
      const std::vector<uint16_t> want = ExpectedRows(60 + i, g, 1, first.view());
      const size_t row = g.head_dim;
      const uint16_t* layer1 = rows->k + rows->layer_values;
      EXPECT_TRUE(std::equal(layer1, layer1 + row, want.begin()));
      EXPECT_TRUE(std::equal(layer1 + 99 * row, layer1 + 100 * row,
                             want.begin() + row));
      ASSERT_OK((*client)->Close(*id));
    }
    auto stats = UntilUnpinned(**client, spares > 0 ? 0 : 1);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->reused_row_sequences, spares > 0 ? 2 : 0);
    EXPECT_EQ(stats->spare_sequences, spares > 0 ? 1 : 0);
    EXPECT_EQ(stats->spare_bytes, spares > 0 ? ReservedBytes(g) : 0);
    EXPECT_EQ(stats->pinned_sequences, spares > 0 ? 0 : 1);  // the kept one
    EXPECT_EQ(stats->bytes_reserved, 0);
    const std::string page = Metrics(node.metrics_port);
    EXPECT_EQ(MetricValue(page, "infinigen_kv_reused_row_sequences_total"),
              spares > 0 ? 2 : 0)
        << page;
    // Another session's sequence of the same size never lands in them.
    Tenant other = NewTenant(node, 70, 100);
    ASSERT_NE(other.id, 0u);
    auto other_rows = other.client->GetDirectRows(other.id);
    ASSERT_TRUE(other_rows.ok()) << other_rows.status();
    EXPECT_NE(other_rows->k, last_k);
    EXPECT_TRUE(CheckRows(other).ok());
    stats = other.client->GetStoreStats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->reused_row_sequences, spares > 0 ? 2 : 0);
    // The session's end lets its spare go; with the client gone, nothing
    // stays pinned.
    client->reset();
    stats = UntilUnpinned(*other.client);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->spare_sequences, 0);
    EXPECT_EQ(stats->pinned_sequences, 0);
  }
}

// The cap per session: beyond --shm_max_pinned_sequences closed sequences
// still held, MapRows of another sequence is refused, naming the flag.
TEST(SharedRowsTest, ASessionKeepsAtMostItsLimitOfPinnedSequences) {
  Node node = StartNode({"--shm_max_pinned_sequences=2", "--shm_spare_rows=0"});
  ASSERT_NE(node.process, nullptr);
  auto client = ConnectKvClient(node.shm_address, Options());
  ASSERT_TRUE(client.ok()) << client.status();
  auto peer = RawShmPeer::Connect(node.shm_path);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const SequenceGeometry g = MakeGeometry(1, 1, 64, 64);
  const SessionId session = (*client)->session();
  std::vector<int> held;
  for (int i = 0; i < 2; ++i) {
    auto id = (*client)->Open(g);
    ASSERT_TRUE(id.ok());
    auto k = (*peer)->MapRows(*id, session, 0);
    ASSERT_TRUE(k.ok()) << k.status();
    held.push_back(*k);
    ASSERT_OK((*client)->Close(*id));
  }
  auto id = (*client)->Open(g);
  ASSERT_TRUE(id.ok());
  auto refused = (*peer)->MapRows(*id, session, 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              testing::HasSubstr("--shm_max_pinned_sequences=2"));
  // The worker's own path falls back to gathers: its fetches still work.
  Tenant canary = NewTenant(node, 5);
  EXPECT_TRUE(CheckRows(canary).ok());
  close(held[0]);
  auto one_left = UntilUnpinned(**client, 1);  // held[1] stays
  ASSERT_TRUE(one_left.ok());
  EXPECT_EQ(one_left->pinned_sequences, 1);
  auto allowed = (*peer)->MapRows(*id, session, 0);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  close(*allowed);
  close(held[1]);
}

// Finding: with no descriptors left, one pending connection on the shm
// socket made the accept thread spin a core (accept4 failing with EMFILE
// about 7,000 times a second) until the peer went away. Now the pending
// peer is shed and the accept loop backs off.
TEST(SharedRowsTest, AtTheDescriptorLimitAPendingPeerDoesNotSpin) {
  Node node = StartNode({}, /*max_descriptors=*/64);
  ASSERT_NE(node.process, nullptr);
  Tenant canary = NewTenant(node, 9);
  ASSERT_NE(canary.id, 0u);
  // Attached peers take a descriptor each until the node cannot take the
  // next one's control region (an Attach needs two). After the node has
  // reaped that one, peers that only read the Hello (one descriptor each,
  // kept for the handshake's 10 s) take the rest, until one gets no Hello:
  // the node is out of descriptors with a connection pending.
  std::vector<std::unique_ptr<RawShmPeer>> peers;
  for (int i = 0; i < 200; ++i) {
    auto peer = RawShmPeer::Connect(node.shm_path, absl::Seconds(1));
    if (!peer.ok()) break;
    peers.push_back(*std::move(peer));
  }
  ASSERT_GT(peers.size(), 0u);
  ASSERT_LT(peers.size(), 64u);
  absl::SleepFor(absl::Milliseconds(1500));
  auto connect_raw = [&node] {
    const int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, node.shm_path.c_str(),
                 sizeof(addr.sun_path) - 1);
    EXPECT_EQ(connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return s;
  };
  std::vector<int> greeted;
  int waiting = -1;
  for (int i = 0; i < 32 && waiting < 0; ++i) {
    const int s = connect_raw();
    if (shm::SetReceiveTimeout(s, absl::Seconds(1)).ok() &&
        shm::ReceiveMessage(s, nullptr).ok()) {
      greeted.push_back(s);
    } else {
      close(s);
      waiting = connect_raw();  // the node has no descriptor for it
    }
  }
  ASSERT_GE(waiting, 0) << "the node never ran out of descriptors";
  const double cpu_before = node.process->CpuSeconds();
  absl::SleepFor(absl::Seconds(3));
  const double cpu = node.process->CpuSeconds() - cpu_before;
  // A spinning accept loop takes 2.5-3 s of CPU in 3 s; the idle peers'
  // wake-ups (20 a second each) and the lease thread's take far less.
  EXPECT_LT(cpu, 1.0) << "the node used " << cpu << " s of CPU in 3 s at "
                      << "its descriptor limit with " << peers.size()
                      << " peers attached";
  // The waiting peer was told, not left hanging: its connection ended
  // without a Hello.
  pollfd p = {waiting, POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 1) << "the peer is still left waiting";
  char c;
  EXPECT_EQ(recv(waiting, &c, 1, MSG_DONTWAIT), 0);
  close(waiting);
  for (int s : greeted) close(s);
  ASSERT_TRUE(node.process->Running());
  // Descriptors free again: new peers attach, and the canary is intact.
  peers.clear();
  absl::SleepFor(absl::Milliseconds(200));  // the node reaps them
  std::unique_ptr<RawShmPeer> fresh;
  for (int i = 0; i < 50 && fresh == nullptr; ++i) {
    auto peer = RawShmPeer::Connect(node.shm_path);
    if (peer.ok()) {
      fresh = *std::move(peer);
    } else {
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  EXPECT_NE(fresh, nullptr);
  EXPECT_TRUE(CheckRows(canary).ok()) << CheckRows(canary);
}

}  // namespace
}  // namespace infinigen::kv_memory_service
