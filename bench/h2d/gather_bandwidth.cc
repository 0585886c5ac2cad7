// One-sided read bandwidth: a decode step's fetch of one layer read by the
// GPU itself (LaunchGatherRows) from pinned host memory mapped for the
// device, laid out as the memory node stores a layer ([kv_head][slot][row]),
// against a pinned cudaMemcpyAsync of the same number of bytes in the same
// run (the ceiling a fetch into the GPU can reach).
//
//   gather_bandwidth [--heads=32] [--ctx=32768] [--row_bytes=256]
//                    [--fractions=1,0.1] [--iters=20]
//                    [--memory=host_alloc,registered,registered_huge,
//                              registered_touched] [--json]
//
// For each fraction f, each head's plan is f * ctx distinct slots drawn at
// random and sorted (f = 1: every slot, in order). GB/s counts the K and V
// bytes the plan moves.
//
// --memory says where the rows lie: host_alloc (cudaHostAlloc), registered
// (as the memory node's rows read one-sided: an anonymous mmap registered
// with cudaHostRegister before the rows are written), registered_huge
// (the same, advised to transparent huge pages first) or
// registered_touched (registered, then one word of every page read by the
// device, as the CUDA backend's PinHost does, then written). Each also
// reports the time to allocate and register the rows (and touch them), and
// the first read of every row (the device's first access to each page
// since it was written), before any warm-up: by the gather kernel, and by
// the copy engine from a third range of the same kind.
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
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
#include "bench/gpu/cuda_bench.h"
#include "gpu_worker/backend/cuda/kernels.h"

ABSL_FLAG(int, heads, 32, "KV heads of the layer.");
ABSL_FLAG(int, ctx, 32768, "Slots (tokens) per head.");
ABSL_FLAG(int, row_bytes, 256, "Bytes a row (fp16 head_dim 128: 256).");
ABSL_FLAG(std::string, fractions, "1,0.1",
          "Fractions of each head's rows a plan reads.");
ABSL_FLAG(int, iters, 20, "Timed repetitions (the median is reported).");
ABSL_FLAG(std::string, memory, "host_alloc",
          "Comma-separated: host_alloc (cudaHostAlloc), registered (an "
          "anonymous mmap registered with cudaHostRegister, as the memory "
          "node's rows for one-sided reads), registered_huge (the same, "
          "advised to transparent huge pages), registered_touched "
          "(registered, then one word of every page read by the device "
          "before the rows are written).");
ABSL_FLAG(bool, json, false,
          "One JSON object per memory and fraction on stdout.");

namespace {

namespace cuda = infinigen::gpu_worker::cuda;

constexpr char kProg[] = "gather_bandwidth";

int Check(cudaError_t e, const char* what) {
  return infinigen::bench::CudaCheck(kProg, e, what);
}

// The rows of K or V in one kind of memory; freed on destruction.
class Rows {
 public:
  Rows(const std::string& memory, size_t bytes)
      : memory_(memory), bytes_(bytes) {}
  Rows(const Rows&) = delete;
  Rows& operator=(const Rows&) = delete;
  ~Rows() {
    if (memory_ == "host_alloc") {
      if (data_ != nullptr) cudaFreeHost(data_);
      return;
    }
    if (registered_) cudaHostUnregister(data_);
    if (data_ != nullptr) munmap(data_, bytes_);
  }

