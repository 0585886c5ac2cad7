#include "model/safetensors_writer.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/half.h"
#include "common/status.h"

namespace infinigen::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

uint32_t FloatBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  return x;
}

size_t ElementSize(SafetensorsDtype dtype) {
  return dtype == SafetensorsDtype::kF32 ? 4 : 2;
}

void AppendValues(const std::vector<float>& values, SafetensorsDtype dtype,
                  std::string& out) {
  for (float v : values) {
    char bytes[4];
    switch (dtype) {
      case SafetensorsDtype::kF32: {
        std::memcpy(bytes, &v, 4);
        break;
      }
      case SafetensorsDtype::kF16: {
        const uint16_t h = FloatToHalf(v);
        std::memcpy(bytes, &h, 2);
        break;
      }
      case SafetensorsDtype::kBF16: {
        const uint16_t h = FloatToBf16(v);
        std::memcpy(bytes, &h, 2);
        break;
      }
    }
    out.append(bytes, ElementSize(dtype));
  }
}

// Deterministic uniform draws (std::uniform_real_distribution is not the
// same on every standard library; mt19937's output is).
class Draw {
 public:
  explicit Draw(uint32_t seed) : gen_(seed) {}
  float Uniform(float lo, float hi) {
    return lo + (hi - lo) * float(gen_() >> 8) * 0x1p-24f;
  }
  TensorData Tensor(std::vector<int64_t> shape, float lo, float hi) {
    TensorData t;
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    t.shape = std::move(shape);
    t.values.resize(n);
    for (float& v : t.values) v = Uniform(lo, hi);
    return t;
  }
  // A projection (out, in): uniform in +-1/sqrt(in).
  TensorData Matrix(int64_t out, int64_t in) {
    const float s = 1.0f / std::sqrt(float(in));
    return Tensor({out, in}, -s, s);
  }
  TensorData Gain(int64_t n) { return Tensor({n}, 0.9f, 1.1f); }
  TensorData Bias(int64_t n) { return Tensor({n}, -0.1f, 0.1f); }

 private:
  std::mt19937 gen_;
};

absl::StatusOr<TinyCheckpoint> Finish(const std::string& dir, json config,
                                      TensorMap tensors,
                                      const TinyCheckpointOptions& options) {
  config.merge_patch(options.config_overrides);
  IG_RETURN_IF_ERROR(WriteHfCheckpoint(dir, config, tensors, options.dtype,
                                       options.num_shards));
  return TinyCheckpoint{dir, std::move(config), std::move(tensors)};
}

}  // namespace

const char* SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kF16:
      return "F16";
    case SafetensorsDtype::kBF16:
      return "BF16";
  }
  return "?";
}

absl::Status WriteSafetensors(const std::string& path, const TensorMap& tensors,
                              SafetensorsDtype dtype) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  std::string data;
  for (const auto& [name, t] : tensors) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    if (n != int64_t(t.values.size())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s has %d values for a shape of %d elements", path, name,
          t.values.size(), n));
    }
    const size_t begin = data.size();
    AppendValues(t.values, dtype, data);
    header[name] = {{"dtype", SafetensorsDtypeName(dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  // The reference implementation pads the header with spaces so that the
  // data starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  char len_bytes[8];
  std::memcpy(len_bytes, &len, sizeof(len));
  return WriteTextFile(path, std::string(len_bytes, 8) + text + data);
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), std::streamsize(text.size()));
  out.close();
  if (!out) {
    return absl::InternalError(absl::StrFormat("cannot write %s", path));
  }
  return absl::OkStatus();
}

absl::Status WriteHfCheckpoint(const std::string& dir, const json& config,
                               const TensorMap& tensors, SafetensorsDtype dtype,
                               int num_shards) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrFormat("cannot create %s: %s", dir, ec.message()));
  }
  const fs::path d(dir);
  IG_RETURN_IF_ERROR(
      WriteTextFile((d / "config.json").string(), config.dump(2) + "\n"));
  if (num_shards <= 1) {
    return WriteSafetensors((d / "model.safetensors").string(), tensors, dtype);
  }
  // Round-robin over the sorted names, so every shard gets some tensors.
  std::vector<TensorMap> shards(num_shards);
  json weight_map = json::object();
  size_t total_size = 0;
  int i = 0;
  for (const auto& [name, t] : tensors) {
    const std::string file =
        absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, num_shards);
    shards[i][name] = t;
    weight_map[name] = file;
    total_size += t.values.size() * ElementSize(dtype);
    i = (i + 1) % num_shards;
  }
  for (int s = 0; s < num_shards; ++s) {
    IG_RETURN_IF_ERROR(WriteSafetensors(
        (d /
         absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, num_shards))
            .string(),
        shards[s], dtype));
  }
  const json index = {{"metadata", {{"total_size", total_size}}},
                      {"weight_map", weight_map}};
  return WriteTextFile((d / "model.safetensors.index.json").string(),
                       index.dump(2) + "\n");
}

