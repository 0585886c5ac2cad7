// Tokenizer: text <-> token ids for one model.
//
// Implementations: llama2.c's sentencepiece-style vocabulary (tok512.bin),
// GGUF byte-level BPE (GPT-2 style) and GGUF SentencePiece (spm_tokenizer.h).
// Immutable after loading; thread-safe.
#ifndef INFINIGEN_MODEL_TOKENIZER_H_
#define INFINIGEN_MODEL_TOKENIZER_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace infinigen::model {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text`, with the BOS token first when `add_bos` and the
  // model's text starts with one (adds_bos()).
  virtual std::vector<int> Encode(std::string_view text, bool add_bos) const = 0;

  // The text of `token` when it follows `prev` (-1 at the start): llama2.c
  // drops the leading space of the first piece after BOS. Byte tokens give
  // their raw byte, so a multi-byte character may span several calls.
  virtual std::string DecodeToken(int prev, int token) const = 0;

  // The concatenated text of `tokens` (BOS/EOS/control tokens give nothing).
  virtual std::string Decode(const std::vector<int>& tokens) const;

  // Whether the model's sequences start with BOS (llama2.c: yes; GGUF:
  // tokenizer.ggml.add_bos_token).
  virtual bool adds_bos() const = 0;
  // Control tokens (BOS, EOS, chat markers) decode to nothing; generating
  // one ends a continuation.
  virtual bool IsControl(int token) const = 0;

  virtual int vocab_size() const = 0;
  virtual int bos_id() const = 0;  // -1 if none
  virtual int eos_id() const = 0;  // -1 if none
};

// A vocabulary's consistency, for the tokenizers' Create: `kind` names it
// in the message ("BPE", "SPM"); `types` (and `scores`, -1: none) sizes
// must be 0 or n; the special ids -1 or inside the vocabulary.
absl::Status CheckVocabulary(const char* kind, int n, size_t types,
                             long scores, int bos, int eos, int unk);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_TOKENIZER_H_