  // Allocates (and registers, and touches) the rows, then writes them with
  // `fill`.
  int Make(char fill, cudaStream_t stream, unsigned* sink) {
    if (memory_ == "host_alloc") {
      if (Check(cudaHostAlloc(&data_, bytes_, cudaHostAllocMapped),
                "cudaHostAlloc")) {
        data_ = nullptr;
        return 1;
      }
    } else {
      void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        std::perror("gather_bandwidth: mmap");
        return 1;
      }
      data_ = p;
      if (memory_ == "registered_huge" &&
          madvise(data_, bytes_, MADV_HUGEPAGE) != 0) {
        std::perror("gather_bandwidth: madvise(MADV_HUGEPAGE)");
      }
      if (Check(cudaHostRegister(data_, bytes_, cudaHostRegisterMapped),
                "cudaHostRegister")) {
        return 1;
      }
      registered_ = true;
      if (memory_ == "registered_touched") {
        void* device = nullptr;
        if (Check(cudaHostGetDevicePointer(&device, data_, 0),
                  "cudaHostGetDevicePointer")) {
          return 1;
        }
        cuda::TouchPagesParams t;
        t.data = device;
        t.bytes = bytes_ / 4 * 4;
        t.page_bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        t.sink = sink;
        if (Check(static_cast<cudaError_t>(cuda::LaunchTouchPages(t, stream)),
                  "LaunchTouchPages") ||
            Check(cudaStreamSynchronize(stream), "touch")) {
          return 1;
        }
      }
    }
    std::fill_n(static_cast<char*>(data_), bytes_, fill);
    return 0;
  }

  void* data() const { return data_; }

