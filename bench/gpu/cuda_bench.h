// What the CUDA benchmarks (h2d_bandwidth, gather_bandwidth,
// flash_attention_bench) share: error reporting, the device probe and the
// median of timed runs.
#ifndef INFINIGEN_BENCH_GPU_CUDA_BENCH_H_
#define INFINIGEN_BENCH_GPU_CUDA_BENCH_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace infinigen::bench {

// 0 for cudaSuccess; else prints "PROG: WHAT: the error" and returns 1.
inline int CudaCheck(const char* prog, cudaError_t e, const char* what) {
  if (e == cudaSuccess) return 0;
  std::fprintf(stderr, "%s: %s: %s\n", prog, what, cudaGetErrorString(e));
  return 1;
}

// The first device's properties; false (and a line on stderr) when no
// CUDA device answers.
inline bool FirstDevice(const char* prog, cudaDeviceProp* prop) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "%s: no CUDA device answers\n", prog);
    return false;
  }
  return cudaGetDeviceProperties(prop, 0) == cudaSuccess;
}

// Median seconds of `iters` runs of run(), each waited for on `stream`,
// after `warmups` runs that are not timed.
template <typename Run>
double MedianSeconds(int warmups, int iters, cudaStream_t stream,
                     const Run& run) {
  std::vector<double> t;
  for (int i = 0; i < warmups + iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    cudaStreamSynchronize(stream);
    const double s = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - t0)
                         .count();
    if (i >= warmups) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace infinigen::bench

#endif  // INFINIGEN_BENCH_GPU_CUDA_BENCH_H_
