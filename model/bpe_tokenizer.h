// BpeTokenizer: byte-level BPE as GPT-2 and SmolLM2 use it.
//
// Text is split into special tokens (control and user-defined tokens written
// literally, e.g. "<|im_start|>") and ordinary text; ordinary text is
// pre-tokenized into words with the GPT-2 rule
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (SmolLM2 / StarCoder first split off every digit on its own), each word's
// bytes are mapped to GPT-2's printable byte alphabet, and the word is merged
// pair by pair, lowest merge rank first. Decoding maps the alphabet back to
// bytes; control tokens decode to nothing.
//
// Immutable after Create(); Encode and DecodeToken are thread-safe.
#ifndef INFINIGEN_MODEL_BPE_TOKENIZER_H_
#define INFINIGEN_MODEL_BPE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "model/tokenizer.h"

namespace infinigen::model {

// Token kinds, numbered as llama.cpp writes tokenizer.ggml.token_type.
enum class TokenType : int {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // <|endoftext|>, <|im_start|>: decodes to nothing
  kUserDefined = 4,  // matched literally, decodes to its text
  kUnused = 5,
  kByte = 6,
};

// How ordinary text is split into words before merging.
enum class BpePreTokenizer {
  kGpt2,            // the GPT-2 rule above
  kDigitsThenGpt2,  // every digit alone first, then GPT-2 (SmolLM, StarCoder)
};

// Everything a BpeTokenizer is built from; GGUF's tokenizer.ggml.* keys map
// one to one.
struct BpeVocabulary {
  std::vector<std::string> tokens;  // in GPT-2's byte alphabet ("Ġthe")
  std::vector<std::string> merges;  // "Ġ t"; rank = index, lower merges first
  std::vector<TokenType> types;     // empty: all kNormal
  int bos_id = -1;
  int eos_id = -1;
  int unk_id = -1;  // used for bytes the vocabulary cannot spell
  // Whether Encode(text, /*add_bos=*/true) prepends bos_id
  // (tokenizer.ggml.add_bos_token). GPT-2 and SmolLM2 say no.
  bool add_bos = false;
  BpePreTokenizer pre_tokenizer = BpePreTokenizer::kGpt2;
  // Whether control and user-defined token texts in the input encode to
  // their ids (as Hugging Face tokenizers do) instead of being spelled out.
  bool parse_special = true;
};

class BpeTokenizer final : public Tokenizer {
 public:
  // InvalidArgument for an empty vocabulary, special ids out of range, a
  // types vector of the wrong size or a merge that is not "left right".
  // Merges whose parts or result are not tokens are ignored.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Create(
      BpeVocabulary vocab);

  // BOS first only when `add_bos` and the vocabulary's add_bos are both set.
  std::vector<int> Encode(std::string_view text, bool add_bos) const override;
  // The bytes of `token` ("" for control tokens and ids out of range);
  // `prev` does not matter for byte-level BPE.
  std::string DecodeToken(int prev, int token) const override;

  bool adds_bos() const override { return add_bos_ && bos_id_ >= 0; }
  bool IsControl(int token) const override {
    return token >= 0 && token < vocab_size() &&
           types_[token] == TokenType::kControl;
  }
  int vocab_size() const override { return static_cast<int>(tokens_.size()); }
  int bos_id() const override { return bos_id_; }
  int eos_id() const override { return eos_id_; }

  // The id of a token text in the byte alphabet, -1 if none.
  int TokenId(const std::string& token) const;
  const std::string& TokenText(int id) const { return tokens_[id]; }

  // The words `text` pre-tokenizes into (exposed for tests).
  std::vector<std::string_view> PreTokenize(std::string_view text) const;

 private:
  BpeTokenizer() = default;

  struct Merge {
    int rank;
    int result;
  };
  // Appends the ids of one pre-tokenized word.
  void EncodeWord(std::string_view word, std::vector<int>& out) const;
  void EncodeText(
      std::string_view text, std::vector<int>& out,
      std::unordered_map<std::string, std::vector<int>>& cache) const;

  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  std::vector<std::string> decoded_;  // bytes of each token
  std::unordered_map<std::string, int> token_ids_;
  // (left id << 32 | right id) -> merge.
  std::unordered_map<uint64_t, Merge> merges_;
  int byte_token_[256];  // id of each byte's single-character token, or -1
  // Literal texts matched before pre-tokenization, longest first.
  std::vector<std::pair<std::string, int>> specials_;
  int bos_id_ = -1;
  int eos_id_ = -1;
  int unk_id_ = -1;
  bool add_bos_ = false;
  BpePreTokenizer pre_tokenizer_ = BpePreTokenizer::kGpt2;
};

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_BPE_TOKENIZER_H_
