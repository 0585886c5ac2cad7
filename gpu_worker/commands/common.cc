#include "gpu_worker/commands/common.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_join.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/server_tls.h"
#include "common/status.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/kv/policies/registry.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/kv/model_identity.h"
#include "kv_memory_service/store/kv_store.h"
#include "model/dummy.h"

ABSL_FLAG(std::string, model, "",
          "Model file: a llama2.c checkpoint (.bin), a GGUF file, or a Hugging "
          "Face safetensors directory / file with config.json beside it.");
ABSL_FLAG(std::string, load_format, "auto",
          "auto: read --model; dummy: no file, deterministic random weights "
          "at the shape --model_config names (for speed measurements: the "
          "text is noise, and there is no tokenizer, so only bench-decode's "
          "synthetic context runs).");
ABSL_FLAG(std::string, model_config, "",
          "With --load_format=dummy: the model whose shape to build, "
          "llama-2-7b, llama-3-8b, opt-13b (their Hugging Face config.json; "
          "the Llama ones take contexts up to 131072) or a config.json path.");
ABSL_FLAG(std::string, tokenizer, "",
          "Tokenizer file for models that carry none (llama2.c tok*.bin, or a "
          "GGUF file whose vocabulary to use).");
ABSL_FLAG(std::string, text, "", "perplexity, bench-decode, skew: the text file to read.");
ABSL_FLAG(int, ctx, 512,
          "perplexity: window length in tokens; bench-decode: context per "
          "sequence (BOS, where the model's text "
          "starts with one, then text tokens).");
ABSL_FLAG(bool, json, false,
          "generate, perplexity, bench-decode: also print JSON lines on "
          "stdout (the last line(s) of the output).");
ABSL_FLAG(int, max_seq_len, 0,
          "Longest sequence the KV cache holds; 0: the model's context "
          "length (or what the command needs).");
ABSL_FLAG(std::string, backend, "auto",
          "Where the model runs: cpu, cuda (fails if no CUDA device "
          "answers) or auto (CUDA when a device answers, else CPU).");
ABSL_FLAG(int, threads, 0, "CPU threads for the matrix work; 0: all cores.");
ABSL_FLAG(int, prefill_chunk, 0,
          "Prompt tokens each layer computes at once while prefilling; 0: "
          "256 on the CPU, 2048 on a GPU (larger matrix products and "
          "attention tiles for its tensor cores).");
ABSL_FLAG(std::string, policy, "ideal",
          "How K and V reach attention when decoding: ideal (the whole cache "
          "on the worker) or one of the policies that offload it to a memory "
          "node, listed below with the flags each reads.");
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
          "--tls_cert). tcp:// fetches go over the server's fetch socket, "
          "which speaks TLS too.");
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
ABSL_FLAG(bool, kv_direct_reads, false,
          "One-sided reads for a memory node on this host (--kv_service="
          "inproc: or shm:unix:PATH, whose node maps each sequence's rows "
          "into the worker read-only): the rows each step selects are read "
          "straight from the node's memory instead of the node gathering "
          "them for a copy; the node is told what was read. On a GPU the "
          "device reads them from pinned memory (each sequence's reserved "
          "rows are pinned when it opens, about the time it takes to touch "
          "them once, which pays off for long generations); on the CPU "
          "attention reads them in place. TCP and RDMA, reused prefixes, "
          "--kv_capacity < 1 and int4 rows on the CPU keep the node's "
          "gather.");
ABSL_FLAG(double, row_cache, 0.125,
          "The worker's row cache, for the policies that select rows, where "
          "the node gathers them (not with one-sided reads; on a GPU in its "
          "memory, for all but h2o): the rows a decode step fetched stay on "
          "the worker, up to this fraction of each sequence's cached rows "
          "(every layer and KV head together), and later steps fetch only "
          "the rows they do not hold, replacing each head's least recently "
          "selected (--row_cache_replacement); the output is the same, and "
          "the node is told of the rows held, so its statistics and "
          "evictions are too. 0 = fetch every selected row each step.");
