// infinigen generate: the prompt and the model's continuation on stdout.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/log.h"
#include "common/status.h"
#include "gpu_worker/serving/chat_template.h"
#include "gpu_worker/commands/common.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/serving/sampler.h"

ABSL_FLAG(std::string, prompt, "Once upon a time", "generate: the prompt.");
ABSL_FLAG(std::string, prompt_file, "",
          "generate: read the prompt from this file instead of --prompt (for "
          "prompts longer than a command line holds, about 128 KiB).");
ABSL_FLAG(int, max_new_tokens, 256,
          "generate: most tokens to generate; stops earlier at the end token.");
ABSL_FLAG(double, temperature, 0.8,
          "generate: sampling temperature; 0 is greedy decoding.");
ABSL_FLAG(double, top_p, 0.9,
          "generate: nucleus sampling cut, in (0, 1]; 1 disables it.");
ABSL_FLAG(uint64_t, seed, 42, "generate: random seed for sampling.");
ABSL_FLAG(std::vector<std::string>, watch_text, {},
          "generate: comma-separated strings of the prompt (a needle's "
          "value, say) whose tokens' rows are watched: --json then reports, "
          "per layer, the share of those rows each decode step's plan "
          "selected (watched_recall_per_layer), of those the step could "
          "select. Each string must occur in the prompt; every occurrence "
          "is watched.");
ABSL_FLAG(bool, chat, false,
          "generate: --prompt is a user message, wrapped in the chat "
          "template; prints only the reply.");

