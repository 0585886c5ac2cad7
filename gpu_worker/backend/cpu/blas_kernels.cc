#include "gpu_worker/backend/cpu/blas_kernels.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "common/log.h"

extern "C" char* openblas_get_corename(void);

namespace infinigen::gpu_worker {

VectorLevel CpuVectorLevel() {
#if defined(__x86_64__)
  // libgcc's checks include the OS's support for the registers (XGETBV).
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    return VectorLevel::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return VectorLevel::kAvx2;
  }
  if (__builtin_cpu_supports("avx")) return VectorLevel::kAvx;
#endif
  return VectorLevel::kSse;
}

VectorLevel BlasCoreLevel(const std::string& core) {
  const std::string c = absl::AsciiStrToLower(core);
  if (c == "skylakex" || c == "cooperlake" || c == "sapphirerapids") {
    return VectorLevel::kAvx512;
  }
  if (c == "haswell" || c == "zen") return VectorLevel::kAvx2;
  if (c == "sandybridge" || c == "bulldozer" || c == "piledriver" ||
      c == "steamroller" || c == "excavator") {
    return VectorLevel::kAvx;
  }
  return VectorLevel::kSse;
}

std::string BetterBlasCore(const std::string& detected, VectorLevel cpu) {
  if (BlasCoreLevel(detected) >= cpu) return "";
  switch (cpu) {
    case VectorLevel::kAvx512:
      return "SkylakeX";
    case VectorLevel::kAvx2:
      return "Haswell";
    case VectorLevel::kAvx:
      return "Sandybridge";
    case VectorLevel::kSse:
      break;
  }
  return "";
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name == nullptr ? "" : name;
}

void SelectBlasKernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string detected = BlasCoreName();
  const std::string better = BetterBlasCore(detected, CpuVectorLevel());
  if (better.empty()) return;
  setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
  execv("/proc/self/exe", argv);
  IG_LOG(WARNING) << "OpenBLAS runs its " << detected
                  << " kernels on a CPU that has " << better
                  << "'s; running again with OPENBLAS_CORETYPE=" << better
                  << " failed (" << std::strerror(errno)
                  << "); set it yourself for about 3x faster matrix products";
  unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace infinigen::gpu_worker
