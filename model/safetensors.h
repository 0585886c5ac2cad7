// Hugging Face safetensors checkpoints (Llama and OPT) -> model::Weights.
//
// A .safetensors file is an 8-byte little-endian header length N, N bytes of
// JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// optional "__metadata__": {string: string}}), then the tensor bytes, with
// offsets relative to the first byte after the header. A large checkpoint is
// split into shards listed by model.safetensors.index.json ("weight_map":
// tensor name -> shard file name). Beside the weights sits config.json, which
// names the architecture (model_type) and its geometry.
//
// SafetensorsFile owns one memory-mapped file and its parsed header;
// SafetensorsCheckpoint owns every file of a (possibly sharded) checkpoint.
// Both are movable, not copyable, and immutable after Open, so concurrent
// reads are safe. Tensors are read as fresh fp32 vectors (F32, F16, BF16 and
// F64 are converted); the caller owns them.
//
// Weights are stored as the checkpoint has them: Q/K rows already in the
// Hugging Face half-split rotary layout, OPT's q scaling (1/sqrt(head_dim))
// not folded in. Errors name the file and the tensor or key: NotFound for a
// missing file or directory, InvalidArgument for a malformed or inconsistent
// checkpoint, Unimplemented for a valid variant the engine does not run.
#ifndef INFINIGEN_MODEL_SAFETENSORS_H_
#define INFINIGEN_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file.h"
#include "model/config.h"
#include "model/weights.h"

namespace infinigen::model {

// One tensor's entry in a safetensors header.
struct SafetensorsTensorInfo {
  std::string dtype;           // as written: "F32", "F16", "BF16", "I64", ...
  std::vector<int64_t> shape;  // empty for a scalar
  size_t begin = 0;            // byte range in the data section
  size_t end = 0;

  int64_t num_elements() const;
};

// One .safetensors file, mapped, with its header parsed and checked: every
// tensor's byte range lies inside the file and, for a known dtype, matches
// its shape.
class SafetensorsFile {
 public:
  // NotFound if `path` does not exist; InvalidArgument naming the file (and
  // the tensor, where one is at fault) if it is shorter than its header
  // length says, the header is not valid JSON of the expected form, or a
  // tensor's data_offsets are inconsistent or lie beyond the end of the file.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

  const std::string& path() const { return file_.path(); }
  const std::map<std::string, SafetensorsTensorInfo>& tensors() const {
    return tensors_;
  }
  // The optional "__metadata__" string map (e.g. {"format": "pt"}).
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }

  // The tensor `name` converted to fp32, row-major as stored. InvalidArgument
  // naming the file and tensor if it is absent or its dtype is not one of
  // F32, F16, BF16, F64.
  absl::StatusOr<std::vector<float>> ReadFloat32(const std::string& name) const;

 private:
  SafetensorsFile(MappedFile file, size_t data_start,
                  std::map<std::string, SafetensorsTensorInfo> tensors,
                  std::map<std::string, std::string> metadata)
      : file_(std::move(file)),
        data_start_(data_start),
        tensors_(std::move(tensors)),
        metadata_(std::move(metadata)) {}

  MappedFile file_;
  size_t data_start_;  // 8 + header length
  std::map<std::string, SafetensorsTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Every tensor of a checkpoint, whether in one file or in shards.
class SafetensorsCheckpoint {
 public:
  // `path` is a .safetensors file, a *.safetensors.index.json, or a directory
  // holding model.safetensors.index.json (preferred) or model.safetensors.
  // NotFound if `path`, the directory's checkpoint or a shard is missing;
  // InvalidArgument for a malformed file or index (naming it), including an
  // index that maps a tensor to a shard which lacks it.
  static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& path);

  SafetensorsCheckpoint(SafetensorsCheckpoint&&) = default;
  SafetensorsCheckpoint& operator=(SafetensorsCheckpoint&&) = default;

  // The file errors about the checkpoint as a whole name: the single
  // .safetensors file or the index.json.
  const std::string& path() const { return path_; }
  bool Contains(const std::string& name) const;
  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;
  // Null if absent.
  const SafetensorsTensorInfo* Find(const std::string& name) const;

  // The tensor `name` as fp32, after checking that its shape is exactly
  // `shape`. InvalidArgument naming the file and tensor if it is missing,
  // has another shape, or has a dtype that is not a float.
  absl::StatusOr<std::vector<float>> ReadFloat32(
      const std::string& name, const std::vector<int64_t>& shape) const;

 private:
  SafetensorsCheckpoint() = default;
  // (file index, tensor info) of `name`, or {-1, null}.
  std::pair<int, const SafetensorsTensorInfo*> Locate(
      const std::string& name) const;

  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, int> file_of_tensor_;  // name -> index into files_
};

// What config.json says, in the project's terms.
struct HfModelConfig {
  ModelConfig config;
  // The classifier shares the embedding matrix. Defaults: false for Llama,
  // true for OPT (the Hugging Face defaults).
  bool tie_word_embeddings = false;
};

// Parses a Hugging Face config.json (its text; `path` only names it in
// errors). model_type "llama" or "mistral" -> kLlama, "opt" -> kOpt; any other
// -> InvalidArgument "unsupported architecture X in PATH". Unimplemented for
// variants the engine cannot run exactly (rope_scaling, attention or MLP
// biases in Llama; OPT with a projected embedding, post-LayerNorm or a
// non-ReLU activation). InvalidArgument for malformed JSON, a missing
// required key or a key of the wrong type.
absl::StatusOr<HfModelConfig> ParseHfConfig(const std::string& json_text,
                                            const std::string& path);

// Loads a Hugging Face checkpoint. `path` is a directory holding config.json
// and model.safetensors or model.safetensors.index.json with its shards, or a
// .safetensors file (or index.json) with config.json beside it. A tied or
// absent lm_head.weight leaves Weights::lm_head empty. The result has passed
// Weights::Validate().
absl::StatusOr<Weights> LoadSafetensorsModel(const std::string& path);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_SAFETENSORS_H_
