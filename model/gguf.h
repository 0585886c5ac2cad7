// GGUF: the single-file model format of llama.cpp / ggml.
//
// GgufFile parses a GGUF v2 or v3 file (little-endian): the header, every
// metadata key/value (all value types, arrays included), the tensor infos and
// the aligned data section. It owns the memory mapping of the file; tensor
// bytes are read straight from it and dequantized to fp32 on request.
// Immutable after Open(); safe to read from several threads.
//
// LoadGgufWeights / LoadGgufTokenizer are what LoadModel calls: a Llama
// checkpoint's weights (dequantized, Q/K rows permuted to the half-split
// rotary layout of weights.h) and its byte-level BPE tokenizer.
//
// Layout reference: ggml's docs/gguf.md. Files: gguf.cc parses,
// ggml_quants.{h,cc} holds the block layouts and dequantizers (ggml's
// reference dequantize_row_* bit for bit), gguf_llama.cc maps a Llama
// checkpoint to Weights and its tokenizer.
#ifndef INFINIGEN_MODEL_GGUF_H_
#define INFINIGEN_MODEL_GGUF_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/file.h"
#include "model/ggml_quants.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace infinigen::model {

// Metadata value types (gguf_type).
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// One metadata value. Scalars fill the field of their kind; arrays fill the
// vector that matches `element_type` (integers and bools -> int_array,
// floats -> float_array, strings -> string_array, arrays -> array_array).
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  GgufValueType element_type = GgufValueType::kUint8;  // kArray only
  int64_t int_value = 0;   // integer types and bool (uint64 bit for bit)
  double float_value = 0;  // kFloat32, kFloat64
  std::string string_value;
  std::vector<int64_t> int_array;
  std::vector<double> float_array;
  std::vector<std::string> string_array;
  std::vector<GgufValue> array_array;

  bool is_integer() const;  // any integer type or bool
  bool is_float() const;
  // Number of elements of an array value (0 for scalars).
  size_t array_size() const;
};

struct GgufTensorInfo {
  std::string name;
  // ggml's ne[]: innermost (contiguous) dimension first, so an [out, in]
  // matrix has shape {in, out}.
  std::vector<int64_t> shape;
  uint32_t type = 0;       // GgmlType id
  uint64_t offset = 0;     // from the start of the data section
  uint64_t num_bytes = 0;  // size of the data in the file
  int64_t num_elements() const;
  std::string ShapeString() const;  // "[576, 192]"
};

class GgufFile {
 public:
  // Maps and parses `path`. NotFound if it does not exist; InvalidArgument,
  // naming the file and the problem, for a bad magic, an unsupported version,
  // a truncated header, a bad alignment, a tensor of unknown type or a tensor
  // whose data lies beyond the end of the file.
  static absl::StatusOr<GgufFile> Open(const std::string& path);

  GgufFile(GgufFile&&) = default;
  GgufFile& operator=(GgufFile&&) = default;

  const std::string& path() const { return file_.path(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }

  // Keys in file order.
  const std::vector<std::string>& keys() const { return keys_; }
  // Null if absent.
  const GgufValue* Find(const std::string& key) const;

  // Typed getters. InvalidArgument naming the file and key if the key is
  // missing or holds another type (integers convert among themselves and
  // to float; floats do not convert to integers).
  absl::StatusOr<int64_t> GetInt(const std::string& key) const;
  absl::StatusOr<double> GetFloat(const std::string& key) const;
  absl::StatusOr<std::string> GetString(const std::string& key) const;
  absl::StatusOr<bool> GetBool(const std::string& key) const;
  // As above, but `fallback` when the key is absent (a wrong type is still an
  // error).
  absl::StatusOr<int64_t> GetIntOr(const std::string& key,
                                   int64_t fallback) const;
  absl::StatusOr<double> GetFloatOr(const std::string& key,
                                    double fallback) const;
  absl::StatusOr<bool> GetBoolOr(const std::string& key, bool fallback) const;
  // Arrays; the pointer stays valid while the GgufFile lives.
  absl::StatusOr<const std::vector<std::string>*> GetStringArray(
      const std::string& key) const;
  absl::StatusOr<const std::vector<int64_t>*> GetIntArray(
      const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  // Null if absent.
  const GgufTensorInfo* FindTensor(const std::string& name) const;

  // The tensor's bytes inside the mapping (bounds were checked by Open()).
  const uint8_t* TensorData(const GgufTensorInfo& t) const {
    return file_.data() + data_offset_ + t.offset;
  }

  // The tensor dequantized to fp32, in file order (row-major over the
  // reversed shape). Large tensors are split across threads. The tensor's
  // file pages leave resident memory afterwards (MappedFile::DropPages).
  absl::StatusOr<std::vector<float>> ReadTensor(const GgufTensorInfo& t) const;

 private:
  explicit GgufFile(MappedFile file) : file_(std::move(file)) {}
  absl::Status Parse();

  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::string> keys_;
  std::unordered_map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// A Llama or Gemma 3 GGUF checkpoint (general.architecture "llama" or
// "gemma3") as fp32 Weights: config from the ARCH.* metadata (Gemma 3's
// layer pattern and local RoPE base, which its files do not carry, as
// llama.cpp sets them), every tensor dequantized, Llama's wq / wk permuted
// from GGUF's interleaved rotary rows to the half-split layout (Gemma's are
// half-split already), and lm_head left empty when the file has no
// output.weight (tied embeddings).
// NotFound for a missing file; InvalidArgument naming the file for anything
// else (other architecture, missing key or tensor, shape mismatch, ...).
absl::StatusOr<Weights> LoadGgufWeights(const std::string& path);

// The tokenizer stored in a GGUF file: byte-level BPE
// (tokenizer.ggml.model == "gpt2") or SentencePiece ("llama", as Gemma's).
// Reads only the metadata. Errors as above.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(
    const std::string& path);

// The same from an already opened file (LoadModel can parse it once for
// both).
absl::StatusOr<Weights> LoadGgufWeights(const GgufFile& file);
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(
    const GgufFile& file);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_GGUF_H_
