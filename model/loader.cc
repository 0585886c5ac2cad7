#include "model/loader.h"

#include <sys/stat.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"
#include "model/llama2c.h"

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

}  // namespace

absl::StatusOr<LoadedModel> LoadModel(const std::string& model_path,
                                      const std::string& tokenizer_path) {
  LoadedModel m;
  if (IsDirectory(model_path) || absl::EndsWith(model_path, ".safetensors")) {
    return absl::UnimplementedError("safetensors pending");
  }
  IG_ASSIGN_OR_RETURN(bool gguf, HasGgufMagic(model_path));
  if (gguf) {
    return absl::UnimplementedError("gguf pending");
  }
  IG_ASSIGN_OR_RETURN(m.weights, LoadLlama2cWeights(model_path));
  if (!tokenizer_path.empty()) {
    IG_ASSIGN_OR_RETURN(m.tokenizer, Llama2cTokenizer::Load(
                                         tokenizer_path,
                                         m.weights.config.vocab_size));
  }
  return m;
}

}  // namespace infinigen::model