namespace infinigen::commands {
namespace {

using gpu_worker::Engine;
using gpu_worker::EngineOptions;

double SecondsBetween(std::chrono::steady_clock::time_point a,
                      std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// --prompt or the contents of --prompt_file, wrapped in the model's chat
// template with --chat.
absl::StatusOr<std::string> PromptFromFlags() {
  std::string prompt = absl::GetFlag(FLAGS_prompt);
  const std::string file = absl::GetFlag(FLAGS_prompt_file);
  if (!file.empty()) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag("prompt");
    if (flag->CurrentValue() != flag->DefaultValue()) {
      return absl::InvalidArgumentError(
          "give --prompt or --prompt_file, not both");
    }
    IG_ASSIGN_OR_RETURN(prompt, ReadFileToString(file));
  }
  if (!absl::GetFlag(FLAGS_chat)) return prompt;
  const ModelFlags flags = ReadModelFlags();
  IG_ASSIGN_OR_RETURN(auto t, gpu_worker::ChatTemplateForModel(
                                  flags.path, flags.chat_template));
  return gpu_worker::ApplyChatTemplate(t, {{"user", prompt}});
}

// The prompt's token positions covering each occurrence of each of
// `texts` (the tokens of the text up to its end, less those up to its
// start). InvalidArgument for a string that does not occur.
absl::StatusOr<std::vector<int32_t>> WatchedPositions(
    const model::Tokenizer& tok, const std::string& prompt,
    const std::vector<std::string>& texts) {
  std::vector<int32_t> positions;
  for (const std::string& text : texts) {
    if (text.empty()) {
      return absl::InvalidArgumentError("--watch_text has an empty string");
    }
    size_t at = prompt.find(text);
    if (at == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--watch_text '%s' does not occur in the prompt", text));
    }
    for (; at != std::string::npos; at = prompt.find(text, at + 1)) {
      const int begin = static_cast<int>(
          tok.Encode(std::string_view(prompt).substr(0, at), true).size());
      const int end = static_cast<int>(
          tok.Encode(std::string_view(prompt).substr(0, at + text.size()),
                     true)
              .size());
      for (int p = std::min(begin, end - 1); p < end; ++p) {
        positions.push_back(p);
      }
    }
  }
  std::sort(positions.begin(), positions.end());
  positions.erase(std::unique(positions.begin(), positions.end()),
                  positions.end());
  return positions;
}

// What a generation produced after its prompt.
struct Continuation {
  std::string text;
  int tokens = 0;
};

// Samples up to max_new tokens after the prompt whose last token is `prev`
// and whose logits are `logits`, writing each piece to stdout as it comes;
// stops at the end token, a control token or a full context.
absl::StatusOr<Continuation> Continue(Engine& engine,
                                      gpu_worker::Sampler& sampler,
                                      const model::Tokenizer& tok, int prev,
                                      absl::Span<const float> logits,
                                      int max_new) {
  Continuation out;
  const int eos = engine.config().eos_id;
  while (out.tokens < max_new) {
    const int next = sampler.Sample(logits);
    if (next == eos || tok.IsControl(next)) break;
    const std::string piece = tok.DecodeToken(prev, next);
    out.text += piece;
    std::fputs(piece.c_str(), stdout);
    std::fflush(stdout);
    ++out.tokens;
    prev = next;
    if (engine.position() >= engine.max_seq_len()) break;
    IG_ASSIGN_OR_RETURN(logits, engine.Forward({next}, /*all_logits=*/false));
  }
  return out;
}

void PrintJson(const Engine& e, int prompt_tokens, double prefill_s,
               const Continuation& c, double decode_s, int watched_tokens) {
  nlohmann::json j;
  j["prompt_tokens"] = prompt_tokens;
  j["cached_tokens"] = e.cached_tokens();
  j["prefill_seconds"] = prefill_s;
  j["generated_tokens"] = c.tokens;
  j["decode_seconds"] = decode_s;
  j["kv_recoveries"] = e.kv_recoveries();
  j["policy"] = e.policy_name();
  j["fetch_fraction_mean"] = e.fetch_stats().fraction_mean();
  const gpu_worker::FetchStats& watched = e.fetch_stats();
  if (!absl::GetFlag(FLAGS_watch_text).empty()) {
    nlohmann::json per_layer = nlohmann::json::array();
    long selected = 0, candidates = 0;
    for (size_t l = 0; l < watched.watched_layer_candidates.size(); ++l) {
      const long n = watched.watched_layer_candidates[l];
      const long k = watched.watched_layer_selected[l];
      per_layer.push_back(n > 0 ? nlohmann::json(static_cast<double>(k) / n)
                                : nlohmann::json(nullptr));
      selected += k;
      candidates += n;
    }
    j["watched_tokens"] = watched_tokens;
    j["watched_recall_per_layer"] = per_layer;
    j["watched_recall"] = candidates > 0
                              ? nlohmann::json(static_cast<double>(selected) /
                                               candidates)
                              : nlohmann::json(nullptr);
  }
  // Invalid UTF-8 (a character cut by max_new_tokens) as U+FFFD.
  j["text"] = c.text;
  std::printf("%s\n",
              j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                  .c_str());
}

// Sets up the policy and the engine for `tokens` from the flags; 0, or
// the exit status after reporting why not.
int GenerateEngine(const model::LoadedModel& m, const std::vector<int>& tokens,
                   int max_new,
                   const kv_memory_service::KvClientOptions& kv_options,
                   const std::vector<int32_t>& watched, PolicySetup& setup,
                   std::unique_ptr<Engine>& engine) {
  auto s = SetUpPolicy(ReadEngineFlags().policy, m, kv_options,
                       /*serving=*/true);
  if (!s.ok()) return SetupFailure(s.status());
  WarnIgnoredPolicyFlags({ReadEngineFlags().policy});
  setup = *std::move(s);
  EngineOptions& options = setup.options;
  options.kv.watch_positions = watched;
  options.max_seq_len = ReadModelFlags().max_seq_len;
  if (options.max_seq_len == 0) {
    options.max_seq_len =
        std::min<int>(m.weights.config.max_seq_len, tokens.size() + max_new);
  }
  auto created = CreateEngine(m.weights, options);
  if (!created.ok()) return EngineFailure(created.status());
  engine = *std::move(created);
  if (static_cast<int>(tokens.size()) >= engine->max_seq_len()) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "the prompt has %d tokens; the context holds %d",
                                tokens.size(), engine->max_seq_len())));
  }
  return 0;
}

