#include "kv_memory_service/shm/shm_protocol.h"

#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace infinigen::kv_memory_service::shm {
namespace {

// The fixed part of a packet; `text_bytes` of text follow it.
struct PacketHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t type;
  uint32_t slot;
  int32_t code;
  uint32_t max_slots;
  uint64_t elements;
  uint32_t text_bytes;
  uint32_t reserved;
  uint64_t sequence;
  uint64_t session;
};
static_assert(sizeof(PacketHeader) == 56);

constexpr size_t kMaxPacketBytes = sizeof(PacketHeader) + kMaxMessageText;

}  // namespace

absl::Status ErrnoStatus(absl::StatusCode code, absl::string_view call,
                         int err) {
  return absl::Status(code, absl::StrCat(call, ": ", std::strerror(err)));
}

absl::Status SendMessage(int socket, const SocketMessage& message, int fd) {
  if (message.text.size() > kMaxMessageText) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm socket message text of ", message.text.size(),
                     " bytes is over the limit of ", kMaxMessageText));
  }
  char packet[kMaxPacketBytes];
  PacketHeader header{};
  header.magic = message.magic;
  header.version = message.version;
  header.type = static_cast<uint32_t>(message.type);
  header.slot = message.slot;
  header.code = message.code;
  header.max_slots = message.max_slots;
  header.elements = message.elements;
  header.sequence = message.sequence;
  header.session = message.session;
  header.text_bytes = static_cast<uint32_t>(message.text.size());
  std::memcpy(packet, &header, sizeof(header));
  if (!message.text.empty()) {
    std::memcpy(packet + sizeof(header), message.text.data(),
                message.text.size());
  }

  iovec iov{packet, sizeof(header) + message.text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  }
  while (true) {
    const ssize_t sent = sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (sent >= 0) return absl::OkStatus();
    if (errno == EINTR) continue;
    return ErrnoStatus(absl::StatusCode::kUnavailable,
                       "shm data plane socket sendmsg", errno);
  }
}

absl::StatusOr<SocketMessage> ReceiveMessage(int socket, int* fd) {
  if (fd != nullptr) *fd = -1;
  char packet[kMaxPacketBytes];
  iovec iov{packet, sizeof(packet)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got;
  while (true) {
    got = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (got >= 0 || errno != EINTR) break;
  }
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::DeadlineExceededError(
          "no answer on the shm data plane socket in time");
    }
    return ErrnoStatus(absl::StatusCode::kUnavailable,
                       "shm data plane socket recvmsg", errno);
  }
  if (got == 0) {
    return absl::UnavailableError(
        "the KV memory server closed the shm data plane socket");
  }
  // Take ownership of a passed descriptor before anything can fail.
  int received_fd = -1;
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr;
       cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level == SOL_SOCKET && cmsg->cmsg_type == SCM_RIGHTS &&
        cmsg->cmsg_len >= CMSG_LEN(sizeof(int))) {
      std::memcpy(&received_fd, CMSG_DATA(cmsg), sizeof(int));
    }
  }
  auto fail = [&](absl::string_view why) {
    if (received_fd >= 0) close(received_fd);
    return absl::InvalidArgumentError(
        absl::StrCat("malformed shm data plane message: ", why));
  };
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) return fail("truncated");
  if (static_cast<size_t>(got) < sizeof(PacketHeader)) return fail("too short");
  PacketHeader header;
  std::memcpy(&header, packet, sizeof(header));
  if (header.magic != static_cast<uint32_t>(kRegionMagic)) {
    return fail("bad magic (not an infinigen KV memory server?)");
  }
  if (header.version != kProtocolVersion) {
    return fail(absl::StrCat("protocol version ", header.version, ", want ",
                             kProtocolVersion));
  }
  if (header.text_bytes != static_cast<size_t>(got) - sizeof(PacketHeader)) {
    return fail("text length does not match the packet");
  }
  SocketMessage message;
  message.magic = header.magic;
  message.version = header.version;
  message.type = static_cast<MessageType>(header.type);
  message.slot = header.slot;
  message.code = header.code;
  message.max_slots = header.max_slots;
  message.elements = header.elements;
  message.sequence = header.sequence;
  message.session = header.session;
  message.text.assign(packet + sizeof(PacketHeader), header.text_bytes);
  if (fd != nullptr) {
    *fd = received_fd;
  } else if (received_fd >= 0) {
    close(received_fd);
  }
  return message;
}

SocketMessage ReplyFor(const absl::Status& status) {
  SocketMessage reply;
  reply.type = MessageType::kReply;
  reply.code = static_cast<int32_t>(status.code());
  reply.text = std::string(status.message().substr(0, kMaxMessageText));
  return reply;
}

absl::Status StatusOfReply(const SocketMessage& reply) {
  if (reply.type != MessageType::kReply) {
    return absl::InternalError(absl::StrCat(
        "shm data plane: expected a reply, got message type ",
        static_cast<uint32_t>(reply.type)));
  }
  if (reply.code == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(reply.code), reply.text);
}

bool PeerClosed(int socket) {
  pollfd p{socket, POLLRDHUP, 0};
  const int n = poll(&p, 1, 0);
  if (n < 0) return errno != EINTR;
  return n > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

absl::Status SetReceiveTimeout(int socket, absl::Duration timeout) {
  const timeval tv = absl::ToTimeval(timeout);
  if (setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0) {
    return ErrnoStatus(absl::StatusCode::kInternal, "setsockopt(SO_RCVTIMEO)",
                       errno);
  }
  return absl::OkStatus();
}

void YieldCpu() { sched_yield(); }

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return;
  const timespec ts = absl::ToTimespec(timeout);
  // Not FUTEX_PRIVATE_FLAG: the word is shared with another process.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
          &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX,
          nullptr, nullptr, 0);
}

}  // namespace infinigen::kv_memory_service::shm
