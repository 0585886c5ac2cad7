#include "common/acceptor.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/time/clock.h"

namespace infinigen {
namespace {

int OpenSpare() { return open("/dev/null", O_RDONLY | O_CLOEXEC); }

}  // namespace

Acceptor::Acceptor(absl::Duration backoff)
    : backoff_(backoff), spare_(OpenSpare()) {}

Acceptor::~Acceptor() {
  if (spare_ >= 0) close(spare_);
}

int Acceptor::Accept(int listen_fd, int flags) {
  const int fd = accept4(listen_fd, nullptr, nullptr, flags);
  if (fd >= 0) {
    if (spare_ < 0) spare_ = OpenSpare();  // a descriptor freed since
    return fd;
  }
  const int err = errno;
  if (err == EMFILE || err == ENFILE) {
    Shed(listen_fd, flags);
    absl::SleepFor(backoff_);
  }
  errno = err;
  return -1;
}

void Acceptor::Shed(int listen_fd, int flags) {
  if (spare_ < 0) spare_ = OpenSpare();
  if (spare_ < 0) return;  // none to spare: the back-off alone paces
  // Only a connection already pending: a blocking socket's accept must not
  // wait here with the spare given up.
  pollfd p = {listen_fd, POLLIN, 0};
  if (poll(&p, 1, 0) != 1 || (p.revents & POLLIN) == 0) return;
  close(spare_);
  spare_ = -1;
  const int fd = accept4(listen_fd, nullptr, nullptr, flags | SOCK_NONBLOCK);
  if (fd >= 0) {
    close(fd);
    ++shed_;
  }
  spare_ = OpenSpare();
}

}  // namespace infinigen
