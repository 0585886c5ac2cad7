#include "kv_memory_service/tcp/fetch_socket_loop.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kv_memory_service/serving/serve_fetch.h"
#include "kv_memory_service/tcp/fetch_tls.h"
#include "kv_memory_service/tcp/fetch_wire.h"
#include "openssl/err.h"

namespace infinigen::kv_memory_service {

absl::StatusOr<std::unique_ptr<FetchSocketLoop>>
FetchSocketLoop::Create() {
  const int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  struct epoll_event ev = {};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  if (epoll_fd < 0 || wake_fd < 0 ||
      epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &ev) != 0) {
    const int err = errno;
    if (epoll_fd >= 0) close(epoll_fd);
    if (wake_fd >= 0) close(wake_fd);
    return absl::UnavailableError(
        absl::StrCat("fetch socket: cannot make an event loop: ",
                     std::strerror(err)));
  }
  return std::unique_ptr<FetchSocketLoop>(
      new FetchSocketLoop(epoll_fd, wake_fd));
}

void FetchSocketLoop::Add(std::unique_ptr<Connection> c) {
  c->loop = this;
  {
    absl::MutexLock lock(&mu_);
    incoming_.push_back(std::move(c));
  }
  Wake();
}

void FetchSocketLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
}

void FetchSocketLoop::Run() {
  struct epoll_event events[64];
  while (true) {
    int timeout_ms = -1;
    if (!ready_.empty()) {
      timeout_ms = 0;
    } else if (next_check_ != absl::InfiniteFuture()) {
      const absl::Duration left = next_check_ - absl::Now();
      timeout_ms = left <= absl::ZeroDuration()
                       ? 0
                       : static_cast<int>(std::min<int64_t>(
                             absl::ToInt64Milliseconds(left) + 1, 60000));
    }
    const int n = epoll_wait(epoll_fd_, events, 64, timeout_ms);
    if (n < 0 && errno != EINTR) {
      IG_LOG(ERROR) << "fetch socket: epoll_wait failed: "
                    << std::strerror(errno);
    }
    for (int i = 0; i < n; ++i) {
      Connection* c = static_cast<Connection*>(events[i].data.ptr);
      if (c == nullptr) {
        if (!TakeIncoming()) {
          CloseAll();
          return;
        }
        continue;
      }
      Handle(c, events[i].events);
    }
    ReadReady();
    if (absl::Now() >= next_check_) ExpireDeadlines();
  }
}

bool FetchSocketLoop::TakeIncoming() {
  uint64_t count;
  (void)!read(wake_fd_, &count, sizeof(count));
  std::vector<std::unique_ptr<Connection>> incoming;
  bool stop;
  {
    absl::MutexLock lock(&mu_);
    incoming.swap(incoming_);
    stop = stop_;
  }
  const absl::Time now = absl::Now();
  for (auto& owned : incoming) {
    Connection* c = owned.get();
    if (server_->options_.tls != nullptr) c->state = Connection::State::kTls;
    conns_[c] = std::move(owned);
    c->deadline = now + server_->options_.handshake_timeout;
    next_check_ = std::min(next_check_, c->deadline);
    struct epoll_event ev = {};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.ptr = c;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &ev) != 0) Close(c);
  }
  return !stop;
}

void FetchSocketLoop::CloseAll() {
  {
    absl::MutexLock lock(&mu_);
    for (auto& c : incoming_) conns_[c.get()] = std::move(c);
    incoming_.clear();
  }
  while (!conns_.empty()) Close(conns_.begin()->first);
}

void FetchSocketLoop::ReadReady() {
  if (ready_.empty()) return;
  std::vector<Connection*> ready(ready_.begin(), ready_.end());
  ready_.clear();
  // Read closes only the connection it reads.
  for (Connection* c : ready) {
    if (c->state != Connection::State::kSending) Read(c);
  }
}

void FetchSocketLoop::ExpireDeadlines() {
  const absl::Time now = absl::Now();
  next_check_ = absl::InfiniteFuture();
  std::vector<Connection*> expired;
  for (auto& [c, owned] : conns_) {
    if (c->deadline <= now) {
      expired.push_back(c);
    } else {
      next_check_ = std::min(next_check_, c->deadline);
    }
  }
  for (Connection* c : expired) Close(c, /*timed_out=*/true);
}

void FetchSocketLoop::Touch(Connection* c) {
  if (c->state == Connection::State::kTls ||
      c->state == Connection::State::kHello ||
      c->state == Connection::State::kToken) {
    return;
  }
  const absl::Duration idle = server_->options_.idle_timeout;
  c->deadline = idle > absl::ZeroDuration() ? absl::Now() + idle
                                            : absl::InfiniteFuture();
  next_check_ = std::min(next_check_, c->deadline);
}

void FetchSocketLoop::Close(Connection* c, bool timed_out) {
  if (c->ssl != nullptr && SSL_is_init_finished(c->ssl.get())) {
    // close_notify, best effort: the peer reads a clean end, not a cut.
    ERR_clear_error();
    SSL_shutdown(c->ssl.get());
    ERR_clear_error();
  }
  ready_.erase(c);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  server_->buffer_bytes_.fetch_sub(c->buffer_counted);
  server_->Release(c, timed_out);
  conns_.erase(c);
}

void FetchSocketLoop::Account(Connection* c) {
  const int64_t now = static_cast<int64_t>(c->body.capacity() * 4 +
                                           c->rows.capacity() * 2);
  server_->buffer_bytes_.fetch_add(now - c->buffer_counted);
  c->buffer_counted = now;
}

void FetchSocketLoop::Handle(Connection* c, uint32_t events) {
  if (c->state == Connection::State::kSending) {
    // Done sending: the session may hold the next request already.
    if (Send(c)) Read(c);
    return;
  }
  // A TLS read that wanted the socket writable has its chance now.
  if (c->want_write) Watch(c, EPOLLIN | EPOLLRDHUP);
  Read(c);
}

void FetchSocketLoop::Watch(Connection* c, uint32_t events) {
  struct epoll_event ev = {};
  ev.events = events;
  ev.data.ptr = c;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &ev);
  c->want_write = (events & EPOLLOUT) != 0;
}

}  // namespace infinigen::kv_memory_service
