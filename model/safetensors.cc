#include "model/safetensors.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "common/log.h"
#include "common/status.h"

namespace infinigen::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// safetensors is little-endian on disk; the conversions below read it as
// native, which is right on every machine the project targets.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the safetensors reader assumes a little-endian host");

// Bytes per element of each dtype the format defines; 0 for one we do not
// know (the header entry is kept, but its size cannot be checked).
size_t DtypeSize(const std::string& dtype) {
  static const std::map<std::string, size_t> kSizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2},    {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U64", 8},     {"U32", 4},
      {"U16", 2}, {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
  };
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

void F64ToFloat(const uint8_t* src, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) {
    double d;
    std::memcpy(&d, src + 8 * i, sizeof(d));
    dst[i] = static_cast<float>(d);
  }
}

// A JSON value as a non-negative integer, or false.
bool AsSize(const json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<uint64_t>();
  return true;
}

// One header entry -> info. `data_size` is the length of the data section.
absl::StatusOr<SafetensorsTensorInfo> ParseTensorEntry(const std::string& path,
                                                       const std::string& name,
                                                       const json& entry,
                                                       size_t data_size) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor %s: %s", path, name, what));
  };
  if (!entry.is_object()) return bad("header entry is not a JSON object");
  SafetensorsTensorInfo info;
  auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return bad("missing or non-string \"dtype\"");
  }
  info.dtype = dtype->get<std::string>();
  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return bad("missing or non-array \"shape\"");
  }
  uint64_t count = 1;
  bool overflow = false;
  for (const json& d : *shape) {
    uint64_t dim;
    if (!AsSize(d, &dim) ||
        dim > uint64_t(std::numeric_limits<int64_t>::max())) {
      return bad(
          absl::StrCat("shape ", shape->dump(),
                       " has an entry that is not a non-negative integer"));
    }
    info.shape.push_back(int64_t(dim));
    overflow |= __builtin_mul_overflow(count, dim, &count);
  }
  auto offsets = entry.find("data_offsets");
  uint64_t begin = 0, end = 0;
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !AsSize((*offsets)[0], &begin) || !AsSize((*offsets)[1], &end) ||
      begin > end) {
    return bad("\"data_offsets\" is not a pair [begin, end] with begin <= end");
  }
  if (end > data_size) {
    return bad(absl::StrFormat(
        "data_offsets [%d, %d] lie beyond the end of the data section (%d "
        "bytes); the file is truncated",
        begin, end, data_size));
  }
  const size_t elem = DtypeSize(info.dtype);
  if (elem != 0) {
    uint64_t bytes;
    overflow |= __builtin_mul_overflow(count, uint64_t(elem), &bytes);
    if (overflow || bytes != end - begin) {
      return bad(absl::StrFormat(
          "shape %s of %s needs %s bytes, data_offsets [%d, %d] give %d",
          ShapeString(info.shape), info.dtype,
          overflow ? "too many" : absl::StrCat(bytes), begin, end,
          end - begin));
    }
  }
  info.begin = begin;
  info.end = end;
  return info;
}

absl::StatusOr<json> ParseJson(std::string_view text, const std::string& path,
                               const char* what) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s is not valid JSON: %s", path, what, e.what()));
  }
}

// Typed reads of config.json keys; a null value counts as absent, as it does
// for Hugging Face's config classes.
class ConfigKeys {
 public:
  ConfigKeys(const json& j, const std::string& path) : j_(j), path_(path) {}

  const json* Find(const char* key) const {
    auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }

