// The model mapping of a GGUF file: a Llama or Gemma 3 checkpoint's config,
// weights (dequantized; Llama's Q/K rows permuted to the half-split rotary
// layout) and its tokenizer (gguf.h: LoadGgufWeights, LoadGgufTokenizer).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "model/bpe_tokenizer.h"
#include "model/gguf.h"
#include "model/spm_tokenizer.h"

namespace infinigen::model {

// ---------------------------------------------------------------------------
// Llama weights.

namespace {

absl::StatusOr<int> GetDim(const GgufFile& f, const std::string& key) {
  IG_ASSIGN_OR_RETURN(int64_t v, f.GetInt(key));
  if (v <= 0 || v > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s = %d is out of range", f.path(), key, v));
  }
  return static_cast<int>(v);
}

// The tensor `name` as fp32; its GGUF shape must be `shape` (innermost
// first).
absl::StatusOr<std::vector<float>> ReadExpected(
    const GgufFile& f, const std::string& name,
    const std::vector<int64_t>& shape) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: missing tensor %s", f.path(), name));
  }
  if (t->shape != shape) {
    GgufTensorInfo want;
    want.shape = shape;
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor %s has shape %s, the config wants %s",
                        f.path(), name, t->ShapeString(), want.ShapeString()));
  }
  return f.ReadTensor(*t);
}

// Gemma 3's conventions that its GGUF files do not carry (llama.cpp and
// Transformers hard-code them): five sliding-window layers, then one
// global; the local layers' RoPE base.
constexpr int kGemma3SlidingWindowPattern = 6;
constexpr float kGemma3LocalRopeTheta = 10000.0f;

// `arch` is the GGUF architecture name, the prefix of its keys.
absl::StatusOr<ModelConfig> LlamaConfig(const GgufFile& f,
                                        const std::string& arch) {
  ModelConfig c;
  c.arch = arch == "gemma3" ? Architecture::kGemma3 : Architecture::kLlama;
  const auto key = [&arch](const char* k) { return arch + "." + k; };
  IG_ASSIGN_OR_RETURN(c.dim, GetDim(f, key("embedding_length")));
  IG_ASSIGN_OR_RETURN(c.hidden_dim, GetDim(f, key("feed_forward_length")));
  IG_ASSIGN_OR_RETURN(c.n_layers, GetDim(f, key("block_count")));
  IG_ASSIGN_OR_RETURN(c.n_heads, GetDim(f, key("attention.head_count")));
  c.n_kv_heads = c.n_heads;
  if (f.Find(key("attention.head_count_kv")) != nullptr) {
    IG_ASSIGN_OR_RETURN(c.n_kv_heads,
                        GetDim(f, key("attention.head_count_kv")));
  }
  c.head_dim = c.dim / c.n_heads;
  if (f.Find(key("attention.key_length")) != nullptr) {
    IG_ASSIGN_OR_RETURN(c.head_dim, GetDim(f, key("attention.key_length")));
  }
  if (f.Find(key("attention.value_length")) != nullptr) {
    IG_ASSIGN_OR_RETURN(int v, GetDim(f, key("attention.value_length")));
    if (v != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s %d differs from the key length %d; that is not supported",
          f.path(), key("attention.value_length"), v, c.head_dim));
    }
  }
  if (f.Find(key("rope.dimension_count")) != nullptr) {
    IG_ASSIGN_OR_RETURN(int rot, GetDim(f, key("rope.dimension_count")));
    if (rot != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s %d differs from the head dim %d; "
          "partial rotary embeddings are not supported",
          f.path(), key("rope.dimension_count"), rot, c.head_dim));
    }
  }
  if (f.Find(key("rope.scaling.type")) != nullptr) {
    IG_ASSIGN_OR_RETURN(std::string scaling,
                        f.GetString(key("rope.scaling.type")));
    if (scaling != "none") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: RoPE scaling %s is not supported", f.path(), scaling));
    }
  }
  IG_ASSIGN_OR_RETURN(c.max_seq_len, GetDim(f, key("context_length")));
  IG_ASSIGN_OR_RETURN(double eps,
                      f.GetFloat(key("attention.layer_norm_rms_epsilon")));
  c.norm_eps = static_cast<float>(eps);
  IG_ASSIGN_OR_RETURN(double theta,
                      f.GetFloatOr(key("rope.freq_base"), 10000.0));
  c.rope_theta = static_cast<float>(theta);
  if (c.arch == Architecture::kGemma3) {
    IG_ASSIGN_OR_RETURN(c.sliding_window,
                        GetDim(f, key("attention.sliding_window")));
    c.sliding_window_pattern = kGemma3SlidingWindowPattern;
    c.rope_theta_local = kGemma3LocalRopeTheta;
    c.embedding_scale = std::sqrt(static_cast<float>(c.dim));
  }

  if (f.Find("tokenizer.ggml.tokens") != nullptr) {
    IG_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens,
                        f.GetStringArray("tokenizer.ggml.tokens"));
    c.vocab_size = static_cast<int>(tokens->size());
  } else if (f.Find("llama.vocab_size") != nullptr) {
    IG_ASSIGN_OR_RETURN(c.vocab_size, GetDim(f, "llama.vocab_size"));
  } else if (const GgufTensorInfo* emb = f.FindTensor("token_embd.weight");
             emb != nullptr && emb->shape.size() == 2) {
    c.vocab_size = static_cast<int>(emb->shape[1]);
  }
  IG_ASSIGN_OR_RETURN(int64_t bos,
                      f.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  IG_ASSIGN_OR_RETURN(int64_t eos,
                      f.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  c.bos_id = static_cast<int>(bos);
  c.eos_id = static_cast<int>(eos);

  absl::Status s = c.Validate();
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", f.path(), s.message()));
  }
  return c;
}

