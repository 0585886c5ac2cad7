// Private to speculator/: the scoring kernels' vector width and the 4-bit
// partial-key row reader shared by the codec and the scoring loops.
#ifndef INFINIGEN_SPECULATOR_INTERNAL_H_
#define INFINIGEN_SPECULATOR_INTERNAL_H_

#include <cstdint>
#include <cstring>

// The hand-vectorized scoring kernel needs AVX2 and FMA (the project builds
// for x86-64-v3); INFINIGEN_SPECULATOR_PORTABLE forces the portable loop so
// that a test can check it too.
#if defined(__AVX2__) && defined(__FMA__) && \
    !defined(INFINIGEN_SPECULATOR_PORTABLE)
#define INFINIGEN_SPECULATOR_AVX2 1
#include <immintrin.h>
#else
#define INFINIGEN_SPECULATOR_AVX2 0
#endif

namespace infinigen::speculator::internal {

// run(n, fn) where a runner is given, else fn(0), ..., fn(n - 1) here.
template <typename Runner, typename Fn>
void RunTasks(const Runner* run, int n, Fn&& fn) {
  if (run != nullptr && *run && n > 1) {
    (*run)(n, fn);
  } else {
    for (int i = 0; i < n; ++i) fn(i);
  }
}

// SpeculateScores runs per layer per decode step over thousands of cached
// rows of only n_cols (e.g. 19) floats each, so it is written for that shape.
constexpr int kLanes = 8;

// A 4-bit row's range: its min and scale.
inline void ReadPartialKeyRange(const uint8_t* row, float* lo, float* scale) {
  std::memcpy(lo, row, sizeof(float));
  std::memcpy(scale, row + sizeof(float), sizeof(float));
}

// Row r's range and its codes as floats.
inline void ReadPartialKeyRow(const uint8_t* row, int n_cols, float* lo,
                              float* scale, float* codes) {
  ReadPartialKeyRange(row, lo, scale);
  const uint8_t* packed = row + 2 * sizeof(float);
  for (int c = 0; c < n_cols; ++c) {
    codes[c] = static_cast<float>((packed[c / 2] >> (4 * (c & 1))) & 0xF);
  }
}

}  // namespace infinigen::speculator::internal

#endif  // INFINIGEN_SPECULATOR_INTERNAL_H_
