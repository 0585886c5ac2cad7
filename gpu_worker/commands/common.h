// What the commands of `infinigen` share: the shared flags as parsed
// (defined in common.cc with the memory-node flags, and in policy_setup.cc
// the policies' flags; commands read them through the structs below), the
// exit codes and how a failure becomes one line on stderr, model loading,
// and the KV policy and memory node set up from the flags
// (policy_setup.cc). Each command lives in its own file (generate.cc,
// perplexity.cc, bench_decode.cc, skew.cc, serve.cc; kv-check and health
// in kv_check.cc) and returns its exit status.
#ifndef INFINIGEN_GPU_WORKER_COMMANDS_COMMON_H_
#define INFINIGEN_GPU_WORKER_COMMANDS_COMMON_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu_worker/eval/calibrate.h"
#include "gpu_worker/engine.h"
#include "kv_memory_service/client/kv_client.h"
#include "model/loader.h"
#include "speculator/speculator.h"

namespace infinigen::commands {

// Bad flags or inputs; runtime failures.
constexpr int kExitUsage = 2;
constexpr int kExitFailure = 1;

// A command: its one-paragraph summary, the flags its --help lists, and
// what runs it (after the flags are parsed) returning the exit status.
struct Command {
  const char* name;
  const char* summary;
  std::vector<const char*> flags;
  int (*run)();
};

// The model flags (common.cc), as parsed.
struct ModelFlags {
  std::string path;           // --model
  std::string load_format;    // --load_format
  int max_seq_len = 0;        // --max_seq_len; 0: the model's
  std::string chat_template;  // --chat_template; empty: the model's
};
ModelFlags ReadModelFlags();

// The flags of a run over a text and of its report (common.cc).
struct RunFlags {
  std::string text;   // --text
  int ctx = 0;        // --ctx
  bool json = false;  // --json
};
RunFlags ReadRunFlags();

// Where the engine runs (common.cc).
struct EngineFlags {
  std::string policy;   // --policy: one name, or a list for bench-decode
  std::string backend;  // --backend
  int threads = 0;      // --threads; 0: all cores
};
EngineFlags ReadEngineFlags();

// The memory node, prefix reuse and recovery (common.cc); the client's
// credentials come from KvClientOptionsFromFlags.
struct MemoryNodeFlags {
  std::string kv_service;            // --kv_service
  double kv_capacity = 1.0;          // --kv_capacity
  bool kv_direct_reads = false;      // --kv_direct_reads
  double row_cache = 0.0;            // --row_cache
  std::string row_cache_replacement;  // --row_cache_replacement
  std::string eviction;              // --eviction
  int64_t max_worker_kv_bytes = 0;   // --max_worker_kv_bytes
  int prefix_block_tokens = 0;       // --prefix_block_tokens
  int64_t prefix_cache_bytes = 0;    // --prefix_cache_bytes
  std::string on_kv_loss;            // --on_kv_loss
};
MemoryNodeFlags ReadMemoryNodeFlags();

// --calibration_tokens (policy_setup.cc): the tokens of the calibration
// text InfiniGen's skew is calibrated on.
int CalibrationTokensFromFlags();

// `own` followed by the flags of every command that builds an engine: the
// KV policy, the memory node and the device.
std::vector<const char*> WithEngineFlags(std::vector<const char*> own);
// `own` and the engine's flags, with prefix reuse and recovery: the
// commands that serve generations.
std::vector<const char*> WithServingFlags(std::vector<const char*> own);

// InfiniGen's speculation from --partial_ratio, --speculate_from,
// --partial_key_bits and --dense_layers, their auto resolved for `tuned`
// (infinigen under --target_fetch, and the profile 'skew' writes) or not:
// InvalidArgument naming the flag for a bad value.
absl::StatusOr<gpu_worker::SpeculationOptions> SpeculationFromFlags(
    bool tuned);

// Writes "infinigen: MESSAGE" to stderr and returns `code`.
int Fail(int code, const absl::Status& status);
// kExitUsage for InvalidArgument, else kExitFailure.
int UsageOrFailure(const absl::Status& status);
// An engine that cannot be created: a usage error for bad flags (an
// unknown --backend, options out of range), a failure otherwise (no CUDA
// device, an unreachable memory node).
int EngineFailure(const absl::Status& status);
// Model loading errors caused by the user's paths are usage errors.
int LoadFailure(const absl::Status& status);
// A SetUpPolicy failure: a memory node that cannot be reached or refuses
// this worker (TLS, token) is a runtime failure (1); bad flags or files are
// usage errors (2).
int SetupFailure(const absl::Status& status);

// The engine over `weights` on the --backend device. prefill_progress: a
// prompt of 1024 tokens or more shows its prefill's progress, layer by
// layer (Progress on stderr; serve logs instead).
absl::StatusOr<std::unique_ptr<gpu_worker::Engine>> CreateEngine(
    const model::Weights& weights, const gpu_worker::EngineOptions& options,
    bool prefill_progress = true);

// --model (and --tokenizer); InvalidArgument when need_tokenizer and the
// model carries none.
absl::StatusOr<model::LoadedModel> LoadFromFlags(bool need_tokenizer);
// What the flags load, for reports: --model's path, or "dummy:NAME" under
// --load_format=dummy.
std::string ModelNameFromFlags();

// The scored text of a perplexity or skew run: the model, and --text's
// tokens (encoded as the model's own tokenizer does, without BOS).
struct TextRun {
  model::LoadedModel model;
  std::vector<int> tokens;
};
absl::StatusOr<TextRun> LoadTextRun();

// The memory node's client options from the flags (--kv_auth_token_file,
// --kv_tls_*), each file read once, before the model loads: InvalidArgument
// naming the flag for an unreadable file or half a TLS configuration.
absl::StatusOr<kv_memory_service::KvClientOptions> KvClientOptionsFromFlags();

// Warns (one line each; the run goes on) about every policy flag set to a
// value other than its default that none of `policies` (--policy names)
// reads, as their registry entries list them, and under ideal alone about
// the memory-node flags, which the local cache ignores.
void WarnIgnoredPolicyFlags(absl::Span<const std::string> policies);

// The KV memory node, the skew and the engine options a policy needs; the
// engine options point at `client` and `skew`, which must outlive it.
struct PolicySetup {
  std::unique_ptr<kv_memory_service::KvClient> client;
  std::unique_ptr<speculator::SkewMatrices> skew;
  gpu_worker::EngineOptions options;
};

// `policy` (a --policy name) with the policy and memory-node flags, for
// model `m` (whose tokenizer reads the calibration text InfiniGen's skew
// is calibrated on when there is no --skew). Failures are usage errors (bad
// flags or files) unless the memory node fails (SetupFailure).
// `kv_options`: KvClientOptionsFromFlags. `serving`: the commands that take
// the reuse and recovery flags (generate, serve, bench-decode); scoring
// runs neither.
absl::StatusOr<PolicySetup> SetUpPolicy(
    const std::string& policy, const model::LoadedModel& m,
    const kv_memory_service::KvClientOptions& kv_options, bool serving);

// A CalibrateSkew progress callback printing to stderr, at most once a
// second and at the end: "calibrating InfiniGen: 40% (12 s, about 18 s
// left)".
std::function<void(int done, int total)> CalibrationProgress();

// The fetch fraction --target_fetch=auto gives infinigen.
inline constexpr double kInfinigenTargetFetch = 0.1;

// The commands, each defined in its own file.
const Command& GenerateCommand();
const Command& PerplexityCommand();
const Command& BenchDecodeCommand();
const Command& SkewCommand();
const Command& ServeCommand();
const Command& KvCheckCommand();  // and health, in kv_check.cc
const Command& HealthCommand();

}  // namespace infinigen::commands

#endif  // INFINIGEN_GPU_WORKER_COMMANDS_COMMON_H_
