// SpmTokenizer: SentencePiece-style BPE as llama.cpp runs it for GGUF files
// whose tokenizer.ggml.model is "llama" (Llama 1/2, Mistral, Gemma).
//
// Encode, as llama.cpp's llm_tokenizer_spm (llama-vocab.cpp):
//   1. The text is split on special tokens written literally: user-defined
//      tokens always (Gemma's runs of spaces, tabs and newlines, "<b>",
//      "<table>", ...), control tokens too when parse_special is set
//      ("<start_of_turn>" -> 105, as the BPE tokenizer and Hugging Face do).
//      At each position the longest special token wins; the scan goes left
//      to right.
//   2. Each remaining fragment gets a leading space when add_space_prefix is
//      set and it starts the text or follows a special token; every ' '
//      becomes U+2581 ('▁').
//   3. The fragment is cut into UTF-8 characters, which merge pairwise: a
//      max-heap holds every adjacent pair whose concatenation is a
//      vocabulary piece, keyed by that piece's score (ties: leftmost first);
//      the best pair merges, its neighbours' pairs are queued, and so on
//      until no pair is a piece. O(n log n) in the fragment's length.
//   4. Each final symbol is its piece's id; a character that is no piece
//      becomes the ids of its bytes' "<0xNN>" tokens (byte fallback), or the
//      unknown token when the vocabulary has no such byte token.
//
// DecodeToken, as llama.cpp's token_to_piece without special tokens: normal
// pieces with '▁' back to ' ', byte tokens to their raw byte, user-defined
// tokens to their text, control / unknown / unused tokens to nothing. With
// add_space_prefix, the first piece (prev -1 or BOS) loses its leading space.
//
// Hugging Face's tokenizer built from the same GGUF (transformers 5) agrees
// except in two cases, where this follows llama.cpp: a run of more than 31
// spaces (Hugging Face merges it as BPE pieces, 40 -> 16 + 24 spaces; here
// the user-defined runs split longest first, 31 + 9), and a literal U+2581 in
// the input (Hugging Face respells Gemma's space-run tokens with it, so "▁▁"
// typed in the text becomes one token there; here it stays two).
//
// Immutable after Create(); Encode and DecodeToken are thread-safe.
#ifndef INFINIGEN_MODEL_SPM_TOKENIZER_H_
#define INFINIGEN_MODEL_SPM_TOKENIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "model/bpe_tokenizer.h"  // TokenType
#include "model/tokenizer.h"

namespace infinigen::model {

// Everything an SpmTokenizer is built from; GGUF's tokenizer.ggml.* keys map
// one to one.
struct SpmVocabulary {
  std::vector<std::string> tokens;  // pieces, U+2581 for a space
  std::vector<float> scores;        // higher merges first; empty: all 0
  std::vector<TokenType> types;     // empty: all kNormal
  int bos_id = -1;
  int eos_id = -1;
  int unk_id = -1;  // for bytes that have no "<0xNN>" token
  // Whether Encode(text, /*add_bos=*/true) prepends bos_id
  // (tokenizer.ggml.add_bos_token).
  bool add_bos = true;
  // SentencePiece's dummy prefix (tokenizer.ggml.add_space_prefix): a space
  // before the text and after each special token. Gemma: false.
  bool add_space_prefix = false;
  // Whether control token texts in the input encode to their ids (as Hugging
  // Face tokenizers and the BPE tokenizer do); user-defined tokens always
  // do.
  bool parse_special = true;
};

class SpmTokenizer final : public Tokenizer {
 public:
  // InvalidArgument for an empty vocabulary, special ids out of range, or
  // scores / types vectors of the wrong size.
  static absl::StatusOr<std::unique_ptr<SpmTokenizer>> Create(
      SpmVocabulary vocab);

  // BOS first only when `add_bos` and the vocabulary's add_bos are both set.
  std::vector<int> Encode(std::string_view text, bool add_bos) const override;
  // See the file comment; "" for ids out of range.
  std::string DecodeToken(int prev, int token) const override;

  bool adds_bos() const override { return add_bos_ && bos_id_ >= 0; }
  bool IsControl(int token) const override {
    return token >= 0 && token < vocab_size() &&
           types_[token] == TokenType::kControl;
  }
  int vocab_size() const override { return static_cast<int>(tokens_.size()); }
  int bos_id() const override { return bos_id_; }
  int eos_id() const override { return eos_id_; }

  // The id of a piece ("▁the", "<0x0A>"), -1 if none.
  int TokenId(std::string_view piece) const;
  const std::string& TokenText(int id) const { return tokens_[id]; }

 private:
  SpmTokenizer() = default;

  // Appends the ids of one fragment of ordinary text (spaces already '▁').
  void EncodeFragment(std::string_view text, std::vector<int>& out) const;
  // The longest special token starting at text[pos]: its length in bytes
  // (0 if none) and id.
  std::pair<size_t, int> MatchSpecial(std::string_view text, size_t pos) const;

  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::vector<TokenType> types_;
  std::vector<std::string> decoded_;  // what DecodeToken gives for each id
  // Piece -> id (views into tokens_; the last of duplicates wins, as in
  // llama.cpp).
  absl::flat_hash_map<std::string_view, int, std::hash<std::string_view>>
      token_ids_;
  int byte_token_[256];  // id for each byte's fallback, or -1

  // A byte trie of the special tokens that Encode matches literally.
  struct TrieNode {
    int id = -1;  // the special token ending here, or -1
    std::vector<std::pair<uint8_t, int>> children;  // byte -> node index
  };
  std::vector<TrieNode> trie_;  // trie_[0] is the root
  int root_child_[256];         // the root's children, by byte (-1: none)

  int bos_id_ = -1;
  int eos_id_ = -1;
  int unk_id_ = -1;
  bool add_bos_ = true;
  bool add_space_prefix_ = false;
};

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_SPM_TOKENIZER_H_
