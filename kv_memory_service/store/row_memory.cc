// RowMemory (row_memory.h): the mapping of a sequence's rows, sealed memfd
// or anonymous, and its release.
#include "kv_memory_service/store/row_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace infinigen::kv_memory_service {

RowMemory::RowMemory(size_t bytes,
                     std::shared_ptr<std::atomic<int64_t>> memfds,
                     int64_t max_memfds)
    : bytes_(bytes == 0 ? 1 : bytes) {
  if (memfds != nullptr && memfds->fetch_add(1) < max_memfds) {
    // A sparse memfd: pages are taken as rows are written, as below. Sealed
    // once the node holds its own writable mapping, before any descriptor
    // can leave the node: whoever holds one, even reopened writable
    // through /proc, can neither write, resize nor punch holes, so the node
    // never faults on its own rows. Without the seals the rows stay
    // private.
    const int fd =
        memfd_create("infinigen-kv-rows", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes_)) == 0) {
      void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_NORESERVE, fd, 0);
      if (p != MAP_FAILED) {
        if (fcntl(fd, F_ADD_SEALS, kRowSeals) == 0) {
          data_ = static_cast<uint16_t*>(p);
          fd_ = fd;
          memfds_ = std::move(memfds);
          return;
        }
        munmap(p, bytes_);
      }
    }
    if (fd >= 0) close(fd);
  }
  if (memfds != nullptr) memfds->fetch_sub(1);
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  data_ = p == MAP_FAILED ? nullptr : static_cast<uint16_t*>(p);
}

RowMemory::~RowMemory() {
  if (data_ != nullptr) munmap(data_, bytes_);
  if (fd_ >= 0) {
    close(fd_);
    memfds_->fetch_sub(1);
  }
}

}  // namespace infinigen::kv_memory_service
