// infinigen: the GPU worker's command line.
//
//   infinigen generate   --model=PATH [--tokenizer=PATH] --prompt=TEXT ...
//   infinigen perplexity --model=PATH [--tokenizer=PATH] --text=FILE --ctx=N
//
// Program output goes to stdout, logs and progress to stderr. Bad flags or
// inputs exit with status 2 and one line saying why; runtime failures exit 1.
#include <cblas.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grpc/support/log.h"

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/file.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/server_tls.h"
#include "common/status.h"
#include "gpu_worker/backend.h"
#include "gpu_worker/calibrate.h"
#include "gpu_worker/chat_template.h"
#include "gpu_worker/kv_policy.h"
#include "kv_memory_service/kv_client.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/model_identity.h"
#include "kv_memory_service/kv_store.h"
#include "gpu_worker/generation_scheduler.h"
#include "gpu_worker/generation_service.h"
#include "gpu_worker/http_api.h"
#include "gpu_worker/worker_metrics.h"
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
ABSL_FLAG(std::string, backend, "auto",
          "Where the model runs: cpu, cuda (fails if no CUDA device "
          "answers) or auto (CUDA when a device answers, else CPU).");
ABSL_FLAG(int, threads, 0, "CPU threads for the matrix work; 0: all cores.");
ABSL_FLAG(std::string, policy, "ideal",
          "How K and V reach attention when decoding: ideal (all local), full "
          "(fetch every row), infinigen, h2o, int4, oracle (a diagnostic: "
          "each layer's exact top --budget of its own scores, layers 0 and 1 "
          "whole), quest (pages of --page_tokens ranked by their key bounds, "
          "the top --budget of pages per head).");
ABSL_FLAG(double, alpha, 5.0,
          "infinigen: fetch tokens whose speculated score is within alpha of "
          "the head's maximum.");
ABSL_FLAG(double, partial_ratio, 0.3,
          "infinigen: fraction of each head's columns in the partial query "
          "weight and partial key cache.");
ABSL_FLAG(double, budget, 0.2,
          "infinigen: cap on tokens fetched per head as a fraction of the "
          "cached tokens; oracle: the fraction each head takes; quest: the "
          "fraction of pages each head takes; h2o: fraction kept (half heavy "
          "hitters, half recent).");
ABSL_FLAG(int, sink_tokens, 0,
          "infinigen, oracle: the first N positions (attention sinks) are "
          "fetched at every speculated layer besides the selection.");
ABSL_FLAG(int, recent_tokens, 0,
          "infinigen, oracle: the last N positions before the new token are "
          "fetched at every speculated layer besides the selection.");
ABSL_FLAG(int, page_tokens, 16, "quest: tokens per page.");
ABSL_FLAG(double, score_mass, 0.0,
          "infinigen, oracle: in (0, 1], each KV head fetches its top "
          "speculated tokens until they carry this share of its speculated "
          "attention (at most --budget of the tokens), so budgets adapt "
          "across layers and heads; 0: the alpha rule.");
ABSL_FLAG(double, target_fetch, 0.0,
          "infinigen, oracle, quest, h2o: in (0, 1], set --budget (and for "
          "the first three --alpha=1e9 and --score_mass=0) so that the mean "
          "fraction of cached KV rows fetched per decode step lands at this "
          "value, counting layers 0 and 1, which read every row; "
          "--sink_tokens and --recent_tokens come on top; 0: off.");
ABSL_FLAG(bool, same_layer_input, false,
          "infinigen, diagnostic: speculate each layer's selection from its "
          "own attention input instead of the previous layer's (no "
          "prefetch): measures the cost of the subset apart from the "
          "speculation error.");
ABSL_FLAG(std::string, partial_rank, "q",
          "infinigen: rank partial columns by the prompt's summed |q| (q, "
          "the reference) or by |q| times |k| (qk).");
ABSL_FLAG(std::string, skew, "",
          "infinigen: skew file from 'infinigen skew'; empty: calibrate on "
          "the first tokens of the input.");
ABSL_FLAG(std::string, kv_service, "inproc:",
          "The KV memory node for offloaded policies: inproc: (in this "
          "process), tcp://HOST:PORT, unix:PATH, shm:unix:PATH (same host, "
          "shared memory), rdma://HOST:PORT; a memory tier: a comma-"
          "separated list of those (A,B,...) or dns+tcp://NAME:PORT (every "
          "address NAME resolves to), each sequence's KV heads spread over "
          "the nodes. A remote node holds this "
          "process's sequences under a lease renewed by heartbeats; it frees "
          "them if the process dies.");
ABSL_FLAG(int64_t, max_worker_kv_bytes, 0,
          "Most bytes the worker may hold for K/V rows, fetch staging and "
          "policy state; a configuration (policy, --batch or --max_batch, "
          "context) that needs more is refused at start with one line. 0: "
          "no limit.");
ABSL_FLAG(std::string, kv_auth_token_file, "",
          "File holding the memory server's auth token (the file its "
          "--auth_token_file reads); sent with every request.");
ABSL_FLAG(std::string, kv_tls_ca, "",
          "PEM file: talk to a remote --kv_service over TLS, trusting the "
          "memory servers whose certificates this CA signed (their "
          "--tls_cert). Fetches then take the gRPC stream: a TLS server "
          "offers no plain fetch socket.");
ABSL_FLAG(std::string, kv_tls_cert, "",
          "PEM file: this worker's certificate for memory servers that "
          "require one (their --tls_client_ca); needs --kv_tls_key and "
          "--kv_tls_ca.");
ABSL_FLAG(std::string, kv_tls_key, "",
          "PEM file: the private key of --kv_tls_cert.");
ABSL_FLAG(std::string, kv_tls_server_name, "",
          "With --kv_tls_ca: the name the memory servers' certificates must "
          "carry, instead of the host of each address (needed when an "
          "address is an IP its certificate does not list). For "
          "dns+tcp://NAME:PORT it defaults to NAME.");
ABSL_FLAG(double, kv_capacity, 1.0,
          "Tokens the memory pool keeps per layer and KV head, as a fraction "
          "of the context; below 1 it evicts by --eviction.");
ABSL_FLAG(int, prefix_block_tokens, 16,
          "Prefix reuse: a prompt's leading tokens whose KV rows the memory "
          "node already holds (from any earlier request of any worker with "
          "the same model, policy and --skew) are fetched instead of "
          "computed, in blocks of this many tokens; 0 = never reuse. Not "
          "for h2o (it needs the prompt's attention) or ideal (no node).");
ABSL_FLAG(int64_t, prefix_cache_bytes, int64_t{1} << 30,
          "The embedded (inproc:) memory node's room for shared prefix "
          "blocks; a remote node has its own flag.");
