#include "gpu_worker/commands/common.h"

#include <chrono>
#include <cstdio>
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
#include "common/server_tls.h"
#include "common/status.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/kv/policies/registry.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/kv/model_identity.h"
#include "kv_memory_service/kv_store.h"
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
ABSL_FLAG(std::string, policy, "ideal",
          "How K and V reach attention when decoding: ideal (the whole cache "
          "on the worker) or one of the policies that offload it to a memory "
          "node, listed below with the flags each reads.");
ABSL_FLAG(double, alpha, 5.0,
          "infinigen: fetch tokens whose speculated score is within alpha of "
          "the head's maximum.");
ABSL_FLAG(std::string, partial_ratio, "auto",
          "infinigen: fraction of each head's columns, in (0, 1], in the "
          "partial query weight and partial key cache; auto: 1 for "
          "infinigen with --target_fetch (and for the profile 'skew' "
          "writes), else 0.3 (the paper's).");
ABSL_FLAG(int, partial_key_bits, 4,
          "infinigen: bits per value in the partial key cache: 4 (rows "
          "quantized against their own range) or 32 (fp32, a diagnostic of "
          "what the 4 bits cost).");
ABSL_FLAG(std::string, speculate_from, "auto",
          "infinigen: where layer l + 1's fetch is speculated from: "
          "layer_input (the paper: layer l's attention input; the fetch "
          "overlaps layer l's attention and MLP) or post_attention (layer "
          "l + 1's norm of the residual stream after layer l's attention; "
          "the fetch overlaps layer l's MLP); auto: post_attention for "
          "infinigen with --target_fetch (and for the profile 'skew' "
          "writes), else layer_input.");
ABSL_FLAG(std::string, dense_layers, "auto",
          "infinigen, oracle, quest: how many first layers read every row; "
          "with 0, layer 0 ranks its rows by its own attention input and "
          "every layer shares the budget; auto: 0 where infinigen "
          "speculates after the attention (--speculate_from), else 2 (the "
          "paper's InfiniGen and Quest).");
ABSL_FLAG(double, budget, 0.2,
          "infinigen: cap on tokens fetched per head as a fraction of the "
          "cached tokens; oracle: the fraction each head takes; quest: the "
          "fraction of pages each head takes; h2o: fraction kept (half heavy "
          "hitters, half recent).");
ABSL_FLAG(int, sink_tokens, 0,
          "infinigen, oracle, quest (the pages holding them): the first N "
          "positions (attention sinks) are fetched at every speculated layer "
          "besides the selection.");
ABSL_FLAG(int, recent_tokens, 0,
          "infinigen, oracle, quest (the pages holding them): the last N "
          "positions before the new token are fetched at every speculated "
          "layer besides the selection.");
ABSL_FLAG(int, page_tokens, 16, "quest: tokens per page.");
ABSL_FLAG(double, score_mass, 0.0,
          "infinigen, oracle: in (0, 1], each KV head fetches its top "
          "speculated tokens until they carry this share of its speculated "
          "attention (at most --budget of the tokens), so budgets adapt "
          "across layers and heads; 0: the alpha rule.");
ABSL_FLAG(std::string, head_budgets, "auto",
          "infinigen, oracle: uniform (every KV head of a selecting layer "
          "takes --budget of the tokens) or adaptive (each takes its own "
          "share, allocated from the calibration's head profile, in the "
          "--skew file or measured with the calibration, so that the mean "
          "is --budget and the calibrated attention-output error is least; "
          "replaces the alpha rule and --score_mass); auto: adaptive for "
          "infinigen with --target_fetch, else uniform.");
ABSL_FLAG(double, budget_floor, 0.25,
          "adaptive head budgets: the least share of a head, as a fraction "
          "of --budget.");
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
ABSL_FLAG(int, calibration_tokens, 1024,
          "skew (and infinigen without --skew): tokens of calibration text.");
ABSL_FLAG(std::string, chat_template, "",
          "serve, generate --chat: chatml, llama2 or llama3; empty: the "
          "model's own (GGUF tokenizer.chat_template).");

