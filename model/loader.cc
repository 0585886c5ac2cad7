#include "model/loader.h"

#include <sys/stat.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"
#include "model/gguf.h"
#include "model/llama2c.h"
#include "model/safetensors.h"

namespace infinigen::model {
namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::StatusOr<bool> HasGgufMagic(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile f, MappedFile::Open(path));
  return f.size() >= 4 && std::memcmp(f.data(), "GGUF", 4) == 0;
}

// A separate tokenizer file: a GGUF file's vocabulary, or a llama2.c
// tokenizer with the model's vocabulary size.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFile(
    const std::string& path, int vocab_size) {
  IG_ASSIGN_OR_RETURN(bool gguf, HasGgufMagic(path));
  std::unique_ptr<Tokenizer> tok;
  if (gguf) {
    IG_ASSIGN_OR_RETURN(tok, LoadGgufTokenizer(path));
  } else {
    IG_ASSIGN_OR_RETURN(tok, Llama2cTokenizer::Load(path, vocab_size));
  }
  if (tok->vocab_size() > vocab_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the tokenizer's %d tokens do not fit the model's vocabulary of %d",
        path, tok->vocab_size(), vocab_size));
  }
  return tok;
}

}  // namespace

absl::StatusOr<LoadedModel> LoadModel(const std::string& model_path,
                                      const std::string& tokenizer_path) {
  LoadedModel m;
  if (IsDirectory(model_path) || absl::EndsWith(model_path, ".safetensors") ||
      absl::EndsWith(model_path, ".safetensors.index.json")) {
    IG_ASSIGN_OR_RETURN(m.weights, LoadSafetensorsModel(model_path));
  } else {
    IG_ASSIGN_OR_RETURN(bool gguf, HasGgufMagic(model_path));
    if (gguf) {
      IG_ASSIGN_OR_RETURN(m.weights, LoadGgufWeights(model_path));
      if (tokenizer_path.empty()) {
        IG_ASSIGN_OR_RETURN(m.tokenizer, LoadGgufTokenizer(model_path));
      }
    } else {
      IG_ASSIGN_OR_RETURN(m.weights, LoadLlama2cWeights(model_path));
    }
  }
  if (!tokenizer_path.empty()) {
    IG_ASSIGN_OR_RETURN(
        m.tokenizer,
        LoadTokenizerFile(tokenizer_path, m.weights.config.vocab_size));
  }
  return m;
}

}  // namespace infinigen::model