ABSL_FLAG(std::string, on_kv_loss, "recompute",
          "When the memory node loses a sequence mid-generation (restart, "
          "eviction, replacement): recompute (prefill it again from the "
          "tokens the worker holds and continue; same greedy output) or "
          "fail (the request fails with the node's error).");
ABSL_FLAG(std::string, eviction, "lru",
          "The in-process pool's eviction policy: fifo, lru, counter.");
ABSL_FLAG(int, prompt_tokens, 0,
          "perplexity: dense prefix per window; later tokens are decoded one "
          "at a time through --policy and scored. 0: score every position "
          "densely (no policy).");
ABSL_FLAG(int, calibration_tokens, 1024,
          "skew (and infinigen without --skew): tokens of calibration text.");
ABSL_FLAG(std::string, out, "", "skew: the skew file to write.");
ABSL_FLAG(int, batch, 1, "bench-decode: sequences decoding together.");
ABSL_FLAG(int, decode_tokens, 64, "bench-decode: decode steps timed.");
ABSL_FLAG(bool, plan_only, false,
          "bench-decode: create each policy's engine for --ctx and --batch "
          "(refused above --max_worker_kv_bytes), report the worker KV bytes "
          "it holds, and decode nothing.");
ABSL_FLAG(std::string, listen, "",
          "serve: HOST:PORT to listen on (port 0 picks a free one), or "
          "unix:PATH.");
ABSL_FLAG(std::string, http_listen, "",
          "serve: HOST:PORT for the OpenAI-compatible HTTP API "
          "(/v1/completions, /v1/chat/completions, /v1/models, /health) "
          "beside --listen; empty: none.");
ABSL_FLAG(std::string, served_model_name, "",
          "serve: the model id of the HTTP API; empty: --model's file name "
          "without its extension.");
ABSL_FLAG(std::string, api_key_file, "",
          "serve: file holding the API key every request must carry: HTTP as "
          "'Authorization: Bearer KEY' (/health excepted), gRPC Worker calls "
          "as the metadata 'authorization: Bearer KEY' (grpc.health.v1 "
          "excepted); empty: none.");
ABSL_FLAG(std::string, tls_cert, "",
          "serve: PEM file: serve --listen (gRPC) and --http_listen (HTTPS) "
          "over TLS with this certificate chain; needs --tls_key. "
          "--metrics_listen stays plaintext.");
ABSL_FLAG(std::string, tls_key, "",
          "serve: PEM file: the private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "serve: PEM file: with --tls_cert, every gRPC and HTTP client must "
          "present a certificate this CA signed (mutual TLS).");
ABSL_FLAG(std::string, chat_template, "",
          "serve, generate --chat: chatml, llama2 or llama3; empty: the "
          "model's own (GGUF tokenizer.chat_template).");
ABSL_FLAG(bool, chat, false,
          "generate: --prompt is a user message, wrapped in the chat "
          "template; prints only the reply.");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve: HOST:PORT serving Prometheus metrics at /metrics (they are "
          "also at /metrics of --http_listen); empty: none.");
ABSL_FLAG(int, max_batch, 8,
          "serve: sequences generating at once (the engine's slots); more "
          "requests wait in the queue.");
ABSL_FLAG(int, max_prefills_per_step, 1,
          "serve: new requests prefilled between two decode steps (0: all "
          "that have a slot); small values keep running streams smooth.");
ABSL_FLAG(int, max_queue, 64,
          "serve: requests waiting for a slot; beyond it requests get "
          "RESOURCE_EXHAUSTED.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "serve: on SIGTERM or SIGINT, how long queued and active "
          "generations may take to finish before they are cut short.");

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

// `own` followed by the flags of every command that builds an engine: the
// KV policy, the memory node and the device.
std::vector<const char*> WithEngineFlags(std::vector<const char*> own) {
  for (const char* f :
       {"policy", "alpha", "partial_ratio", "partial_rank", "budget",
        "sink_tokens", "recent_tokens", "score_mass", "page_tokens",
         "target_fetch", "skew",
        "kv_service", "kv_auth_token_file", "kv_tls_ca", "kv_tls_cert",
        "kv_tls_key", "kv_tls_server_name", "kv_capacity", "eviction",
        "max_worker_kv_bytes", "backend", "threads"}) {
    own.push_back(f);
  }
  return own;
}

// `own` and the engine's flags, with prefix reuse and recovery: the
// commands that serve generations.
std::vector<const char*> WithServingFlags(std::vector<const char*> own) {
  own = WithEngineFlags(std::move(own));
  for (const char* f : {"prefix_block_tokens", "prefix_cache_bytes",
                        "on_kv_loss"}) {
    own.push_back(f);
  }
  return own;
}

