// infinigen: the GPU worker's command line.
//
//   infinigen generate   --model=PATH [--tokenizer=PATH] --prompt=TEXT ...
//   infinigen perplexity --model=PATH [--tokenizer=PATH] --text=FILE --ctx=N
//
// Program output goes to stdout, logs and progress to stderr. Bad flags or
// inputs exit with status 2 and one line saying why; runtime failures exit 1.
#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file.h"
#include "common/log.h"
#include "common/status.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/sampler.h"
#include "model/loader.h"

ABSL_FLAG(std::string, model, "",
          "Model file: a llama2.c checkpoint (.bin), a GGUF file, or a Hugging "
          "Face safetensors directory / file with config.json beside it.");
ABSL_FLAG(std::string, tokenizer, "",
          "Tokenizer file for models that carry none (llama2.c tok*.bin, or a "
          "GGUF file whose vocabulary to use).");
ABSL_FLAG(std::string, prompt, "Once upon a time", "generate: the prompt.");
ABSL_FLAG(int, max_new_tokens, 256,
          "generate: most tokens to generate; stops earlier at the end token.");
ABSL_FLAG(double, temperature, 0.8,
          "generate: sampling temperature; 0 is greedy decoding.");
ABSL_FLAG(double, top_p, 0.9,
          "generate: nucleus sampling cut, in (0, 1]; 1 disables it.");
ABSL_FLAG(uint64_t, seed, 42, "generate: random seed for sampling.");
ABSL_FLAG(std::string, text, "", "perplexity: the text file to score.");
ABSL_FLAG(int, ctx, 512,
          "perplexity: window length in tokens (BOS, where the model's text "
          "starts with one, then text tokens).");
ABSL_FLAG(int, max_windows, 0, "perplexity: score at most this many windows "
                               "(0: the whole text).");
ABSL_FLAG(bool, json, false,
          "perplexity: print one JSON object as the last stdout line.");
ABSL_FLAG(int, max_seq_len, 0,
          "Longest sequence the KV cache holds; 0: the model's context "
          "length (or what the command needs).");
ABSL_FLAG(int, threads, 0, "CPU threads for the matrix work; 0: all cores.");

