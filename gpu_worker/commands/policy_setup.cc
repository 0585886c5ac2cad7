// The KV policy's side of the commands: the flags that set a policy's
// options (each policy's registry entry names the ones it reads), the
// engine options and skew they give, and the memory node a policy needs
// (SetUpPolicy, declared in common.h).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>
#include <xxhash.h>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/progress.h"
#include "common/status.h"
#include "gpu_worker/commands/common.h"
#include "gpu_worker/eval/bench_decode.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/kv/kv_policy.h"
#include "gpu_worker/kv/model_identity.h"
#include "gpu_worker/kv/policies/registry.h"
#include "kv_memory_service/store/kv_store.h"
#include "models/calibration/calibration_text.h"

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
ABSL_FLAG(std::string, target_fetch, "auto",
          "infinigen, oracle, quest, h2o: in (0, 1], set --budget (and for "
          "the first three --alpha=1e9 and --score_mass=0) so that the mean "
          "fraction of cached KV rows fetched per decode step lands at this "
          "value, counting layers 0 and 1, which read every row; "
          "--sink_tokens and --recent_tokens come on top; 0: off; auto: 0.1 "
          "for infinigen (its best measured setting) unless --alpha, "
          "--budget or --score_mass is given, else off.");
ABSL_FLAG(bool, same_layer_input, false,
          "infinigen, diagnostic: speculate each layer's selection from its "
          "own attention input instead of the previous layer's (no "
          "prefetch): measures the cost of the subset apart from the "
          "speculation error.");
ABSL_FLAG(std::string, partial_rank, "q",
          "infinigen: rank partial columns by the prompt's summed |q| (q, "
          "the reference) or by |q| times |k| (qk).");
ABSL_FLAG(std::string, skew, "",
          "infinigen: skew file from 'infinigen skew'; empty: calibrated on "
          "the calibration text the binary carries (a chapter of "
          "Moby-Dick; synthetic tokens for a model without a tokenizer), "
          "once per model and speculation settings, and kept in "
          "--skew_cache_dir.");
ABSL_FLAG(int, calibration_tokens, 1024,
          "skew (and infinigen without --skew): tokens of calibration text.");
ABSL_FLAG(std::string, skew_cache_dir, "auto",
          "infinigen without --skew: where calibrated skews are kept, one "
          "file per model (a hash of its weights) and speculation settings; "
          "auto: $XDG_CACHE_HOME/infinigen, else $HOME/.cache/infinigen; "
          "none: calibrate at every start.");

namespace infinigen::commands {

using gpu_worker::EngineOptions;

// --dense_layers: its number, or auto: 0 where infinigen speculates after
// the attention or the offloaded layers are a model's global layers (not
// its first ones), else 2.
absl::StatusOr<int> DenseLayersFromFlags(bool speculates_after_attention,
                                         bool global_layers_only) {
  const std::string flag = absl::GetFlag(FLAGS_dense_layers);
  if (flag == "auto") {
    return speculates_after_attention || global_layers_only ? 0 : 2;
  }
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
  IG_ASSIGN_OR_RETURN(o.dense_layers,
                      DenseLayersFromFlags(o.post_attention, false));
  return o;
}

namespace {

// Whether flag `name` is set to something other than its default (this
// Abseil does not say whether a flag was given).
bool FlagChanged(absl::string_view name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && flag->CurrentValue() != flag->DefaultValue();
}

// The fetch fraction --target_fetch asks of `policy` (0: none): its value,
// or under auto 0.1 for infinigen unless the user chose its selection rule
// (--alpha, --budget, --score_mass). InvalidArgument for a value that is
// neither auto nor a number.
absl::StatusOr<double> TargetFetchFromFlags(const std::string& policy) {
  const std::string flag = absl::GetFlag(FLAGS_target_fetch);
  if (flag != "auto") {
    double target = 0;
    if (!absl::SimpleAtod(flag, &target)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--target_fetch must be auto or a fraction in (0, 1] (0: off), "
          "got '%s'", flag));
    }
    return target;
  }
  if (policy != "infinigen") return 0.0;
  for (const char* rule : {"alpha", "budget", "score_mass"}) {
    if (FlagChanged(rule)) return 0.0;
  }
  return kInfinigenTargetFetch;
}