absl::StatusOr<TinyCheckpoint> WriteTinyLlamaCheckpoint(
    const std::string& dir, uint32_t seed,
    const TinyCheckpointOptions& options) {
  constexpr int kDim = 8, kLayers = 2, kHeads = 4, kKvHeads = 2, kHidden = 12,
                kVocab = 16, kContext = 32;
  constexpr int kHeadDim = kDim / kHeads;
  json config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", kDim},
      {"intermediate_size", kHidden},
      {"num_hidden_layers", kLayers},
      {"num_attention_heads", kHeads},
      {"num_key_value_heads", kKvHeads},
      {"vocab_size", kVocab},
      {"max_position_embeddings", kContext},
      {"rms_norm_eps", 1e-5},
      {"rope_theta", 10000.0},
      {"hidden_act", "silu"},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"torch_dtype", "float32"},
  };
  const bool tied = options.tie_word_embeddings.value_or(false);
  if (options.tie_word_embeddings) config["tie_word_embeddings"] = tied;

  Draw draw(seed);
  TensorMap t;
  t["model.embed_tokens.weight"] = draw.Tensor({kVocab, kDim}, -1.0f, 1.0f);
  for (int i = 0; i < kLayers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    t[p + "input_layernorm.weight"] = draw.Gain(kDim);
    t[p + "self_attn.q_proj.weight"] = draw.Matrix(kHeads * kHeadDim, kDim);
    t[p + "self_attn.k_proj.weight"] = draw.Matrix(kKvHeads * kHeadDim, kDim);
    t[p + "self_attn.v_proj.weight"] = draw.Matrix(kKvHeads * kHeadDim, kDim);
    t[p + "self_attn.o_proj.weight"] = draw.Matrix(kDim, kHeads * kHeadDim);
    t[p + "post_attention_layernorm.weight"] = draw.Gain(kDim);
    t[p + "mlp.gate_proj.weight"] = draw.Matrix(kHidden, kDim);
    t[p + "mlp.up_proj.weight"] = draw.Matrix(kHidden, kDim);
    t[p + "mlp.down_proj.weight"] = draw.Matrix(kDim, kHidden);
  }
  t["model.norm.weight"] = draw.Gain(kDim);
  if (!tied) t["lm_head.weight"] = draw.Matrix(kVocab, kDim);
  return Finish(dir, std::move(config), std::move(t), options);
}

absl::StatusOr<TinyCheckpoint> WriteTinyOptCheckpoint(
    const std::string& dir, uint32_t seed,
    const TinyCheckpointOptions& options) {
  constexpr int kDim = 8, kLayers = 2, kHeads = 2, kFfn = 16, kVocab = 16,
                kContext = 16, kPositionOffset = 2;
  json config = {
      {"architectures", {"OPTForCausalLM"}},
      {"model_type", "opt"},
      {"hidden_size", kDim},
      {"ffn_dim", kFfn},
      {"num_hidden_layers", kLayers},
      {"num_attention_heads", kHeads},
      {"vocab_size", kVocab},
      {"max_position_embeddings", kContext},
      {"word_embed_proj_dim", kDim},
      {"do_layer_norm_before", true},
      {"activation_function", "relu"},
      {"bos_token_id", 2},
      {"eos_token_id", 2},
      {"pad_token_id", 1},
      {"torch_dtype", "float32"},
  };
  const bool tied = options.tie_word_embeddings.value_or(true);
  if (options.tie_word_embeddings) config["tie_word_embeddings"] = tied;

  Draw draw(seed);
  TensorMap t;
  const std::string d =
      options.opt_model_prefix ? "model.decoder." : "decoder.";
  t[d + "embed_tokens.weight"] = draw.Tensor({kVocab, kDim}, -1.0f, 1.0f);
  t[d + "embed_positions.weight"] =
      draw.Tensor({kContext + kPositionOffset, kDim}, -1.0f, 1.0f);
  for (int i = 0; i < kLayers; ++i) {
    const std::string p = absl::StrCat(d, "layers.", i, ".");
    t[p + "self_attn_layer_norm.weight"] = draw.Gain(kDim);
    t[p + "self_attn_layer_norm.bias"] = draw.Bias(kDim);
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      t[absl::StrCat(p, "self_attn.", proj, ".weight")] =
          draw.Matrix(kDim, kDim);
      t[absl::StrCat(p, "self_attn.", proj, ".bias")] = draw.Bias(kDim);
    }
    t[p + "final_layer_norm.weight"] = draw.Gain(kDim);
    t[p + "final_layer_norm.bias"] = draw.Bias(kDim);
    t[p + "fc1.weight"] = draw.Matrix(kFfn, kDim);
    t[p + "fc1.bias"] = draw.Bias(kFfn);
    t[p + "fc2.weight"] = draw.Matrix(kDim, kFfn);
    t[p + "fc2.bias"] = draw.Bias(kDim);
  }
  t[d + "final_layer_norm.weight"] = draw.Gain(kDim);
  t[d + "final_layer_norm.bias"] = draw.Bias(kDim);
  if (!tied) t["lm_head.weight"] = draw.Matrix(kVocab, kDim);
  return Finish(dir, std::move(config), std::move(t), options);
}

}  // namespace infinigen::model