const std::map<std::string, Command>& Commands() {
  static const auto* commands = new std::map<std::string, Command>{
      {"generate",
       {"Writes the prompt and the model's continuation to stdout; with "
        "--json, then a JSON line: prompt_tokens, cached_tokens (reused "
        "from the memory node), prefill_seconds, generated_tokens, "
        "decode_seconds, kv_recoveries, policy, fetch_fraction_mean (of "
        "cached KV rows per decode step), text (the continuation). With --chat, --prompt is a user "
        "message in the model's chat template and only the reply is "
        "written.",
        WithServingFlags({"model", "tokenizer", "prompt", "max_new_tokens",
                          "temperature", "top_p", "seed", "max_seq_len",
                          "calibration_tokens", "json", "chat",
                          "chat_template"})}},
      {"perplexity",
       {"Scores a text file in windows of --ctx tokens and reports the mean "
        "negative log-likelihood and the perplexity; with --prompt_tokens, "
        "decodes through a KV policy and reports the rows it fetched.",
        WithEngineFlags({"model", "tokenizer", "text", "ctx", "max_windows",
                         "json", "prompt_tokens", "same_layer_input",
                         "calibration_tokens"})}},
      {"bench-decode",
       {"Fills --ctx tokens of context per sequence (from --text, else "
        "synthetic), decodes --decode_tokens steps of --batch sequences "
        "under each policy of the comma-separated --policy, and reports "
        "per-token latency (p50, p99), tokens/s, KV bytes fetched per token, "
        "the time spent waiting on fetches, the KV memory held by the "
        "worker and by the memory node, and the process's peak RSS.",
        WithServingFlags({"model", "tokenizer", "text", "ctx", "batch",
                          "decode_tokens", "calibration_tokens", "json",
                          "plan_only"})}},
      {"serve",
       {"Serves the Worker gRPC generation API (proto/worker.proto) and "
        "grpc.health.v1 on --listen, and with --http_listen the "
        "OpenAI-compatible HTTP API over the same batches: token streams to many clients, "
        "--max_batch sequences decoded together. Health is NOT_SERVING "
        "while a remote --kv_service does not answer its heartbeats (about "
        "once a second; the service infinigen.worker.Liveness stays "
        "SERVING), SERVING again once it does. SIGTERM or SIGINT stops "
        "taking requests, lets streams finish for --drain_timeout, exits 0.",
        WithServingFlags({"model", "tokenizer", "listen", "http_listen",
                          "tls_cert", "tls_key", "tls_client_ca",
                          "served_model_name", "api_key_file",
                          "chat_template", "metrics_listen", "max_batch",
                          "max_queue", "max_prefills_per_step",
                          "drain_timeout", "max_seq_len"})}},
      {"skew",
       {"Computes InfiniGen's skew matrices from calibration text and writes "
        "them to --out.",
        {"model", "tokenizer", "text", "calibration_tokens", "out",
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

// An engine that cannot be created: a usage error for bad flags (an unknown
// --backend, options out of range), a failure otherwise (no CUDA device, an
// unreachable memory node).
int EngineFailure(const absl::Status& status) {
  return Fail(absl::IsInvalidArgument(status) ? kExitUsage : kExitFailure,
              status);
}

// The engine over `weights` on the --backend device.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(
    const model::Weights& weights, const EngineOptions& options) {
  IG_ASSIGN_OR_RETURN(auto backend,
                      gpu_worker::NewBackend(absl::GetFlag(FLAGS_backend)));
  return Engine::Create(weights, std::move(backend), options);
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

// The KV memory node, the skew and the engine options a policy needs.
struct PolicySetup {
  std::unique_ptr<kv_memory_service::KvClient> client;
  std::unique_ptr<speculator::SkewMatrices> skew;
  EngineOptions options;
};

// The memory node's client options from the flags (--kv_auth_token_file,
// --kv_tls_*), each file read once, before the model loads: InvalidArgument
// naming the flag for an unreadable file or half a TLS configuration.
absl::StatusOr<kv_memory_service::KvClientOptions> KvClientOptionsFromFlags() {
  kv_memory_service::KvClientOptions options;
  if (const std::string token_file = absl::GetFlag(FLAGS_kv_auth_token_file);
      !token_file.empty()) {
    auto token = ReadTokenFile(token_file);
    if (!token.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_auth_token_file: ", token.status().message()));
    }
    options.auth_token = *std::move(token);
  }
  const struct {
    const char* flag;
    std::string path;
    std::string* pem;
  } tls_files[] = {
      {"kv_tls_ca", absl::GetFlag(FLAGS_kv_tls_ca), &options.tls_ca_pem},
      {"kv_tls_cert", absl::GetFlag(FLAGS_kv_tls_cert), &options.tls_cert_pem},
      {"kv_tls_key", absl::GetFlag(FLAGS_kv_tls_key), &options.tls_key_pem}};
  for (const auto& file : tls_files) {
    if (file.path.empty()) continue;
    absl::StatusOr<std::string> text = ReadFileToString(file.path);
    if (!text.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", file.flag, ": ", text.status().message()));
    }
    if (text->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", file.flag, ": ", file.path, " is empty"));
    }
    *file.pem = *std::move(text);
  }
  options.tls_server_name = absl::GetFlag(FLAGS_kv_tls_server_name);
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "--kv_tls_cert and --kv_tls_key go together (the worker's "
        "certificate and its key)");
  }
  if (options.tls_ca_pem.empty() &&
      (!options.tls_cert_pem.empty() || !options.tls_server_name.empty())) {
    return absl::InvalidArgumentError(
        "--kv_tls_cert, --kv_tls_key and --kv_tls_server_name need "
        "--kv_tls_ca (the CA of the memory servers' certificates)");
  }
  if (!options.tls_ca_pem.empty()) {
    if (absl::Status ok = CheckPemCertificates(options.tls_ca_pem); !ok.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_tls_ca: ", ok.message()));
    }
  }
  if (!options.tls_cert_pem.empty()) {
    if (absl::Status ok =
            CheckPemKeyPair(options.tls_cert_pem, options.tls_key_pem);
        !ok.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_tls_cert, --kv_tls_key: ", ok.message()));
    }
  }
  const std::string kv_service = absl::GetFlag(FLAGS_kv_service);
  if (!options.tls_ca_pem.empty() && kv_service == "inproc:") {
    return absl::InvalidArgumentError(
        "--kv_tls_ca needs a remote --kv_service (tcp://, dns+tcp://, a "
        "list of them, unix:, shm: or rdma://), not inproc:");
  }
  return options;
}

// The exit status of a SetUpPolicy failure: a memory node that cannot be
// reached or refuses this worker (TLS, token) is a runtime failure (1);
// bad flags or files are usage errors (2).
int SetupFailure(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kInternal:
      return Fail(kExitFailure, status);
    default:
      return Fail(kExitUsage, status);
  }
}

// Failures are usage errors (bad flags or files) unless the memory node
// fails (SetupFailure). `kv_options`: KvClientOptionsFromFlags. `serving`:
// the commands that take the reuse and recovery flags (generate, serve,
// bench-decode); scoring runs neither.
absl::StatusOr<PolicySetup> SetUpPolicy(
    const model::Weights& weights, absl::Span<const int> calibration,
    const kv_memory_service::KvClientOptions& kv_options,
    bool serving = false) {
  PolicySetup s;
  const std::string on_loss = absl::GetFlag(FLAGS_on_kv_loss);
  if (on_loss != "recompute" && on_loss != "fail") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--on_kv_loss must be recompute or fail, got '%s'", on_loss));
  }
  s.options.recompute_on_kv_loss = serving && on_loss == "recompute";
  const int block = absl::GetFlag(FLAGS_prefix_block_tokens);
  if (block < 0 || block > kv_memory_service::KvStore::kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--prefix_block_tokens must be in [0, %d], got %d",
        kv_memory_service::KvStore::kMaxBlockTokens, block));
  }
  if (absl::GetFlag(FLAGS_prefix_cache_bytes) < 0) {
    return absl::InvalidArgumentError("--prefix_cache_bytes must be >= 0");
  }
  IG_ASSIGN_OR_RETURN(s.options.policy.kind,
                      gpu_worker::ParsePolicy(absl::GetFlag(FLAGS_policy)));
  s.options.policy.alpha = static_cast<float>(absl::GetFlag(FLAGS_alpha));
  s.options.policy.partial_ratio =
      static_cast<float>(absl::GetFlag(FLAGS_partial_ratio));
  s.options.policy.budget = static_cast<float>(absl::GetFlag(FLAGS_budget));
  const std::string rank = absl::GetFlag(FLAGS_partial_rank);
  if (rank != "q" && rank != "qk") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--partial_rank must be q or qk, got '%s'", rank));
  }
  s.options.policy.rank_columns_by_keys = rank == "qk";
  s.options.policy.same_layer_input = absl::GetFlag(FLAGS_same_layer_input);
  s.options.policy.sink_tokens = absl::GetFlag(FLAGS_sink_tokens);
  s.options.policy.recent_tokens = absl::GetFlag(FLAGS_recent_tokens);
  s.options.policy.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  s.options.policy.score_mass =
      static_cast<float>(absl::GetFlag(FLAGS_score_mass));
  s.options.kv_capacity = absl::GetFlag(FLAGS_kv_capacity);
  s.options.max_worker_kv_bytes = absl::GetFlag(FLAGS_max_worker_kv_bytes);
  if (s.options.max_worker_kv_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_worker_kv_bytes must be >= 0, got %d",
                        s.options.max_worker_kv_bytes));
  }
  if (const double target = absl::GetFlag(FLAGS_target_fetch); target != 0) {
    if (absl::Status st = gpu_worker::SetTargetFetch(
            target, weights.config.n_layers, s.options.policy);
        !st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--target_fetch: ", st.message()));
    }
    IG_LOG(INFO) << "--target_fetch=" << target << ": --budget="
                 << s.options.policy.budget << " for "
                 << gpu_worker::PolicyName(s.options.policy.kind);
  }
  if (s.options.policy.kind == gpu_worker::PolicyKind::kIdeal) return s;
  const model::ModelConfig& c = weights.config;
  if (s.options.policy.kind == gpu_worker::PolicyKind::kInfiniGen) {
    const std::string path = absl::GetFlag(FLAGS_skew);
    if (!path.empty()) {
      IG_ASSIGN_OR_RETURN(auto skew, speculator::SkewMatrices::Load(path));
      IG_RETURN_IF_ERROR(
          skew.CheckShape(c.n_layers, c.n_kv_heads, c.head_dim));
      s.skew = std::make_unique<speculator::SkewMatrices>(std::move(skew));
    } else {
      const int n = std::min<int>(calibration.size(),
                                  absl::GetFlag(FLAGS_calibration_tokens));
      IG_LOG(INFO) << "no --skew: calibrating on the first " << n
                   << " tokens of the input";
      IG_ASSIGN_OR_RETURN(auto skew, gpu_worker::CalibrateSkew(
                                         weights, calibration.subspan(0, n)));
      s.skew = std::make_unique<speculator::SkewMatrices>(std::move(skew));
    }
    s.options.policy.skew = s.skew.get();
  }
  kv_memory_service::KvClientOptions client_options = kv_options;
  IG_ASSIGN_OR_RETURN(
      client_options.inproc_store_options.eviction,
      kv_memory_service::ParseEvictionPolicy(absl::GetFlag(FLAGS_eviction)));
  client_options.inproc_store_options.prefix_cache_bytes =
      absl::GetFlag(FLAGS_prefix_cache_bytes);
  if (serving && block > 0) {
    s.options.prefix_block_tokens = block;
    s.options.model_identity = gpu_worker::ModelIdentity(weights, s.skew.get());
  }
  IG_ASSIGN_OR_RETURN(s.client, kv_memory_service::ConnectKvClient(
                                    absl::GetFlag(FLAGS_kv_service),
                                    client_options));
  s.options.kv_client = s.client.get();
  IG_LOG(INFO) << "policy " << gpu_worker::PolicyName(s.options.policy.kind)
               << " over " << s.client->data_plane() << " ("
               << absl::GetFlag(FLAGS_kv_service) << ")";
  return s;
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
  const model::Tokenizer& tok = *m->tokenizer;
  std::string prompt = absl::GetFlag(FLAGS_prompt);
  const bool chat = absl::GetFlag(FLAGS_chat);
  if (chat) {
    auto t = gpu_worker::ChatTemplateForModel(absl::GetFlag(FLAGS_model),
                                              absl::GetFlag(FLAGS_chat_template));
    if (!t.ok()) return Fail(kExitUsage, t.status());
    auto text = gpu_worker::ApplyChatTemplate(*t, {{"user", prompt}});
    if (!text.ok()) return Fail(kExitUsage, text.status());
    prompt = *std::move(text);
  }
  std::vector<int> tokens = tok.Encode(prompt, /*add_bos=*/true);
  if (tokens.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "the prompt is empty and the model has no BOS"));
  }
  auto setup = SetUpPolicy(m->weights, tokens, *kv_options, /*serving=*/true);
  if (!setup.ok()) return SetupFailure(setup.status());
  EngineOptions& options = setup->options;
  options.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  if (options.max_seq_len == 0) {
    options.max_seq_len = std::min<int>(m->weights.config.max_seq_len,
                                        tokens.size() + max_new);
  }
  auto engine = CreateEngine(m->weights, options);
  if (!engine.ok()) return EngineFailure(engine.status());
  if (static_cast<int>(tokens.size()) >= (*engine)->max_seq_len()) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(absl::StrFormat(
                    "the prompt has %d tokens; the context holds %d",
                    tokens.size(), (*engine)->max_seq_len())));
  }

  if (!chat) std::fputs(prompt.c_str(), stdout);
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  auto logits = (*engine)->Forward(tokens, /*all_logits=*/false);
  if (!logits.ok()) return Fail(kExitFailure, logits.status());
  const auto prefill_done = std::chrono::steady_clock::now();
  int prev = tokens.back();
  int generated = 0;
  std::string text;  // what was generated, for --json
  const model::ModelConfig& c = m->weights.config;
  while (generated < max_new) {
    const int next = sampler->Sample(*logits);
    if (next == c.eos_id || tok.IsControl(next)) break;
    const std::string piece = tok.DecodeToken(prev, next);
    text += piece;
    std::fputs(piece.c_str(), stdout);
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
  const Engine& e = **engine;
  IG_LOG(INFO) << absl::StrFormat(
      "prompt %d tokens (%d reused from the memory node) in %.3f s; "
      "generated %d tokens in %.3f s (%.1f tokens/s)",
      tokens.size(), e.cached_tokens(), prefill_s, generated, decode_s,
      decode_s > 0 ? generated / decode_s : 0.0);
  if (absl::GetFlag(FLAGS_json)) {
    nlohmann::json j;
    j["prompt_tokens"] = tokens.size();
    j["cached_tokens"] = e.cached_tokens();
    j["prefill_seconds"] = prefill_s;
    j["generated_tokens"] = generated;
    j["decode_seconds"] = decode_s;
    j["kv_recoveries"] = e.kv_recoveries();
    j["policy"] = gpu_worker::PolicyName(e.policy());
    j["fetch_fraction_mean"] = e.fetch_stats().fraction_mean();
    // Invalid UTF-8 (a character cut by max_new_tokens) as U+FFFD.
    j["text"] = text;
    std::printf("%s\n",
                j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                    .c_str());
  }
  return 0;
}

