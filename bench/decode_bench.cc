// decode_bench: CPU decode speed of the reference engine against the
// machine's memory bandwidth, measured in the same run.
//
// Decoding one token reads every weight once (a GEMV per matrix), so the
// ceiling is memory bandwidth / weight bytes per token. The bench measures a
// multi-threaded memcpy over a buffer larger than the caches, decodes
// --tokens tokens after a --prompt_tokens prefill, and reports tokens/s and
// the fraction of that ceiling reached. Writes a Markdown row to stdout and
// appends JSON lines to --out.
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu/blas_kernels.h"
#include "gpu_worker/backend/cpu/cpu_backend.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/serving/sampler.h"
#include "model/loader.h"

ABSL_FLAG(std::string, model, "", "Model file (llama2.c .bin, GGUF, safetensors).");
ABSL_FLAG(std::string, tokenizer, "", "Tokenizer for llama2.c models (unused "
                                      "otherwise; the bench feeds token ids).");
ABSL_FLAG(int, prompt_tokens, 32, "Tokens prefilled before timing.");
ABSL_FLAG(int, tokens, 64, "Tokens decoded and timed.");
ABSL_FLAG(int, threads, 0, "Threads for BLAS and memcpy; 0: all cores.");
ABSL_FLAG(std::string, out, "", "Append one JSON line of results here.");

namespace infinigen {
namespace {

double Seconds(std::chrono::steady_clock::time_point a,
               std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Bytes copied per second by `threads` threads each memcpy-ing its share of
// a 512 MiB buffer; best of five passes.
double MemcpyBandwidth(int threads) {
  const size_t bytes = size_t(512) << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0;
  for (int pass = 0; pass < 5; ++pass) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    const size_t share = bytes / threads;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        std::memcpy(dst.data() + t * share, src.data() + t * share, share);
      });
    }
    for (auto& th : pool) th.join();
    best = std::max(best, bytes / Seconds(t0, std::chrono::steady_clock::now()));
  }
  return best;
}

size_t WeightBytesPerToken(const model::Weights& w) {
  size_t floats = w.final_norm.size() + w.final_norm_bias.size();
  for (const model::LayerWeights& l : w.layers) {
    for (const auto* t : {&l.attn_norm, &l.attn_norm_bias, &l.wq, &l.wk, &l.wv,
                          &l.wo, &l.bq, &l.bk, &l.bv, &l.bo, &l.ffn_norm,
                          &l.ffn_norm_bias, &l.w1, &l.w3, &l.w2, &l.b1, &l.b2}) {
      floats += t->size();
    }
  }
  // The classifier is read whole; the embedding only one row.
  floats += size_t(w.config.vocab_size) * w.config.dim + w.config.dim;
  return floats * sizeof(float);
}

int Main() {
  int threads = absl::GetFlag(FLAGS_threads);
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  openblas_set_num_threads(threads);
  auto m = model::LoadModel(absl::GetFlag(FLAGS_model),
                            absl::GetFlag(FLAGS_tokenizer));
  if (!m.ok()) {
    std::fprintf(stderr, "decode_bench: %s\n",
                 std::string(m.status().message()).c_str());
    return 2;
  }
  const int prompt = absl::GetFlag(FLAGS_prompt_tokens);
  const int decode = absl::GetFlag(FLAGS_tokens);
  if (prompt < 1 || decode < 1) {
    std::fprintf(stderr, "decode_bench: --prompt_tokens and --tokens must be >= 1\n");
    return 2;
  }
  gpu_worker::EngineOptions opts;
  opts.max_seq_len = std::min(m->weights.config.max_seq_len, prompt + decode + 1);
  if (prompt + decode > opts.max_seq_len) {
    std::fprintf(stderr, "decode_bench: %d tokens exceed the context of %d\n",
                 prompt + decode, opts.max_seq_len);
    return 2;
  }
  auto engine = gpu_worker::Engine::Create(m->weights,
                                           gpu_worker::NewCpuBackend(), opts);
  if (!engine.ok()) {
    std::fprintf(stderr, "decode_bench: %s\n",
                 std::string(engine.status().message()).c_str());
    return 2;
  }
  const double bw = MemcpyBandwidth(threads);
  const double bw1 = MemcpyBandwidth(1);

  std::vector<int> ids(prompt);
  for (int i = 0; i < prompt; ++i) ids[i] = (i * 7919 + 3) % m->weights.config.vocab_size;
  auto logits = (*engine)->Forward(ids, false);
  if (!logits.ok()) return 1;
  // One untimed step warms the caches and thread pool.
  int next = gpu_worker::Argmax(*logits);
  logits = (*engine)->Forward({next}, false);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < decode - 1; ++i) {
    next = gpu_worker::Argmax(*logits);
    logits = (*engine)->Forward({next}, false);
    if (!logits.ok()) return 1;
  }
  const double secs = Seconds(t0, std::chrono::steady_clock::now());
  const double tps = (decode - 1) / secs;
  const size_t wbytes = WeightBytesPerToken(m->weights);
  const double bound = bw / wbytes;
  const std::string name = absl::GetFlag(FLAGS_model);
  std::printf("| %s | %d | %.1f | %.1f | %.2f | %.2f | %.1f | %.0f%% |\n",
              name.substr(name.find_last_of('/') + 1).c_str(), threads, tps,
              wbytes / 1e6, bw1 / 1e9, bw / 1e9, bound, 100.0 * tps / bound);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::ofstream f(out, std::ios::app);
    f << absl::StrFormat(
        "{\"model\": \"%s\", \"threads\": %d, \"prompt_tokens\": %d, "
        "\"decode_tokens\": %d, \"tokens_per_s\": %.3f, "
        "\"weight_bytes_per_token\": %d, \"memcpy_gbps_1thread\": %.3f, "
        "\"memcpy_gbps\": %.3f, \"bound_tokens_per_s\": %.3f, "
        "\"fraction_of_bound\": %.4f}\n",
        name, threads, prompt, decode, tps, wbytes, bw1 / 1e9, bw / 1e9, bound,
        tps / bound);
  }
  return 0;
}

}  // namespace
}  // namespace infinigen

int main(int argc, char** argv) {
  infinigen::gpu_worker::SelectBlasKernels(argv);
  absl::SetProgramUsageMessage(
      "CPU decode tokens/s against the memory-bandwidth bound.\n"
      "Usage: decode_bench --model=PATH [--tokens=N] [--out=results.jsonl]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "decode_bench: unexpected argument '%s'\n", rest[1]);
    return 2;
  }
  return infinigen::Main();
}