namespace infinigen::commands {

using gpu_worker::Engine;
using gpu_worker::EngineOptions;

// --dense_layers: its number, or auto: 0 where infinigen speculates after
// the attention, else 2.
absl::StatusOr<int> DenseLayersFromFlags(bool speculates_after_attention) {
  const std::string flag = absl::GetFlag(FLAGS_dense_layers);
  if (flag == "auto") return speculates_after_attention ? 0 : 2;
  int n = 0;
  if (!absl::SimpleAtoi(flag, &n) || n < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--dense_layers must be auto or a number of layers >= 0, got '%s'",
        flag));
  }
  return n;
}

absl::StatusOr<gpu_worker::SpeculationOptions> SpeculationFromFlags(
    bool tuned) {
  gpu_worker::SpeculationOptions o;
  const std::string ratio = absl::GetFlag(FLAGS_partial_ratio);
  if (ratio == "auto") {
    o.partial_ratio = tuned ? 1.0 : 0.3;
  } else if (!absl::SimpleAtod(ratio, &o.partial_ratio) ||
             !(o.partial_ratio > 0.0 && o.partial_ratio <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--partial_ratio must be auto or in (0, 1], got '%s'", ratio));
  }
  const std::string from = absl::GetFlag(FLAGS_speculate_from);
  if (from != "auto" && from != "layer_input" && from != "post_attention") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--speculate_from must be auto, layer_input or post_attention, got "
        "'%s'", from));
  }
  o.post_attention = from == "post_attention" || (from == "auto" && tuned);
  const int bits = absl::GetFlag(FLAGS_partial_key_bits);
  if (bits != 4 && bits != 32) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--partial_key_bits must be 4 or 32, got %d", bits));
  }
  o.exact_keys = bits == 32;
  IG_ASSIGN_OR_RETURN(o.dense_layers, DenseLayersFromFlags(o.post_attention));
  return o;
}