// The scored text of a perplexity or skew run: the model, and the text's
// tokens (encoded as the model's own tokenizer does, without BOS).
struct TextRun {
  model::LoadedModel model;
  std::vector<int> tokens;
};

absl::StatusOr<TextRun> LoadTextRun() {
  const std::string text_path = absl::GetFlag(FLAGS_text);
  if (text_path.empty()) return absl::InvalidArgumentError("--text is required");
  IG_ASSIGN_OR_RETURN(std::string text, ReadFileToString(text_path));
  TextRun run;
  IG_ASSIGN_OR_RETURN(run.model, LoadFromFlags(/*need_tokenizer=*/true));
  const auto t0 = std::chrono::steady_clock::now();
  run.tokens = run.model.tokenizer->Encode(text, /*add_bos=*/false);
  IG_LOG(INFO) << absl::StrFormat(
      "%s: %d tokens (encoded in %.2f s)", text_path, run.tokens.size(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count());
  return run;
}

int RunPerplexity() {
  const int ctx = absl::GetFlag(FLAGS_ctx);
  const int max_windows = absl::GetFlag(FLAGS_max_windows);
  const int prompt_tokens = absl::GetFlag(FLAGS_prompt_tokens);
  if (ctx < 2) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--ctx must be >= 2"));
  }
  if (max_windows < 0) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError("--max_windows must be >= 0"));
  }
  if (prompt_tokens < 0 || prompt_tokens >= ctx) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "--prompt_tokens must be in [0, ctx)"));
  }
  auto kv_options = KvClientOptionsFromFlags();
  if (!kv_options.ok()) return Fail(kExitUsage, kv_options.status());
  auto run = LoadTextRun();
  if (!run.ok()) return LoadFailure(run.status());
  const model::ModelConfig& c = run->model.weights.config;
  const std::vector<int>& all = run->tokens;
  const std::string text_path = absl::GetFlag(FLAGS_text);
  if (ctx > c.max_seq_len) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "--ctx %d exceeds the model's context of %d",
                                ctx, c.max_seq_len)));
  }
  const model::Tokenizer& tok = *run->model.tokenizer;
  const int bos = tok.adds_bos() ? tok.bos_id() : -1;
  const int text_per_window = bos >= 0 ? ctx - 1 : ctx;
  int windows = static_cast<int>(all.size()) / text_per_window;
  if (windows == 0 && all.size() >= 2) windows = 1;  // short text: one window
  if (max_windows > 0) windows = std::min(windows, max_windows);
  if (windows == 0) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "%s holds too little text to score", text_path)));
  }
  const bool teacher_forced = prompt_tokens > 0;
  if (!teacher_forced && absl::GetFlag(FLAGS_policy) != "ideal") {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(
                    "--policy needs --prompt_tokens (the dense prefix before "
                    "decoding through the policy)"));
  }
  auto setup = SetUpPolicy(run->model.weights, all, *kv_options);
  if (!setup.ok()) return SetupFailure(setup.status());
  EngineOptions& options = setup->options;
  const gpu_worker::PolicyOptions used_policy = options.policy;
  options.max_seq_len = ctx;
  auto engine = CreateEngine(run->model.weights, options);
  if (!engine.ok()) return EngineFailure(engine.status());
  const int chunk = options.max_chunk;

  double nll_sum = 0.0;
  long predicted = 0;
  gpu_worker::FetchStats fetch;  // over all windows
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int> window;
  for (int w = 0; w < windows; ++w) {
    window.clear();
    if (bos >= 0) window.push_back(bos);
    const size_t begin = static_cast<size_t>(w) * text_per_window;
    const size_t end = std::min(all.size(), begin + text_per_window);
    window.insert(window.end(), all.begin() + begin, all.begin() + end);
    if (absl::Status s = (*engine)->Reset(); !s.ok()) {
      return Fail(kExitFailure, s);
    }
    const int len = static_cast<int>(window.size());
    if (teacher_forced) {
      // Dense prefix, then one token at a time: position i's logits
      // predict token i + 1, for i >= prompt_tokens - 1.
      const int prefix = std::min(prompt_tokens, len - 1);
      auto logits = (*engine)->Forward(
          absl::MakeConstSpan(window.data(), prefix), /*all_logits=*/false);
      for (int i = prefix - 1; i + 1 < len; ++i) {
        if (!logits.ok()) return Fail(kExitFailure, logits.status());
        nll_sum -= gpu_worker::LogProb(*logits, window[i + 1]);
        ++predicted;
        if (i + 2 < len) logits = (*engine)->Forward({window[i + 1]}, false);
      }
      const gpu_worker::FetchStats& f = (*engine)->fetch_stats();
      fetch.steps += f.steps;
      fetch.fraction_sum += f.fraction_sum;
      fetch.fraction_max = std::max(fetch.fraction_max, f.fraction_max);
      fetch.rows_fetched += f.rows_fetched;
      fetch.bytes_fetched += f.bytes_fetched;
    } else {
      for (int start = 0; start + 1 < len; start += chunk) {
        const int n = std::min(chunk, len - 1 - start);
        auto logits = (*engine)->Forward(
            absl::MakeConstSpan(window.data() + start, n), /*all_logits=*/true);
        if (!logits.ok()) return Fail(kExitFailure, logits.status());
        for (int i = 0; i < n; ++i) {
          nll_sum -= gpu_worker::LogProb(
              logits->subspan(static_cast<size_t>(i) * c.vocab_size,
                              c.vocab_size),
              window[start + i + 1]);
        }
        predicted += n;
      }
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    std::fprintf(stderr,
                 "perplexity: window %d/%d  tokens %ld  ppl %.4f  "
                 "fetched %.1f%%  (%.0f tokens/s, %.0f s left)\n",
                 w + 1, windows, predicted, std::exp(nll_sum / predicted),
                 100.0 * fetch.fraction_mean(), predicted / secs,
                 secs / (w + 1) * (windows - w - 1));
  }
  const double nll = nll_sum / predicted;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  const std::string policy = gpu_worker::PolicyName(options.policy.kind);
  std::printf("%s: %d windows of %d tokens, %ld predicted tokens, policy %s: "
              "nll %.6f, perplexity %.4f, fetched %.2f%% of cached rows per "
              "step (max %.2f%%) (%.1f s)\n",
              text_path.c_str(), windows, ctx, predicted, policy.c_str(), nll,
              std::exp(nll), 100.0 * fetch.fraction_mean(),
              100.0 * fetch.fraction_max, secs);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"model\": \"%s\", \"text\": \"%s\", \"ctx\": %d, \"windows\": %d, "
        "\"prompt_tokens\": %d, \"policy\": \"%s\", \"alpha\": %g, "
        "\"partial_ratio\": %g, \"budget\": %g, \"kv_capacity\": %g, "
        "\"eviction\": \"%s\", \"tokens\": %ld, \"nll\": %.8f, \"ppl\": %.6f, "
        "\"fetch_fraction_mean\": %.6f, \"fetch_fraction_max\": %.6f, "
        "\"bytes_fetched_per_step\": %.1f, \"seconds\": %.3f}\n",
        absl::GetFlag(FLAGS_model).c_str(), text_path.c_str(), ctx, windows,
        prompt_tokens, policy.c_str(), used_policy.alpha,
        used_policy.partial_ratio, used_policy.budget,
        absl::GetFlag(FLAGS_kv_capacity),
        absl::GetFlag(FLAGS_eviction).c_str(), predicted, nll, std::exp(nll),
        fetch.fraction_mean(), fetch.fraction_max,
        fetch.steps ? static_cast<double>(fetch.bytes_fetched) / fetch.steps
                    : 0.0,
        secs);
  }
  return 0;
}

