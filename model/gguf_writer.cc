#include "model/gguf_writer.h"

#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/strings/str_format.h"

namespace infinigen::model {
namespace {

template <typename T>
void Put(std::string& out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out.append(buf, sizeof(T));
}

void PutString(std::string& out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out += s;
}

void PutType(std::string& out, GgufValueType t) {
  Put<uint32_t>(out, static_cast<uint32_t>(t));
}

void Pad(std::string& out, size_t alignment) {
  out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
}

}  // namespace

void GgufWriter::Key(const std::string& key, GgufValueType type) {
  ++kv_count_;
  PutString(kv_, key);
  PutType(kv_, type);
}

void GgufWriter::SetAlignment(uint32_t alignment) {
  alignment_ = alignment;
  if (alignment != 32) AddUint32("general.alignment", alignment);
}

void GgufWriter::AddUint8(const std::string& key, uint8_t v) {
  Key(key, GgufValueType::kUint8);
  Put(kv_, v);
}
void GgufWriter::AddInt8(const std::string& key, int8_t v) {
  Key(key, GgufValueType::kInt8);
  Put(kv_, v);
}
void GgufWriter::AddUint16(const std::string& key, uint16_t v) {
  Key(key, GgufValueType::kUint16);
  Put(kv_, v);
}
void GgufWriter::AddInt16(const std::string& key, int16_t v) {
  Key(key, GgufValueType::kInt16);
  Put(kv_, v);
}
void GgufWriter::AddUint32(const std::string& key, uint32_t v) {
  Key(key, GgufValueType::kUint32);
  Put(kv_, v);
}
void GgufWriter::AddInt32(const std::string& key, int32_t v) {
  Key(key, GgufValueType::kInt32);
  Put(kv_, v);
}
void GgufWriter::AddUint64(const std::string& key, uint64_t v) {
  Key(key, GgufValueType::kUint64);
  Put(kv_, v);
}
void GgufWriter::AddInt64(const std::string& key, int64_t v) {
  Key(key, GgufValueType::kInt64);
  Put(kv_, v);
}
void GgufWriter::AddFloat32(const std::string& key, float v) {
  Key(key, GgufValueType::kFloat32);
  Put(kv_, v);
}
void GgufWriter::AddFloat64(const std::string& key, double v) {
  Key(key, GgufValueType::kFloat64);
  Put(kv_, v);
}
void GgufWriter::AddBool(const std::string& key, bool v) {
  Key(key, GgufValueType::kBool);
  Put<uint8_t>(kv_, v ? 1 : 0);
}
void GgufWriter::AddString(const std::string& key, const std::string& v) {
  Key(key, GgufValueType::kString);
  PutString(kv_, v);
}

void GgufWriter::AddStringArray(const std::string& key,
                                const std::vector<std::string>& v) {
  Key(key, GgufValueType::kArray);
  PutType(kv_, GgufValueType::kString);
  Put<uint64_t>(kv_, v.size());
  for (const std::string& s : v) PutString(kv_, s);
}

void GgufWriter::AddInt32Array(const std::string& key,
                               const std::vector<int32_t>& v) {
  Key(key, GgufValueType::kArray);
  PutType(kv_, GgufValueType::kInt32);
  Put<uint64_t>(kv_, v.size());
  for (int32_t x : v) Put(kv_, x);
}

void GgufWriter::AddFloat32Array(const std::string& key,
                                 const std::vector<float>& v) {
  Key(key, GgufValueType::kArray);
  PutType(kv_, GgufValueType::kFloat32);
  Put<uint64_t>(kv_, v.size());
  for (float x : v) Put(kv_, x);
}

void GgufWriter::AddNestedUint8Array(
    const std::string& key, const std::vector<std::vector<uint8_t>>& v) {
  Key(key, GgufValueType::kArray);
  PutType(kv_, GgufValueType::kArray);
  Put<uint64_t>(kv_, v.size());
  for (const auto& inner : v) {
    PutType(kv_, GgufValueType::kUint8);
    Put<uint64_t>(kv_, inner.size());
    for (uint8_t x : inner) Put(kv_, x);
  }
}

void GgufWriter::AddTensor(const std::string& name,
                           const std::vector<int64_t>& shape, uint32_t type,
                           std::string bytes) {
  tensors_.push_back({name, shape, type, std::move(bytes)});
}

void GgufWriter::AddF32Tensor(const std::string& name,
                              const std::vector<int64_t>& shape,
                              const std::vector<float>& values) {
  std::string bytes(values.size() * sizeof(float), '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  AddTensor(name, shape, static_cast<uint32_t>(GgmlType::kF32),
            std::move(bytes));
}

std::string GgufWriter::Serialize() const {
  std::string out;
  Put(out, magic_);
  Put(out, version_);
  Put<uint64_t>(out, tensors_.size());
  Put<uint64_t>(out, kv_count_);
  out += kv_;
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, t.shape.size());
    for (int64_t d : t.shape) Put(out, d);
    Put(out, t.type);
    Put(out, offset);
    offset += (t.bytes.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  Pad(out, alignment_);
  for (const Tensor& t : tensors_) {
    out += t.bytes;
    Pad(out, alignment_);
  }
  return out;
}

absl::Status GgufWriter::WriteFile(const std::string& path) const {
  const std::string bytes = Serialize();
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"),
                                          &std::fclose);
  if (f == nullptr ||
      std::fwrite(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) {
    return absl::InternalError(absl::StrFormat("cannot write %s", path));
  }
  return absl::OkStatus();
}

void PermuteHalfSplitToInterleaved(std::vector<float>& w, int n_heads,
                                   int head_dim, int cols) {
  std::vector<float> out(w.size());
  const int half = head_dim / 2;
  for (int h = 0; h < n_heads; ++h) {
    for (int j = 0; j < head_dim; ++j) {
      const int src = (j % 2 == 0) ? j / 2 : j / 2 + half;
      std::memcpy(&out[(size_t(h) * head_dim + j) * cols],
                  &w[(size_t(h) * head_dim + src) * cols],
                  sizeof(float) * cols);
    }
  }
  w.swap(out);
}

void AddLlamaModel(const Weights& w, const BpeVocabulary* vocab,
                   GgufWriter& writer) {
  const ModelConfig& c = w.config;
  writer.AddString("general.architecture", "llama");
  writer.AddString("general.name", "test-llama");
  writer.AddUint32("llama.context_length", c.max_seq_len);
  writer.AddUint32("llama.embedding_length", c.dim);
  writer.AddUint32("llama.feed_forward_length", c.hidden_dim);
  writer.AddUint32("llama.block_count", c.n_layers);
  writer.AddUint32("llama.attention.head_count", c.n_heads);
  writer.AddUint32("llama.attention.head_count_kv", c.n_kv_heads);
  writer.AddUint32("llama.rope.dimension_count", c.head_dim);
  writer.AddFloat32("llama.rope.freq_base", c.rope_theta);
  writer.AddFloat32("llama.attention.layer_norm_rms_epsilon", c.norm_eps);
  writer.AddUint32("llama.vocab_size", c.vocab_size);
  if (vocab != nullptr) {
    writer.AddString("tokenizer.ggml.model", "gpt2");
    writer.AddString("tokenizer.ggml.pre",
                     vocab->pre_tokenizer == BpePreTokenizer::kDigitsThenGpt2
                         ? "smollm"
                         : "gpt2");
    writer.AddStringArray("tokenizer.ggml.tokens", vocab->tokens);
    std::vector<int32_t> types;
    for (TokenType t : vocab->types) types.push_back(static_cast<int32_t>(t));
    if (!types.empty())
      writer.AddInt32Array("tokenizer.ggml.token_type", types);
    writer.AddStringArray("tokenizer.ggml.merges", vocab->merges);
    writer.AddBool("tokenizer.ggml.add_bos_token", vocab->add_bos);
    if (vocab->unk_id >= 0) {
      writer.AddUint32("tokenizer.ggml.unknown_token_id", vocab->unk_id);
    }
  }
  if (c.bos_id >= 0) writer.AddUint32("tokenizer.ggml.bos_token_id", c.bos_id);
  if (c.eos_id >= 0) writer.AddUint32("tokenizer.ggml.eos_token_id", c.eos_id);

  const int64_t dim = c.dim, hid = c.hidden_dim, q = c.q_dim(), kv = c.kv_dim(),
                vocab_size = c.vocab_size;
  writer.AddF32Tensor("token_embd.weight", {dim, vocab_size},
                      w.token_embedding);
  for (int i = 0; i < c.n_layers; ++i) {
    const LayerWeights& l = w.layers[i];
    const auto name = [i](const char* t) {
      return absl::StrFormat("blk.%d.%s.weight", i, t);
    };
    std::vector<float> wq = l.wq, wk = l.wk;
    PermuteHalfSplitToInterleaved(wq, c.n_heads, c.head_dim, c.dim);
    PermuteHalfSplitToInterleaved(wk, c.n_kv_heads, c.head_dim, c.dim);
    writer.AddF32Tensor(name("attn_norm"), {dim}, l.attn_norm);
    writer.AddF32Tensor(name("attn_q"), {dim, q}, wq);
    writer.AddF32Tensor(name("attn_k"), {dim, kv}, wk);
    writer.AddF32Tensor(name("attn_v"), {dim, kv}, l.wv);
    writer.AddF32Tensor(name("attn_output"), {q, dim}, l.wo);
    writer.AddF32Tensor(name("ffn_norm"), {dim}, l.ffn_norm);
    writer.AddF32Tensor(name("ffn_gate"), {dim, hid}, l.w1);
    writer.AddF32Tensor(name("ffn_up"), {dim, hid}, l.w3);
    writer.AddF32Tensor(name("ffn_down"), {hid, dim}, l.w2);
  }
  writer.AddF32Tensor("output_norm.weight", {dim}, w.final_norm);
  if (!w.lm_head.empty()) {
    writer.AddF32Tensor("output.weight", {dim, vocab_size}, w.lm_head);
  }
}

}  // namespace infinigen::model
