// ggml's tensor element types: the block layout of every type id, and the
// dequantizers of the ones this project reads (F32, F16, BF16, the legacy
// Q4_0 ... Q8_0 and the K-quants Q2_K ... Q8_K), after ggml's reference
// dequantize_row_* (ggml-quants.c) bit for bit; block layouts are
// ggml-common.h's block_* structs. The parser (gguf.cc) sizes tensors with
// it and GgufFile::ReadTensor converts them. Stateless; thread-safe.
#ifndef INFINIGEN_MODEL_GGML_QUANTS_H_
#define INFINIGEN_MODEL_GGML_QUANTS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace infinigen::model {

// ggml tensor element types (ggml.h's enum ggml_type). Only the ones this
// project dequantizes are named; any other id is rejected with its number.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};

// One ggml type: its name and block layout, and how to convert whole blocks
// of it to fp32 (null: the layout is known but not dequantized here).
struct GgmlTypeTraits {
  const char* name;
  int64_t block_elems;
  int64_t block_bytes;
  void (*dequant)(const uint8_t* src, int64_t blocks, float* dst);
};

// The type with ggml id `type` (ggml.h's enum ggml_type); null if unknown.
const GgmlTypeTraits* FindGgmlType(uint32_t type);

// "Q4_1", "F32", ... for any ggml type id, "type<N>" for ids it does not know.
std::string GgmlTypeName(uint32_t type);

// Elements per block and bytes per block of `type`; false for types this
// loader cannot dequantize (the block size of Q8_1 is known but it is an
// activation format, never a weight, and is not supported).
bool GgmlBlockLayout(uint32_t type, int64_t* block_elems, int64_t* block_bytes);

// Dequantizes `n` values of `type` from `src` (n / block_elems whole blocks)
// into `dst`. InvalidArgument if the type is unsupported or `n` is not a
// multiple of the block size.
absl::Status Dequantize(uint32_t type, const uint8_t* src, int64_t n,
                        float* dst);

}  // namespace infinigen::model

#endif  // INFINIGEN_MODEL_GGML_QUANTS_H_
