// infinigen bench-decode: decode latency, fetches and memory per policy
// (gpu_worker/eval/bench_decode.h).
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/file.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/status.h"
#include "gpu_worker/commands/common.h"
#include "gpu_worker/eval/bench_decode.h"
#include "gpu_worker/kv/kv_policy.h"

ABSL_FLAG(int, batch, 1, "bench-decode: sequences decoding together.");
ABSL_FLAG(int, decode_tokens, 64, "bench-decode: decode steps timed.");
ABSL_FLAG(bool, plan_only, false,
          "bench-decode: create each policy's engine for --ctx and --batch "
          "(refused above --max_worker_kv_bytes), report the worker KV bytes "
          "it holds, and decode nothing.");

namespace infinigen::commands {
namespace {

using gpu_worker::DecodeBenchResult;

// The input: --text's tokens repeated to fill, else synthetic ids.
absl::StatusOr<std::vector<int>> SourceFromFlags(const model::LoadedModel& m,
                                                 size_t need) {
  const std::string path = ReadRunFlags().text;
  std::vector<int> text;
  if (!path.empty()) {
    IG_ASSIGN_OR_RETURN(std::string s, ReadFileToString(path));
    text = m.tokenizer->Encode(s, /*add_bos=*/false);
    if (text.size() < need) {
      IG_LOG(WARNING) << path << " holds " << text.size()
                      << " tokens; repeating it to fill " << need;
    }
    if (text.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s holds no tokens", path));
    }
  }
  return gpu_worker::DecodeBenchSource(text, need, m.weights.config.vocab_size);
}

void PrintTable(const std::vector<DecodeBenchResult>& results) {
  const DecodeBenchResult& first = results[0];
  std::printf(
      "bench-decode: %s, ctx %d, batch %d, %d steps, KV node %s, backend %s\n",
      ModelNameFromFlags().c_str(), first.ctx, first.batch, first.steps,
      ReadMemoryNodeFlags().kv_service.c_str(), first.backend.c_str());
  std::printf("| policy | tokens/s | p50 ms/step | p99 ms/step | KV bytes "
              "fetched/token | rows fetched | fetch wait | prefill s | "
              "worker KV MiB | node KV MiB | peak RSS MiB |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  constexpr double kMiB = 1024.0 * 1024.0;
  for (const auto& r : results) {
    std::printf("| %s | %.2f | %.2f | %.2f | %.0f | %.2f%% | %.1f%% | %.1f | "
                "%.1f | %.1f | %.0f |\n",
                r.policy.c_str(), r.tokens_per_second(), r.step_ms(50),
                r.step_ms(99),
                static_cast<double>(r.fetch.bytes_fetched) / r.tokens(),
                100.0 * r.fetch.fraction_mean(),
                100.0 * r.fetch.wait_seconds / r.seconds, r.prefill_seconds,
                r.worker_kv_bytes / kMiB, r.memory_node_bytes / kMiB,
                r.peak_rss_bytes / kMiB);
  }
  if (results.size() > 1) {
    std::printf("(peak RSS is the process's so far: with several policies in "
                "one run, compare it only from one policy per process)\n");
  }
}

void PrintJson(const DecodeBenchResult& r) {
  nlohmann::json j;
  j["model"] = ModelNameFromFlags();
  j["policy"] = r.policy;
  j["backend"] = r.backend;
  j["kv_service"] = ReadMemoryNodeFlags().kv_service;
  j["ctx"] = r.ctx;
  j["batch"] = r.batch;
  j["decode_tokens"] = r.steps;
  j["tokens_per_s"] = r.tokens_per_second();
  j["p50_ms"] = r.step_ms(50);
  j["p99_ms"] = r.step_ms(99);
  // Every step in order: the first after a prompt carries what the
  // sequence's first decode sets up.
  std::vector<double> steps_ms;
  for (double t : r.step_seconds) steps_ms.push_back(1e3 * t);
  j["step_ms"] = steps_ms;
  j["bytes_fetched_per_token"] =
      static_cast<double>(r.fetch.bytes_fetched) / r.tokens();
  j["fetch_fraction_mean"] = r.fetch.fraction_mean();
  j["fetch_wait_fraction"] = r.fetch.wait_seconds / r.seconds;
  j["compute_fraction"] = 1.0 - r.fetch.wait_seconds / r.seconds;
  j["prefill_seconds"] = r.prefill_seconds;
  j["warmup_seconds"] = r.warmup_seconds;
  // Of the prefill (offloaded policies, summed over the batch): opening
  // the sequences at the memory node (and pinning their rows for one-sided
  // reads), and waiting on a layer's append to the node once the next
  // layer's work was done.
  j["prefill_open_seconds"] = r.fetch.open_seconds;
  j["prefill_append_wait_seconds"] = r.fetch.prefill_append_wait_seconds;
  // The policy's own prefill work on the host (FetchStats).
  j["prefill_policy_seconds"] = r.fetch.prefill_policy_seconds;
  // Prompt tokens computed per second of prefill (reused ones excluded).
  j["prefill_tokens_per_s"] =
      r.prefill_seconds > 0
          ? (static_cast<double>(r.ctx) * r.batch - r.cached_tokens) /
                r.prefill_seconds
          : 0.0;
  // Bytes fetched per second spent waiting for fetches: a lower bound of
  // the fetch path's rate where fetches overlap compute.
  j["fetch_gbps"] = r.fetch.wait_seconds > 0
                        ? r.fetch.bytes_fetched / r.fetch.wait_seconds / 1e9
                        : 0.0;
  // Bytes fetched per second of decoding: what the fetch path sustained
  // at least (one-sided reads leave no wait on the host to time).
  j["decode_fetch_gbps"] =
      r.seconds > 0 ? r.fetch.bytes_fetched / r.seconds / 1e9 : 0.0;
  j["kv_direct_reads"] = ReadMemoryNodeFlags().kv_direct_reads;
  // Of the rows fetched, the share read where the node keeps them.
  j["fetch_in_place_fraction"] =
      r.fetch.rows_fetched > 0
          ? static_cast<double>(r.fetch.rows_read_in_place) /
                r.fetch.rows_fetched
          : 0.0;
  // The row cache (--row_cache): the share of selected rows it held, over
  // the run, per step and per layer, the rows that moved per token and the
  // bytes it held at the end (summed over the batch).
  j["row_cache"] = ReadMemoryNodeFlags().row_cache;
  j["row_cache_replacement"] = ReadMemoryNodeFlags().row_cache_replacement;
  j["row_cache_hit_rate"] = r.fetch.row_cache_hit_rate();
  j["row_cache_step_hit_rate"] = r.step_row_cache_hit_rate;
  std::vector<double> layer_hit_rate;
  for (size_t l = 0; l < r.fetch.row_cache_layer_lookups.size(); ++l) {
    const long n = r.fetch.row_cache_layer_lookups[l];
    layer_hit_rate.push_back(
        n > 0 ? static_cast<double>(r.fetch.row_cache_layer_hits[l]) / n : 0.0);
  }
  j["row_cache_layer_hit_rate"] = layer_hit_rate;
  // Per step from the second, per layer: the share of the step's
  // selection that the previous step selected too.
  j["selection_overlap_step_layer"] = r.step_layer_overlap;
  j["row_cache_bytes"] = r.fetch.row_cache_bytes;
  j["rows_fetched_per_token"] =
      static_cast<double>(r.fetch.rows_fetched) / r.tokens();
  j["worker_kv_bytes"] = r.worker_kv_bytes;
  j["memory_node_bytes"] = r.memory_node_bytes;
  j["peak_rss_bytes"] = r.peak_rss_bytes;
  j["cached_tokens"] = r.cached_tokens;
  std::printf("%s\n", j.dump().c_str());
}

// One policy's run (or, with --plan_only, its engine's worker KV bytes):
// 0, or the exit status after reporting why not.
int BenchPolicy(const std::string& policy, const model::LoadedModel& m,
                const std::vector<int>& source,
                const kv_memory_service::KvClientOptions& kv_options, int ctx,
                int batch, int steps, std::vector<DecodeBenchResult>& results) {
  auto setup = SetUpPolicy(policy, m, kv_options, /*serving=*/true);
  if (!setup.ok()) return SetupFailure(setup.status());
  setup->options.max_seq_len = ctx + steps;
  setup->options.batch = batch;
  auto engine = CreateEngine(m.weights, setup->options);
  if (!engine.ok()) return EngineFailure(engine.status());
  if (absl::GetFlag(FLAGS_plan_only)) {
    std::printf("bench-decode --plan_only: %s at ctx %d x batch %d holds "
                "%lld bytes of worker KV\n",
                policy.c_str(), ctx, batch,
                static_cast<long long>((*engine)->worker_kv_bytes()));
    return 0;
  }
  // Progress on stderr: each prefilled sequence, then the decode steps.
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Progress> decoding;
  auto r = gpu_worker::RunDecodeBench(
      **engine, source, ctx, steps,
      [&](int prefilled) {
        const double s = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - start)
                             .count();
        std::fprintf(stderr,
                     "bench-decode %s: prefilled sequence %d/%d (%.1f s, "
                     "about %.0f s left)\n",
                     policy.c_str(), prefilled, batch, s,
                     s / prefilled * (batch - prefilled));
        if (prefilled == batch) {  // decoding starts
          decoding = std::make_unique<Progress>(
              absl::StrCat("bench-decode ", policy), steps, "steps");
        }
      },
      [&](int step) {
        if (decoding != nullptr) decoding->Update(step);
      });
  if (!r.ok()) return Fail(kExitFailure, r.status());
  results.push_back(*std::move(r));
  return 0;
}

int RunBenchDecode() {
  const int ctx = ReadRunFlags().ctx;
  const int batch = absl::GetFlag(FLAGS_batch);
  const int steps = absl::GetFlag(FLAGS_decode_tokens);
  if (ctx < 1 || batch < 1 || steps < 2) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(
                    "--ctx and --batch must be >= 1, --decode_tokens >= 2"));
  }
  const std::vector<std::string> policies =
      absl::StrSplit(ReadEngineFlags().policy, ',');
  for (const std::string& p : policies) {
    gpu_worker::KvOptions chosen;
    if (absl::Status st = gpu_worker::ChoosePolicy(p, chosen); !st.ok()) {
      return Fail(kExitUsage, st);
    }
  }
  auto kv_options = KvClientOptionsFromFlags();
  if (!kv_options.ok()) return Fail(kExitUsage, kv_options.status());
  auto m = LoadFromFlags(/*need_tokenizer=*/!ReadRunFlags().text.empty());
  if (!m.ok()) return LoadFailure(m.status());
  if (ctx + steps > m->weights.config.max_seq_len) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "--ctx + --decode_tokens = %d exceeds the "
                                "model's context of %d",
                                ctx + steps, m->weights.config.max_seq_len)));
  }
  auto source = SourceFromFlags(*m, static_cast<size_t>(batch) * (ctx + steps));
  if (!source.ok()) return Fail(kExitUsage, source.status());
  WarnIgnoredPolicyFlags(policies);
  std::vector<DecodeBenchResult> results;
  for (const std::string& policy : policies) {
    if (int code = BenchPolicy(policy, *m, *source, *kv_options, ctx, batch,
                               steps, results);
        code != 0) {
      return code;
    }
  }
  if (absl::GetFlag(FLAGS_plan_only)) return 0;
  PrintTable(results);
  if (ReadRunFlags().json) {
    for (const auto& r : results) PrintJson(r);
  }
  return 0;
}

}  // namespace

const Command& BenchDecodeCommand() {
  static const Command* command = new Command{
      "bench-decode",
      "After a warm-up (a 16-token prompt and one step, as the Transformers "
      "baseline takes), fills --ctx tokens of context per sequence (from "
      "--text, else synthetic), decodes --decode_tokens steps of --batch "
      "sequences under each policy of the comma-separated --policy, and "
      "reports per-token "
      "latency (p50, p99), tokens/s, KV bytes fetched per token, the time "
      "spent waiting on fetches, the KV memory held by the worker and by "
      "the memory node, and the process's peak RSS.",
      WithServingFlags({"model", "tokenizer", "text", "ctx", "batch",
                        "decode_tokens", "calibration_tokens", "json",
                        "plan_only"}),
      RunBenchDecode};
  return *command;
}

}  // namespace infinigen::commands