  absl::StatusOr<int> Int(const char* key) const {
    const json* v = Find(key);
    if (v == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: missing required key \"%s\"", path_, key));
    }
    return ToInt(key, *v);
  }
  absl::StatusOr<int> Int(const char* key, int dflt) const {
    const json* v = Find(key);
    return v == nullptr ? dflt : ToInt(key, *v);
  }
  absl::StatusOr<double> Float(const char* key, double dflt) const {
    const json* v = Find(key);
    if (v == nullptr) return dflt;
    if (!v->is_number()) return WrongType(key, "a number", *v);
    return v->get<double>();
  }
  absl::StatusOr<bool> Bool(const char* key, bool dflt) const {
    const json* v = Find(key);
    if (v == nullptr) return dflt;
    if (!v->is_boolean()) return WrongType(key, "true or false", *v);
    return v->get<bool>();
  }
  absl::StatusOr<std::string> String(const char* key,
                                     const std::string& dflt) const {
    const json* v = Find(key);
    if (v == nullptr) return dflt;
    if (!v->is_string()) return WrongType(key, "a string", *v);
    return v->get<std::string>();
  }
  // A special token id: an integer, the first of a list (Llama 3 lists
  // several EOS ids), or -1 for null / an empty list.
  absl::StatusOr<int> TokenId(const char* key, int dflt) const {
    auto it = j_.find(key);
    if (it == j_.end()) return dflt;
    if (it->is_null()) return -1;
    if (it->is_array()) {
      if (it->empty()) return -1;
      return ToInt(key, it->front());
    }
    return ToInt(key, *it);
  }

 private:
  absl::StatusOr<int> ToInt(const char* key, const json& v) const {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > uint64_t(INT_MAX)) {
        return WrongType(key, "an int", v);
      }
      return int(v.get<uint64_t>());
    }
    if (v.is_number_integer()) {
      const int64_t i = v.get<int64_t>();
      if (i < INT_MIN) return WrongType(key, "an int", v);
      return int(i);
    }
    return WrongType(key, "an integer", v);
  }
  absl::Status WrongType(const char* key, const char* want,
                         const json& v) const {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: \"%s\" must be %s, got %s", path_, key, want, v.dump()));
  }

  const json& j_;
  const std::string& path_;
};

absl::Status Unsupported(const std::string& path, const std::string& what) {
  return absl::UnimplementedError(absl::StrFormat("%s: %s", path, what));
}

absl::StatusOr<HfModelConfig> ParseLlamaConfig(const ConfigKeys& k,
                                               const std::string& path) {
  HfModelConfig hf;
  ModelConfig& c = hf.config;
  c.arch = Architecture::kLlama;
  IG_ASSIGN_OR_RETURN(c.dim, k.Int("hidden_size"));
  IG_ASSIGN_OR_RETURN(c.hidden_dim, k.Int("intermediate_size"));
  IG_ASSIGN_OR_RETURN(c.n_layers, k.Int("num_hidden_layers"));
  IG_ASSIGN_OR_RETURN(c.n_heads, k.Int("num_attention_heads"));
  IG_ASSIGN_OR_RETURN(c.n_kv_heads, k.Int("num_key_value_heads", c.n_heads));
  if (k.Find("head_dim") != nullptr) {
    IG_ASSIGN_OR_RETURN(c.head_dim, k.Int("head_dim"));
  } else if (c.n_heads > 0 && c.dim % c.n_heads == 0) {
    c.head_dim = c.dim / c.n_heads;
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: hidden_size %d is not a multiple of num_attention_heads %d and "
        "there is no head_dim",
        path, c.dim, c.n_heads));
  }
  IG_ASSIGN_OR_RETURN(c.vocab_size, k.Int("vocab_size"));
  IG_ASSIGN_OR_RETURN(c.max_seq_len, k.Int("max_position_embeddings", 2048));
  IG_ASSIGN_OR_RETURN(double eps, k.Float("rms_norm_eps", 1e-6));
  IG_ASSIGN_OR_RETURN(double theta, k.Float("rope_theta", 10000.0));
  c.norm_eps = static_cast<float>(eps);
  c.rope_theta = static_cast<float>(theta);
  IG_ASSIGN_OR_RETURN(c.bos_id, k.TokenId("bos_token_id", 1));
  IG_ASSIGN_OR_RETURN(c.eos_id, k.TokenId("eos_token_id", 2));
  IG_ASSIGN_OR_RETURN(hf.tie_word_embeddings,
                      k.Bool("tie_word_embeddings", false));

  IG_ASSIGN_OR_RETURN(std::string act, k.String("hidden_act", "silu"));
  if (act != "silu") {
    return Unsupported(path, absl::StrCat("hidden_act \"", act,
                                          "\" is not supported (only silu)"));
  }
  if (const json* s = k.Find("rope_scaling")) {
    return Unsupported(path,
                       absl::StrCat("rope_scaling ", s->dump(),
                                    " is not supported (only plain RoPE)"));
  }
  IG_ASSIGN_OR_RETURN(bool attention_bias, k.Bool("attention_bias", false));
  IG_ASSIGN_OR_RETURN(bool mlp_bias, k.Bool("mlp_bias", false));
  if (attention_bias || mlp_bias) {
    return Unsupported(
        path, "Llama with attention_bias or mlp_bias is not supported");
  }
  if (k.Find("sliding_window") != nullptr) {
    IG_ASSIGN_OR_RETURN(int window, k.Int("sliding_window"));
    if (window < c.max_seq_len) {
      IG_LOG(WARNING) << path << ": sliding_window " << window
                      << " is ignored: attention is exact only for sequences "
                         "of at most that many tokens";
    }
  }
  return hf;
}