std::string TypeHistogram(const GgufFile& f) {
  std::map<std::string, int> counts;
  for (const GgufTensorInfo& t : f.tensors()) ++counts[GgmlTypeName(t.type)];
  return absl::StrJoin(counts, ", ", [](std::string* out, const auto& kv) {
    absl::StrAppend(out, kv.first, " x", kv.second);
  });
}

}  // namespace

absl::StatusOr<Weights> LoadGgufWeights(const std::string& path) {
  IG_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Open(path));
  return LoadGgufWeights(f);
}

absl::StatusOr<Weights> LoadGgufWeights(const GgufFile& f) {
  const std::string& path = f.path();
  IG_ASSIGN_OR_RETURN(std::string arch, f.GetString("general.architecture"));
  if (arch != "llama" && arch != "gemma3") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unsupported architecture %s in %s (llama and gemma3 are supported)",
        arch, path));
  }
  Weights w;
  IG_ASSIGN_OR_RETURN(w.config, LlamaConfig(f, arch));
  const bool gemma = w.config.arch == Architecture::kGemma3;
  const ModelConfig& c = w.config;
  const int64_t dim = c.dim, hid = c.hidden_dim, q = c.q_dim(), kv = c.kv_dim(),
                vocab = c.vocab_size;

  IG_ASSIGN_OR_RETURN(w.token_embedding,
                      ReadExpected(f, "token_embd.weight", {dim, vocab}));
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const auto name = [i](const char* t) {
      return absl::StrFormat("blk.%d.%s.weight", i, t);
    };
    IG_ASSIGN_OR_RETURN(l.attn_norm, ReadExpected(f, name("attn_norm"), {dim}));
    IG_ASSIGN_OR_RETURN(l.wq, ReadExpected(f, name("attn_q"), {dim, q}));
    IG_ASSIGN_OR_RETURN(l.wk, ReadExpected(f, name("attn_k"), {dim, kv}));
    IG_ASSIGN_OR_RETURN(l.wv, ReadExpected(f, name("attn_v"), {dim, kv}));
    IG_ASSIGN_OR_RETURN(l.wo, ReadExpected(f, name("attn_output"), {q, dim}));
    IG_ASSIGN_OR_RETURN(l.ffn_norm, ReadExpected(f, name("ffn_norm"), {dim}));
    IG_ASSIGN_OR_RETURN(l.w1, ReadExpected(f, name("ffn_gate"), {dim, hid}));
    IG_ASSIGN_OR_RETURN(l.w3, ReadExpected(f, name("ffn_up"), {dim, hid}));
    IG_ASSIGN_OR_RETURN(l.w2, ReadExpected(f, name("ffn_down"), {hid, dim}));
    if (gemma) {
      // Its norm gains are stored as used (1 + w), and its rotary pairs are
      // half-split already (llama.cpp's NEOX rotation).
      const int64_t hd = c.head_dim;
      IG_ASSIGN_OR_RETURN(l.q_norm, ReadExpected(f, name("attn_q_norm"), {hd}));
      IG_ASSIGN_OR_RETURN(l.k_norm, ReadExpected(f, name("attn_k_norm"), {hd}));
      IG_ASSIGN_OR_RETURN(l.post_attn_norm,
                          ReadExpected(f, name("post_attention_norm"), {dim}));
      IG_ASSIGN_OR_RETURN(l.post_ffn_norm,
                          ReadExpected(f, name("post_ffw_norm"), {dim}));
    } else {
      // llama.cpp's converter interleaves each head's rotary pairs; undo it.
      PermuteInterleavedToHalfSplit(l.wq, c.n_heads, c.head_dim, c.dim);
      PermuteInterleavedToHalfSplit(l.wk, c.n_kv_heads, c.head_dim, c.dim);
    }
  }
  IG_ASSIGN_OR_RETURN(w.final_norm,
                      ReadExpected(f, "output_norm.weight", {dim}));
  if (f.FindTensor("output.weight") != nullptr) {
    IG_ASSIGN_OR_RETURN(w.lm_head,
                        ReadExpected(f, "output.weight", {dim, vocab}));
  }
  absl::Status s = w.Validate();
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", path, s.message()));
  }
  IG_LOG(INFO) << "loaded GGUF v" << f.version() << " " << path << ": "
               << f.tensors().size() << " tensors (" << TypeHistogram(f)
               << "), " << c.DebugString()
               << (w.lm_head.empty() ? ", tied lm_head" : "");
  return w;
}

