// Which OpenBLAS kernels the CPU backend runs.
//
// OpenBLAS (built DYNAMIC_ARCH, as Debian ships it) picks its kernels when it
// loads, from the CPU's family and model numbers. A CPU newer than the
// library is unknown to it: Debian 12's 0.3.21 gives Sapphire Rapids and
// Emerald Rapids Xeons (model 143, 207) its oldest x86-64 kernels, Prescott
// (SSE3), which multiply matrices about 3x slower than the AVX-512 ones the
// same CPU runs. SelectBlasKernels() checks what the CPU supports instead
// and, where OpenBLAS chose below it, runs the program again with
// OPENBLAS_CORETYPE naming the kernels that fit (the variable is read only
// when the library loads). A user's own OPENBLAS_CORETYPE is always kept.
#ifndef INFINIGEN_GPU_WORKER_BACKEND_CPU_BLAS_KERNELS_H_
#define INFINIGEN_GPU_WORKER_BACKEND_CPU_BLAS_KERNELS_H_

#include <string>

namespace infinigen::gpu_worker {

// The vector extensions a CPU (and its OS) supports, as kernel classes.
enum class VectorLevel { kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3 };

// This CPU's level (AVX-512 means F, BW, DQ and VL; AVX2 means AVX2 and FMA).
VectorLevel CpuVectorLevel();

// The level of an OpenBLAS core name as openblas_get_corename() gives it
// ("Prescott", "Haswell", "SkylakeX", ...; case ignored); unknown: kSse.
VectorLevel BlasCoreLevel(const std::string& core);

// The OPENBLAS_CORETYPE to use where OpenBLAS chose `detected` on a CPU of
// `cpu` level, or "" to keep `detected`.
std::string BetterBlasCore(const std::string& detected, VectorLevel cpu);

// The kernels OpenBLAS runs in this process, e.g. "SkylakeX".
std::string BlasCoreName();

// Called first in a binary's main: when OPENBLAS_CORETYPE is unset and
// BetterBlasCore() names a better core than OpenBLAS chose, sets the
// variable and executes the program again (same PID, same arguments);
// returns only where nothing is to be done or the exec failed (then the
// program goes on with the detected kernels, with a warning).
void SelectBlasKernels(char** argv);

}  // namespace infinigen::gpu_worker

#endif  // INFINIGEN_GPU_WORKER_BACKEND_CPU_BLAS_KERNELS_H_