// The engine options of `policy` from the policy flags (--alpha, --budget,
// --target_fetch, ...), the pool and the recovery flags: InvalidArgument
// naming the flag that is out of range.
absl::StatusOr<EngineOptions> EngineOptionsFromFlags(
    const std::string& policy, const model::ModelConfig& config,
    bool serving) {
  // The layers the policy serves (its dense layers and target fetch count
  // these): a sliding-window model's global layers.
  const int n_layers = gpu_worker::OffloadedLayerCount(config);
  const bool global_layers_only = config.sliding_window > 0;
  EngineOptions options;
  const MemoryNodeFlags node = ReadMemoryNodeFlags();
  const std::string on_loss = node.on_kv_loss;
  if (on_loss != "recompute" && on_loss != "fail") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--on_kv_loss must be recompute or fail, got '%s'", on_loss));
  }
  options.recompute_on_kv_loss = serving && on_loss == "recompute";
  const int block = node.prefix_block_tokens;
  if (block < 0 || block > kv_memory_service::KvStore::kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--prefix_block_tokens must be in [0, %d], got %d",
        kv_memory_service::KvStore::kMaxBlockTokens, block));
  }
  if (node.prefix_cache_bytes < 0) {
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
  p.infinigen.alpha = static_cast<float>(absl::GetFlag(FLAGS_alpha));
  IG_ASSIGN_OR_RETURN(const double target, TargetFetchFromFlags(policy));
  // The --target_fetch defaults of infinigen (auto flags).
  const bool tuned = speculates && target != 0;
  IG_ASSIGN_OR_RETURN(const gpu_worker::SpeculationOptions speculation,
                      SpeculationFromFlags(tuned));
  p.infinigen.partial_ratio = static_cast<float>(speculation.partial_ratio);
  p.infinigen.speculation_input =
      speculation.post_attention
          ? gpu_worker::InfiniGenOptions::SpeculationInput::kPostAttention
          : gpu_worker::InfiniGenOptions::SpeculationInput::kLayerInput;
  p.infinigen.exact_partial_keys = speculation.exact_keys;
  IG_ASSIGN_OR_RETURN(
      p.selection.dense_layers,
      DenseLayersFromFlags(speculates && speculation.post_attention,
                           global_layers_only));
  if (p.selection.dense_layers > n_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--dense_layers is %d, the model has %d layers",
                        p.selection.dense_layers, n_layers));
  }
  p.selection.budget = static_cast<float>(absl::GetFlag(FLAGS_budget));
  const std::string rank = absl::GetFlag(FLAGS_partial_rank);
  if (rank != "q" && rank != "qk") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--partial_rank must be q or qk, got '%s'", rank));
  }
  p.infinigen.rank_columns_by_keys = rank == "qk";
  p.infinigen.same_layer_input = absl::GetFlag(FLAGS_same_layer_input);
  p.selection.sink_tokens = absl::GetFlag(FLAGS_sink_tokens);
  p.selection.recent_tokens = absl::GetFlag(FLAGS_recent_tokens);
  p.quest.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  p.infinigen.score_mass = static_cast<float>(absl::GetFlag(FLAGS_score_mass));
  p.infinigen.budget_floor =
      static_cast<float>(absl::GetFlag(FLAGS_budget_floor));
  options.kv.kv_capacity = node.kv_capacity;
  options.kv.direct_reads = node.kv_direct_reads;
  options.kv.row_cache = node.row_cache;
  if (!(node.row_cache >= 0.0 && node.row_cache <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--row_cache must be in [0, 1], got %g", node.row_cache));
  }
  if (node.row_cache_replacement == "recency") {
    options.kv.row_cache_replacement = gpu_worker::RowCacheReplacement::kRecency;
  } else if (node.row_cache_replacement == "frequency") {
    options.kv.row_cache_replacement =
        gpu_worker::RowCacheReplacement::kFrequency;
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--row_cache_replacement must be recency or frequency, got '%s'",
        node.row_cache_replacement));
  }
  options.kv.max_worker_bytes = node.max_worker_kv_bytes;
  if (options.kv.max_worker_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_worker_kv_bytes must be >= 0, got %d",
                        options.kv.max_worker_bytes));
  }
  if (target != 0) {
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
    IG_LOG(INFO) << "--target_fetch=" << target
                 << ": --budget=" << p.selection.budget << " for "
                 << gpu_worker::PolicyName(p.kind);
  }
  const std::string budgets = absl::GetFlag(FLAGS_head_budgets);
  if (budgets != "auto" && budgets != "uniform" && budgets != "adaptive") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--head_budgets must be auto, uniform or adaptive, got '%s'",
        budgets));
  }
  p.infinigen.adaptive_budgets =
      budgets == "adaptive" || (budgets == "auto" && speculates && target != 0);
  if (!local) options.kv.policy = p;
  return options;
}

