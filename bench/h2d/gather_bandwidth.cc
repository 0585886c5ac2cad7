// One-sided read bandwidth: a decode step's fetch of one layer read by the
// GPU itself (LaunchGatherRows) from pinned host memory mapped for the
// device, laid out as the memory node stores a layer ([kv_head][slot][row]),
// against a pinned cudaMemcpyAsync of the same number of bytes in the same
// run (the ceiling a fetch into the GPU can reach).
//
//   gather_bandwidth [--heads=32] [--ctx=32768] [--row_bytes=256]
//                    [--fractions=1,0.1] [--iters=20] [--json]
//
// For each fraction f, each head's plan is f * ctx distinct slots drawn at
// random and sorted (f = 1: every slot, in order). GB/s counts the K and V
// bytes the plan moves.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gpu_worker/backend/cuda/kernels.h"

ABSL_FLAG(int, heads, 32, "KV heads of the layer.");
ABSL_FLAG(int, ctx, 32768, "Slots (tokens) per head.");
ABSL_FLAG(int, row_bytes, 256, "Bytes a row (fp16 head_dim 128: 256).");
ABSL_FLAG(std::string, fractions, "1,0.1",
          "Fractions of each head's rows a plan reads.");
ABSL_FLAG(int, iters, 20, "Timed repetitions (the median is reported).");
ABSL_FLAG(bool, json, false, "One JSON object per fraction on stdout.");

namespace {

namespace cuda = infinigen::gpu_worker::cuda;

int Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return 0;
  std::fprintf(stderr, "gather_bandwidth: %s: %s\n", what,
               cudaGetErrorString(e));
  return 1;
}