ABSL_FLAG(std::string, row_cache_replacement, "recency",
          "Which held row a miss of the row cache replaces at its bound: "
          "recency (the head's least recently selected row) or frequency "
          "(its least often selected, the least recent of those); never a "
          "row the step selected.");
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
ABSL_FLAG(std::string, chat_template, "",
          "serve, generate --chat: chatml, llama2, llama3 or gemma; empty: "
          "the model's own (GGUF tokenizer.chat_template; gemma for a "
          "gemma3 GGUF).");

namespace infinigen::commands {

using gpu_worker::Engine;
using gpu_worker::EngineOptions;

ModelFlags ReadModelFlags() {
  ModelFlags f;
  f.path = absl::GetFlag(FLAGS_model);
  f.load_format = absl::GetFlag(FLAGS_load_format);
  f.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  f.chat_template = absl::GetFlag(FLAGS_chat_template);
  return f;
}

RunFlags ReadRunFlags() {
  RunFlags f;
  f.text = absl::GetFlag(FLAGS_text);
  f.ctx = absl::GetFlag(FLAGS_ctx);
  f.json = absl::GetFlag(FLAGS_json);
  return f;
}

EngineFlags ReadEngineFlags() {
  EngineFlags f;
  f.policy = absl::GetFlag(FLAGS_policy);
  f.backend = absl::GetFlag(FLAGS_backend);
  f.threads = absl::GetFlag(FLAGS_threads);
  return f;
}

MemoryNodeFlags ReadMemoryNodeFlags() {
  MemoryNodeFlags f;
  f.kv_service = absl::GetFlag(FLAGS_kv_service);
  f.kv_capacity = absl::GetFlag(FLAGS_kv_capacity);
  f.kv_direct_reads = absl::GetFlag(FLAGS_kv_direct_reads);
  f.row_cache = absl::GetFlag(FLAGS_row_cache);
  f.row_cache_replacement = absl::GetFlag(FLAGS_row_cache_replacement);
  f.eviction = absl::GetFlag(FLAGS_eviction);
  f.max_worker_kv_bytes = absl::GetFlag(FLAGS_max_worker_kv_bytes);
  f.prefix_block_tokens = absl::GetFlag(FLAGS_prefix_block_tokens);
  f.prefix_cache_bytes = absl::GetFlag(FLAGS_prefix_cache_bytes);
  f.on_kv_loss = absl::GetFlag(FLAGS_on_kv_loss);
  return f;
}

std::vector<const char*> WithEngineFlags(std::vector<const char*> own) {
  for (const char* f :
       {"policy", "alpha", "partial_ratio", "partial_key_bits",
        "speculate_from", "dense_layers", "partial_rank", "budget",
        "sink_tokens", "recent_tokens", "score_mass", "head_budgets",
        "budget_floor", "page_tokens", "target_fetch", "skew",
        "skew_cache_dir",
        "kv_service", "kv_auth_token_file", "kv_tls_ca", "kv_tls_cert",
        "kv_tls_key", "kv_tls_server_name", "kv_capacity", "kv_direct_reads",
        "row_cache", "row_cache_replacement", "eviction",
        "max_worker_kv_bytes", "backend", "threads", "prefill_chunk",
        "load_format", "model_config"}) {
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
int Fail(int code, const absl::Status& status) {
  std::fprintf(stderr, "infinigen: %s\n", std::string(status.message()).c_str());
  return code;
}

// An engine that cannot be created: a usage error for bad flags (an unknown
// --backend, options out of range), a failure otherwise (no CUDA device, an
// unreachable memory node).
int UsageOrFailure(const absl::Status& status) {
  return Fail(absl::IsInvalidArgument(status) ? kExitUsage : kExitFailure,
              status);
}

int EngineFailure(const absl::Status& status) { return UsageOrFailure(status); }

// The engine over `weights` on the --backend device, prefilling
// --prefill_chunk tokens at a time.
constexpr int kDevicePrefillChunk = 2048;
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(
    const model::Weights& weights, const EngineOptions& options,
    bool prefill_progress) {
  const int chunk = absl::GetFlag(FLAGS_prefill_chunk);
  if (chunk < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--prefill_chunk must be >= 0 (0: the backend's default), got %d",
        chunk));
  }
  IG_ASSIGN_OR_RETURN(auto backend,
                      gpu_worker::NewBackend(absl::GetFlag(FLAGS_backend)));
  EngineOptions o = options;
  if (prefill_progress && !o.on_prefill_layer) {
    auto prefill = std::make_shared<std::unique_ptr<Progress>>();
    o.on_prefill_layer = [prefill](int done, int layers, int tokens) {
      constexpr int kLongPrompt = 1024;
      if (tokens < kLongPrompt) return;
      if (*prefill == nullptr) {
        *prefill = std::make_unique<Progress>(
            absl::StrFormat("prefill of %d tokens", tokens), layers, "layers");
      }
      (*prefill)->Update(done);
      if (done == layers) prefill->reset();
    };
  }
  if (chunk > 0) {
    o.max_chunk = chunk;
  } else if (!backend->OperatesOnHostMemory()) {
    o.max_chunk = kDevicePrefillChunk;
  }
  return Engine::Create(weights, std::move(backend), o);
}

// Model loading errors caused by the user's paths are usage errors.
int LoadFailure(const absl::Status& status) {
  return Fail(status.code() == absl::StatusCode::kInternal ? kExitFailure
                                                            : kExitUsage,
              status);
}

// --load_format=dummy: weights at --model_config's shape, no file.
absl::StatusOr<model::LoadedModel> DummyFromFlags(bool need_tokenizer) {
  const std::string name = absl::GetFlag(FLAGS_model_config);
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--load_format=dummy needs --model_config (%s, or a config.json)",
        absl::StrJoin(model::DummyModelPresets(), ", ")));
  }
  if (need_tokenizer) {
    return absl::InvalidArgumentError(
        "--load_format=dummy has no tokenizer: it serves speed measurements "
        "(bench-decode without --text); load a real --model for text");
  }
  if (!absl::GetFlag(FLAGS_model).empty()) {
    return absl::InvalidArgumentError(
        "--model and --load_format=dummy exclude each other");
  }
  IG_ASSIGN_OR_RETURN(model::HfModelConfig config,
                      model::DummyModelConfig(name));
  const auto start = std::chrono::steady_clock::now();
  model::LoadedModel m;
  m.weights = model::DummyWeights(config);
  IG_LOG(INFO) << "dummy weights at the shape of " << name << " ("
               << m.weights.config.DebugString() << ") made in "
               << absl::StrFormat("%.2f", std::chrono::duration<double>(
                                              std::chrono::steady_clock::now() -
                                              start)
                                              .count())
               << " s";
  return m;
}