std::vector<const char*> WithEngineFlags(std::vector<const char*> own) {
  for (const char* f :
       {"policy", "alpha", "partial_ratio", "partial_key_bits",
        "speculate_from", "dense_layers", "partial_rank", "budget",
        "sink_tokens", "recent_tokens", "score_mass", "head_budgets",
        "budget_floor", "page_tokens", "target_fetch", "skew",
        "kv_service", "kv_auth_token_file", "kv_tls_ca", "kv_tls_cert",
        "kv_tls_key", "kv_tls_server_name", "kv_capacity", "eviction",
        "max_worker_kv_bytes", "backend", "threads", "load_format",
        "model_config"}) {
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

namespace {

// The engine options of `policy` from the policy flags (--alpha, --budget,
// --target_fetch, ...), the pool and the recovery flags: InvalidArgument
// naming the flag that is out of range.
absl::StatusOr<EngineOptions> EngineOptionsFromFlags(const std::string& policy,
                                                     int n_layers,
                                                     bool serving) {
  EngineOptions options;
  const std::string on_loss = absl::GetFlag(FLAGS_on_kv_loss);
  if (on_loss != "recompute" && on_loss != "fail") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--on_kv_loss must be recompute or fail, got '%s'", on_loss));
  }
  options.recompute_on_kv_loss = serving && on_loss == "recompute";
  const int block = absl::GetFlag(FLAGS_prefix_block_tokens);
  if (block < 0 || block > kv_memory_service::KvStore::kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--prefix_block_tokens must be in [0, %d], got %d",
        kv_memory_service::KvStore::kMaxBlockTokens, block));
  }
  if (absl::GetFlag(FLAGS_prefix_cache_bytes) < 0) {
    return absl::InvalidArgumentError("--prefix_cache_bytes must be >= 0");
  }
  IG_RETURN_IF_ERROR(gpu_worker::ChoosePolicy(policy, options.kv));
  // The policy flags are judged under ideal too (the local cache, no
  // policy), so a bad value never passes unnoticed.
  const bool local = !options.kv.policy;
  gpu_worker::PolicyOptions p = options.kv.policy.value_or(
      gpu_worker::PolicyOptions());
  const bool speculates =
      !local && gpu_worker::PolicyEntryOf(p.kind).traits.speculates;
  p.alpha = static_cast<float>(absl::GetFlag(FLAGS_alpha));
  // The --target_fetch defaults of infinigen (auto flags).
  const bool tuned = speculates &&
                     absl::GetFlag(FLAGS_target_fetch) != 0;
  IG_ASSIGN_OR_RETURN(const gpu_worker::SpeculationOptions speculation,
                      SpeculationFromFlags(tuned));
  p.partial_ratio = static_cast<float>(speculation.partial_ratio);
  p.speculation_input =
      speculation.post_attention
          ? gpu_worker::PolicyOptions::SpeculationInput::kPostAttention
          : gpu_worker::PolicyOptions::SpeculationInput::kLayerInput;
  p.exact_partial_keys = speculation.exact_keys;
  IG_ASSIGN_OR_RETURN(
      p.dense_layers,
      DenseLayersFromFlags(speculates &&
                           speculation.post_attention));
  if (p.dense_layers > n_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--dense_layers is %d, the model has %d layers",
                        p.dense_layers, n_layers));
  }
  p.budget = static_cast<float>(absl::GetFlag(FLAGS_budget));
  const std::string rank = absl::GetFlag(FLAGS_partial_rank);
  if (rank != "q" && rank != "qk") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--partial_rank must be q or qk, got '%s'", rank));
  }
  p.rank_columns_by_keys = rank == "qk";
  p.same_layer_input = absl::GetFlag(FLAGS_same_layer_input);
  p.sink_tokens = absl::GetFlag(FLAGS_sink_tokens);
  p.recent_tokens = absl::GetFlag(FLAGS_recent_tokens);
  p.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  p.score_mass = static_cast<float>(absl::GetFlag(FLAGS_score_mass));
  p.budget_floor = static_cast<float>(absl::GetFlag(FLAGS_budget_floor));
  options.kv.kv_capacity = absl::GetFlag(FLAGS_kv_capacity);
  options.kv.max_worker_bytes = absl::GetFlag(FLAGS_max_worker_kv_bytes);
  if (options.kv.max_worker_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_worker_kv_bytes must be >= 0, got %d",
                        options.kv.max_worker_bytes));
  }
  if (const double target = absl::GetFlag(FLAGS_target_fetch); target != 0) {
    if (local) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--target_fetch: %s fetches nothing (the whole cache is local); "
          "a target fetch applies to %s",
          gpu_worker::kLocalCacheName, gpu_worker::TargetFetchPolicyNames()));
    }
    if (absl::Status st = gpu_worker::SetTargetFetch(target, n_layers, p);
        !st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--target_fetch: ", st.message()));
    }
    IG_LOG(INFO) << "--target_fetch=" << target << ": --budget=" << p.budget
                 << " for " << gpu_worker::PolicyName(p.kind);
  }
  const std::string budgets = absl::GetFlag(FLAGS_head_budgets);
  if (budgets != "auto" && budgets != "uniform" && budgets != "adaptive") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--head_budgets must be auto, uniform or adaptive, got '%s'",
        budgets));
  }
  p.adaptive_budgets =
      budgets == "adaptive" ||
      (budgets == "auto" && speculates &&
       absl::GetFlag(FLAGS_target_fetch) != 0);
  if (!local) options.kv.policy = p;
  return options;
}

// InfiniGen's skew: --skew's file (checked against the model), else
// calibrated on the first --calibration_tokens of `calibration`.
absl::StatusOr<std::unique_ptr<speculator::SkewMatrices>> SkewFromFlags(
    const model::Weights& weights, absl::Span<const int> calibration,
    const gpu_worker::PolicyOptions& options) {
  const model::ModelConfig& c = weights.config;
  const std::string path = absl::GetFlag(FLAGS_skew);
  if (!path.empty()) {
    IG_ASSIGN_OR_RETURN(auto skew, speculator::SkewMatrices::Load(path));
    IG_RETURN_IF_ERROR(skew.CheckShape(c.n_layers, c.n_kv_heads, c.head_dim));
    return std::make_unique<speculator::SkewMatrices>(std::move(skew));
  }
  const int n = std::min<int>(calibration.size(),
                              absl::GetFlag(FLAGS_calibration_tokens));
  IG_LOG(INFO) << "no --skew: calibrating on the first " << n
               << " tokens of the input";
  IG_ASSIGN_OR_RETURN(
      auto skew, gpu_worker::CalibrateSkew(
                     weights, calibration.subspan(0, n),
                     {options.partial_ratio, options.SpeculatesAfterAttention(),
                      options.exact_partial_keys, options.dense_layers}));
  return std::make_unique<speculator::SkewMatrices>(std::move(skew));
}

}  // namespace

