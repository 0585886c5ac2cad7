// Prefill attention on tensor cores: the causal attention of a prompt chunk
// over the rows before it and its own (LaunchFlashAttention, fp16 K and V
// as the local cache keeps them), in TFLOP/s, against the shared-memory
// WMMA kernel (LaunchFlashAttentionWmma) on the same problem in the same
// run.
//
//   flash_attention_bench [--heads=32] [--kv_heads=32] [--head_dim=128]
//                         [--chunk=2048] [--prefixes=0,30720] [--iters=10]
//                         [--json]
//
// FLOPs count the causal half: 4 * head_dim per (query, visible row, head)
// (two products of a multiply and an add each). The rows are random fp16
// values, the queries fp32.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/gpu/cuda_bench.h"
#include "common/half.h"
#include "gpu_worker/backend/cuda/kernels.h"

ABSL_FLAG(int, heads, 32, "Query heads.");
ABSL_FLAG(int, kv_heads, 32, "KV heads (divides --heads).");
ABSL_FLAG(int, head_dim, 128, "Dims a head (a multiple of 16, <= 256).");
ABSL_FLAG(int, chunk, 2048, "Queries of the chunk (the prefill's chunk).");
ABSL_FLAG(std::string, prefixes, "0,30720",
          "Comma-separated rows before the chunk (0: a prompt's first "
          "chunk; 30720: the last chunk of a 32768-token prompt).");
ABSL_FLAG(int, iters, 10, "Timed repetitions (the median is reported).");
ABSL_FLAG(bool, json, false, "One JSON object per prefix on stdout.");

namespace {

namespace cuda = infinigen::gpu_worker::cuda;

constexpr char kProg[] = "flash_attention_bench";

int Check(cudaError_t e, const char* what) {
  return infinigen::bench::CudaCheck(kProg, e, what);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Prefill attention TFLOP/s: the tensor-core kernel against the WMMA "
      "one.\n  flash_attention_bench [--heads=32] [--kv_heads=32] "
      "[--head_dim=128] [--chunk=2048] [--prefixes=0,30720] [--iters=10] "
      "[--json]");
  absl::ParseCommandLine(argc, argv);
  const int heads = absl::GetFlag(FLAGS_heads);
  const int kv_heads = absl::GetFlag(FLAGS_kv_heads);
  const int d = absl::GetFlag(FLAGS_head_dim);
  const int chunk = absl::GetFlag(FLAGS_chunk);
  const int iters = absl::GetFlag(FLAGS_iters);
  if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0 || d < 16 ||
      d % 16 != 0 || d > cuda::kMaxFlashHeadDim || chunk < 1 || iters < 1) {
    std::fprintf(stderr,
                 "flash_attention_bench: --kv_heads must divide --heads, "
                 "--head_dim be a multiple of 16 up to %d, --chunk and "
                 "--iters >= 1\n",
                 cuda::kMaxFlashHeadDim);
    return 2;
  }
  std::vector<int> prefixes;
  for (const auto& s : absl::StrSplit(absl::GetFlag(FLAGS_prefixes), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(s, &v) || v < 0) {
      std::fprintf(stderr,
                   "flash_attention_bench: a prefix is a row count >= 0, "
                   "got '%s'\n",
                   std::string(s).c_str());
      return 2;
    }
    prefixes.push_back(v);
  }
  cudaDeviceProp prop;
  if (!infinigen::bench::FirstDevice(kProg, &prop)) return 1;
  const int max_prefix = *std::max_element(prefixes.begin(), prefixes.end());
  const long stride = static_cast<long>(max_prefix) + chunk;
  const size_t q_values = static_cast<size_t>(chunk) * heads * d;
  const size_t kv_values = static_cast<size_t>(kv_heads) * stride * d;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> q(q_values);
  for (float& x : q) x = normal(rng);
  std::vector<uint16_t> kv(kv_values);
  for (uint16_t& x : kv) x = infinigen::FloatToHalf(normal(rng));
  float *dq = nullptr, *dout = nullptr;
  uint16_t *dk = nullptr, *dv = nullptr;
  if (Check(cudaMalloc(&dq, q_values * sizeof(float)), "cudaMalloc") ||
      Check(cudaMalloc(&dout, q_values * sizeof(float)), "cudaMalloc") ||
      Check(cudaMalloc(&dk, kv_values * sizeof(uint16_t)), "cudaMalloc") ||
      Check(cudaMalloc(&dv, kv_values * sizeof(uint16_t)), "cudaMalloc") ||
      Check(cudaMemcpy(dq, q.data(), q_values * sizeof(float),
                       cudaMemcpyHostToDevice),
            "cudaMemcpy") ||
      Check(cudaMemcpy(dk, kv.data(), kv_values * sizeof(uint16_t),
                       cudaMemcpyHostToDevice),
            "cudaMemcpy") ||
      Check(cudaMemcpy(dv, kv.data(), kv_values * sizeof(uint16_t),
                       cudaMemcpyHostToDevice),
            "cudaMemcpy")) {
    return 1;
  }
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("device: %s; %d heads (%d KV) x %d dims, chunk of %d "
                "queries, fp16 K and V\n"
                "| rows before | tensor-core TFLOP/s | WMMA TFLOP/s | ratio |\n"
                "|---|---|---|---|\n",
                prop.name, heads, kv_heads, d, chunk);
  }
  for (int prefix : prefixes) {
    cuda::AttentionKernelParams p{};
    p.q = dq;
    p.out = dout;
    p.k_half = dk;
    p.v_half = dv;
    p.n = chunk;
    p.n_heads = heads;
    p.n_kv_heads = kv_heads;
    p.head_dim = d;
    p.kv_stride = static_cast<int>(stride);
    p.kv_len0 = prefix + 1;
    p.scale = 1.0f / std::sqrt(static_cast<float>(d));
    // Query i sees prefix + i + 1 rows.
    const double pairs =
        static_cast<double>(chunk) * prefix + chunk * (chunk + 1.0) / 2;
    const double flops = 4.0 * d * heads * pairs;
    // One warm-up each; the launches go to the default stream.
    int status = 0;
    const double t_mma = infinigen::bench::MedianSeconds(
        1, iters, nullptr,
        [&] { status |= cuda::LaunchFlashAttention(p, nullptr); });
    const double t_wmma = infinigen::bench::MedianSeconds(
        1, iters, nullptr,
        [&] { status |= cuda::LaunchFlashAttentionWmma(p, nullptr); });
    if (status != 0) {
      return Check(static_cast<cudaError_t>(status), "LaunchFlashAttention");
    }
    if (Check(cudaGetLastError(), "run")) return 1;
    const double mma_tflops = flops / t_mma / 1e12;
    const double wmma_tflops = flops / t_wmma / 1e12;
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("{\"device\": \"%s\", \"heads\": %d, \"kv_heads\": %d, "
                  "\"head_dim\": %d, \"chunk\": %d, \"prefix\": %d, "
                  "\"tflops\": %.2f, \"wmma_tflops\": %.2f}\n",
                  prop.name, heads, kv_heads, d, chunk, prefix, mma_tflops,
                  wmma_tflops);
    } else {
      std::printf("| %d | %.1f | %.1f | %.2f |\n", prefix, mma_tflops,
                  wmma_tflops, mma_tflops / wmma_tflops);
    }
    std::fflush(stdout);
  }
  cudaFree(dq);
  cudaFree(dout);
  cudaFree(dk);
  cudaFree(dv);
  return 0;
}