absl::StatusOr<HfModelConfig> ParseOptConfig(const ConfigKeys& k,
                                             const std::string& path) {
  HfModelConfig hf;
  ModelConfig& c = hf.config;
  c.arch = Architecture::kOpt;
  IG_ASSIGN_OR_RETURN(c.dim, k.Int("hidden_size"));
  IG_ASSIGN_OR_RETURN(c.hidden_dim, k.Int("ffn_dim"));
  IG_ASSIGN_OR_RETURN(c.n_layers, k.Int("num_hidden_layers"));
  IG_ASSIGN_OR_RETURN(c.n_heads, k.Int("num_attention_heads"));
  c.n_kv_heads = c.n_heads;
  if (c.n_heads <= 0 || c.dim % c.n_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: hidden_size %d is not a multiple of num_attention_heads %d", path,
        c.dim, c.n_heads));
  }
  c.head_dim = c.dim / c.n_heads;
  IG_ASSIGN_OR_RETURN(c.vocab_size, k.Int("vocab_size"));
  IG_ASSIGN_OR_RETURN(c.max_seq_len, k.Int("max_position_embeddings", 2048));
  c.norm_eps = 1e-5f;
  IG_ASSIGN_OR_RETURN(c.bos_id, k.TokenId("bos_token_id", 2));
  IG_ASSIGN_OR_RETURN(c.eos_id, k.TokenId("eos_token_id", 2));
  IG_ASSIGN_OR_RETURN(hf.tie_word_embeddings,
                      k.Bool("tie_word_embeddings", true));

  IG_ASSIGN_OR_RETURN(int proj_dim, k.Int("word_embed_proj_dim", c.dim));
  if (proj_dim != c.dim) {
    return Unsupported(
        path, absl::StrFormat(
                  "word_embed_proj_dim %d differs from hidden_size %d: OPT "
                  "with projected embeddings (as opt-350m) is not supported",
                  proj_dim, c.dim));
  }
  IG_ASSIGN_OR_RETURN(bool pre_norm, k.Bool("do_layer_norm_before", true));
  if (!pre_norm) {
    return Unsupported(path,
                       "do_layer_norm_before is false: only pre-LayerNorm OPT "
                       "is supported (every size but opt-350m)");
  }
  IG_ASSIGN_OR_RETURN(std::string act, k.String("activation_function", "relu"));
  if (act != "relu") {
    return Unsupported(path, absl::StrCat("activation_function \"", act,
                                          "\" is not supported (only relu)"));
  }
  IG_ASSIGN_OR_RETURN(bool bias, k.Bool("enable_bias", true));
  IG_ASSIGN_OR_RETURN(bool affine,
                      k.Bool("layer_norm_elementwise_affine", true));
  IG_ASSIGN_OR_RETURN(bool no_final_norm,
                      k.Bool("_remove_final_layer_norm", false));
  if (!bias || !affine || no_final_norm) {
    return Unsupported(path,
                       "OPT without biases, LayerNorm affine parameters or the "
                       "final LayerNorm is not supported");
  }
  return hf;
}

