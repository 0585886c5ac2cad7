// The partial key cache's row format: speculator::QuantizePartialKeys and
// SpeculateScores (CPU) and the CUDA kernels follow it formula for formula.
// Plain C++, no dependencies, so that nvcc compiles it too.
//
// A row holds the n_cols partial columns of one token's skewed key in one
// KV head, quantized to 4 bits against the row's own range (asymmetric, as
// FlexGen's int4 KV rows): float min, float scale = (max - min) / 15, then
// ceil(n_cols / 2) bytes of codes, column 2i in the low nibble of byte i
// and 2i + 1 in its high nibble, padded with zeros to a multiple of 4 bytes.
// code = rint((v - min) / scale) in [0, 15] (0 where scale is 0), and the
// value read back is min + scale * code. At head_dim 64 a full-column row is
// 40 bytes, about the paper's 30% of the columns in fp16 (38 bytes); the
// ranking the scores give is that of the fp32 keys but for near ties.
//
// The exact diagnostics (the oracle, a layer speculating from its own
// input) keep fp32 rows instead: n_cols floats.
#ifndef INFINIGEN_SPECULATOR_PARTIAL_KEYS_H_
#define INFINIGEN_SPECULATOR_PARTIAL_KEYS_H_

#if defined(__CUDACC__)
#define INFINIGEN_PARTIAL_KEYS_FN __host__ __device__ inline
#else
#define INFINIGEN_PARTIAL_KEYS_FN inline
#endif

namespace infinigen::speculator {

enum class PartialKeyFormat { kInt4, kFloat };

// Bytes of one partial key row of n_cols columns (a multiple of 4).
INFINIGEN_PARTIAL_KEYS_FN int PartialKeyRowBytes(
    int n_cols, PartialKeyFormat format = PartialKeyFormat::kInt4) {
  return format == PartialKeyFormat::kFloat
             ? 4 * n_cols
             : 8 + ((n_cols + 1) / 2 + 3) / 4 * 4;
}

}  // namespace infinigen::speculator

#endif  // INFINIGEN_SPECULATOR_PARTIAL_KEYS_H_