struct DecodeBenchResult {
  std::string policy;
  std::string backend;
  std::vector<double> step_seconds;
  double seconds = 0;
  double prefill_seconds = 0;
  long cached_tokens = 0;  // prefill tokens reused from the memory node
  gpu_worker::FetchStats fetch;
  int64_t worker_kv_bytes = 0;    // K/V, staging and policy state
  int64_t memory_node_bytes = 0;  // reserved on the node for the run
  int64_t peak_rss_bytes = 0;     // this process's, so far
};

// This process's peak resident set so far (Linux: ru_maxrss in KiB).
int64_t PeakRssBytes() {
  struct rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1,
                            static_cast<size_t>(p / 100.0 * v.size()));
  return v[i];
}

int RunBenchDecode() {
  const int ctx = absl::GetFlag(FLAGS_ctx);
  const int batch = absl::GetFlag(FLAGS_batch);
  const int steps = absl::GetFlag(FLAGS_decode_tokens);
  if (ctx < 1 || batch < 1 || steps < 2) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError(
                    "--ctx and --batch must be >= 1, --decode_tokens >= 2"));
  }
  std::vector<std::string> policies =
      absl::StrSplit(absl::GetFlag(FLAGS_policy), ',');
  for (const std::string& p : policies) {
    if (auto k = gpu_worker::ParsePolicy(p); !k.ok()) {
      return Fail(kExitUsage, k.status());
    }
  }
  auto kv_options = KvClientOptionsFromFlags();
  if (!kv_options.ok()) return Fail(kExitUsage, kv_options.status());
  auto m = LoadFromFlags(/*need_tokenizer=*/!absl::GetFlag(FLAGS_text).empty());
  if (!m.ok()) return LoadFailure(m.status());
  const model::ModelConfig& c = m->weights.config;
  if (ctx + steps > c.max_seq_len) {
    return Fail(kExitUsage, absl::InvalidArgumentError(absl::StrFormat(
                                "--ctx + --decode_tokens = %d exceeds the "
                                "model's context of %d",
                                ctx + steps, c.max_seq_len)));
  }
  // Context per sequence: consecutive stretches of real text, or a
  // deterministic synthetic stream when no --text is given.
  std::vector<int> source;
  const std::string text_path = absl::GetFlag(FLAGS_text);
  if (!text_path.empty()) {
    auto text = ReadFileToString(text_path);
    if (!text.ok()) return Fail(kExitUsage, text.status());
    source = m->tokenizer->Encode(*text, false);
  }
  const size_t need = static_cast<size_t>(batch) * (ctx + steps);
  if (source.size() < need) {
    if (!text_path.empty()) {
      IG_LOG(WARNING) << text_path << " holds " << source.size()
                      << " tokens; repeating it to fill " << need;
    }
    uint64_t x = 88172645463325252ull;
    while (source.size() < need) {
      if (!text_path.empty()) {
        source.push_back(source[source.size() % (source.size() ? source.size() : 1)]);
      } else {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        source.push_back(static_cast<int>(x % c.vocab_size));
      }
    }
  }
  std::vector<DecodeBenchResult> results;
  for (const std::string& policy : policies) {
    absl::SetFlag(&FLAGS_policy, policy);
    auto setup = SetUpPolicy(m->weights, source, *kv_options, /*serving=*/true);
    if (!setup.ok()) return SetupFailure(setup.status());
    EngineOptions& options = setup->options;
    options.max_seq_len = ctx + steps;
    options.batch = batch;
    auto engine = CreateEngine(m->weights, options);
    if (!engine.ok()) return EngineFailure(engine.status());
    DecodeBenchResult r;
    r.policy = policy;
    r.backend = (*engine)->backend().name();
    if (absl::GetFlag(FLAGS_plan_only)) {
      std::printf("bench-decode --plan_only: %s at ctx %d x batch %d holds "
                  "%lld bytes of worker KV\n",
                  policy.c_str(), ctx, batch,
                  static_cast<long long>((*engine)->worker_kv_bytes()));
      continue;
    }
    auto t0 = std::chrono::steady_clock::now();
    std::vector<int> slots(batch), next(batch);
    for (int b = 0; b < batch; ++b) {
      slots[b] = b;
      const int* seq = source.data() + static_cast<size_t>(b) * (ctx + steps);
      auto l = (*engine)->Forward(b, absl::MakeConstSpan(seq, ctx), false);
      if (!l.ok()) return Fail(kExitFailure, l.status());
      r.cached_tokens += (*engine)->cached_tokens(b);
      std::fprintf(stderr, "bench-decode %s: prefilled sequence %d/%d\n",
                   policy.c_str(), b + 1, batch);
    }
    r.prefill_seconds = std::chrono::duration<double>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
    t0 = std::chrono::steady_clock::now();
    for (int step = 0; step < steps; ++step) {
      for (int b = 0; b < batch; ++b) {
        next[b] = source[static_cast<size_t>(b) * (ctx + steps) + ctx + step];
      }
      const auto s0 = std::chrono::steady_clock::now();
      auto l = (*engine)->DecodeBatch(slots, next);
      if (!l.ok()) return Fail(kExitFailure, l.status());
      r.step_seconds.push_back(std::chrono::duration<double>(
                                   std::chrono::steady_clock::now() - s0)
                                   .count());
    }
    r.seconds = std::chrono::duration<double>(
                    std::chrono::steady_clock::now() - t0)
                    .count();
    for (int b = 0; b < batch; ++b) r.fetch.Add((*engine)->fetch_stats(b));
    r.worker_kv_bytes = (*engine)->worker_kv_bytes();
    r.memory_node_bytes = (*engine)->node_kv_bytes();
    r.peak_rss_bytes = PeakRssBytes();
    results.push_back(std::move(r));
  }
  if (absl::GetFlag(FLAGS_plan_only)) return 0;
  const std::string plane = absl::GetFlag(FLAGS_kv_service);
  std::printf(
      "bench-decode: %s, ctx %d, batch %d, %d steps, KV node %s, backend %s\n",
      absl::GetFlag(FLAGS_model).c_str(), ctx, batch, steps, plane.c_str(),
      results.empty() ? "" : results[0].backend.c_str());
  std::printf("| policy | tokens/s | p50 ms/step | p99 ms/step | KV bytes "
              "fetched/token | rows fetched | fetch wait | prefill s | "
              "worker KV MiB | node KV MiB | peak RSS MiB |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|\n");
  constexpr double kMiB = 1024.0 * 1024.0;
  for (const auto& r : results) {
    const long tokens = static_cast<long>(steps) * batch;
    std::printf("| %s | %.2f | %.2f | %.2f | %.0f | %.2f%% | %.1f%% | %.1f | "
                "%.1f | %.1f | %.0f |\n",
                r.policy.c_str(), tokens / r.seconds,
                1e3 * Percentile(r.step_seconds, 50),
                1e3 * Percentile(r.step_seconds, 99),
                static_cast<double>(r.fetch.bytes_fetched) / tokens,
                100.0 * r.fetch.fraction_mean(),
                100.0 * r.fetch.wait_seconds / r.seconds, r.prefill_seconds,
                r.worker_kv_bytes / kMiB, r.memory_node_bytes / kMiB,
                r.peak_rss_bytes / kMiB);
  }
  if (results.size() > 1) {
    std::printf("(peak RSS is the process's so far: with several policies in "
                "one run, compare it only from one policy per process)\n");
  }
  if (absl::GetFlag(FLAGS_json)) {
    for (const auto& r : results) {
      const long tokens = static_cast<long>(steps) * batch;
      std::printf(
          "{\"policy\": \"%s\", \"backend\": \"%s\", "
          "\"kv_service\": \"%s\", \"ctx\": %d, "
          "\"batch\": %d, \"decode_tokens\": %d, \"tokens_per_s\": %.4f, "
          "\"p50_ms\": %.4f, \"p99_ms\": %.4f, \"bytes_fetched_per_token\": "
          "%.1f, \"fetch_fraction_mean\": %.6f, \"fetch_wait_fraction\": "
          "%.6f, \"compute_fraction\": %.6f, \"prefill_seconds\": %.3f, "
          "\"worker_kv_bytes\": %lld, \"memory_node_bytes\": %lld, "
          "\"peak_rss_bytes\": %lld, \"cached_tokens\": %ld}\n",
          r.policy.c_str(), r.backend.c_str(), plane.c_str(), ctx, batch,
          steps,
          tokens / r.seconds, 1e3 * Percentile(r.step_seconds, 50),
          1e3 * Percentile(r.step_seconds, 99),
          static_cast<double>(r.fetch.bytes_fetched) / tokens,
          r.fetch.fraction_mean(), r.fetch.wait_seconds / r.seconds,
          1.0 - r.fetch.wait_seconds / r.seconds, r.prefill_seconds,
          static_cast<long long>(r.worker_kv_bytes),
          static_cast<long long>(r.memory_node_bytes),
          static_cast<long long>(r.peak_rss_bytes), r.cached_tokens);
    }
  }
  return 0;
}