// Median seconds of `iters` runs of `run` (after two warm-ups).
template <typename Run>
double Median(int iters, cudaStream_t stream, const Run& run) {
  std::vector<double> t;
  for (int i = 0; i < iters + 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    cudaStreamSynchronize(stream);
    const double s = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - t0)
                         .count();
    if (i >= 2) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "One-sided gather bandwidth from mapped host memory, against a pinned "
      "copy.\n  gather_bandwidth [--heads=32] [--ctx=32768] [--row_bytes=256] "
      "[--fractions=1,0.1] [--iters=20] [--json]");
  absl::ParseCommandLine(argc, argv);
  const int heads = absl::GetFlag(FLAGS_heads);
  const int ctx = absl::GetFlag(FLAGS_ctx);
  const int row_bytes = absl::GetFlag(FLAGS_row_bytes);
  const int iters = absl::GetFlag(FLAGS_iters);
  if (heads < 1 || ctx < 1 || row_bytes < 2 || row_bytes % 2 != 0 ||
      iters < 1) {
    std::fprintf(stderr,
                 "gather_bandwidth: --heads, --ctx and --iters must be >= 1, "
                 "--row_bytes even and >= 2\n");
    return 2;
  }
  std::vector<double> fractions;
  for (const auto& s : absl::StrSplit(absl::GetFlag(FLAGS_fractions), ',')) {
    double f = 0;
    if (!absl::SimpleAtod(s, &f) || f <= 0 || f > 1) {
      std::fprintf(stderr,
                   "gather_bandwidth: a fraction is in (0, 1], got '%s'\n",
                   std::string(s).c_str());
      return 2;
    }
    fractions.push_back(f);
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "gather_bandwidth: no CUDA device answers\n");
    return 1;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const size_t layer_bytes = static_cast<size_t>(heads) * ctx * row_bytes;
  void *k = nullptr, *v = nullptr, *out = nullptr;
  int32_t *indices = nullptr, *offsets = nullptr;
  cudaStream_t stream;
  if (Check(cudaHostAlloc(&k, layer_bytes, cudaHostAllocMapped),
            "cudaHostAlloc") ||
      Check(cudaHostAlloc(&v, layer_bytes, cudaHostAllocMapped),
            "cudaHostAlloc") ||
      Check(cudaMalloc(&out, 2 * layer_bytes), "cudaMalloc") ||
      Check(cudaMalloc(&indices, sizeof(int32_t) * heads * ctx),
            "cudaMalloc") ||
      Check(cudaMalloc(&offsets, sizeof(int32_t) * (heads + 1)),
            "cudaMalloc") ||
      Check(cudaStreamCreate(&stream), "cudaStreamCreate")) {
    return 1;
  }
  std::fill_n(static_cast<char*>(k), layer_bytes, 1);
  std::fill_n(static_cast<char*>(v), layer_bytes, 2);
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("device: %s; %d heads x %d slots x %d-byte rows\n"
                "| fraction | rows | gather GB/s | pinned copy GB/s | ratio |\n"
                "|---|---|---|---|---|\n",
                prop.name, heads, ctx, row_bytes);
  }
  std::mt19937 rng(1);
  for (double f : fractions) {
    const int per_head = std::max(1, static_cast<int>(f * ctx));
    std::vector<int32_t> plan, heads_at{0};
    std::vector<int32_t> all(ctx);
    std::iota(all.begin(), all.end(), 0);
    for (int h = 0; h < heads; ++h) {
      if (per_head < ctx) std::shuffle(all.begin(), all.end(), rng);
      std::vector<int32_t> chosen(all.begin(), all.begin() + per_head);
      std::sort(chosen.begin(), chosen.end());
      plan.insert(plan.end(), chosen.begin(), chosen.end());
      heads_at.push_back(static_cast<int32_t>(plan.size()));
    }
    if (Check(cudaMemcpy(indices, plan.data(), sizeof(int32_t) * plan.size(),
                         cudaMemcpyHostToDevice),
              "cudaMemcpy") ||
        Check(cudaMemcpy(offsets, heads_at.data(),
                         sizeof(int32_t) * heads_at.size(),
                         cudaMemcpyHostToDevice),
              "cudaMemcpy")) {
      return 1;
    }
    infinigen::gpu_worker::GatherRowsParams p;
    p.k_rows = k;
    p.v_rows = v;
    p.head_stride = ctx;
    p.indices = indices;
    p.head_offsets = offsets;
    p.n_heads = heads;
    p.n_rows = static_cast<long>(plan.size());
    p.row_bytes = row_bytes;
    p.out = out;
    const size_t bytes = 2 * plan.size() * static_cast<size_t>(row_bytes);
    int launch = 0;
    const double tg = Median(iters, stream, [&] {
      launch |= cuda::LaunchGatherRows(p, stream);
    });
    const double tc = Median(iters, stream, [&] {
      cudaMemcpyAsync(out, k, bytes / 2, cudaMemcpyHostToDevice, stream);
      cudaMemcpyAsync(static_cast<char*>(out) + bytes / 2, v, bytes / 2,
                      cudaMemcpyHostToDevice, stream);
    });
    if (launch != 0) {
      return Check(static_cast<cudaError_t>(launch), "LaunchGatherRows");
    }
    if (Check(cudaGetLastError(), "run")) return 1;
    const double gather_gbps = bytes / tg / 1e9, copy_gbps = bytes / tc / 1e9;
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("{\"device\": \"%s\", \"heads\": %d, \"ctx\": %d, "
                  "\"row_bytes\": %d, \"fraction\": %g, \"rows\": %zu, "
                  "\"gather_gbps\": %.3f, \"pinned_copy_gbps\": %.3f}\n",
                  prop.name, heads, ctx, row_bytes, f, plan.size(),
                  gather_gbps, copy_gbps);
    } else {
      std::printf("| %g | %zu | %.2f | %.2f | %.2f |\n", f, plan.size(),
                  gather_gbps, copy_gbps, gather_gbps / copy_gbps);
    }
  }
  cudaFreeHost(k);
  cudaFreeHost(v);
  cudaFree(out);
  cudaFree(indices);
  cudaFree(offsets);
  return 0;
}
