// Registers host memory with CUDA as page-locked ("pinned"), so that a GPU
// copies from it by DMA at full PCIe speed, where CUDA is present.
//
// libcudart is loaded with dlopen on first use, so nothing here makes a
// binary need CUDA to start: without the library, a driver or a device,
// registration is skipped (said once in the log) and the memory stays
// ordinary pageable memory, still correct, only slower to copy to a GPU.
// Thread-safe.
#ifndef INFINIGEN_COMMON_CUDA_HOST_REGISTER_H_
#define INFINIGEN_COMMON_CUDA_HOST_REGISTER_H_

#include <cstddef>

namespace infinigen {

// cudaHostRegister(data, bytes, cudaHostRegisterPortable) when a CUDA device
// answers. True if the range is now registered (then call
// CudaHostUnregister before unmapping it).
bool CudaHostRegister(void* data, size_t bytes);
// The same for memory mapped read-only, mapped for kernels to read in
// place too (cudaHostRegisterPortable | Mapped | ReadOnly).
bool CudaHostRegisterReadOnly(void* data, size_t bytes);
void CudaHostUnregister(void* data);

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_CUDA_HOST_REGISTER_H_