int RunSkew() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError("--out is required"));
  }
  auto run = LoadTextRun();
  if (!run.ok()) return LoadFailure(run.status());
  const int n = std::min<int>({static_cast<int>(run->tokens.size()),
                               absl::GetFlag(FLAGS_calibration_tokens),
                               run->model.weights.config.max_seq_len});
  const auto t0 = std::chrono::steady_clock::now();
  auto skew = gpu_worker::CalibrateSkew(
      run->model.weights, absl::MakeConstSpan(run->tokens).subspan(0, n));
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

// serve: the SIGTERM/SIGINT handler writes the signal to this pipe and
// RunServe waits on it. A handler, not sigwait: OpenBLAS starts threads
// before main, so the signals cannot be blocked in every thread.
int stop_pipe[2] = {-1, -1};

extern "C" void OnStopSignal(int signal) {
  const char c = static_cast<char>(signal);
  [[maybe_unused]] ssize_t n = write(stop_pipe[1], &c, 1);
}

// "models/SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct.Q4_1".
std::string ModelIdFromPath(const std::string& path) {
  std::string name = path.substr(path.rfind('/') + 1);
  if (const size_t dot = name.rfind('.'); dot != std::string::npos && dot > 0) {
    name.resize(dot);
  }
  return name;
}

