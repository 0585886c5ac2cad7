// libFuzzer target: one setup packet of the shm data plane
// (kv_memory_service/shm/shm_protocol.h) as a peer would send it on the
// SEQPACKET socket. A packet that parses must survive a send/receive round
// trip unchanged.
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "kv_memory_service/shm/shm_protocol.h"

namespace shm = infinigen::kv_memory_service::shm;

namespace {

struct SocketPair {
  int fds[2] = {-1, -1};
  SocketPair() {
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) {
      std::abort();
    }
    // Larger than any packet the fuzzer makes, so a send never blocks.
    int bytes = 1 << 20;
    setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    setsockopt(fds[1], SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static SocketPair pair;
  if (size == 0 || size > 65536) return 0;  // an empty packet is EOF-like
  if (send(pair.fds[0], data, size, MSG_NOSIGNAL) != static_cast<ssize_t>(size)) {
    return 0;
  }
  int fd = -1;
  auto message = shm::ReceiveMessage(pair.fds[1], &fd);
  if (fd >= 0) close(fd);
  if (!message.ok()) return 0;
  if (message->text.size() > shm::kMaxMessageText) return 0;
  if (!shm::SendMessage(pair.fds[0], *message).ok()) std::abort();
  auto again = shm::ReceiveMessage(pair.fds[1], nullptr);
  if (!again.ok() || again->type != message->type ||
      again->slot != message->slot || again->code != message->code ||
      again->max_slots != message->max_slots ||
      again->elements != message->elements || again->text != message->text) {
    std::abort();
  }
  return 0;
}