// ---------------------------------------------------------------------------
// Tokenizer.

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(
    const std::string& path) {
  IG_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Open(path));
  return LoadGgufTokenizer(f);
}

namespace {

// tokenizer.ggml.token_type, empty when absent.
absl::StatusOr<std::vector<TokenType>> ReadTokenTypes(const GgufFile& f) {
  std::vector<TokenType> out;
  if (f.Find("tokenizer.ggml.token_type") == nullptr) return out;
  IG_ASSIGN_OR_RETURN(const std::vector<int64_t>* types,
                      f.GetIntArray("tokenizer.ggml.token_type"));
  out.reserve(types->size());
  for (int64_t t : *types) {
    if (t < 0 || t > static_cast<int64_t>(TokenType::kByte)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tokenizer.ggml.token_type holds unknown type %d", f.path(), t));
    }
    out.push_back(static_cast<TokenType>(t));
  }
  return out;
}

// A SentencePiece vocabulary (tokenizer.ggml.model == "llama"). Absent keys
// take llama.cpp's defaults for this model: bos 1, eos 2, unk 0, BOS added,
// a dummy space prefix, all scores 0.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSpmTokenizer(
    const GgufFile& f) {
  const std::string& path = f.path();
  SpmVocabulary vocab;
  IG_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens,
                      f.GetStringArray("tokenizer.ggml.tokens"));
  vocab.tokens = *tokens;
  if (const GgufValue* scores = f.Find("tokenizer.ggml.scores")) {
    if (scores->type != GgufValueType::kArray ||
        (scores->element_type != GgufValueType::kFloat32 &&
         scores->element_type != GgufValueType::kFloat64)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tokenizer.ggml.scores is not an array of floats", path));
    }
    vocab.scores.assign(scores->float_array.begin(),
                        scores->float_array.end());
  }
  IG_ASSIGN_OR_RETURN(vocab.types, ReadTokenTypes(f));
  IG_ASSIGN_OR_RETURN(int64_t bos,
                      f.GetIntOr("tokenizer.ggml.bos_token_id", 1));
  IG_ASSIGN_OR_RETURN(int64_t eos,
                      f.GetIntOr("tokenizer.ggml.eos_token_id", 2));
  IG_ASSIGN_OR_RETURN(int64_t unk,
                      f.GetIntOr("tokenizer.ggml.unknown_token_id", 0));
  vocab.bos_id = static_cast<int>(bos);
  vocab.eos_id = static_cast<int>(eos);
  vocab.unk_id = static_cast<int>(unk);
  IG_ASSIGN_OR_RETURN(vocab.add_bos,
                      f.GetBoolOr("tokenizer.ggml.add_bos_token", true));
  IG_ASSIGN_OR_RETURN(vocab.add_space_prefix,
                      f.GetBoolOr("tokenizer.ggml.add_space_prefix", true));
  absl::StatusOr<std::unique_ptr<SpmTokenizer>> t =
      SpmTokenizer::Create(std::move(vocab));
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", path, t.status().message()));
  }
  return std::unique_ptr<Tokenizer>(std::move(t).value());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(
    const GgufFile& f) {
  const std::string& path = f.path();
  IG_ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
  if (model == "llama") return LoadSpmTokenizer(f);
  if (model != "gpt2") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unsupported tokenizer model %s in %s (supported: gpt2 byte-level "
        "BPE, llama SentencePiece)",
        model, path));
  }
  BpeVocabulary vocab;
  IG_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens,
                      f.GetStringArray("tokenizer.ggml.tokens"));
  vocab.tokens = *tokens;
  IG_ASSIGN_OR_RETURN(const std::vector<std::string>* merges,
                      f.GetStringArray("tokenizer.ggml.merges"));
  vocab.merges = *merges;
  IG_ASSIGN_OR_RETURN(vocab.types, ReadTokenTypes(f));
  IG_ASSIGN_OR_RETURN(int64_t bos,
                      f.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  IG_ASSIGN_OR_RETURN(int64_t eos,
                      f.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  IG_ASSIGN_OR_RETURN(int64_t unk,
                      f.GetIntOr("tokenizer.ggml.unknown_token_id", -1));
  vocab.bos_id = static_cast<int>(bos);
  vocab.eos_id = static_cast<int>(eos);
  vocab.unk_id = static_cast<int>(unk);
  IG_ASSIGN_OR_RETURN(vocab.add_bos,
                      f.GetBoolOr("tokenizer.ggml.add_bos_token", false));

  // llama.cpp's pre-tokenizer names (llama-vocab.cpp): these split every
  // digit off before the GPT-2 rule; the rest of the known GPT-2-style ones
  // use the rule as is.
  std::string pre = "default";
  if (f.Find("tokenizer.ggml.pre") != nullptr) {
    IG_ASSIGN_OR_RETURN(pre, f.GetString("tokenizer.ggml.pre"));
  }
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" ||
      pre == "command-r" || pre == "codeshell" || pre == "exaone" ||
      pre == "minerva-7b") {
    vocab.pre_tokenizer = BpePreTokenizer::kDigitsThenGpt2;
  } else if (pre == "default" || pre == "gpt2" || pre == "gpt-2" ||
             pre == "mpt" || pre == "olmo" || pre == "jais") {
    vocab.pre_tokenizer = BpePreTokenizer::kGpt2;
  } else {
    IG_LOG(WARNING) << path << ": pre-tokenizer " << pre
                    << " is not implemented; using GPT-2's, so tokenization "
                       "may differ from the model's own";
    vocab.pre_tokenizer = BpePreTokenizer::kGpt2;
  }

  absl::StatusOr<std::unique_ptr<BpeTokenizer>> t =
      BpeTokenizer::Create(std::move(vocab));
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", path, t.status().message()));
  }
  return std::unique_ptr<Tokenizer>(std::move(t).value());
}

}  // namespace infinigen::model