namespace infinigen {
namespace {

using gpu_worker::Engine;
using gpu_worker::EngineOptions;

constexpr int kExitUsage = 2;
constexpr int kExitFailure = 1;

struct Command {
  const char* summary;
  std::vector<const char*> flags;
};

const std::map<std::string, Command>& Commands() {
  static const auto* commands = new std::map<std::string, Command>{
      {"generate",
       {"Writes the prompt and the model's continuation to stdout.",
        {"model", "tokenizer", "prompt", "max_new_tokens", "temperature",
         "top_p", "seed", "max_seq_len", "threads"}}},
      {"perplexity",
       {"Scores a text file in windows of --ctx tokens and reports the mean "
        "negative log-likelihood and the perplexity.",
        {"model", "tokenizer", "text", "ctx", "max_windows", "json",
         "threads"}}},
  };
  return *commands;
}

std::string MainUsage() {
  std::string s =
      "infinigen: LLM inference with an offloaded KV cache (InfiniGen).\n\n"
      "Usage: infinigen COMMAND [--flag=value ...]\n\nCommands:\n";
  for (const auto& [name, cmd] : Commands()) {
    s += absl::StrFormat("  %-11s %s\n", name, cmd.summary);
  }
  s += "\n'infinigen COMMAND --help' lists a command's flags.\n";
  return s;
}

std::string CommandUsage(const std::string& name, const Command& cmd) {
  std::string s = absl::StrFormat("Usage: infinigen %s [flags]\n\n%s\n\nFlags:\n",
                                  name, cmd.summary);
  for (const char* f : cmd.flags) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(f);
    s += absl::StrFormat("  --%s (default: \"%s\")\n      %s\n", f,
                         flag->DefaultValue(), flag->Help());
  }
  return s;
}

int Fail(int code, const absl::Status& status) {
  std::fprintf(stderr, "infinigen: %s\n", std::string(status.message()).c_str());
  return code;
}

// Model loading errors caused by the user's paths are usage errors.
int LoadFailure(const absl::Status& status) {
  return Fail(status.code() == absl::StatusCode::kInternal ? kExitFailure
                                                            : kExitUsage,
              status);
}

absl::StatusOr<model::LoadedModel> LoadFromFlags(bool need_tokenizer) {
  const std::string path = absl::GetFlag(FLAGS_model);
  if (path.empty()) {
    return absl::InvalidArgumentError("--model is required");
  }
  const auto start = std::chrono::steady_clock::now();
  IG_ASSIGN_OR_RETURN(model::LoadedModel m,
                      model::LoadModel(path, absl::GetFlag(FLAGS_tokenizer)));
  if (need_tokenizer && m.tokenizer == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s carries no tokenizer: pass --tokenizer", path));
  }
  const double secs = std::chrono::duration<double>(
                          std::chrono::steady_clock::now() - start)
                          .count();
  IG_LOG(INFO) << "loaded " << path << " (" << m.weights.config.DebugString()
               << ") in " << absl::StrFormat("%.2f", secs) << " s";
  return m;
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
  auto m = LoadFromFlags(/*need_tokenizer=*/true);
  if (!m.ok()) return LoadFailure(m.status());
  const model::Tokenizer& tok = *m->tokenizer;
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  std::vector<int> tokens = tok.Encode(prompt, /*add_bos=*/true);
  if (tokens.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "the prompt is empty and the model has no BOS"));
  }
  EngineOptions options;
  options.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  if (options.max_seq_len == 0) {
    options.max_seq_len = std::min<int>(m->weights.config.max_seq_len,
                                        tokens.size() + max_new);
  }
  auto engine =
      Engine::Create(m->weights, gpu_worker::NewCpuBackend(), options);
  if (!engine.ok()) return Fail(kExitUsage, engine.status());
  if (static_cast<int>(tokens.size()) >= (*engine)->max_seq_len()) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(absl::StrFormat(
                    "the prompt has %d tokens; the context holds %d",
                    tokens.size(), (*engine)->max_seq_len())));
  }

  std::fputs(prompt.c_str(), stdout);
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  auto logits = (*engine)->Forward(tokens, /*all_logits=*/false);
  if (!logits.ok()) return Fail(kExitFailure, logits.status());
  const auto prefill_done = std::chrono::steady_clock::now();
  int prev = tokens.back();
  int generated = 0;
  const model::ModelConfig& c = m->weights.config;
  while (generated < max_new) {
    const int next = sampler->Sample(*logits);
    if (next == c.eos_id || tok.IsControl(next)) break;
    std::fputs(tok.DecodeToken(prev, next).c_str(), stdout);
    std::fflush(stdout);
    ++generated;
    prev = next;
    if ((*engine)->position() >= (*engine)->max_seq_len()) break;
    logits = (*engine)->Forward({next}, /*all_logits=*/false);
    if (!logits.ok()) return Fail(kExitFailure, logits.status());
  }
  std::fputs("\n", stdout);
  std::fflush(stdout);
  const auto end = std::chrono::steady_clock::now();
  const double prefill_s =
      std::chrono::duration<double>(prefill_done - start).count();
  const double decode_s =
      std::chrono::duration<double>(end - prefill_done).count();
  IG_LOG(INFO) << absl::StrFormat(
      "prompt %d tokens in %.3f s; generated %d tokens in %.3f s (%.1f "
      "tokens/s)",
      tokens.size(), prefill_s, generated, decode_s,
      decode_s > 0 ? generated / decode_s : 0.0);
  return 0;
}

