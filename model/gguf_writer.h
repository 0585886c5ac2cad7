// GgufWriter: builds small GGUF files for tests (testonly).
//
// Collects metadata and tensors in memory and serializes them in GGUF's
// little-endian layout: header, key/values, tensor infos, then each tensor's
// bytes padded to the alignment. Tensors are passed as raw bytes in their
// ggml type (tests hand-build quantized blocks) or as fp32 values. It checks
// nothing, so tests can also write malformed files. Not thread-safe.
#ifndef INFINIGEN_MODEL_GGUF_WRITER_H_
#define INFINIGEN_MODEL_GGUF_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/bpe_tokenizer.h"
#include "model/gguf.h"
#include "model/weights.h"

namespace infinigen::model {

class GgufWriter {
 public:
  // Header fields; the defaults write a valid v3 file.
  void set_version(uint32_t version) { version_ = version; }
  void set_magic(uint32_t magic) { magic_ = magic; }
  // Alignment of the data section and of every tensor. Also writes
  // general.alignment (as uint32) unless it is GGUF's default of 32.
  void SetAlignment(uint32_t alignment);

  void AddUint8(const std::string& key, uint8_t v);
  void AddInt8(const std::string& key, int8_t v);
  void AddUint16(const std::string& key, uint16_t v);
  void AddInt16(const std::string& key, int16_t v);
  void AddUint32(const std::string& key, uint32_t v);
  void AddInt32(const std::string& key, int32_t v);
  void AddUint64(const std::string& key, uint64_t v);
  void AddInt64(const std::string& key, int64_t v);
  void AddFloat32(const std::string& key, float v);
  void AddFloat64(const std::string& key, double v);
  void AddBool(const std::string& key, bool v);
  void AddString(const std::string& key, const std::string& v);
  void AddStringArray(const std::string& key,
                      const std::vector<std::string>& v);
  void AddInt32Array(const std::string& key, const std::vector<int32_t>& v);
  void AddFloat32Array(const std::string& key, const std::vector<float>& v);
  // An array of arrays of uint8, to exercise nesting.
  void AddNestedUint8Array(const std::string& key,
                           const std::vector<std::vector<uint8_t>>& v);

  // `shape` is ggml's ne[] (innermost first); `bytes` the tensor's data.
  void AddTensor(const std::string& name, const std::vector<int64_t>& shape,
                 uint32_t type, std::string bytes);
  void AddF32Tensor(const std::string& name, const std::vector<int64_t>& shape,
                    const std::vector<float>& values);

  std::string Serialize() const;
  absl::Status WriteFile(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    uint32_t type;
    std::string bytes;
  };
  void Key(const std::string& key, GgufValueType type);

  uint32_t magic_ = 0x46554747;  // "GGUF"
  uint32_t version_ = 3;
  uint32_t alignment_ = 32;
  uint64_t kv_count_ = 0;
  std::string kv_;  // serialized key/values
  std::vector<Tensor> tensors_;
};

// Fills `writer` with a llama checkpoint of `w` as llama.cpp's converter
// writes it: llama.* metadata, fp32 tensors, Q/K rows in the interleaved
// rotary layout, no output.weight when lm_head is empty. Adds the gpt2
// tokenizer keys when `vocab` is not null.
void AddLlamaModel(const Weights& w, const BpeVocabulary* vocab,
                   GgufWriter& writer);

// Inverse of PermuteInterleavedToHalfSplit.
void PermuteHalfSplitToInterleaved(std::vector<float>& w, int n_heads,
                                   int head_dim, int cols);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_GGUF_WRITER_H_