// Gemma 3 (model_type gemma3_text): Llama's keys plus its sliding window,
// the kinds of its layers, and a RoPE base per kind.
absl::StatusOr<HfModelConfig> ParseGemma3Config(const ConfigKeys& k,
                                                const std::string& path,
                                                const json& j) {
  HfModelConfig hf;
  ModelConfig& c = hf.config;
  c.arch = Architecture::kGemma3;
  IG_ASSIGN_OR_RETURN(c.dim, k.Int("hidden_size"));
  IG_ASSIGN_OR_RETURN(c.hidden_dim, k.Int("intermediate_size"));
  IG_ASSIGN_OR_RETURN(c.n_layers, k.Int("num_hidden_layers"));
  IG_ASSIGN_OR_RETURN(c.n_heads, k.Int("num_attention_heads"));
  IG_ASSIGN_OR_RETURN(c.n_kv_heads, k.Int("num_key_value_heads", c.n_heads));
  IG_ASSIGN_OR_RETURN(c.head_dim, k.Int("head_dim", 256));
  IG_ASSIGN_OR_RETURN(c.vocab_size, k.Int("vocab_size"));
  IG_ASSIGN_OR_RETURN(c.max_seq_len, k.Int("max_position_embeddings", 32768));
  IG_ASSIGN_OR_RETURN(double eps, k.Float("rms_norm_eps", 1e-6));
  c.norm_eps = static_cast<float>(eps);
  IG_ASSIGN_OR_RETURN(c.bos_id, k.TokenId("bos_token_id", 2));
  IG_ASSIGN_OR_RETURN(c.eos_id, k.TokenId("eos_token_id", 1));
  IG_ASSIGN_OR_RETURN(hf.tie_word_embeddings,
                      k.Bool("tie_word_embeddings", true));
  IG_ASSIGN_OR_RETURN(c.sliding_window, k.Int("sliding_window", 512));
  c.embedding_scale = std::sqrt(static_cast<float>(c.dim));
  IG_ASSIGN_OR_RETURN(std::string act,
                      k.String("hidden_activation", "gelu_pytorch_tanh"));
  if (act != "gelu_pytorch_tanh") {
    return Unsupported(path, absl::StrCat("hidden_activation \"", act,
                                          "\" is not supported (only "
                                          "gelu_pytorch_tanh)"));
  }
  IG_ASSIGN_OR_RETURN(int scalar, k.Int("query_pre_attn_scalar", c.head_dim));
  if (scalar != c.head_dim) {
    return Unsupported(path, absl::StrFormat(
                                 "query_pre_attn_scalar %d differs from "
                                 "head_dim %d: not supported",
                                 scalar, c.head_dim));
  }
  for (const char* cap : {"final_logit_softcapping", "attn_logit_softcapping"}) {
    if (const json* v = k.Find(cap); v != nullptr && !v->is_null()) {
      return Unsupported(path, absl::StrCat(cap, " is not supported"));
    }
  }
  // The layer kinds: layer_types, or every sliding_window_pattern-th layer
  // global; only that periodic form is supported.
  int pattern = 6;
  if (auto it = j.find("layer_types"); it != j.end() && it->is_array()) {
    pattern = 0;
    for (size_t i = 0; i < it->size(); ++i) {
      if ((*it)[i] == "full_attention") {
        pattern = static_cast<int>(i) + 1;
        break;
      }
    }
    for (size_t i = 0; i < it->size(); ++i) {
      const bool global = pattern > 0 && (i + 1) % pattern == 0;
      if ((*it)[i] != (global ? "full_attention" : "sliding_attention")) {
        return Unsupported(path, absl::StrFormat(
                                     "layer_types %s: only one global layer "
                                     "every k layers is supported",
                                     it->dump()));
      }
    }
  } else {
    IG_ASSIGN_OR_RETURN(pattern, k.Int("sliding_window_pattern", 6));
  }
  c.sliding_window_pattern = pattern;
  // RoPE bases: Transformers 5's rope_parameters per layer kind, or the
  // older rope_theta and rope_local_base_freq.
  double global = 1000000.0, local = 10000.0;
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) {
    for (const auto& [kind, base] :
         {std::pair{"full_attention", &global},
          std::pair{"sliding_attention", &local}}) {
      auto p = it->find(kind);
      if (p == it->end()) continue;
      if (p->value("rope_type", "default") != "default") {
        return Unsupported(path, absl::StrCat("rope_parameters ", p->dump(),
                                              " (only plain RoPE)"));
      }
      if (p->contains("rope_theta") && (*p)["rope_theta"].is_number()) {
        *base = (*p)["rope_theta"].get<double>();
      }
    }
  } else {
    IG_ASSIGN_OR_RETURN(global, k.Float("rope_theta", global));
    IG_ASSIGN_OR_RETURN(local, k.Float("rope_local_base_freq", local));
    if (const json* s = k.Find("rope_scaling"); s != nullptr && !s->is_null()) {
      return Unsupported(path, absl::StrCat("rope_scaling ", s->dump(),
                                            " is not supported"));
    }
  }
  c.rope_theta = static_cast<float>(global);
  c.rope_theta_local = static_cast<float>(local);
  return hf;
}

