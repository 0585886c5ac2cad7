#include "model/llama2c.h"

#include <cstdint>
#include <cstring>
#include <queue>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"
#include "common/utf8.h"

namespace infinigen::model {
namespace {

constexpr size_t kHeaderInts = 7;
constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

// Reads consecutive fp32 tensors from the body, failing on a short file.
class TensorReader {
 public:
  TensorReader(const MappedFile& file, size_t offset)
      : file_(file), offset_(offset) {}

  absl::Status Read(const char* name, size_t count, std::vector<float>* out) {
    IG_RETURN_IF_ERROR(Need(name, count));
    out->resize(count);
    std::memcpy(out->data(), file_.data() + offset_, count * sizeof(float));
    offset_ += count * sizeof(float);
    return absl::OkStatus();
  }
  absl::Status Skip(const char* name, size_t count) {
    IG_RETURN_IF_ERROR(Need(name, count));
    offset_ += count * sizeof(float);
    return absl::OkStatus();
  }
  const float* At(size_t offset_floats) const {
    return reinterpret_cast<const float*>(file_.data() + offset_) +
           offset_floats;
  }
  size_t offset() const { return offset_; }

 private:
  absl::Status Need(const char* name, size_t count) const {
    if (offset_ + count * sizeof(float) > file_.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: truncated llama2.c checkpoint: tensor %s needs %d bytes at "
          "offset %d, file has %d",
          file_.path(), name, count * sizeof(float), offset_, file_.size()));
    }
    return absl::OkStatus();
  }
  const MappedFile& file_;
  size_t offset_;
};

// Reads `n_layers` stacked (rows x cols) matrices into each layer's field.
absl::Status ReadStacked(TensorReader& r, const char* name,
                         std::vector<LayerWeights>& layers, size_t per_layer,
                         std::vector<float> LayerWeights::*field) {
  std::vector<float> all;
  IG_RETURN_IF_ERROR(r.Read(name, per_layer * layers.size(), &all));
  for (size_t l = 0; l < layers.size(); ++l) {
    (layers[l].*field)
        .assign(all.begin() + l * per_layer, all.begin() + (l + 1) * per_layer);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Weights> LoadLlama2cWeights(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  if (file.size() < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: too short for a llama2.c checkpoint (%d bytes, header needs %d)",
        path, file.size(), kHeaderBytes));
  }
  int32_t h[kHeaderInts];
  std::memcpy(h, file.data(), kHeaderBytes);
  Weights w;
  ModelConfig& c = w.config;
  c.arch = Architecture::kLlama;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  const bool shared_classifier = h[5] > 0;
  c.vocab_size = h[5] > 0 ? h[5] : -h[5];
  c.max_seq_len = h[6];
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  c.norm_eps = 1e-5f;
  c.rope_theta = 10000.0f;
  c.bos_id = 1;
  c.eos_id = 2;
  absl::Status valid = c.Validate();
  if (!valid.ok() || c.dim % c.n_heads != 0 || c.dim > (1 << 16) ||
      c.n_layers > 1024 || c.vocab_size > (1 << 22) ||
      c.max_seq_len > (1 << 22)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: not a llama2.c checkpoint: implausible header (%s)%s", path,
        c.DebugString(), valid.ok() ? "" : ": " + std::string(valid.message())));
  }

  const size_t dim = c.dim, hid = c.hidden_dim, q = c.q_dim(),
               kv = c.kv_dim();
  w.layers.resize(c.n_layers);
  TensorReader r(file, kHeaderBytes);
  IG_RETURN_IF_ERROR(
      r.Read("token_embedding", size_t(c.vocab_size) * dim, &w.token_embedding));
  IG_RETURN_IF_ERROR(
      ReadStacked(r, "rms_att_weight", w.layers, dim, &LayerWeights::attn_norm));
  IG_RETURN_IF_ERROR(ReadStacked(r, "wq", w.layers, q * dim, &LayerWeights::wq));
  IG_RETURN_IF_ERROR(ReadStacked(r, "wk", w.layers, kv * dim, &LayerWeights::wk));
  IG_RETURN_IF_ERROR(ReadStacked(r, "wv", w.layers, kv * dim, &LayerWeights::wv));
  IG_RETURN_IF_ERROR(ReadStacked(r, "wo", w.layers, dim * q, &LayerWeights::wo));
  IG_RETURN_IF_ERROR(
      ReadStacked(r, "rms_ffn_weight", w.layers, dim, &LayerWeights::ffn_norm));
  IG_RETURN_IF_ERROR(ReadStacked(r, "w1", w.layers, hid * dim, &LayerWeights::w1));
  IG_RETURN_IF_ERROR(ReadStacked(r, "w2", w.layers, dim * hid, &LayerWeights::w2));
  IG_RETURN_IF_ERROR(ReadStacked(r, "w3", w.layers, hid * dim, &LayerWeights::w3));
  IG_RETURN_IF_ERROR(r.Read("rms_final_weight", dim, &w.final_norm));
  // Legacy freq_cis_real and freq_cis_imag; RoPE is computed instead.
  const size_t rope_table = size_t(c.max_seq_len) * c.head_dim / 2;
  IG_RETURN_IF_ERROR(r.Skip("freq_cis_real", rope_table));
  IG_RETURN_IF_ERROR(r.Skip("freq_cis_imag", rope_table));
  if (!shared_classifier) {
    IG_RETURN_IF_ERROR(
        r.Read("wcls", size_t(c.vocab_size) * dim, &w.lm_head));
  }
  if (r.offset() != file.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d trailing bytes after the last tensor: the header does not "
        "match the file",
        path, file.size() - r.offset()));
  }
  for (LayerWeights& l : w.layers) {
    PermuteInterleavedToHalfSplit(l.wq, c.n_heads, c.head_dim, c.dim);
    PermuteInterleavedToHalfSplit(l.wk, c.n_kv_heads, c.head_dim, c.dim);
  }
  IG_RETURN_IF_ERROR(w.Validate());
  return w;
}

