// The CPU backend: OpenBLAS for matrix work, plain loops elsewhere. It is
// the reference every other backend is compared with; NewBackend("cpu")
// (backend.h) makes one too.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_CPU_CPU_BACKEND_H_
#define INFINIGEN_GPU_WORKER_BACKEND_CPU_CPU_BACKEND_H_

#include <memory>

#include "gpu_worker/backend/backend.h"

namespace infinigen::gpu_worker {

std::unique_ptr<Backend> NewCpuBackend();

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_CPU_CPU_BACKEND_H_