std::string ModelNameFromFlags() {
  return absl::GetFlag(FLAGS_load_format) == "dummy"
             ? "dummy:" + absl::GetFlag(FLAGS_model_config)
             : absl::GetFlag(FLAGS_model);
}

absl::StatusOr<model::LoadedModel> LoadFromFlags(bool need_tokenizer) {
  const std::string format = absl::GetFlag(FLAGS_load_format);
  if (format == "dummy") return DummyFromFlags(need_tokenizer);
  if (format != "auto") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--load_format must be auto or dummy, got '%s'", format));
  }
  if (!absl::GetFlag(FLAGS_model_config).empty()) {
    return absl::InvalidArgumentError(
        "--model_config applies to --load_format=dummy only");
  }
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
  IG_ASSIGN_OR_RETURN(options.tls_ca_pem,
                      ReadPemFlagFile("kv_tls_ca", absl::GetFlag(FLAGS_kv_tls_ca)));
  IG_ASSIGN_OR_RETURN(
      options.tls_cert_pem,
      ReadPemFlagFile("kv_tls_cert", absl::GetFlag(FLAGS_kv_tls_cert)));
  IG_ASSIGN_OR_RETURN(
      options.tls_key_pem,
      ReadPemFlagFile("kv_tls_key", absl::GetFlag(FLAGS_kv_tls_key)));
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

}  // namespace infinigen::commands