  // Bytes of this mapping the kernel backs with huge pages
  // (/proc/self/smaps' AnonHugePages); 0 for cudaHostAlloc's.
  long HugeBytes() const {
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool ours = false;
    const auto at = reinterpret_cast<uintptr_t>(data_);
    while (std::getline(smaps, line)) {
      uintptr_t lo = 0, hi = 0;
      if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
        // A mapping's first line: its address range.
        ours = lo <= at && at < hi;
        continue;
      }
      long kb = 0;
      if (ours &&
          std::sscanf(line.c_str(), "AnonHugePages: %ld kB", &kb) == 1) {
        return kb * 1024;
      }
    }
    return 0;
  }

 private:
  const std::string memory_;
  const size_t bytes_;
  void* data_ = nullptr;
  bool registered_ = false;
};

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "One-sided gather bandwidth from mapped host memory, against a pinned "
      "copy.\n  gather_bandwidth [--heads=32] [--ctx=32768] [--row_bytes=256] "
      "[--fractions=1,0.1] [--iters=20]\n"
      "                   [--memory=host_alloc,registered,registered_huge,"
      "registered_touched] [--json]");
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
  std::vector<std::string> memories;
  for (const auto& m : absl::StrSplit(absl::GetFlag(FLAGS_memory), ',')) {
    if (m != "host_alloc" && m != "registered" && m != "registered_huge" &&
        m != "registered_touched") {
      std::fprintf(stderr,
                   "gather_bandwidth: --memory takes host_alloc, registered, "
                   "registered_huge and registered_touched, got '%s'\n",
                   std::string(m).c_str());
      return 2;
    }
    memories.emplace_back(m);
  }
  cudaDeviceProp prop;
  if (!infinigen::bench::FirstDevice(kProg, &prop)) return 1;
  const size_t layer_bytes = static_cast<size_t>(heads) * ctx * row_bytes;
  void* out = nullptr;
  unsigned* sink = nullptr;
  int32_t *indices = nullptr, *offsets = nullptr;
  cudaStream_t stream;
  if (Check(cudaMalloc(&out, 2 * layer_bytes), "cudaMalloc") ||
      Check(cudaMalloc(&indices, sizeof(int32_t) * heads * ctx),
            "cudaMalloc") ||
      Check(cudaMalloc(&offsets, sizeof(int32_t) * (heads + 1)),
            "cudaMalloc") ||
      Check(cudaStreamCreate(&stream), "cudaStreamCreate") ||
      Check(cudaMalloc(&sink, sizeof(unsigned)), "cudaMalloc")) {
    return 1;
  }
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("device: %s; %d heads x %d slots x %d-byte rows\n"
                "| memory | fraction | rows | gather GB/s | pinned copy GB/s "
                "| ratio | first read of every row GB/s (kernel) | first "
                "copy GB/s | allocate and register ms | huge-page bytes |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n",
                prop.name, heads, ctx, row_bytes);
  }
  for (const std::string& memory : memories) {
    Rows k_rows(memory, layer_bytes), v_rows(memory, layer_bytes),
        w_rows(memory, layer_bytes);
    const auto t_make = std::chrono::steady_clock::now();
    if (k_rows.Make(1, stream, sink) || v_rows.Make(2, stream, sink)) {
      return 1;
    }
    // Allocation and registration (and the touch), and the rows' first
    // writes.
    const double make_ms = 1e3 * SecondsSince(t_make);
    if (w_rows.Make(3, stream, sink)) return 1;
    // The copy engine's first read of a range of the same kind.
    const auto t_copy = std::chrono::steady_clock::now();
    if (Check(cudaMemcpyAsync(out, w_rows.data(), layer_bytes,
                              cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync") ||
        Check(cudaStreamSynchronize(stream), "first copy")) {
      return 1;
    }
    const double first_copy_gbps = layer_bytes / SecondsSince(t_copy) / 1e9;
    const long huge = k_rows.HugeBytes() + v_rows.HugeBytes();
    void* k = k_rows.data();
    void* v = v_rows.data();
    infinigen::gpu_worker::GatherRowsParams p;
    p.k_rows = k;
    p.v_rows = v;
    p.head_stride = ctx;
    p.n_heads = heads;
    p.row_bytes = row_bytes;
    p.out = out;
    // The device's first read of every row: each head's leading rows (no
    // indices), before any warm-up.
    std::vector<int32_t> heads_all(heads + 1);
    for (int h = 0; h <= heads; ++h) heads_all[h] = h * ctx;
    if (Check(cudaMemcpy(offsets, heads_all.data(),
                         sizeof(int32_t) * heads_all.size(),
                         cudaMemcpyHostToDevice),
              "cudaMemcpy")) {
      return 1;
    }
    p.indices = nullptr;
    p.head_offsets = offsets;
    p.n_rows = static_cast<long>(heads) * ctx;
    const auto t_first = std::chrono::steady_clock::now();
    if (Check(static_cast<cudaError_t>(cuda::LaunchGatherRows(p, stream)),
              "LaunchGatherRows") ||
        Check(cudaStreamSynchronize(stream), "first read")) {
      return 1;
    }
    const double first_gbps = 2.0 * layer_bytes / SecondsSince(t_first) / 1e9;
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
      if (Check(cudaMemcpy(indices, plan.data(),
                           sizeof(int32_t) * plan.size(),
                           cudaMemcpyHostToDevice),
                "cudaMemcpy") ||
          Check(cudaMemcpy(offsets, heads_at.data(),
                           sizeof(int32_t) * heads_at.size(),
                           cudaMemcpyHostToDevice),
                "cudaMemcpy")) {
        return 1;
      }
      p.indices = indices;
      p.n_rows = static_cast<long>(plan.size());
      const size_t bytes = 2 * plan.size() * static_cast<size_t>(row_bytes);
      int launch = 0;
      const double tg = infinigen::bench::MedianSeconds(2, iters, stream, [&] {
        launch |= cuda::LaunchGatherRows(p, stream);
      });
      const double tc = infinigen::bench::MedianSeconds(2, iters, stream, [&] {
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
        std::printf("{\"device\": \"%s\", \"memory\": \"%s\", "
                    "\"heads\": %d, \"ctx\": %d, \"row_bytes\": %d, "
                    "\"fraction\": %g, \"rows\": %zu, "
                    "\"gather_gbps\": %.3f, \"pinned_copy_gbps\": %.3f, "
                    "\"first_read_gbps\": %.3f, \"first_copy_gbps\": %.3f, "
                    "\"make_ms\": %.1f, \"huge_page_bytes\": %ld}\n",
                    prop.name, memory.c_str(), heads, ctx, row_bytes, f,
                    plan.size(), gather_gbps, copy_gbps, first_gbps,
                    first_copy_gbps, make_ms, huge);
      } else {
        std::printf("| %s | %g | %zu | %.2f | %.2f | %.2f | %.2f | %.2f | "
                    "%.1f | %ld |\n",
                    memory.c_str(), f, plan.size(), gather_gbps, copy_gbps,
                    gather_gbps / copy_gbps, first_gbps, first_copy_gbps,
                    make_ms, huge);
      }
      std::fflush(stdout);
    }
  }
  cudaFree(out);
  cudaFree(indices);
  cudaFree(offsets);
  cudaFree(sink);
  return 0;
}
