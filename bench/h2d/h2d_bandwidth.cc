// Host-to-device copy bandwidth: pinned (cudaHostAlloc) and pageable host
// memory into device memory with cudaMemcpyAsync, for the sizes a decode
// step fetches. The baseline the GPU fetch path is compared with.
//
//   h2d_bandwidth [--sizes=16K,192K,3M,48M] [--iters=50] [--json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/gpu/cuda_bench.h"

ABSL_FLAG(std::string, sizes, "16K,192K,3M,48M",
          "Copy sizes (K, M suffixes are binary multiples).");
ABSL_FLAG(int, iters, 50, "Copies timed per size.");
ABSL_FLAG(bool, json, false, "One JSON object per size on stdout.");

namespace {

bool ParseSize(const std::string& s, size_t* out) {
  if (s.empty()) return false;
  size_t mult = 1;
  std::string digits = s;
  const char last = s.back();
  if (last == 'K' || last == 'k') mult = 1024;
  if (last == 'M' || last == 'm') mult = 1024 * 1024;
  if (mult != 1) digits.pop_back();
  uint64_t v = 0;
  if (!absl::SimpleAtoi(digits, &v) || v == 0) return false;
  *out = v * mult;
  return true;
}

constexpr char kProg[] = "h2d_bandwidth";

int Check(cudaError_t e, const char* what) {
  return infinigen::bench::CudaCheck(kProg, e, what);
}

// Median seconds of `iters` copies of `bytes` from `src` to `dst` (after
// two warm-up copies).
double TimeCopies(void* dst, const void* src, size_t bytes, int iters,
                  cudaStream_t stream) {
  return infinigen::bench::MedianSeconds(2, iters, stream, [&] {
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
  });
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Host-to-device copy bandwidth, pinned and pageable.\n"
      "  h2d_bandwidth [--sizes=16K,192K,3M,48M] [--iters=50] [--json]");
  absl::ParseCommandLine(argc, argv);
  std::vector<size_t> sizes;
  for (const auto& s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
    size_t v;
    if (!ParseSize(std::string(s), &v)) {
      std::fprintf(stderr, "h2d_bandwidth: bad size '%s' in --sizes\n",
                   std::string(s).c_str());
      return 2;
    }
    sizes.push_back(v);
  }
  const int iters = absl::GetFlag(FLAGS_iters);
  if (iters < 1) {
    std::fprintf(stderr, "h2d_bandwidth: --iters must be >= 1\n");
    return 2;
  }
  cudaDeviceProp prop;
  if (!infinigen::bench::FirstDevice(kProg, &prop)) return 1;
  const size_t max_bytes = *std::max_element(sizes.begin(), sizes.end());
  void *pinned = nullptr, *device = nullptr;
  cudaStream_t stream;
  if (Check(cudaHostAlloc(&pinned, max_bytes, cudaHostAllocDefault),
            "cudaHostAlloc") ||
      Check(cudaMalloc(&device, max_bytes), "cudaMalloc") ||
      Check(cudaStreamCreate(&stream), "cudaStreamCreate")) {
    return 1;
  }
  std::vector<char> pageable(max_bytes, 1);
  std::fill_n(static_cast<char*>(pinned), max_bytes, 1);
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("device: %s\n| bytes | pinned GB/s | pinned us | pageable "
                "GB/s |\n|---|---|---|---|\n",
                prop.name);
  }
  for (size_t bytes : sizes) {
    const double tp = TimeCopies(device, pinned, bytes, iters, stream);
    const double tq = TimeCopies(device, pageable.data(), bytes, iters, stream);
    if (Check(cudaGetLastError(), "copy")) return 1;
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("{\"device\": \"%s\", \"bytes\": %zu, \"pinned_gbps\": %.3f, "
                  "\"pinned_us\": %.2f, \"pageable_gbps\": %.3f}\n",
                  prop.name, bytes, bytes / tp / 1e9, tp * 1e6,
                  bytes / tq / 1e9);
    } else {
      std::printf("| %zu | %.2f | %.1f | %.2f |\n", bytes, bytes / tp / 1e9,
                  tp * 1e6, bytes / tq / 1e9);
    }
  }
  cudaFreeHost(pinned);
  cudaFree(device);
  return 0;
}