absl::StatusOr<std::unique_ptr<Llama2cTokenizer>> Llama2cTokenizer::Load(
    const std::string& path, int vocab_size) {
  IG_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path));
  const uint8_t* p = file.data();
  const uint8_t* end = p + file.size();
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: not a llama2.c tokenizer for a vocab of %d: %s", path,
        vocab_size, what));
  };
  if (end - p < 4) return bad("file shorter than its header");
  p += 4;  // max_token_length, not needed
  std::vector<std::string> pieces;
  std::vector<float> scores;
  pieces.reserve(vocab_size);
  scores.reserve(vocab_size);
  for (int i = 0; i < vocab_size; ++i) {
    if (end - p < 8) {
      return bad(absl::StrFormat("truncated at token %d", i));
    }
    float score;
    int32_t len;
    std::memcpy(&score, p, 4);
    std::memcpy(&len, p + 4, 4);
    p += 8;
    if (len < 0 || end - p < len) {
      return bad(absl::StrFormat("token %d has a bad length %d", i, len));
    }
    pieces.emplace_back(reinterpret_cast<const char*>(p), len);
    scores.push_back(score);
    p += len;
  }
  if (p != end) {
    return bad(absl::StrFormat("%d trailing bytes after %d tokens", end - p,
                               vocab_size));
  }
  return std::make_unique<Llama2cTokenizer>(std::move(pieces),
                                            std::move(scores));
}

Llama2cTokenizer::Llama2cTokenizer(std::vector<std::string> pieces,
                                   std::vector<float> scores)
    : pieces_(std::move(pieces)), scores_(std::move(scores)) {
  ids_.reserve(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    ids_.emplace(std::string_view(pieces_[i]), static_cast<int>(i));
  }
}

