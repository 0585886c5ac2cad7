// LoadModel: one entry point for every model format the project reads.
//
// Picks the format from the file: a directory or *.safetensors (with
// config.json beside it) -> Hugging Face safetensors; a file starting with
// the GGUF magic -> GGUF (carries its own tokenizer); anything else -> a
// llama2.c checkpoint (tokenizer from `tokenizer_path`).
#ifndef INFINIGEN_MODEL_LOADER_H_
#define INFINIGEN_MODEL_LOADER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace infinigen::model {

struct LoadedModel {
  Weights weights;
  // Null when the format carries none and no tokenizer_path was given.
  std::unique_ptr<Tokenizer> tokenizer;
};

// `tokenizer_path` may be empty. Errors name the file and what is wrong:
// NotFound for a missing file, InvalidArgument for a malformed one.
absl::StatusOr<LoadedModel> LoadModel(const std::string& model_path,
                                      const std::string& tokenizer_path);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_LOADER_H_
