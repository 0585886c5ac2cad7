#include "kv_memory_service/shm/shm_socket_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "kv_memory_service/shm/shm_protocol.h"

namespace infinigen::kv_memory_service::shm {

namespace {

std::string LockPath(const std::string& socket_path) {
  return socket_path + ".lock";
}

}  // namespace

absl::StatusOr<int> LockSocketPath(const std::string& path) {
  const std::string lock_path = LockPath(path);
  while (true) {
    const int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
      return ErrnoStatus(absl::StatusCode::kUnavailable,
                         absl::StrCat("open ", lock_path), errno);
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      close(fd);
      if (err == EWOULDBLOCK) {
        return absl::FailedPreconditionError(absl::StrCat(
            "another kv_memory_server is serving ", path, " (it holds ",
            lock_path, ")"));
      }
      return ErrnoStatus(absl::StatusCode::kUnavailable,
                         absl::StrCat("flock ", lock_path), err);
    }
    // The holder we waited out may have removed the file as we opened it:
    // the lock counts only on the file still at the path.
    struct stat held, now;
    if (fstat(fd, &held) == 0 && stat(lock_path.c_str(), &now) == 0 &&
        held.st_ino == now.st_ino && held.st_dev == now.st_dev) {
      return fd;
    }
    close(fd);
  }
}

void UnlockSocketPath(const std::string& path, int lock_fd) {
  unlink(LockPath(path).c_str());  // while still held: see LockSocketPath
  close(lock_fd);
}

}  // namespace infinigen::kv_memory_service::shm