// The directory --skew_cache_dir names ("" for none).
std::string SkewCacheDir() {
  const std::string flag = absl::GetFlag(FLAGS_skew_cache_dir);
  if (flag == "none") return "";
  if (flag != "auto") return flag;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    return absl::StrCat(xdg, "/infinigen");
  }
  if (const char* home = std::getenv("HOME"); home && *home) {
    return absl::StrCat(home, "/.cache/infinigen");
  }
  return "";
}

// The first --calibration_tokens tokens of the calibration text the binary
// carries, in the model's tokenizer; synthetic ids (as bench-decode's) for
// a model without one.
std::vector<int> CalibrationTokens(const model::LoadedModel& m) {
  const int n = std::max(0, std::min(absl::GetFlag(FLAGS_calibration_tokens),
                                     m.weights.config.max_seq_len));
  if (m.tokenizer == nullptr) {
    return gpu_worker::DecodeBenchSource({}, n, m.weights.config.vocab_size);
  }
  std::vector<int> tokens =
      m.tokenizer->Encode(model::kCalibrationText, /*add_bos=*/true);
  if (static_cast<int>(tokens.size()) > n) tokens.resize(n);
  return tokens;
}

// InfiniGen's skew: --skew's file (checked against the model), else the
// calibration on the carried text, read from --skew_cache_dir when it was
// made before for this model and these settings, and kept there when not.
// `weights_identity`: WeightsIdentity(m.weights), computed here when the
// cache needs it and empty before (it reads every weight), for the caller
// to reuse.
absl::StatusOr<std::unique_ptr<speculator::SkewMatrices>> SkewFromFlags(
    const model::LoadedModel& m, const gpu_worker::PolicyOptions& options,
    std::string& weights_identity) {
  const model::Weights& weights = m.weights;
  const model::ModelConfig& c = weights.config;
  const std::string path = absl::GetFlag(FLAGS_skew);
  if (!path.empty()) {
    IG_ASSIGN_OR_RETURN(auto skew, speculator::SkewMatrices::Load(path));
    IG_RETURN_IF_ERROR(skew.CheckShape(c.n_layers, c.n_kv_heads, c.head_dim));
    return std::make_unique<speculator::SkewMatrices>(std::move(skew));
  }
  const std::vector<int> tokens = CalibrationTokens(m);
  const int n = static_cast<int>(tokens.size());
  if (n < c.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "no --skew, and %d calibration tokens are too few to calibrate "
        "InfiniGen's skew on (it needs at least head_dim = %d): raise "
        "--calibration_tokens, or make a skew file once with 'infinigen "
        "skew --model=... --text=FILE --out=model.skew' and pass "
        "--skew=model.skew",
        n, c.head_dim));
  }
  const gpu_worker::SpeculationOptions speculation = {
      options.infinigen.partial_ratio, options.SpeculatesAfterAttention(),
      options.infinigen.exact_partial_keys, options.selection.dense_layers};
  // One file per model, calibration and speculation settings.
  const std::string dir = SkewCacheDir();
  std::string cached;
  if (!dir.empty()) {
    if (weights_identity.empty()) {
      weights_identity = gpu_worker::WeightsIdentity(weights);
    }
    const std::string key = absl::StrFormat(
        "%s|tokens=%s|partial=%.6f|post=%d|exact=%d|dense=%d",
        weights_identity,
        absl::StrJoin(tokens, ","), speculation.partial_ratio,
        speculation.post_attention, speculation.exact_keys,
        speculation.dense_layers);
    const XXH128_hash_t h = XXH3_128bits(key.data(), key.size());
    cached = absl::StrFormat("%s/skew-%016x%016x.skew", dir, h.high64,
                             h.low64);
    absl::StatusOr<speculator::SkewMatrices> loaded =
        speculator::SkewMatrices::Load(cached);
    if (loaded.ok() &&
        loaded->CheckShape(c.n_layers, c.n_kv_heads, c.head_dim).ok()) {
      IG_LOG(INFO) << "no --skew: InfiniGen's calibration from " << cached;
      return std::make_unique<speculator::SkewMatrices>(*std::move(loaded));
    }
  }
  IG_LOG(INFO) << "no --skew: calibrating InfiniGen on " << n << " tokens of "
               << (m.tokenizer != nullptr ? "the carried calibration text"
                                          : "synthetic ids (no tokenizer)")
               << (cached.empty() ? "" : ", kept in " + cached);
  IG_ASSIGN_OR_RETURN(auto backend,
                      gpu_worker::NewBackend(ReadEngineFlags().backend));
  IG_ASSIGN_OR_RETURN(auto skew,
                      gpu_worker::CalibrateSkew(weights, tokens, speculation,
                                                std::move(backend),
                                                CalibrationProgress()));
  if (!cached.empty()) {
    // Written aside and renamed: processes starting together never read a
    // half-written file.
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    const std::string tmp =
        absl::StrFormat("%s.%d.tmp", cached, static_cast<int>(getpid()));
    absl::Status saved = skew.Save(tmp);
    if (saved.ok() && std::rename(tmp.c_str(), cached.c_str()) != 0) {
      saved = absl::InternalError(std::strerror(errno));
    }
    if (!saved.ok()) {
      std::remove(tmp.c_str());
      IG_LOG(WARNING) << "no --skew: could not keep the calibration in "
                      << dir << " (" << saved.message()
                      << "); it is made again at the next start";
    }
  }
  return std::make_unique<speculator::SkewMatrices>(std::move(skew));
}

}  // namespace

