// A Hugging Face checkpoint's tensors mapped to Weights, for the Llama
// family and OPT: LoadSafetensorsModel (safetensors.h).
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "common/file.h"
#include "model/safetensors.h"

namespace infinigen::model {
namespace {

namespace fs = std::filesystem;

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
