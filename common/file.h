// Read-only memory-mapped files, the one way the project reads model files.
//
// MappedFile owns the mapping and unmaps it on destruction; the bytes stay
// valid while it lives. Movable, not copyable.
#ifndef INFINIGEN_COMMON_FILE_H_
#define INFINIGEN_COMMON_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace infinigen {

class MappedFile {
 public:
  // NotFound if `path` does not exist, InvalidArgument if it is a directory,
  // Internal for other I/O errors; messages name the path.
  static absl::StatusOr<MappedFile> Open(const std::string& path);

  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::string_view view() const {
    return std::string_view(reinterpret_cast<const char*>(data_), size_);
  }
  const std::string& path() const { return path_; }

  // Tells the kernel the pages wholly inside [begin, begin + bytes) (which
  // must lie in the mapping) are not needed now: they leave this process's
  // resident memory, and a later read maps them in again from the file.
  // For loaders that convert a file's contents once.
  void DropPages(const uint8_t* begin, size_t bytes) const;

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The whole file as a string (for small text files such as config.json).
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// A secret such as an auth token: the file's contents without surrounding
// whitespace. ReadFileToString's errors, or InvalidArgument naming the file
// when nothing is left.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_FILE_H_