std::function<void(int done, int total)> CalibrationProgress() {
  // Made at the first call, when the total is known; shared by the copies
  // of the function.
  auto progress = std::make_shared<std::unique_ptr<Progress>>();
  const auto start = std::chrono::steady_clock::now();
  return [progress, start](int done, int total) {
    if (*progress == nullptr) {
      *progress = std::make_unique<Progress>("calibrating InfiniGen", total,
                                             "steps", stderr, -1, 1.0, start);
    }
    (*progress)->Update(done);
  };
}

void WarnIgnoredPolicyFlags(absl::Span<const std::string> policies) {
  const auto set = FlagChanged;
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
  for (const char* flag :
       {"kv_service", "kv_capacity", "kv_direct_reads", "row_cache",
        "row_cache_replacement", "eviction"}) {
    if (set(flag)) {
      IG_LOG(WARNING) << "--" << flag << " has no effect on "
                      << gpu_worker::kLocalCacheName
                      << ": the whole cache stays on the worker (pick an "
                         "offloading --policy to use a memory node)";
    }
  }
}

int CalibrationTokensFromFlags() {
  return absl::GetFlag(FLAGS_calibration_tokens);
}

absl::StatusOr<PolicySetup> SetUpPolicy(
    const std::string& policy, const model::LoadedModel& m,
    const kv_memory_service::KvClientOptions& kv_options, bool serving) {
  const model::Weights& weights = m.weights;
  // Hashed at most once (every weight read), for the skew cache and for
  // prefix reuse.
  std::string weights_identity;
  PolicySetup s;
  IG_ASSIGN_OR_RETURN(s.options,
                      EngineOptionsFromFlags(policy, weights.config, serving));
  if (!s.options.kv.policy) return s;
  gpu_worker::PolicyOptions& p = *s.options.kv.policy;
  const bool speculates = gpu_worker::PolicyEntryOf(p.kind).traits.speculates;
  if (speculates || p.infinigen.adaptive_budgets) {
    IG_ASSIGN_OR_RETURN(s.skew, SkewFromFlags(m, p, weights_identity));
    if (speculates) p.infinigen.skew = s.skew.get();
  }
  if (p.infinigen.adaptive_budgets && s.skew->profile.empty()) {
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
    p.infinigen.adaptive_budgets = false;
  }
  if (p.infinigen.adaptive_budgets) p.infinigen.profile = &s.skew->profile;
  const MemoryNodeFlags node = ReadMemoryNodeFlags();
  kv_memory_service::KvClientOptions client_options = kv_options;
  IG_ASSIGN_OR_RETURN(
      client_options.inproc_store_options.eviction,
      kv_memory_service::ParseEvictionPolicy(node.eviction));
  client_options.inproc_store_options.prefix_cache_bytes =
      node.prefix_cache_bytes;
  if (const int block = node.prefix_block_tokens; serving && block > 0) {
    s.options.kv.prefix_block_tokens = block;
    if (weights_identity.empty()) {
      weights_identity = gpu_worker::WeightsIdentity(weights);
    }
    s.options.kv.model_identity =
        gpu_worker::ModelIdentity(weights_identity, s.skew.get());
  }
  const std::string kv_service = node.kv_service;
  IG_ASSIGN_OR_RETURN(s.client, kv_memory_service::ConnectKvClient(
                                    kv_service, client_options));
  s.options.kv.kv_client = s.client.get();
  IG_LOG(INFO) << "policy " << s.options.kv.policy_name()
               << " over " << s.client->data_plane() << " (" << kv_service
               << ")";
  return s;
}

}  // namespace infinigen::commands
