// The CUDA backend as a plugin, libinfinigen_cuda.so: the backend factory
// (gpu_worker/backend/backend_factory.cc) loads it only when CUDA is asked for, so a
// process on the CPU backend never maps cudart and cuBLAS (whose load alone
// costs a few hundred MB of resident memory). Built by the same toolchain
// from the same headers as the binaries that load it, so the entry point
// passes C++ types.
#include <memory>
#include <string>

#include "gpu_worker/backend/cuda/cuda_backend.h"

// Returns a new CUDA backend on `device` (the caller owns it), or null with
// the status code and message in *code and *message.
extern "C" __attribute__((visibility("default")))
infinigen::gpu_worker::Backend* InfinigenCreateCudaBackend(
    int device, int* code, std::string* message) {
  auto backend = infinigen::gpu_worker::cuda::CreateCudaBackend(device);
  if (!backend.ok()) {
    *code = static_cast<int>(backend.status().code());
    *message = std::string(backend.status().message());
    return nullptr;
  }
  return backend->release();
}