// The names Weights needs, read from `ckpt` with shapes from `c`. Every name
// read is added to `used`.
class TensorReader {
 public:
  explicit TensorReader(const SafetensorsCheckpoint& ckpt) : ckpt_(ckpt) {}

  absl::Status Read(const std::string& name, std::vector<int64_t> shape,
                    std::vector<float>* out) {
    IG_ASSIGN_OR_RETURN(*out, ckpt_.ReadFloat32(name, shape));
    used_.insert(name);
    return absl::OkStatus();
  }
  const std::set<std::string>& used() const { return used_; }

 private:
  const SafetensorsCheckpoint& ckpt_;
  std::set<std::string> used_;
};

absl::Status ReadLlama(const SafetensorsCheckpoint& ckpt, bool tied,
                       TensorReader& r, Weights& w) {
  const ModelConfig& c = w.config;
  const int64_t dim = c.dim, hid = c.hidden_dim, q = c.q_dim(), kv = c.kv_dim();
  IG_RETURN_IF_ERROR(r.Read("model.embed_tokens.weight", {c.vocab_size, dim},
                            &w.token_embedding));
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    IG_RETURN_IF_ERROR(
        r.Read(p + "input_layernorm.weight", {dim}, &l.attn_norm));
    IG_RETURN_IF_ERROR(r.Read(p + "self_attn.q_proj.weight", {q, dim}, &l.wq));
    IG_RETURN_IF_ERROR(r.Read(p + "self_attn.k_proj.weight", {kv, dim}, &l.wk));
    IG_RETURN_IF_ERROR(r.Read(p + "self_attn.v_proj.weight", {kv, dim}, &l.wv));
    IG_RETURN_IF_ERROR(r.Read(p + "self_attn.o_proj.weight", {dim, q}, &l.wo));
    if (c.arch == Architecture::kGemma3) {
      // Its post_attention_layernorm normalizes the attention's output;
      // the MLP's input norm is pre_feedforward_layernorm. Gains are
      // stored as w and used as 1 + w.
      const int64_t hd = c.head_dim;
      IG_RETURN_IF_ERROR(
          r.Read(p + "self_attn.q_norm.weight", {hd}, &l.q_norm));
      IG_RETURN_IF_ERROR(
          r.Read(p + "self_attn.k_norm.weight", {hd}, &l.k_norm));
      IG_RETURN_IF_ERROR(r.Read(p + "post_attention_layernorm.weight", {dim},
                                &l.post_attn_norm));
      IG_RETURN_IF_ERROR(
          r.Read(p + "pre_feedforward_layernorm.weight", {dim}, &l.ffn_norm));
      IG_RETURN_IF_ERROR(r.Read(p + "post_feedforward_layernorm.weight",
                                {dim}, &l.post_ffn_norm));
      for (std::vector<float>* gain : {&l.attn_norm, &l.q_norm, &l.k_norm,
                                       &l.post_attn_norm, &l.ffn_norm,
                                       &l.post_ffn_norm}) {
        for (float& g : *gain) g += 1.0f;
      }
    } else {
      IG_RETURN_IF_ERROR(
          r.Read(p + "post_attention_layernorm.weight", {dim}, &l.ffn_norm));
    }
    IG_RETURN_IF_ERROR(r.Read(p + "mlp.gate_proj.weight", {hid, dim}, &l.w1));
    IG_RETURN_IF_ERROR(r.Read(p + "mlp.up_proj.weight", {hid, dim}, &l.w3));
    IG_RETURN_IF_ERROR(r.Read(p + "mlp.down_proj.weight", {dim, hid}, &l.w2));
  }
  IG_RETURN_IF_ERROR(r.Read("model.norm.weight", {dim}, &w.final_norm));
  if (c.arch == Architecture::kGemma3) {
    for (float& g : w.final_norm) g += 1.0f;
  }
  if (!tied && ckpt.Contains("lm_head.weight")) {
    IG_RETURN_IF_ERROR(
        r.Read("lm_head.weight", {c.vocab_size, dim}, &w.lm_head));
  } else if (!tied) {
    IG_LOG(WARNING) << ckpt.path()
                    << ": no lm_head.weight; the classifier is tied to "
                       "model.embed_tokens.weight";
  }
  return absl::OkStatus();
}

