// infinigen skew: InfiniGen's skew matrices from calibration text.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "gpu_worker/eval/bench_decode.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/commands/common.h"

ABSL_FLAG(std::string, out, "", "skew: the skew file to write.");

namespace infinigen::commands {
namespace {

int RunSkew() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--out is required"));
  }
  // Dummy weights have no tokenizer: they calibrate on bench-decode's
  // synthetic tokens (a skew for speed measurements, not for accuracy).
  const bool synthetic =
      ReadModelFlags().load_format == "dummy" && ReadRunFlags().text.empty();
  absl::StatusOr<TextRun> run;
  if (synthetic) {
    auto m = LoadFromFlags(/*need_tokenizer=*/false);
    if (!m.ok()) return LoadFailure(m.status());
    run.emplace();
    run->model = *std::move(m);
    run->tokens = gpu_worker::DecodeBenchSource(
        {}, CalibrationTokensFromFlags(),
        run->model.weights.config.vocab_size);
  } else {
    run = LoadTextRun();
  }
  if (!run.ok()) return LoadFailure(run.status());
  const int n = std::min<int>({static_cast<int>(run->tokens.size()),
                               CalibrationTokensFromFlags(),
                               run->model.weights.config.max_seq_len});
  const auto t0 = std::chrono::steady_clock::now();
  // The profile is for adaptive head budgets, which infinigen uses under
  // --target_fetch: measured with that mode's speculation by default.
  const auto speculation = SpeculationFromFlags(true);
  if (!speculation.ok()) return Fail(kExitUsage, speculation.status());
  auto backend = gpu_worker::NewBackend(ReadEngineFlags().backend);
  if (!backend.ok()) return Fail(kExitUsage, backend.status());
  auto skew = gpu_worker::CalibrateSkew(
      run->model.weights, absl::MakeConstSpan(run->tokens).subspan(0, n),
      *speculation, *std::move(backend), CalibrationProgress());
  if (!skew.ok()) return Fail(kExitUsage, skew.status());
  if (absl::Status s = skew->Save(out); !s.ok()) return Fail(kExitFailure, s);
  std::printf("wrote %s: %d layers x %d KV heads, head_dim %d, from %d "
              "calibration tokens (%.1f s)\n",
              out.c_str(), skew->n_layers, skew->n_kv_heads, skew->head_dim, n,
              std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                            t0)
                  .count());
  return 0;
}

}  // namespace

const Command& SkewCommand() {
  static const Command* command = new Command{
      "skew",
      "Computes InfiniGen's skew matrices and its head profile (for "
      "--head_budgets=adaptive, measured with --partial_ratio, "
      "--speculate_from, --partial_key_bits and --dense_layers, by default as "
      "infinigen speculates under --target_fetch) from calibration text and "
      "writes them to --out. With --load_format=dummy and no --text, from "
      "synthetic tokens (for speed measurements).",
      {"model", "load_format", "model_config", "tokenizer", "text",
       "calibration_tokens", "partial_ratio",
       "speculate_from", "partial_key_bits", "dense_layers", "out", "threads",
       "backend"},
      RunSkew};
  return *command;
}

}  // namespace infinigen::commands
