// Backend defaults: shared memory is aligned host memory.
#include <cstdlib>

#include "gpu_worker/backend.h"

namespace infinigen::gpu_worker {

void* Backend::AllocateShared(size_t bytes) {
  // 64-byte alignment for AVX-512 loads and cache lines.
  const size_t rounded = (bytes + 63) / 64 * 64;
  return std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
}

void Backend::FreeShared(void* p) { std::free(p); }

}  // namespace infinigen::gpu_worker