absl::Status ReadOpt(const SafetensorsCheckpoint& ckpt, bool tied,
                     TensorReader& r, Weights& w) {
  const ModelConfig& c = w.config;
  const int64_t dim = c.dim, hid = c.hidden_dim;
  // OPTForCausalLM saves "model.decoder.*"; OPTModel (as the original
  // facebook/opt-* files) saves "decoder.*".
  const std::string d =
      ckpt.Contains("decoder.embed_tokens.weight") &&
              !ckpt.Contains("model.decoder.embed_tokens.weight")
          ? "decoder."
          : "model.decoder.";
  IG_RETURN_IF_ERROR(r.Read(d + "embed_tokens.weight", {c.vocab_size, dim},
                            &w.token_embedding));
  IG_RETURN_IF_ERROR(
      r.Read(d + "embed_positions.weight",
             {c.max_seq_len + ModelConfig::kOptPositionOffset, dim},
             &w.position_embedding));
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat(d, "layers.", i, ".");
    const std::string a = p + "self_attn.";
    IG_RETURN_IF_ERROR(
        r.Read(p + "self_attn_layer_norm.weight", {dim}, &l.attn_norm));
    IG_RETURN_IF_ERROR(
        r.Read(p + "self_attn_layer_norm.bias", {dim}, &l.attn_norm_bias));
    IG_RETURN_IF_ERROR(r.Read(a + "q_proj.weight", {dim, dim}, &l.wq));
    IG_RETURN_IF_ERROR(r.Read(a + "q_proj.bias", {dim}, &l.bq));
    IG_RETURN_IF_ERROR(r.Read(a + "k_proj.weight", {dim, dim}, &l.wk));
    IG_RETURN_IF_ERROR(r.Read(a + "k_proj.bias", {dim}, &l.bk));
    IG_RETURN_IF_ERROR(r.Read(a + "v_proj.weight", {dim, dim}, &l.wv));
    IG_RETURN_IF_ERROR(r.Read(a + "v_proj.bias", {dim}, &l.bv));
    IG_RETURN_IF_ERROR(r.Read(a + "out_proj.weight", {dim, dim}, &l.wo));
    IG_RETURN_IF_ERROR(r.Read(a + "out_proj.bias", {dim}, &l.bo));
    IG_RETURN_IF_ERROR(
        r.Read(p + "final_layer_norm.weight", {dim}, &l.ffn_norm));
    IG_RETURN_IF_ERROR(
        r.Read(p + "final_layer_norm.bias", {dim}, &l.ffn_norm_bias));
    IG_RETURN_IF_ERROR(r.Read(p + "fc1.weight", {hid, dim}, &l.w1));
    IG_RETURN_IF_ERROR(r.Read(p + "fc1.bias", {hid}, &l.b1));
    IG_RETURN_IF_ERROR(r.Read(p + "fc2.weight", {dim, hid}, &l.w2));
    IG_RETURN_IF_ERROR(r.Read(p + "fc2.bias", {dim}, &l.b2));
  }
  IG_RETURN_IF_ERROR(
      r.Read(d + "final_layer_norm.weight", {dim}, &w.final_norm));
  IG_RETURN_IF_ERROR(
      r.Read(d + "final_layer_norm.bias", {dim}, &w.final_norm_bias));
  if (!tied && ckpt.Contains("lm_head.weight")) {
    IG_RETURN_IF_ERROR(
        r.Read("lm_head.weight", {c.vocab_size, dim}, &w.lm_head));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SafetensorsTensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  const size_t size = file.size();
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d bytes is too short for a safetensors header length", path,
        size));
  }
  uint64_t header_len;
  std::memcpy(&header_len, file.data(), sizeof(header_len));
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: header length %d is larger than the %d bytes that follow it", path,
        header_len, size - 8));
  }
  IG_ASSIGN_OR_RETURN(json header, ParseJson(file.view().substr(8, header_len),
                                             path, "the safetensors header"));
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the safetensors header is not a JSON object", path));
  }
  const size_t data_start = 8 + header_len;
  const size_t data_size = size - data_start;
  std::map<std::string, SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: __metadata__ is not a JSON object", path));
      }
      for (const auto& [key, value] : entry.items()) {
        metadata[key] =
            value.is_string() ? value.get<std::string>() : value.dump();
      }
      continue;
    }
    IG_ASSIGN_OR_RETURN(tensors[name],
                        ParseTensorEntry(path, name, entry, data_size));
  }
  return SafetensorsFile(std::move(file), data_start, std::move(tensors),
                         std::move(metadata));
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat32(
    const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: no tensor %s", path(), name));
  }
  const SafetensorsTensorInfo& info = it->second;
  const uint8_t* src = file_.data() + data_start_ + info.begin;
  const size_t n = size_t(info.num_elements());
  std::vector<float> out(n);
  if (info.dtype == "F32") {
    if (n > 0) std::memcpy(out.data(), src, n * sizeof(float));
  } else if (info.dtype == "F16") {
    HalfToFloat(reinterpret_cast<const uint16_t*>(src), n, out.data());
  } else if (info.dtype == "BF16") {
    Bf16ToFloat(reinterpret_cast<const uint16_t*>(src), n, out.data());
  } else if (info.dtype == "F64") {
    F64ToFloat(src, n, out.data());
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: tensor %s has dtype %s; only F32, F16, BF16 and F64 can be read "
        "as floats",
        path(), name, info.dtype));
  }
  return out;
}

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(
    const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    return absl::NotFoundError(
        absl::StrFormat("%s: no such file or directory", path));
  }
  std::string file = path;
  if (fs::is_directory(st)) {
    const fs::path dir(path);
    const std::string index = (dir / "model.safetensors.index.json").string();
    const std::string single = (dir / "model.safetensors").string();
    if (fs::exists(index, ec)) {
      file = index;
    } else if (fs::exists(single, ec)) {
      file = single;
    } else {
      return absl::NotFoundError(absl::StrFormat(
          "%s: no model.safetensors or model.safetensors.index.json in this "
          "directory",
          path));
    }
  }

  SafetensorsCheckpoint ckpt;
  ckpt.path_ = file;
  if (!absl::EndsWith(file, ".index.json")) {
    IG_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(file));
    for (const auto& entry : f.tensors()) ckpt.file_of_tensor_[entry.first] = 0;
    ckpt.files_.push_back(std::move(f));
    return ckpt;
  }

  IG_ASSIGN_OR_RETURN(std::string text, ReadFileToString(file));
  IG_ASSIGN_OR_RETURN(json index, ParseJson(text, file, "the index"));
  auto map = index.is_object() ? index.find("weight_map") : index.end();
  if (map == index.end() || !map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: no \"weight_map\" object", file));
  }
  // Shard name -> tensors the index puts there.
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& [name, shard] : map->items()) {
    if (!shard.is_string() || shard.get<std::string>().empty() ||
        absl::StrContains(shard.get<std::string>(), "/") ||
        shard.get<std::string>() == "..") {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: weight_map entry for %s is not a file name: %s",
                          file, name, shard.dump()));
    }
    shards[shard.get<std::string>()].push_back(name);
  }
  const fs::path dir = fs::path(file).parent_path();
  for (const auto& [shard, names] : shards) {
    IG_ASSIGN_OR_RETURN(SafetensorsFile f,
                        SafetensorsFile::Open((dir / shard).string()));
    const int idx = int(ckpt.files_.size());
    for (const std::string& name : names) {
      if (f.tensors().count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: weight_map puts tensor %s in %s, which has no such tensor",
            file, name, f.path()));
      }
      ckpt.file_of_tensor_[name] = idx;
    }
    ckpt.files_.push_back(std::move(f));
  }
  return ckpt;
}

