// llama2.c checkpoints and tokenizers (karpathy/llama2.c, legacy format).
//
// Checkpoint: a 28-byte header of 7 int32 (dim, hidden_dim, n_layers,
// n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the
// classifier is stored separately), then fp32 tensors in run.c's order,
// including two legacy RoPE tables that are skipped.
// Tokenizer: int32 max_token_length, then per token a float score, an int32
// length and the piece's bytes.
#ifndef INFINIGEN_MODEL_LLAMA2C_H_
#define INFINIGEN_MODEL_LLAMA2C_H_

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace infinigen::model {

// Reads a llama2.c checkpoint. NotFound for a missing file; InvalidArgument
// naming the file for a bad header or a size that does not match it.
absl::StatusOr<Weights> LoadLlama2cWeights(const std::string& path);

// llama2.c's sentencepiece-style tokenizer: pieces with merge scores, byte
// fallback (<0xXX> at id byte + 3), a dummy-prefix space, BOS = 1, EOS = 2.
// Encoding merges the adjacent pair whose merged piece has the highest score
// (leftmost on ties) until none is left, exactly as run.c's encode() does,
// but in O(n log n) with a heap so that whole books encode quickly.
class Llama2cTokenizer final : public Tokenizer {
 public:
  // `vocab_size` comes from the model; the file must hold that many pieces.
  static absl::StatusOr<std::unique_ptr<Llama2cTokenizer>> Load(
      const std::string& path, int vocab_size);
  // From pieces and scores directly (tests).
  Llama2cTokenizer(std::vector<std::string> pieces, std::vector<float> scores);

  std::vector<int> Encode(std::string_view text, bool add_bos) const override;
  std::string DecodeToken(int prev, int token) const override;
  bool adds_bos() const override { return true; }
  bool IsControl(int token) const override { return token >= 0 && token <= 2; }
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  int bos_id() const override { return 1; }
  int eos_id() const override { return 2; }

 private:
  int Lookup(std::string_view piece) const;  // -1 if absent

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string_view, int> ids_;  // views into pieces_
};

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_LLAMA2C_H_
