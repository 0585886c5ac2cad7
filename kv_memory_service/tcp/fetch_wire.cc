#include "kv_memory_service/tcp/fetch_wire.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace infinigen::kv_memory_service::fetch_wire {
namespace {

absl::Status IoError(const char* what, int err) {
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return absl::DeadlineExceededError(
        absl::StrCat("fetch connection ", what, " timed out"));
  }
  return absl::UnavailableError(
      absl::StrCat("fetch connection ", what, ": ", std::strerror(err)));
}

}  // namespace

absl::Status SendAll(int fd, struct iovec* iov, int iovcnt) {
  while (iovcnt > 0) {
    struct msghdr msg = {};
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("send", errno);
    }
    size_t left = static_cast<size_t>(n);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = recv(fd, p, bytes, 0);
    if (n == 0) return absl::UnavailableError("fetch connection closed");
    if (n < 0) {
      if (errno == EINTR) continue;
      return IoError("receive", errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status Discard(int fd, size_t bytes) {
  char sink[16384];
  while (bytes > 0) {
    const size_t chunk = bytes < sizeof(sink) ? bytes : sizeof(sink);
    absl::Status s = RecvAll(fd, sink, chunk);
    if (!s.ok()) return s;
    bytes -= chunk;
  }
  return absl::OkStatus();
}

void TuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 10, interval = 2, count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

}  // namespace infinigen::kv_memory_service::fetch_wire
