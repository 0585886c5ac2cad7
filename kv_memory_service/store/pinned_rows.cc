#include "kv_memory_service/store/pinned_rows.h"

#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace infinigen::kv_memory_service {
namespace {

// The watch of `fd`'s inode: inotify_add_watch on the same inode returns the
// same watch descriptor. IN_DELETE_SELF is the only event asked for; the
// kernel adds IN_IGNORED when the inode goes, which is what Reap reads.
int AddWatch(int inotify_fd, int fd) {
  const std::string path = absl::StrCat("/proc/self/fd/", fd);
  return inotify_add_watch(inotify_fd, path.c_str(), IN_DELETE_SELF);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PinnedRows>> PinnedRows::Create() {
  const int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "inotify_init1: ", std::strerror(errno),
        " (the node cannot see when shared rows are released)"));
  }
  return std::unique_ptr<PinnedRows>(new PinnedRows(fd));
}

PinnedRows::~PinnedRows() { close(inotify_fd_); }

absl::StatusOr<int> PinnedRows::Watch(int fd) {
  absl::MutexLock lock(&mu_);
  const int wd = AddWatch(inotify_fd_, fd);
  if (wd < 0) {
    const int err = errno;
    return (err == ENOSPC || err == ENOMEM)
               ? absl::ResourceExhaustedError(absl::StrCat(
                     "cannot watch another shared memfd: ", std::strerror(err),
                     " (fs.inotify.max_user_watches)"))
               : absl::InternalError(
                     absl::StrCat("inotify_add_watch: ", std::strerror(err)));
  }
  watches_.try_emplace(wd);
  return wd;
}

void PinnedRows::Outlive(int watch, int fd, SequenceId seq,
                         SessionId session) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return;
  absl::MutexLock lock(&mu_);
  auto it = watches_.find(watch);
  if (it == watches_.end() || it->second.closed) return;
  Pinned& p = it->second;
  p.closed = true;
  p.seq = seq;
  p.session = session;
  p.bytes = static_cast<int64_t>(st.st_blocks) * 512;  // committed pages
  bytes_ += p.bytes;
  if (memfds_by_sequence_[seq]++ == 0) ++sequences_by_session_[session];
}

void PinnedRows::Reap() {
  absl::MutexLock lock(&mu_);
  ReapLocked();
}

void PinnedRows::ReapUnless(absl::FunctionRef<bool()> held,
                            absl::Duration within) {
  Reap();
  const absl::Time deadline = absl::Now() + within;
  while (held() && absl::Now() < deadline) {
    pollfd p = {inotify_fd_, POLLIN, 0};
    poll(&p, 1, 10);  // ms
    Reap();
  }
}

void PinnedRows::ReapLocked() {
  alignas(inotify_event) char buffer[4096];
  while (true) {
    const ssize_t n = read(inotify_fd_, buffer, sizeof(buffer));
    if (n <= 0) return;  // EAGAIN: nothing more
    for (ssize_t at = 0; at < n;) {
      const auto* e = reinterpret_cast<const inotify_event*>(buffer + at);
      at += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
      // IN_Q_OVERFLOW loses notices: the memory they would free stays
      // counted (never less than is held).
      if ((e->mask & IN_IGNORED) == 0) continue;
      auto it = watches_.find(e->wd);
      if (it == watches_.end()) continue;
      const Pinned& p = it->second;
      if (p.closed) {
        bytes_ -= p.bytes;
        auto q = memfds_by_sequence_.find(p.seq);
        if (q != memfds_by_sequence_.end() && --q->second == 0) {
          memfds_by_sequence_.erase(q);
          auto s = sequences_by_session_.find(p.session);
          if (s != sequences_by_session_.end() && --s->second == 0) {
            sequences_by_session_.erase(s);
          }
        }
      }
      watches_.erase(it);
    }
  }
}

int64_t PinnedRows::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int64_t PinnedRows::sequences() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(memfds_by_sequence_.size());
}

int64_t PinnedRows::sequences_of(SessionId session) const {
  absl::MutexLock lock(&mu_);
  auto it = sequences_by_session_.find(session);
  return it == sequences_by_session_.end() ? 0 : it->second;
}

}  // namespace infinigen::kv_memory_service
