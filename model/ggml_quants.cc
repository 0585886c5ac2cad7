#include "model/ggml_quants.h"

#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/half.h"

namespace infinigen::model {
namespace {

constexpr int kQK = 32;     // block size of the legacy quants
constexpr int kQK_K = 256;  // super-block size of the K-quants

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

float LoadHalf(const uint8_t* p) { return HalfToFloat(Load<uint16_t>(p)); }

// ---------------------------------------------------------------------------
// Dequantization, one block at a time, after ggml's reference
// dequantize_row_* (ggml-quants.c). Block layouts are ggml-common.h's
// block_* structs; the offsets below are their field offsets.

// block_q4_0 {half d; uint8 qs[16]}: 18 bytes.
void DequantQ4_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = ((qs[j] & 0x0F) - 8) * d;
    y[j + kQK / 2] = ((qs[j] >> 4) - 8) * d;
  }
}

// block_q4_1 {half d; half m; uint8 qs[16]}: 20 bytes.
void DequantQ4_1(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const float m = LoadHalf(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = (qs[j] & 0x0F) * d + m;
    y[j + kQK / 2] = (qs[j] >> 4) * d + m;
  }
}

// block_q5_0 {half d; uint8 qh[4]; uint8 qs[16]}: 22 bytes.
void DequantQ5_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const uint32_t qh = Load<uint32_t>(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t xh0 = ((qh >> (j + 0)) << 4) & 0x10;
    const uint8_t xh1 = ((qh >> (j + 12))) & 0x10;
    y[j] = (((qs[j] & 0x0F) | xh0) - 16) * d;
    y[j + kQK / 2] = (((qs[j] >> 4) | xh1) - 16) * d;
  }
}

// block_q5_1 {half d; half m; uint8 qh[4]; uint8 qs[16]}: 24 bytes.
void DequantQ5_1(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const float m = LoadHalf(b + 2);
  const uint32_t qh = Load<uint32_t>(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < kQK / 2; ++j) {
    const uint8_t xh0 = ((qh >> (j + 0)) << 4) & 0x10;
    const uint8_t xh1 = ((qh >> (j + 12))) & 0x10;
    y[j] = ((qs[j] & 0x0F) | xh0) * d + m;
    y[j + kQK / 2] = ((qs[j] >> 4) | xh1) * d + m;
  }
}

// block_q8_0 {half d; int8 qs[32]}: 34 bytes.
void DequantQ8_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kQK; ++j) y[j] = qs[j] * d;
}

// block_q2_K {uint8 scales[16]; uint8 qs[64]; half d; half dmin}: 84 bytes.
void DequantQ2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = LoadHalf(b + 80);
  const float min = LoadHalf(b + 82);
  int is = 0;
  for (int n = 0; n < kQK_K; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      uint8_t sc = scales[is++];
      float dl = d * (sc & 0xF), ml = min * (sc >> 4);
      for (int l = 0; l < 16; ++l) {
        *y++ = dl * static_cast<int8_t>((q[l] >> shift) & 3) - ml;
      }
      sc = scales[is++];
      dl = d * (sc & 0xF);
      ml = min * (sc >> 4);
      for (int l = 0; l < 16; ++l) {
        *y++ = dl * static_cast<int8_t>((q[l + 16] >> shift) & 3) - ml;
      }
      shift += 2;
    }
    q += 32;
  }
}

// block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d}:
// 110 bytes. Sixteen 6-bit scales: low 4 bits in scales[0..7] (two per
// byte), high 2 bits in scales[8..11].
void DequantQ3_K(const uint8_t* b, float* y) {
  constexpr uint32_t kmask1 = 0x03030303;
  constexpr uint32_t kmask2 = 0x0f0f0f0f;
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d_all = LoadHalf(b + 108);
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  int8_t scales[16];
  std::memcpy(scales, aux, 16);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < kQK_K; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      float dl = d_all * (scales[is++] - 32);
      for (int l = 0; l < 16; ++l) {
        *y++ = dl * (static_cast<int8_t>((q[l + 0] >> shift) & 3) -
                     ((hm[l + 0] & m) ? 0 : 4));
      }
      dl = d_all * (scales[is++] - 32);
      for (int l = 0; l < 16; ++l) {
        *y++ = dl * (static_cast<int8_t>((q[l + 16] >> shift) & 3) -
                     ((hm[l + 16] & m) ? 0 : 4));
      }
      shift += 2;
      m <<= 1;
    }
    q += 32;
  }
}

// The j-th 6-bit scale and min of a Q4_K / Q5_K block (get_scale_min_k4).
void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

