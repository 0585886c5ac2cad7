// RowMemory: the memory a stored sequence's K or V rows live in (an
// anonymous mapping, or a sealed memfd another process on this host may map
// read-only), and kRowSeals, the seals on every such memfd. Private to the
// store.
#ifndef INFINIGEN_KV_MEMORY_SERVICE_STORE_ROW_MEMORY_H_
#define INFINIGEN_KV_MEMORY_SERVICE_STORE_ROW_MEMORY_H_

#include <fcntl.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace infinigen::kv_memory_service {

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1
#endif

// The seals on every memfd of shareable rows: no one may shrink, grow or
// write it (the node writes through the mapping it made before sealing),
// nor change the seals.
inline constexpr int kRowSeals =
    F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;

// The rows of a sequence: an anonymous private mapping, or with
// `shareable` a sealed memfd's shared one (kRowSeals) that a reader on this
// host may map read-only too (fd()); either way the kernel commits its pages only as rows are written
// (an Open reserves capacity, it does not take memory), and Close returns
// all of it at once. Page-aligned, so a data plane may register it (RDMA,
// CUDA).
class RowMemory {
 public:
  RowMemory() = default;
  // Null (get() == nullptr) when the mapping fails. Shareable while
  // `memfds` (counting the live ones; null: none) stays below `max_memfds`;
  // private memory (fd() < 0) beyond it or where no memfd can be made.
  RowMemory(size_t bytes, std::shared_ptr<std::atomic<int64_t>> memfds,
            int64_t max_memfds);
  RowMemory(RowMemory&& o) noexcept
      : data_(o.data_), bytes_(o.bytes_), fd_(o.fd_),
        memfds_(std::move(o.memfds_)) {
    o.data_ = nullptr;
    o.fd_ = -1;
  }
  RowMemory& operator=(RowMemory&&) = delete;
  RowMemory(const RowMemory&) = delete;
  ~RowMemory();
  uint16_t* get() const { return data_; }
  bool operator==(std::nullptr_t) const { return data_ == nullptr; }
  // The memfd holding the rows, or -1 (private memory).
  int fd() const { return fd_; }

 private:
  uint16_t* data_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
  std::shared_ptr<std::atomic<int64_t>> memfds_;  // counts fd_ while >= 0
};

}  // namespace infinigen::kv_memory_service

#endif  // INFINIGEN_KV_MEMORY_SERVICE_STORE_ROW_MEMORY_H_