std::pair<int, const SafetensorsTensorInfo*> SafetensorsCheckpoint::Locate(
    const std::string& name) const {
  auto it = file_of_tensor_.find(name);
  if (it == file_of_tensor_.end()) return {-1, nullptr};
  return {it->second, &files_[it->second].tensors().at(name)};
}

bool SafetensorsCheckpoint::Contains(const std::string& name) const {
  return file_of_tensor_.count(name) != 0;
}

std::vector<std::string> SafetensorsCheckpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(file_of_tensor_.size());
  for (const auto& entry : file_of_tensor_) names.push_back(entry.first);
  return names;
}

const SafetensorsTensorInfo* SafetensorsCheckpoint::Find(
    const std::string& name) const {
  return Locate(name).second;
}

absl::StatusOr<std::vector<float>> SafetensorsCheckpoint::ReadFloat32(
    const std::string& name, const std::vector<int64_t>& shape) const {
  auto [idx, info] = Locate(name);
  if (info == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: missing tensor %s", path_, name));
  }
  const SafetensorsFile& f = files_[idx];
  if (info->shape != shape) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: tensor %s has shape %s, the config wants %s", f.path(), name,
        ShapeString(info->shape), ShapeString(shape)));
  }
  return f.ReadFloat32(name);
}

absl::StatusOr<HfModelConfig> ParseHfConfig(const std::string& json_text,
                                            const std::string& path) {
  IG_ASSIGN_OR_RETURN(json j, ParseJson(json_text, path, "the config"));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: the config is not a JSON object", path));
  }
  const ConfigKeys keys(j, path);
  IG_ASSIGN_OR_RETURN(std::string type, keys.String("model_type", ""));
  absl::StatusOr<HfModelConfig> hf;
  if (type == "llama" || type == "mistral") {
    hf = ParseLlamaConfig(keys, path);
  } else if (type == "opt") {
    hf = ParseOptConfig(keys, path);
  } else if (type == "gemma3_text") {
    hf = ParseGemma3Config(keys, path, j);
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unsupported architecture %s in %s (llama, mistral, opt and "
        "gemma3_text are)",
        type.empty() ? "(no model_type)" : type, path));
  }
  if (!hf.ok()) return hf.status();
  absl::Status valid = hf->config.Validate();
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", path, valid.message()));
  }
  return hf;
}

