// fp16 (IEEE binary16) and bf16 conversions: the project's one copy.
//
// Scalar conversions are exact bit manipulations (round to nearest even on
// the way down); the bulk versions use F16C instructions where the compiler
// targets them. KV rows are stored as fp16 (uint16_t) everywhere.
#ifndef INFINIGEN_COMMON_HALF_H_
#define INFINIGEN_COMMON_HALF_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace infinigen {

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in fp32.
    const float f = float(mant) * 0x1p-24f;
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 0x1f
                            ? sign | 0x7f800000u | (mant << 13)  // inf, NaN
                            : sign | ((exp + 112) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// IEEE binary16, round to nearest even, overflow to infinity.
inline uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = (x >> 16) & 0x8000;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (abs >= 0x47800000u) return sign | 0x7c00;  // >= 65536 or inf
  if (abs >= 0x38800000u) {                      // normal: >= 2^-14
    // Add half an ulp (minus one unless the kept lsb is odd), drop 13 bits,
    // rebias the exponent from 127 to 15; a carry moves into the exponent.
    const uint32_t rounded = abs + 0xfff + ((abs >> 13) & 1);
    return sign | uint16_t((rounded - 0x38000000u) >> 13);
  }
  // Subnormal or zero: a multiple of 2^-24; nearbyint rounds to even.
  const float scaled = std::fabs(f) * 0x1p24f;
  return sign | uint16_t(std::nearbyint(scaled));
}

inline float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// bfloat16 (the top half of fp32), round to nearest even.
inline uint16_t FloatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);
  return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

// dst[i] = HalfToFloat(src[i]); src may be unaligned.
inline void HalfToFloat(const uint16_t* src, size_t n, float* dst) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + i, sizeof(h));
    dst[i] = HalfToFloat(h);
  }
}

// dst[i] = FloatToHalf(src[i]) (round to nearest even).
inline void FloatToHalf(const float* src, size_t n, uint16_t* dst) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = FloatToHalf(src[i]);
}

inline void Bf16ToFloat(const uint16_t* src, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + i, sizeof(h));
    dst[i] = Bf16ToFloat(h);
  }
}

}  // namespace infinigen

#endif  // INFINIGEN_COMMON_HALF_H_