int RunGenerate() {
  auto sampler = gpu_worker::Sampler::Create(
      {static_cast<float>(absl::GetFlag(FLAGS_temperature)),
       static_cast<float>(absl::GetFlag(FLAGS_top_p)),
       absl::GetFlag(FLAGS_seed)});
  if (!sampler.ok()) return Fail(kExitUsage, sampler.status());
  const int max_new = absl::GetFlag(FLAGS_max_new_tokens);
  if (max_new < 0) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError("--max_new_tokens must be >= 0"));
  }
  auto kv_options = KvClientOptionsFromFlags();
  if (!kv_options.ok()) return Fail(kExitUsage, kv_options.status());
  auto m = LoadFromFlags(/*need_tokenizer=*/true);
  if (!m.ok()) return LoadFailure(m.status());
  auto prompt = PromptFromFlags();
  if (!prompt.ok()) return Fail(kExitUsage, prompt.status());
  const model::Tokenizer& tok = *m->tokenizer;
  const std::vector<int> tokens = tok.Encode(*prompt, /*add_bos=*/true);
  if (tokens.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "the prompt is empty and the model has no BOS"));
  }
  auto watched = WatchedPositions(tok, *prompt, absl::GetFlag(FLAGS_watch_text));
  if (!watched.ok()) return Fail(kExitUsage, watched.status());
  PolicySetup setup;
  std::unique_ptr<Engine> engine;
  if (int code = GenerateEngine(*m, tokens, max_new, *kv_options, *watched,
                                setup, engine);
      code != 0) {
    return code;
  }

  if (!absl::GetFlag(FLAGS_chat)) std::fputs(prompt->c_str(), stdout);
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  auto logits = engine->Forward(tokens, /*all_logits=*/false);
  if (!logits.ok()) return Fail(kExitFailure, logits.status());
  const auto prefill_done = std::chrono::steady_clock::now();
  auto c = Continue(*engine, *sampler, tok, tokens.back(), *logits, max_new);
  if (!c.ok()) return Fail(kExitFailure, c.status());
  std::fputs("\n", stdout);
  std::fflush(stdout);
  const auto end = std::chrono::steady_clock::now();
  const double prefill_s = SecondsBetween(start, prefill_done);
  const double decode_s = SecondsBetween(prefill_done, end);
  IG_LOG(INFO) << absl::StrFormat(
      "prompt %d tokens (%d reused from the memory node) in %.3f s; "
      "generated %d tokens in %.3f s (%.1f tokens/s)",
      tokens.size(), engine->cached_tokens(), prefill_s, c->tokens,
      decode_s, decode_s > 0 ? c->tokens / decode_s : 0.0);
  if (ReadRunFlags().json) {
    PrintJson(*engine, tokens.size(), prefill_s, *c, decode_s,
              static_cast<int>(watched->size()));
  }
  return 0;
}

}  // namespace

const Command& GenerateCommand() {
  static const Command* command = new Command{
      "generate",
      "Writes the prompt and the model's continuation to stdout; with "
      "--json, then a JSON line: prompt_tokens, cached_tokens (reused from "
      "the memory node), prefill_seconds, generated_tokens, decode_seconds, "
      "kv_recoveries, policy, fetch_fraction_mean (of cached KV rows per "
      "decode step), with --watch_text watched_tokens, watched_recall and "
      "watched_recall_per_layer, text (the continuation). With --chat, "
      "--prompt is a user message in the model's chat template and only the "
      "reply is written.",
      WithServingFlags({"model", "tokenizer", "prompt", "prompt_file",
                        "max_new_tokens",
                        "temperature", "top_p", "seed", "max_seq_len",
                        "calibration_tokens", "json", "chat", "watch_text",
                        "chat_template"}),
      RunGenerate};
  return *command;
}

}  // namespace infinigen::commands