int Llama2cTokenizer::Lookup(std::string_view piece) const {
  auto it = ids_.find(piece);
  return it == ids_.end() ? -1 : it->second;
}

std::vector<int> Llama2cTokenizer::Encode(std::string_view text,
                                          bool add_bos) const {
  // Symbols form a doubly linked list over the initial tokens; merging a
  // pair keeps the left symbol and unlinks the right one.
  struct Symbol {
    int id;
    int prev;
    int next;
    int start;  // byte offset in `source`, fixes the left-to-right order
    int len;
  };
  std::string source;
  std::vector<Symbol> sym;
  if (!text.empty()) {
    source.reserve(text.size() + 1);
    source.push_back(' ');  // dummy prefix, as sentencepiece adds
    source.append(text);
    sym.reserve(source.size());
    size_t i = 0;
    while (i < source.size()) {
      // One UTF-8 codepoint: a lead byte and up to three continuation bytes.
      size_t n = 1;
      while (i + n < source.size() && n < 4 &&
             utf8::IsContinuation(static_cast<uint8_t>(source[i + n]))) {
        ++n;
      }
      int id = Lookup(std::string_view(source).substr(i, n));
      if (id >= 0) {
        sym.push_back({id, 0, 0, static_cast<int>(i), static_cast<int>(n)});
      } else {
        for (size_t b = 0; b < n; ++b) {  // byte fallback: <0xXX> = byte + 3
          sym.push_back({static_cast<uint8_t>(source[i + b]) + 3, 0, 0,
                         static_cast<int>(i + b), 1});
        }
      }
      i += n;
    }
  }
  const int n_sym = static_cast<int>(sym.size());
  for (int i = 0; i < n_sym; ++i) {
    sym[i].prev = i - 1;
    sym[i].next = i + 1 < n_sym ? i + 1 : -1;
  }

  struct Candidate {
    float score;
    int left;    // symbol index
    int start;   // sym[left].start when queued
    int len;     // combined length when queued: detects stale entries
    int id;
  };
  auto worse = [](const Candidate& a, const Candidate& b) {
    if (a.score != b.score) return a.score < b.score;
    return a.start > b.start;  // leftmost wins ties
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> heap(
      worse);
  auto push_pair = [&](int left) {
    if (left < 0) return;
    int right = sym[left].next;
    if (right < 0) return;
    std::string_view merged = std::string_view(source).substr(
        sym[left].start, sym[left].len + sym[right].len);
    int id = Lookup(merged);
    if (id < 0) return;
    heap.push({scores_[id], left, sym[left].start,
               sym[left].len + sym[right].len, id});
  };
  for (int i = 0; i + 1 < n_sym; ++i) push_pair(i);
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    Symbol& l = sym[c.left];
    if (l.len == 0 || l.next < 0) continue;  // merged away
    Symbol& r = sym[l.next];
    if (l.len + r.len != c.len) continue;  // a side changed since queued
    l.id = c.id;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = c.left;
    push_pair(l.prev);
    push_pair(c.left);
  }

  std::vector<int> out;
  out.reserve(n_sym + 1);
  if (add_bos) out.push_back(bos_id());
  for (int i = n_sym > 0 ? 0 : -1; i >= 0; i = sym[i].next) {
    out.push_back(sym[i].id);
  }
  return out;
}

std::string Llama2cTokenizer::DecodeToken(int prev, int token) const {
  if (token < 0 || token >= vocab_size()) return "";
  if (IsControl(token)) return "";
  std::string_view piece = pieces_[token];
  // After BOS, sentencepiece's dummy-prefix space is dropped.
  if (prev == bos_id() && !piece.empty() && piece[0] == ' ') {
    piece.remove_prefix(1);
  }
  unsigned int byte;
  if (piece.size() == 6 && std::sscanf(std::string(piece).c_str(),
                                       "<0x%02X>", &byte) == 1) {
    return std::string(1, static_cast<char>(byte));
  }
  return std::string(piece);
}

}  // namespace infinigen::model