// block_q4_K {half d; half dmin; uint8 scales[12]; uint8 qs[128]}: 144 bytes.
void DequantQ4_K(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const float min = LoadHalf(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  uint8_t sc, m;
  for (int j = 0; j < kQK_K; j += 64) {
    ScaleMinK4(is + 0, scales, &sc, &m);
    const float d1 = d * sc, m1 = min * m;
    ScaleMinK4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = min * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

// block_q5_K {half d; half dmin; uint8 scales[12]; uint8 qh[32];
// uint8 qs[128]}: 176 bytes.
void DequantQ5_K(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const float min = LoadHalf(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  int is = 0;
  uint8_t sc, m;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < kQK_K; j += 64) {
    ScaleMinK4(is + 0, scales, &sc, &m);
    const float d1 = d * sc, m1 = min * m;
    ScaleMinK4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = min * m;
    for (int l = 0; l < 32; ++l) {
      *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
    ql += 32;
    is += 2;
    u1 <<= 2;
    u2 <<= 2;
  }
}

// block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d}:
// 210 bytes.
void DequantQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = LoadHalf(b + 208);
  for (int n = 0; n < kQK_K; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int8_t q1 =
          static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) -
          32;
      const int8_t q2 =
          static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) -
          32;
      const int8_t q3 =
          static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) -
          32;
      const int8_t q4 =
          static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) -
          32;
      y[l + 0] = d * sc[is + 0] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// block_q8_K {float d; int8 qs[256]; int16 bsums[16]}: 292 bytes.
void DequantQ8_K(const uint8_t* b, float* y) {
  const float d = Load<float>(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 4);
  for (int j = 0; j < kQK_K; ++j) y[j] = d * qs[j];
}

// Converts `n` blocks from `src` to `dst`.
using BlocksFn = void (*)(const uint8_t* src, int64_t n, float* dst);

template <void (*kBlock)(const uint8_t*, float*), int kElems, int kBytes>
void QuantBlocks(const uint8_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) kBlock(src + i * kBytes, dst + i * kElems);
}

void F32Values(const uint8_t* src, int64_t n, float* dst) {
  std::memcpy(dst, src, n * sizeof(float));
}
void F16Values(const uint8_t* src, int64_t n, float* dst) {
  HalfToFloat(reinterpret_cast<const uint16_t*>(src), n, dst);
}
void BF16Values(const uint8_t* src, int64_t n, float* dst) {
  Bf16ToFloat(reinterpret_cast<const uint16_t*>(src), n, dst);
}


// Every ggml type id with its block layout (gguf-py's GGML_QUANT_SIZES).
const std::map<uint32_t, GgmlTypeTraits>& Types() {
  static const auto* types = new std::map<uint32_t, GgmlTypeTraits>{
      {0, {"F32", 1, 4, F32Values}},
      {1, {"F16", 1, 2, F16Values}},
      {2, {"Q4_0", 32, 18, QuantBlocks<DequantQ4_0, 32, 18>}},
      {3, {"Q4_1", 32, 20, QuantBlocks<DequantQ4_1, 32, 20>}},
      {6, {"Q5_0", 32, 22, QuantBlocks<DequantQ5_0, 32, 22>}},
      {7, {"Q5_1", 32, 24, QuantBlocks<DequantQ5_1, 32, 24>}},
      {8, {"Q8_0", 32, 34, QuantBlocks<DequantQ8_0, 32, 34>}},
      {9, {"Q8_1", 32, 40, nullptr}},
      {10, {"Q2_K", 256, 84, QuantBlocks<DequantQ2_K, 256, 84>}},
      {11, {"Q3_K", 256, 110, QuantBlocks<DequantQ3_K, 256, 110>}},
      {12, {"Q4_K", 256, 144, QuantBlocks<DequantQ4_K, 256, 144>}},
      {13, {"Q5_K", 256, 176, QuantBlocks<DequantQ5_K, 256, 176>}},
      {14, {"Q6_K", 256, 210, QuantBlocks<DequantQ6_K, 256, 210>}},
      {15, {"Q8_K", 256, 292, QuantBlocks<DequantQ8_K, 256, 292>}},
      {16, {"IQ2_XXS", 256, 66, nullptr}},
      {17, {"IQ2_XS", 256, 74, nullptr}},
      {18, {"IQ3_XXS", 256, 98, nullptr}},
      {19, {"IQ1_S", 256, 50, nullptr}},
      {20, {"IQ4_NL", 32, 18, nullptr}},
      {21, {"IQ3_S", 256, 110, nullptr}},
      {22, {"IQ2_S", 256, 82, nullptr}},
      {23, {"IQ4_XS", 256, 136, nullptr}},
      {24, {"I8", 1, 1, nullptr}},
      {25, {"I16", 1, 2, nullptr}},
      {26, {"I32", 1, 4, nullptr}},
      {27, {"I64", 1, 8, nullptr}},
      {28, {"F64", 1, 8, nullptr}},
      {29, {"IQ1_M", 256, 56, nullptr}},
      {30, {"BF16", 1, 2, BF16Values}},
      {34, {"TQ1_0", 256, 54, nullptr}},
      {35, {"TQ2_0", 256, 66, nullptr}},
      {39, {"MXFP4", 32, 17, nullptr}},
  };
  return *types;
}


}  // namespace

const GgmlTypeTraits* FindGgmlType(uint32_t type) {
  auto it = Types().find(type);
  return it == Types().end() ? nullptr : &it->second;
}

std::string GgmlTypeName(uint32_t type) {
  const GgmlTypeTraits* t = FindGgmlType(type);
  return t != nullptr ? t->name : absl::StrCat("type", type);
}

bool GgmlBlockLayout(uint32_t type, int64_t* block_elems,
                     int64_t* block_bytes) {
  const GgmlTypeTraits* t = FindGgmlType(type);
  if (t == nullptr || t->dequant == nullptr) return false;
  *block_elems = t->block_elems;
  *block_bytes = t->block_bytes;
  return true;
}

absl::Status Dequantize(uint32_t type, const uint8_t* src, int64_t n,
                        float* dst) {
  const GgmlTypeTraits* t = FindGgmlType(type);
  if (t == nullptr || t->dequant == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot dequantize ggml type %s (%d)", GgmlTypeName(type), type));
  }
  if (n < 0 || n % t->block_elems != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d values of %s are not whole blocks of %d", n,
                        t->name, t->block_elems));
  }
  t->dequant(src, n / t->block_elems, dst);
  return absl::OkStatus();
}


}  // namespace infinigen::model
