#include "common/acceptor.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace infinigen {
namespace {

// A listening unix socket in an abstract name of its own.
int Listen(sockaddr_un* addr) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  *addr = {};
  addr->sun_family = AF_UNIX;
  const std::string name =
      "infinigen-acceptor-test-" + std::to_string(getpid());
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  const socklen_t len = offsetof(sockaddr_un, sun_path) + 1 + name.size();
  if (bind(fd, reinterpret_cast<sockaddr*>(addr), len) != 0 ||
      listen(fd, 8) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

int Connect(const sockaddr_un& addr) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const size_t name = 1 + std::strlen(addr.sun_path + 1);
  const socklen_t len = offsetof(sockaddr_un, sun_path) + name;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Holds every free descriptor below a lowered soft limit; restores both.
class DescriptorsExhausted {
 public:
  DescriptorsExhausted() {
    getrlimit(RLIMIT_NOFILE, &saved_);
    // A limit a little above what is open now.
    int highest = 0;
    for (int fd = 0; fd < 1024; ++fd) {
      if (fcntl(fd, F_GETFD) >= 0) highest = fd;
    }
    rlimit low = saved_;
    low.rlim_cur = static_cast<rlim_t>(highest + 16);
    setrlimit(RLIMIT_NOFILE, &low);
    while (true) {
      const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      held_.push_back(fd);
    }
  }
  ~DescriptorsExhausted() {
    Release();
    setrlimit(RLIMIT_NOFILE, &saved_);
  }
  void Release() {
    for (int fd : held_) close(fd);
    held_.clear();
  }

 private:
  rlimit saved_{};
  std::vector<int> held_;
};

TEST(AcceptorTest, AcceptsAsAccept4Does) {
  sockaddr_un addr;
  const int listener = Listen(&addr);
  ASSERT_GE(listener, 0);
  const int client = Connect(addr);
  ASSERT_GE(client, 0);
  Acceptor acceptor;
  const int server = acceptor.Accept(listener, SOCK_CLOEXEC);
  ASSERT_GE(server, 0);
  ASSERT_EQ(write(client, "x", 1), 1);
  char c = 0;
  EXPECT_EQ(read(server, &c, 1), 1);
  EXPECT_EQ(c, 'x');
  EXPECT_EQ(acceptor.shed(), 0);
  close(server);
  close(client);
  close(listener);
}

TEST(AcceptorTest, ShedsThePendingPeerWhenOutOfDescriptorsAndBacksOff) {
  sockaddr_un addr;
  const int listener = Listen(&addr);
  ASSERT_GE(listener, 0);
  const int client = Connect(addr);
  ASSERT_GE(client, 0);
  Acceptor acceptor(absl::Milliseconds(100));
  {
    DescriptorsExhausted exhausted;
    ASSERT_LT(open("/dev/null", O_RDONLY), 0);
    const absl::Time start = absl::Now();
    EXPECT_EQ(acceptor.Accept(listener, SOCK_CLOEXEC), -1);
    EXPECT_TRUE(errno == EMFILE || errno == ENFILE) << std::strerror(errno);
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));  // backed off
    EXPECT_EQ(acceptor.shed(), 1);
    // The peer learns at once that it was dropped.
    pollfd p = {client, POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 1000), 1);
    char c;
    EXPECT_EQ(read(client, &c, 1), 0);
    // Nothing left pending: the socket is no longer readable.
    pollfd l = {listener, POLLIN, 0};
    EXPECT_EQ(poll(&l, 1, 0), 0);
    // With none pending, a failing Accept does not block.
    EXPECT_EQ(acceptor.Accept(listener, SOCK_CLOEXEC | SOCK_NONBLOCK), -1);
    EXPECT_EQ(acceptor.shed(), 1);
  }
  // Descriptors free again: the next peer is served.
  const int again = Connect(addr);
  ASSERT_GE(again, 0);
  const int server = acceptor.Accept(listener, SOCK_CLOEXEC);
  EXPECT_GE(server, 0);
  close(server);
  close(again);
  close(client);
  close(listener);
}

}  // namespace
}  // namespace infinigen