int RunServe() {
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const int max_batch = absl::GetFlag(FLAGS_max_batch);
  const absl::Duration drain = absl::GetFlag(FLAGS_drain_timeout);
  if (listen.empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "--listen is required (HOST:PORT or unix:PATH)"));
  }
  if (max_batch < 1) {
    return Fail(kExitUsage,
                absl::InvalidArgumentError("--max_batch must be at least 1"));
  }
  if (drain < absl::ZeroDuration()) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "--drain_timeout must not be negative"));
  }
  if (absl::GetFlag(FLAGS_policy) == "infinigen" &&
      absl::GetFlag(FLAGS_skew).empty()) {
    return Fail(kExitUsage, absl::InvalidArgumentError(
                                "serve --policy=infinigen needs --skew (from "
                                "'infinigen skew'): there is no input to "
                                "calibrate on"));
  }
  absl::StatusOr<ServerTlsPem> tls = ReadServerTlsFiles(
      absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
      absl::GetFlag(FLAGS_tls_client_ca));
  if (!tls.ok()) return Fail(kExitUsage, tls.status());
  auto kv_options = KvClientOptionsFromFlags();
  if (!kv_options.ok()) return Fail(kExitUsage, kv_options.status());
  auto m = LoadFromFlags(/*need_tokenizer=*/true);
  if (!m.ok()) return LoadFailure(m.status());
  auto setup = SetUpPolicy(m->weights, {}, *kv_options, /*serving=*/true);
  if (!setup.ok()) return SetupFailure(setup.status());
  EngineOptions& options = setup->options;
  options.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  options.batch = max_batch;
  auto engine = CreateEngine(m->weights, options);
  if (!engine.ok()) return EngineFailure(engine.status());
  gpu_worker::GenerationSchedulerOptions scheduler_options;
  scheduler_options.max_queue = absl::GetFlag(FLAGS_max_queue);
  scheduler_options.max_prefills_per_step =
      absl::GetFlag(FLAGS_max_prefills_per_step);
  auto metrics = std::make_shared<gpu_worker::WorkerMetrics>();
  scheduler_options.on_sequence_done =
      [metrics](const gpu_worker::SequenceRecord& r) {
        metrics->OnSequenceDone(r);
      };
  auto scheduler = gpu_worker::GenerationScheduler::Create(
      std::move(*engine), *m->tokenizer, scheduler_options);
  if (!scheduler.ok()) return Fail(kExitUsage, scheduler.status());
  metrics->set_scheduler(scheduler->get());

  if (pipe(stop_pipe) != 0) {
    return Fail(kExitFailure, absl::InternalError("pipe() failed"));
  }
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  // The HTTP API's settings, checked before anything starts.
  const std::string http_listen = absl::GetFlag(FLAGS_http_listen);
  gpu_worker::HttpApiOptions http_options;
  http_options.listen = http_listen;
  http_options.model_id = absl::GetFlag(FLAGS_served_model_name);
  if (http_options.model_id.empty()) {
    http_options.model_id = ModelIdFromPath(absl::GetFlag(FLAGS_model));
  }
  http_options.chat_template = gpu_worker::ChatTemplateForModel(
      absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_chat_template));
  if (!http_options.chat_template.ok() &&
      http_options.chat_template.status().code() ==
          absl::StatusCode::kInvalidArgument &&
      !absl::GetFlag(FLAGS_chat_template).empty()) {
    return Fail(kExitUsage, http_options.chat_template.status());
  }
  if (const std::string key_file = absl::GetFlag(FLAGS_api_key_file);
      !key_file.empty()) {
    auto key = ReadTokenFile(key_file);
    if (!key.ok()) {
      return Fail(kExitUsage,
                  absl::InvalidArgumentError(absl::StrCat(
                      "--api_key_file: ", key.status().message())));
    }
    http_options.api_key = *std::move(key);
  }
  http_options.tls = *tls;
  http_options.metrics = [metrics] {
    return MetricsText(metrics->collectables());
  };
  http_options.threads =
      max_batch + absl::GetFlag(FLAGS_max_queue) + 4;  // + idle keep-alives

  (*scheduler)->Start();
  gpu_worker::GenerationServerOptions server_options;
  server_options.listen = listen;
  server_options.api_key = http_options.api_key;
  server_options.tls = *tls;
  if (const kv_memory_service::KvClient* kv = setup->client.get();
      kv != nullptr) {
    // Readiness follows the memory node's heartbeats (KvClient::Health).
    server_options.dependency_health = [kv] { return kv->Health(); };
  }
  auto server = gpu_worker::GenerationServer::Start(std::move(*scheduler),
                                                    server_options);
  if (!server.ok()) {
    return Fail(server.status().code() == absl::StatusCode::kInvalidArgument
                    ? kExitUsage
                    : kExitFailure,
                server.status());
  }
  std::unique_ptr<gpu_worker::HttpApiServer> http;
  if (!http_listen.empty()) {
    gpu_worker::GenerationServer* grpc_server = server->get();
    http_options.serving = [grpc_server] { return grpc_server->serving(); };
    if (!http_options.chat_template.ok()) {
      IG_LOG(INFO) << "infinigen serve: no chat completions: "
                   << http_options.chat_template.status().message();
    }
    auto started = gpu_worker::HttpApiServer::Start(
        &(*server)->scheduler(), m->tokenizer.get(), std::move(http_options));
    if (!started.ok()) {
      (*server)->Shutdown(absl::ZeroDuration());
      (*server)->Wait();
      return Fail(started.status().code() == absl::StatusCode::kInvalidArgument
                      ? kExitUsage
                      : kExitFailure,
                  started.status());
    }
    http = *std::move(started);
    IG_LOG(INFO) << "infinigen serve: HTTP API on port " << http->port();
  }
  std::unique_ptr<MetricsServer> metrics_server;
  if (const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
      !metrics_listen.empty()) {
    auto started = MetricsServer::Start(metrics_listen, metrics->collectables());
    if (!started.ok()) {
      if (http != nullptr) http->Stop();
      metrics->set_scheduler(nullptr);
      (*server)->Shutdown(absl::ZeroDuration());
      (*server)->Wait();
      return Fail(started.status().code() == absl::StatusCode::kInvalidArgument
                      ? kExitUsage
                      : kExitFailure,
                  started.status());
    }
    metrics_server = *std::move(started);
    IG_LOG(INFO) << "infinigen serve: metrics on port "
                 << metrics_server->port();
  }
  char signal = 0;
  while (read(stop_pipe[0], &signal, 1) < 0 && errno == EINTR) {
  }
  IG_LOG(INFO) << "infinigen serve: "
               << (signal == SIGTERM ? "SIGTERM" : "SIGINT")
               << ", draining for up to " << absl::FormatDuration(drain);
  (*server)->Shutdown(drain);
  if (http != nullptr) http->Stop();  // its streams ended with the drain
  metrics_server.reset();
  metrics->set_scheduler(nullptr);
  (*server)->Wait();
  const gpu_worker::SchedulerStats stats = (*server)->scheduler().stats();
  IG_LOG(INFO) << "infinigen serve: stopped; " << stats.completed
               << " generations completed, " << stats.cancelled
               << " cancelled, " << stats.failed << " failed, "
               << stats.rejected << " requests refused";
  return 0;
}

extern "C" void GrpcLogAsDebug(gpr_log_func_args* args) {
  IG_LOG(DEBUG) << "grpc " << args->file << ":" << args->line << ": "
                << args->message;
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
  // The one-shot commands report every memory node failure in their own
  // last line (a failed TLS handshake with gRPC's reason included), so
  // gRPC's own log lines are debug output there; serve keeps them (a
  // client's failed handshake is news to its operator).
  if (command != "serve") gpr_set_log_function(GrpcLogAsDebug);
  if (command == "generate") return RunGenerate();
  if (command == "skew") return RunSkew();
  if (command == "bench-decode") return RunBenchDecode();
  if (command == "serve") return RunServe();
  return RunPerplexity();
}
