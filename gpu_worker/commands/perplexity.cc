// infinigen perplexity: scores a text file in windows (gpu_worker/eval/perplexity.h).
#include <cerrno>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "common/progress.h"
#include "gpu_worker/commands/common.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/eval/perplexity.h"

ABSL_FLAG(int, max_windows, 0, "perplexity: score at most this many windows "
                               "(0: the whole text).");
ABSL_FLAG(int, prompt_tokens, 0,
          "perplexity: dense prefix per window; later tokens are decoded one "
          "at a time through --policy and scored. 0: score every position "
          "densely (no policy).");

ABSL_FLAG(std::string, token_logprobs, "",
          "perplexity: also write every scored token's log-probability to "
          "this file, a JSON line each: {\"window\", \"position\" (in the "
          "window, BOS at 0), \"token\", \"logprob\"}. Empty: none.");

namespace infinigen::commands {
namespace {

// Each window's running perplexity, a line of its own beside the bar.
std::string WindowLine(const gpu_worker::PerplexityProgress& p) {
  return absl::StrFormat(
      "perplexity: window %d/%d  tokens %ld  ppl %.4f  fetched %.1f%%",
      p.window, p.windows, p.predicted, std::exp(p.nll_sum / p.predicted),
      100.0 * p.fetch_fraction_mean);
}

// The tokens a run scores: every window's but its dense prefix's.
int64_t TokensToScore(size_t text_tokens, const gpu_worker::PerplexityOptions& o,
                      int windows) {
  const int per_window = o.bos >= 0 ? o.ctx - 1 : o.ctx;
  int64_t total = 0;
  for (int w = 0; w < windows; ++w) {
    const int64_t text = std::min<int64_t>(
        per_window, static_cast<int64_t>(text_tokens) -
                        static_cast<int64_t>(w) * per_window);
    const int64_t len = text + (o.bos >= 0 ? 1 : 0);
    const int64_t prefix =
        o.prompt_tokens > 0 ? std::min<int64_t>(o.prompt_tokens, len - 1) - 1
                            : 0;
    total += len - 1 - prefix;
  }
  return total;
}

void PrintResult(const gpu_worker::PerplexityOptions& o,
                 const gpu_worker::KvOptions& kv,
                 const gpu_worker::PerplexityResult& r) {
  const std::string text = ReadRunFlags().text;
  const std::string name = kv.policy_name();
  // The local cache's settings print as PolicyOptions' defaults.
  const gpu_worker::PolicyOptions policy =
      kv.policy.value_or(gpu_worker::PolicyOptions());
  std::printf("%s: %d windows of %d tokens, %ld predicted tokens, policy %s: "
              "nll %.6f, perplexity %.4f, fetched %.2f%% of cached rows per "
              "step (max %.2f%%) (%.1f s)\n",
              text.c_str(), r.windows, o.ctx, r.predicted, name.c_str(), r.nll,
              r.perplexity(), 100.0 * r.fetch.fraction_mean(),
              100.0 * r.fetch.fraction_max, r.seconds);
  if (!ReadRunFlags().json) return;
  nlohmann::json j;
  j["model"] = ReadModelFlags().path;
  j["text"] = text;
  j["ctx"] = o.ctx;
  j["windows"] = r.windows;
  j["prompt_tokens"] = o.prompt_tokens;
  j["policy"] = name;
  // The policy's float settings as the decimals they were given as.
  auto decimal = [](float x) { return std::stod(absl::StrFormat("%g", x)); };
  j["alpha"] = decimal(policy.infinigen.alpha);
  j["partial_ratio"] = decimal(policy.infinigen.partial_ratio);
  j["partial_key_bits"] = policy.infinigen.exact_partial_keys ? 32 : 4;
  j["speculate_from"] = policy.SpeculatesAfterAttention() ? "post_attention"
                                                          : "layer_input";
  j["dense_layers"] = policy.selection.dense_layers;
  j["budget"] = decimal(policy.selection.budget);
  j["kv_capacity"] = ReadMemoryNodeFlags().kv_capacity;
  j["eviction"] = ReadMemoryNodeFlags().eviction;
  j["tokens"] = r.predicted;
  j["nll"] = r.nll;
  j["ppl"] = r.perplexity();
  j["fetch_fraction_mean"] = r.fetch.fraction_mean();
  j["fetch_fraction_max"] = r.fetch.fraction_max;
  j["bytes_fetched_per_step"] =
      r.fetch.steps ? static_cast<double>(r.fetch.bytes_fetched) / r.fetch.steps
                    : 0.0;
  j["seconds"] = r.seconds;
  std::printf("%s\n", j.dump(-1, ' ', false,
                             nlohmann::json::error_handler_t::replace)
                          .c_str());
}

int RunPerplexity() {
  gpu_worker::PerplexityOptions o;
  o.ctx = ReadRunFlags().ctx;
  o.max_windows = absl::GetFlag(FLAGS_max_windows);
  o.prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  if (auto ok = gpu_worker::PerplexityWindows(0, o); !ok.ok()) {
    return Fail(kExitUsage, ok.status());
  }
  auto kv_options = KvClientOptionsFromFlags();
  if (!kv_options.ok()) return Fail(kExitUsage, kv_options.status());
  auto run = LoadTextRun();
  if (!run.ok()) return LoadFailure(run.status());
  const model::ModelConfig& c = run->model.weights.config;
  if (o.ctx > c.max_seq_len) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "--ctx %d exceeds the model's context of %d",
                                o.ctx, c.max_seq_len)));
  }
  const model::Tokenizer& tok = *run->model.tokenizer;
  o.bos = tok.adds_bos() ? tok.bos_id() : -1;
  if (*gpu_worker::PerplexityWindows(run->tokens.size(), o) == 0) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "%s holds too little text to score",
                                ReadRunFlags().text)));
  }
  const std::string policy = ReadEngineFlags().policy;
  gpu_worker::KvOptions chosen;
  if (absl::Status st = gpu_worker::ChoosePolicy(policy, chosen); !st.ok()) {
    return Fail(kExitUsage, st);
  }
  if (o.prompt_tokens == 0 && chosen.policy) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(
                    "--policy needs --prompt_tokens (the dense prefix before "
                    "decoding through the policy)"));
  }
  auto setup = SetUpPolicy(policy, run->model, *kv_options,
                           /*serving=*/false);
  if (!setup.ok()) return SetupFailure(setup.status());
  WarnIgnoredPolicyFlags({policy});
  setup->options.max_seq_len = o.ctx;
  auto engine = CreateEngine(run->model.weights, setup->options);
  if (!engine.ok()) return EngineFailure(engine.status());
  // Progress over the tokens scored, with each window's line beside it.
  const int windows = *gpu_worker::PerplexityWindows(run->tokens.size(), o);
  Progress progress("perplexity", TokensToScore(run->tokens.size(), o, windows),
                    "tokens");
  int64_t scored = 0;
  std::FILE* token_file = nullptr;
  if (const std::string path = absl::GetFlag(FLAGS_token_logprobs);
      !path.empty()) {
    token_file = std::fopen(path.c_str(), "w");
    if (token_file == nullptr) {
      return Fail(kExitUsage,
                  absl::InvalidArgumentError(absl::StrFormat(
                      "--token_logprobs: cannot write %s: %s", path,
                      std::strerror(errno))));
    }
  }
  o.on_token = [token_file, &progress, &scored](int window, int position,
                                                int token, double logprob) {
    progress.Update(++scored);
    if (token_file == nullptr) return;
    std::fprintf(token_file,
                 "{\"window\": %d, \"position\": %d, \"token\": %d, "
                 "\"logprob\": %.9g}\n",
                 window, position, token, logprob);
  };
  auto result = gpu_worker::ScorePerplexity(
      **engine, run->tokens, o,
      [&progress](const gpu_worker::PerplexityProgress& p) {
        progress.Note(WindowLine(p));
      });
  if (token_file != nullptr && std::fclose(token_file) != 0 && result.ok()) {
    return Fail(kExitFailure, absl::DataLossError(absl::StrFormat(
                                  "--token_logprobs: writing failed: %s",
                                  std::strerror(errno))));
  }
  if (!result.ok()) return Fail(kExitFailure, result.status());
  PrintResult(o, setup->options.kv, *result);
  return 0;
}

}  // namespace

const Command& PerplexityCommand() {
  static const Command* command = new Command{
      "perplexity",
      "Scores a text file in windows of --ctx tokens and reports the mean "
      "negative log-likelihood and the perplexity; with --prompt_tokens, "
      "decodes through a KV policy and reports the rows it fetched; with "
      "--json, then a JSON line with the run's settings and figures.",
      WithEngineFlags({"model", "tokenizer", "text", "ctx", "max_windows",
                       "json", "prompt_tokens", "token_logprobs",
                       "same_layer_input",
                       "calibration_tokens"}),
      RunPerplexity};
  return *command;
}

}  // namespace infinigen::commands