void WarnIgnoredPolicyFlags(absl::Span<const std::string> policies) {
  // Set to something other than its default (this Abseil does not say
  // whether a flag was given).
  auto set = [](absl::string_view name) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    return flag != nullptr && flag->CurrentValue() != flag->DefaultValue();
  };
  bool all_local = true;
  for (const std::string& name : policies) {
    all_local = all_local && name == gpu_worker::kLocalCacheName;
  }
  for (const std::string& flag : gpu_worker::PolicyFlagNames()) {
    // A target fetch a policy cannot take is refused (SetTargetFetch).
    if (flag == "target_fetch" || !set(flag)) continue;
    bool read = false;
    for (const std::string& name : policies) {
      const gpu_worker::PolicyEntry* entry = gpu_worker::FindPolicy(name);
      if (entry == nullptr) continue;  // ideal reads none
      for (const char* f : entry->flags) read = read || flag == f;
    }
    if (read) continue;
    IG_LOG(WARNING) << "--" << flag << " has no effect on "
                    << absl::StrJoin(policies, ", ") << ": it sets options of "
                    << gpu_worker::PoliciesReadingFlag(flag);
  }
  if (!all_local) return;
  for (const char* flag : {"kv_service", "kv_capacity", "eviction"}) {
    if (set(flag)) {
      IG_LOG(WARNING) << "--" << flag << " has no effect on "
                      << gpu_worker::kLocalCacheName
                      << ": the whole cache stays on the worker (pick an "
                         "offloading --policy to use a memory node)";
    }
  }
}

absl::StatusOr<PolicySetup> SetUpPolicy(
    const std::string& policy, const model::Weights& weights,
    absl::Span<const int> calibration,
    const kv_memory_service::KvClientOptions& kv_options, bool serving) {
  PolicySetup s;
  IG_ASSIGN_OR_RETURN(s.options, EngineOptionsFromFlags(
                                     policy, weights.config.n_layers, serving));
  if (!s.options.kv.policy) return s;
  gpu_worker::PolicyOptions& p = *s.options.kv.policy;
  const bool speculates = gpu_worker::PolicyEntryOf(p.kind).traits.speculates;
  if (speculates || p.adaptive_budgets) {
    IG_ASSIGN_OR_RETURN(s.skew, SkewFromFlags(weights, calibration, p));
    if (speculates) p.skew = s.skew.get();
  }
  if (p.adaptive_budgets && s.skew->profile.empty()) {
    if (absl::GetFlag(FLAGS_head_budgets) == "adaptive") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--head_budgets=adaptive needs the calibration's head profile, and "
          "--skew=%s has none (written before it existed): rerun 'infinigen "
          "skew' to make a new file",
          absl::GetFlag(FLAGS_skew)));
    }
    IG_LOG(WARNING) << "--skew=" << absl::GetFlag(FLAGS_skew)
                    << " has no head profile (written before it existed): "
                       "uniform head budgets; rerun 'infinigen skew' for "
                       "adaptive ones";
    p.adaptive_budgets = false;
  }
  if (p.adaptive_budgets) p.profile = &s.skew->profile;
  kv_memory_service::KvClientOptions client_options = kv_options;
  IG_ASSIGN_OR_RETURN(
      client_options.inproc_store_options.eviction,
      kv_memory_service::ParseEvictionPolicy(absl::GetFlag(FLAGS_eviction)));
  client_options.inproc_store_options.prefix_cache_bytes =
      absl::GetFlag(FLAGS_prefix_cache_bytes);
  if (const int block = absl::GetFlag(FLAGS_prefix_block_tokens);
      serving && block > 0) {
    s.options.kv.prefix_block_tokens = block;
    s.options.kv.model_identity = gpu_worker::ModelIdentity(weights, s.skew.get());
  }
  const std::string kv_service = absl::GetFlag(FLAGS_kv_service);
  IG_ASSIGN_OR_RETURN(s.client, kv_memory_service::ConnectKvClient(
                                    kv_service, client_options));
  s.options.kv.kv_client = s.client.get();
  IG_LOG(INFO) << "policy " << s.options.kv.policy_name()
               << " over " << s.client->data_plane() << " (" << kv_service
               << ")";
  return s;
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
