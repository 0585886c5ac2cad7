// config.json of a Hugging Face checkpoint, for the architectures the
// engine runs (Llama and Mistral, OPT, Gemma 3): ParseHfConfig
// (safetensors.h).
#include <cmath>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "model/safetensors.h"
#include "model/safetensors_json.h"

namespace infinigen::model {
namespace {

using nlohmann::json;

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

}  // namespace

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

}  // namespace infinigen::model
