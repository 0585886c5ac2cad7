// The backend factory: CPU, or CUDA when the binary has it and a device
// answers.
#include "common/log.h"
#include "gpu_worker/backend.h"

#ifdef INFINIGEN_WITH_CUDA
#include "gpu_worker/cuda/cuda_backend.h"
#endif

namespace infinigen::gpu_worker {

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device) {
#ifdef INFINIGEN_WITH_CUDA
  return cuda::CreateCudaBackend(device);
#else
  (void)device;
  return absl::UnavailableError(
      "this binary was built without CUDA (no toolkit at build time)");
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> NewBackend(const std::string& kind) {
  if (kind == "cpu") return NewCpuBackend();
  if (kind == "cuda") return NewCudaBackend(0);
  if (kind == "auto") {
    auto cuda = NewCudaBackend(0);
    if (cuda.ok()) return cuda;
    IG_LOG(INFO) << "backend: CPU (" << cuda.status().message() << ")";
    return NewCpuBackend();
  }
  return absl::InvalidArgumentError("--backend must be cpu, cuda or auto, not '" +
                                    kind + "'");
}

}  // namespace infinigen::gpu_worker
