// A fuzz input as a file the loaders can open by path: an anonymous memfd,
// named /proc/self/fd/N, closed with the object. Loaders take paths because
// they map their files; this keeps the fuzzers off the disk.
#ifndef INFINIGEN_FUZZ_MEMFD_FILE_H_
#define INFINIGEN_FUZZ_MEMFD_FILE_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace infinigen::fuzz {

class MemfdFile {
 public:
  MemfdFile(const uint8_t* data, size_t size)
      : fd_(memfd_create("fuzz", MFD_CLOEXEC)) {
    size_t done = 0;
    while (fd_ >= 0 && done < size) {
      const ssize_t n = write(fd_, data + done, size - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
  }
  ~MemfdFile() {
    if (fd_ >= 0) close(fd_);
  }
  MemfdFile(const MemfdFile&) = delete;
  MemfdFile& operator=(const MemfdFile&) = delete;

  bool ok() const { return fd_ >= 0; }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  const int fd_;
};

}  // namespace infinigen::fuzz

#endif  // INFINIGEN_FUZZ_MEMFD_FILE_H_