absl::StatusOr<Weights> LoadSafetensorsModel(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    return absl::NotFoundError(
        absl::StrFormat("%s: no such file or directory", path));
  }
  const fs::path dir =
      fs::is_directory(st) ? fs::path(path) : fs::path(path).parent_path();
  const std::string config_path = (dir / "config.json").string();
  IG_ASSIGN_OR_RETURN(std::string config_text, ReadFileToString(config_path));
  IG_ASSIGN_OR_RETURN(HfModelConfig hf,
                      ParseHfConfig(config_text, config_path));
  IG_ASSIGN_OR_RETURN(SafetensorsCheckpoint ckpt,
                      SafetensorsCheckpoint::Open(path));

  Weights w;
  w.config = hf.config;
  TensorReader reader(ckpt);
  if (hf.config.arch == Architecture::kOpt) {
    IG_RETURN_IF_ERROR(ReadOpt(ckpt, hf.tie_word_embeddings, reader, w));
  } else {
    IG_RETURN_IF_ERROR(ReadLlama(ckpt, hf.tie_word_embeddings, reader, w));
  }
  IG_RETURN_IF_ERROR(w.Validate());

  // Tensors left over usually mean a variant the loader does not know; the
  // precomputed rotary tables and a tied copy of the classifier are expected.
  std::vector<std::string> unused;
  for (const std::string& name : ckpt.TensorNames()) {
    if (reader.used().count(name) ||
        absl::EndsWith(name, "rotary_emb.inv_freq") ||
        name == "lm_head.weight") {
      continue;
    }
    unused.push_back(name);
  }
  if (!unused.empty()) {
    IG_LOG(WARNING) << ckpt.path() << ": " << unused.size()
                    << " tensors not used, e.g. " << unused.front();
  }
  IG_LOG(INFO) << "loaded " << ckpt.path() << ": " << w.config.DebugString()
               << (w.lm_head.empty() ? ", tied classifier" : "");
  return w;
}

}  // namespace infinigen::model