int RunPerplexity() {
  const int ctx = absl::GetFlag(FLAGS_ctx);
  const int max_windows = absl::GetFlag(FLAGS_max_windows);
  if (ctx < 2) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--ctx must be >= 2"));
  }
  if (max_windows < 0) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError("--max_windows must be >= 0"));
  }
  const std::string text_path = absl::GetFlag(FLAGS_text);
  if (text_path.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--text is required"));
  }
  auto text = ReadFileToString(text_path);
  if (!text.ok()) return Fail(kExitUsage, text.status());
  auto m = LoadFromFlags(/*need_tokenizer=*/true);
  if (!m.ok()) return LoadFailure(m.status());
  const model::ModelConfig& c = m->weights.config;
  if (ctx > c.max_seq_len) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "--ctx %d exceeds the model's context of %d",
                                ctx, c.max_seq_len)));
  }
  auto t0 = std::chrono::steady_clock::now();
  const std::vector<int> all = m->tokenizer->Encode(*text, /*add_bos=*/false);
  IG_LOG(INFO) << absl::StrFormat(
      "%s: %d tokens (encoded in %.2f s)", text_path, all.size(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count());
  const int bos = m->tokenizer->adds_bos() ? m->tokenizer->bos_id() : -1;
  const int text_per_window = bos >= 0 ? ctx - 1 : ctx;
  int windows = static_cast<int>(all.size()) / text_per_window;
  if (windows == 0 && all.size() >= 2) windows = 1;  // short text: one window
  if (max_windows > 0) windows = std::min(windows, max_windows);
  if (windows == 0) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "%s holds too little text to score", text_path)));
  }
  EngineOptions options;
  options.max_seq_len = ctx;
  auto engine =
      Engine::Create(m->weights, gpu_worker::NewCpuBackend(), options);
  if (!engine.ok()) return Fail(kExitUsage, engine.status());
  const int chunk = options.max_chunk;

  double nll_sum = 0.0;
  long predicted = 0;
  t0 = std::chrono::steady_clock::now();
  std::vector<int> window;
  for (int w = 0; w < windows; ++w) {
    window.clear();
    if (bos >= 0) window.push_back(bos);
    const size_t begin = static_cast<size_t>(w) * text_per_window;
    const size_t end = std::min(all.size(), begin + text_per_window);
    window.insert(window.end(), all.begin() + begin, all.begin() + end);
    (*engine)->Reset();
    // Position i's logits predict token i + 1.
    for (int start = 0; start + 1 < static_cast<int>(window.size());
         start += chunk) {
      const int len =
          std::min<int>(chunk, static_cast<int>(window.size()) - 1 - start);
      auto logits = (*engine)->Forward(
          absl::MakeConstSpan(window.data() + start, len), /*all_logits=*/true);
      if (!logits.ok()) return Fail(kExitFailure, logits.status());
      for (int i = 0; i < len; ++i) {
        nll_sum -= gpu_worker::LogProb(
            logits->subspan(static_cast<size_t>(i) * c.vocab_size,
                            c.vocab_size),
            window[start + i + 1]);
      }
      predicted += len;
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    std::fprintf(stderr,
                 "perplexity: window %d/%d  tokens %ld  ppl %.4f  "
                 "(%.0f tokens/s, %.0f s left)\n",
                 w + 1, windows, predicted, std::exp(nll_sum / predicted),
                 predicted / secs, secs / (w + 1) * (windows - w - 1));
  }
  const double nll = nll_sum / predicted;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  std::printf("%s: %d windows of %d tokens, %ld predicted tokens: nll %.6f, "
              "perplexity %.4f (%.1f s)\n",
              text_path.c_str(), windows, ctx, predicted, nll, std::exp(nll),
              secs);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"model\": \"%s\", \"text\": \"%s\", \"ctx\": %d, \"windows\": %d, "
        "\"tokens\": %ld, \"nll\": %.8f, \"ppl\": %.6f, \"seconds\": %.3f}\n",
        absl::GetFlag(FLAGS_model).c_str(), text_path.c_str(), ctx, windows,
        predicted, nll, std::exp(nll), secs);
  }
  return 0;
}

}  // namespace
}  // namespace infinigen

int main(int argc, char** argv) {
  using namespace infinigen;
  absl::SetProgramUsageMessage(MainUsage());
  if (argc < 2 || std::string(argv[1]) == "--help" ||
      std::string(argv[1]) == "-h" || std::string(argv[1]) == "help") {
    std::fputs(MainUsage().c_str(), argc < 2 ? stderr : stdout);
    return argc < 2 ? kExitUsage : 0;
  }
  const std::string command = argv[1];
  auto it = Commands().find(command);
  if (it == Commands().end()) {
    std::fprintf(stderr,
                 "infinigen: unknown command '%s' (try 'infinigen --help')\n",
                 command.c_str());
    return kExitUsage;
  }
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h" || a == "--helpfull") {
      std::fputs(CommandUsage(command, it->second).c_str(), stdout);
      return 0;
    }
  }
  // Parse everything after the command name; positional leftovers are errors.
  std::vector<char*> args = {argv[0]};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (rest.size() > 1) {
    std::fprintf(stderr, "infinigen %s: unexpected argument '%s'\n",
                 command.c_str(), rest[1]);
    return kExitUsage;
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  if (threads > 0) openblas_set_num_threads(threads);
  if (command == "generate") return RunGenerate();
  return RunPerplexity();
}
