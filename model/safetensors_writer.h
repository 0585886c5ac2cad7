// Test-only writer of Hugging Face checkpoints: .safetensors files, sharded
// checkpoints with model.safetensors.index.json, and config.json.
//
// Tests build tiny checkpoints with it (fp32 values in, stored as F32, F16 or
// BF16 with round-to-nearest-even) and load them with the real loader. The
// two Write*TinyCheckpoint functions make a complete random Llama or OPT
// model from a seed, deterministically on every platform, and return the
// fp32 values they drew so that a test can compare what was loaded. Writes
// go to paths the caller chooses (normally under testing::TempDir()); the
// caller owns the files. Not thread-safe for the same path.
#ifndef INFINIGEN_MODEL_SAFETENSORS_WRITER_H_
#define INFINIGEN_MODEL_SAFETENSORS_WRITER_H_

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace infinigen::model {

enum class SafetensorsDtype { kF32, kF16, kBF16 };

// "F32", "F16" or "BF16", as the header spells it.
const char* SafetensorsDtypeName(SafetensorsDtype dtype);

// One tensor to write: fp32 values, row-major, as many as the shape holds.
struct TensorData {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
// Name -> tensor; the header lists them in this (sorted) order.
using TensorMap = std::map<std::string, TensorData>;

// Writes one .safetensors file holding `tensors` as `dtype`, with
// {"format": "pt"} as metadata. InvalidArgument if a tensor's value count
// does not match its shape; Internal if the file cannot be written.
absl::Status WriteSafetensors(const std::string& path, const TensorMap& tensors,
                              SafetensorsDtype dtype);

// Writes `text` to `path`, replacing it (config.json, a damaged header...).
absl::Status WriteTextFile(const std::string& path, const std::string& text);

// Writes a checkpoint directory (created if needed): config.json from
// `config`, and `tensors` as model.safetensors when `num_shards` is 1, or
// spread over model-0000i-of-0000n.safetensors with
// model.safetensors.index.json when it is more.
absl::Status WriteHfCheckpoint(const std::string& dir,
                               const nlohmann::json& config,
                               const TensorMap& tensors, SafetensorsDtype dtype,
                               int num_shards = 1);

struct TinyCheckpointOptions {
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  // Unset: the architecture's default (Llama untied, OPT tied) and no
  // tie_word_embeddings key. true: the key and no lm_head.weight. false: the
  // key and an lm_head.weight of its own.
  std::optional<bool> tie_word_embeddings;
  int num_shards = 1;
  // OPT only: name tensors "model.decoder.*" (OPTForCausalLM) rather than
  // "decoder.*" (OPTModel, as the original facebook/opt-* files).
  bool opt_model_prefix = true;
  // Merged into config.json as a JSON merge patch (RFC 7396): a key set to
  // null is removed. Tensors follow the geometry before the patch.
  nlohmann::json config_overrides = nlohmann::json::object();
};

struct TinyCheckpoint {
  std::string dir;        // holds config.json and the safetensors file(s)
  nlohmann::json config;  // as written
  TensorMap tensors;      // as drawn, before rounding to the stored dtype
};

// A random Llama with grouped-query attention: dim 8, 2 layers, 4 query
// heads, 2 KV heads (head_dim 2), MLP hidden 12, vocab 16, context 32,
// bos 1, eos 2. Projections are uniform in +-1/sqrt(fan_in), norm gains near
// 1, embeddings uniform in +-1.
absl::StatusOr<TinyCheckpoint> WriteTinyLlamaCheckpoint(
    const std::string& dir, uint32_t seed,
    const TinyCheckpointOptions& options = {});

// A random pre-LayerNorm OPT: dim 8, 2 layers, 2 heads (head_dim 4), ffn 16,
// vocab 16, context 16 (18 learned position rows), bos = eos = 2, with every
// bias. Values are drawn as for the Llama above; biases uniform in +-0.1.
absl::StatusOr<TinyCheckpoint> WriteTinyOptCheckpoint(
    const std::string& dir, uint32_t seed,
    const TinyCheckpointOptions& options = {});

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_SAFETENSORS_WRITER_H_
