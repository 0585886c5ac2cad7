// Tests only: std::vector storage from a backend's AllocateShared, for
// tests that fill and read backend memory from host code. It throws
// std::bad_alloc when the backend is out of memory (as an allocator must);
// library code allocates through DeviceBuffer (backend.h), which returns
// ResourceExhausted instead.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_SHARED_VECTOR_H_
#define INFINIGEN_GPU_WORKER_BACKEND_SHARED_VECTOR_H_

#include <cstddef>
#include <new>
#include <type_traits>
#include <vector>

#include "gpu_worker/backend/backend.h"

namespace infinigen::gpu_worker {

template <typename T>
class SharedAllocator {
 public:
  using value_type = T;
  // Buffers move and swap with their backend.
  using propagate_on_container_copy_assignment = std::true_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  // A default-constructed allocator only holds empty vectors.
  SharedAllocator() : backend_(nullptr) {}
  explicit SharedAllocator(Backend* backend) : backend_(backend) {}
  template <typename U>
  SharedAllocator(const SharedAllocator<U>& o) : backend_(o.backend()) {}
  T* allocate(size_t n) {
    if (backend_ == nullptr) throw std::bad_alloc();
    void* p = backend_->AllocateShared(n * sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { backend_->FreeShared(p); }
  Backend* backend() const { return backend_; }
  template <typename U>
  bool operator==(const SharedAllocator<U>& o) const {
    return backend_ == o.backend();
  }
  template <typename U>
  bool operator!=(const SharedAllocator<U>& o) const {
    return backend_ != o.backend();
  }

 private:
  Backend* backend_;
};
template <typename T>
using SharedVector = std::vector<T, SharedAllocator<T>>;

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_SHARED_VECTOR_H_
