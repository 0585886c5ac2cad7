#include "model/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "common/log.h"
#include "common/status.h"
#include "model/bpe_tokenizer.h"

namespace infinigen::model {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read little-endian
constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;        // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;  // arrays of arrays of ...
constexpr int kQK = 32;            // block size of the legacy quants
constexpr int kQK_K = 256;         // super-block size of the K-quants

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

struct TypeTraits {
  const char* name;
  int64_t block_elems;
  int64_t block_bytes;
  BlocksFn dequant;  // null: the layout is known but not dequantized here
};

// Every ggml type id with its block layout (gguf-py's GGML_QUANT_SIZES).
const std::map<uint32_t, TypeTraits>& Types() {
  static const auto* types = new std::map<uint32_t, TypeTraits>{
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

const TypeTraits* FindType(uint32_t type) {
  auto it = Types().find(type);
  return it == Types().end() ? nullptr : &it->second;
}

// ---------------------------------------------------------------------------
// Parsing.

// Bounds-checked little-endian reads over the mapped file; every failure
// names the file, what was being read and where.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& path)
      : data_(data), size_(size), path_(path) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  absl::Status Truncated(const std::string& what, size_t need) const {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: truncated GGUF file: %s needs %d bytes at offset %d, but the "
        "file has %d bytes",
        path_, what, need, pos_, size_));
  }

  template <typename T>
  absl::Status Read(T* v, const std::string& what) {
    if (remaining() < sizeof(T)) return Truncated(what, sizeof(T));
    std::memcpy(v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }

  absl::Status ReadString(std::string* s, const std::string& what) {
    uint64_t len = 0;
    IG_RETURN_IF_ERROR(Read(&len, what + " length"));
    if (len > remaining()) return Truncated(what, len);
    s->assign(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return absl::OkStatus();
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& path_;
};

bool IsIntegerType(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kBool:
      return true;
    default:
      return false;
  }
}

bool IsFloatType(GgufValueType t) {
  return t == GgufValueType::kFloat32 || t == GgufValueType::kFloat64;
}

const char* ValueTypeName(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

// Reads one integer or float scalar of type `t`.
absl::Status ReadNumber(Reader& r, GgufValueType t, const std::string& what,
                        int64_t* i, double* f) {
  switch (t) {
#define IG_GGUF_INT(enumerator, ctype)    \
  case GgufValueType::enumerator: {       \
    ctype v = 0;                          \
    IG_RETURN_IF_ERROR(r.Read(&v, what)); \
    *i = static_cast<int64_t>(v);         \
    return absl::OkStatus();              \
  }
    IG_GGUF_INT(kUint8, uint8_t)
    IG_GGUF_INT(kInt8, int8_t)
    IG_GGUF_INT(kUint16, uint16_t)
    IG_GGUF_INT(kInt16, int16_t)
    IG_GGUF_INT(kUint32, uint32_t)
    IG_GGUF_INT(kInt32, int32_t)
    IG_GGUF_INT(kUint64, uint64_t)
    IG_GGUF_INT(kInt64, int64_t)
    IG_GGUF_INT(kBool, uint8_t)
#undef IG_GGUF_INT
    case GgufValueType::kFloat32: {
      float v = 0;
      IG_RETURN_IF_ERROR(r.Read(&v, what));
      *f = v;
      return absl::OkStatus();
    }
    case GgufValueType::kFloat64:
      return r.Read(f, what);
    default:
      return absl::InternalError("ReadNumber on a non-number");
  }
}

size_t MinEncodedSize(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kString:  // uint64 length
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kArray:  // uint32 type + uint64 count
      return 12;
  }
  return 1;
}

absl::Status ReadValue(Reader& r, const std::string& path,
                       const std::string& key, uint32_t raw_type, int depth,
                       GgufValue* v) {
  if (raw_type > static_cast<uint32_t>(GgufValueType::kFloat64)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: metadata key %s has unknown value type %d", path, key, raw_type));
  }
  v->type = static_cast<GgufValueType>(raw_type);
  const std::string what = "metadata value of " + key;
  if (v->type == GgufValueType::kString) {
    return r.ReadString(&v->string_value, what);
  }
  if (v->type != GgufValueType::kArray) {
    return ReadNumber(r, v->type, what, &v->int_value, &v->float_value);
  }
  if (depth >= kMaxArrayDepth) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: metadata key %s nests arrays deeper than %d", path,
                        key, kMaxArrayDepth));
  }
  uint32_t elem_raw = 0;
  uint64_t count = 0;
  IG_RETURN_IF_ERROR(r.Read(&elem_raw, what + " element type"));
  IG_RETURN_IF_ERROR(r.Read(&count, what + " element count"));
  if (elem_raw > static_cast<uint32_t>(GgufValueType::kFloat64)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: metadata key %s is an array of unknown value type %d", path, key,
        elem_raw));
  }
  const auto elem = static_cast<GgufValueType>(elem_raw);
  v->element_type = elem;
  if (count > r.remaining() / MinEncodedSize(elem)) {
    return r.Truncated(absl::StrFormat("%s (%d elements)", what, count),
                       count * MinEncodedSize(elem));
  }
  if (elem == GgufValueType::kString) {
    v->string_array.resize(count);
    for (auto& s : v->string_array) IG_RETURN_IF_ERROR(r.ReadString(&s, what));
  } else if (elem == GgufValueType::kArray) {
    v->array_array.resize(count);
    for (auto& a : v->array_array) {
      uint32_t t = static_cast<uint32_t>(GgufValueType::kArray);
      IG_RETURN_IF_ERROR(ReadValue(r, path, key, t, depth + 1, &a));
    }
  } else if (IsFloatType(elem)) {
    v->float_array.resize(count);
    int64_t unused;
    for (auto& f : v->float_array) {
      IG_RETURN_IF_ERROR(ReadNumber(r, elem, what, &unused, &f));
    }
  } else {
    v->int_array.resize(count);
    double unused;
    for (auto& i : v->int_array) {
      IG_RETURN_IF_ERROR(ReadNumber(r, elem, what, &i, &unused));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
// Public helpers.

std::string GgmlTypeName(uint32_t type) {
  const TypeTraits* t = FindType(type);
  return t != nullptr ? t->name : absl::StrCat("type", type);
}

bool GgmlBlockLayout(uint32_t type, int64_t* block_elems,
                     int64_t* block_bytes) {
  const TypeTraits* t = FindType(type);
  if (t == nullptr || t->dequant == nullptr) return false;
  *block_elems = t->block_elems;
  *block_bytes = t->block_bytes;
  return true;
}

absl::Status Dequantize(uint32_t type, const uint8_t* src, int64_t n,
                        float* dst) {
  const TypeTraits* t = FindType(type);
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

bool GgufValue::is_integer() const { return IsIntegerType(type); }
bool GgufValue::is_float() const { return IsFloatType(type); }

size_t GgufValue::array_size() const {
  if (type != GgufValueType::kArray) return 0;
  switch (element_type) {
    case GgufValueType::kString:
      return string_array.size();
    case GgufValueType::kArray:
      return array_array.size();
    case GgufValueType::kFloat32:
    case GgufValueType::kFloat64:
      return float_array.size();
    default:
      return int_array.size();
  }
}

int64_t GgufTensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string GgufTensorInfo::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// ---------------------------------------------------------------------------
// GgufFile.

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  IG_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
  GgufFile file(std::move(mapped));
  IG_RETURN_IF_ERROR(file.Parse());
  return file;
}

absl::Status GgufFile::Parse() {
  const std::string& p = file_.path();
  Reader r(file_.data(), file_.size(), p);
  uint32_t magic = 0;
  IG_RETURN_IF_ERROR(r.Read(&magic, "magic"));
  if (magic != kGgufMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is not a GGUF file: it starts with %s, not \"GGUF\"", p,
        absl::CEscape(std::string(file_.view().substr(0, 4)))));
  }
  IG_RETURN_IF_ERROR(r.Read(&version_, "version"));
  if (version_ != 2 && version_ != 3) {
    if ((version_ & 0xFFFF) == 0 && version_ != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: big-endian GGUF files are not supported", p));
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: unsupported GGUF version %d (this loader reads 2 and 3)", p,
        version_));
  }
  uint64_t tensor_count = 0, kv_count = 0;
  IG_RETURN_IF_ERROR(r.Read(&tensor_count, "tensor count"));
  IG_RETURN_IF_ERROR(r.Read(&kv_count, "metadata count"));
  // Each key/value takes at least 8 + 4 + 1 bytes, each tensor info at
  // least 8 + 4 + 4 + 8.
  if (kv_count > r.remaining() / 13) {
    return r.Truncated(absl::StrFormat("%d metadata entries", kv_count),
                       kv_count * 13);
  }
  if (tensor_count > r.remaining() / 24) {
    return r.Truncated(absl::StrFormat("%d tensor infos", tensor_count),
                       tensor_count * 24);
  }

  for (uint64_t i = 0; i < kv_count; ++i) {
    std::string key;
    IG_RETURN_IF_ERROR(r.ReadString(&key, absl::StrCat("metadata key ", i)));
    uint32_t type = 0;
    IG_RETURN_IF_ERROR(r.Read(&type, "value type of " + key));
    GgufValue v;
    IG_RETURN_IF_ERROR(ReadValue(r, p, key, type, 0, &v));
    if (!metadata_.emplace(key, std::move(v)).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: duplicate metadata key %s", p, key));
    }
    keys_.push_back(std::move(key));
  }

  IG_ASSIGN_OR_RETURN(alignment_,
                      GetIntOr("general.alignment", kDefaultAlignment));
  if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: general.alignment %d is not a power of two", p, alignment_));
  }

  tensors_.resize(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo& t = tensors_[i];
    IG_RETURN_IF_ERROR(
        r.ReadString(&t.name, absl::StrCat("name of tensor ", i)));
    uint32_t n_dims = 0;
    IG_RETURN_IF_ERROR(r.Read(&n_dims, "dimension count of " + t.name));
    if (n_dims > kMaxDims) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s has %d dimensions, at most %d are allowed", p, t.name,
          n_dims, kMaxDims));
    }
    t.shape.resize(n_dims);
    int64_t elems = 1;
    for (auto& d : t.shape) {
      IG_RETURN_IF_ERROR(r.Read(&d, "shape of " + t.name));
      if (d < 0 || (d > 0 && elems > std::numeric_limits<int64_t>::max() / d)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: tensor %s has an invalid shape", p, t.name));
      }
      elems *= d;
    }
    IG_RETURN_IF_ERROR(r.Read(&t.type, "type of " + t.name));
    IG_RETURN_IF_ERROR(r.Read(&t.offset, "data offset of " + t.name));
    const TypeTraits* traits = FindType(t.type);
    if (traits == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s has unknown ggml type id %d", p, t.name, t.type));
    }
    const int64_t row = t.shape.empty() ? 1 : t.shape[0];
    if (row % traits->block_elems != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s of type %s has rows of %d values, not a multiple of "
          "its block size %d",
          p, t.name, traits->name, row, traits->block_elems));
    }
    t.num_bytes = static_cast<uint64_t>(elems / traits->block_elems) *
                  traits->block_bytes;
    if (t.offset % alignment_ != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s data offset %d is not a multiple of the alignment %d",
          p, t.name, t.offset, alignment_));
    }
    if (!tensor_index_.emplace(t.name, i).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: duplicate tensor %s", p, t.name));
    }
  }

  data_offset_ = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t size = file_.size();
  for (const GgufTensorInfo& t : tensors_) {
    const uint64_t begin = data_offset_ + t.offset;
    if (begin < t.offset || begin > size || t.num_bytes > size - begin) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: tensor %s data [%d, %d) extends beyond the end of the file "
          "(%d bytes); the file is truncated or corrupt",
          p, t.name, begin, begin + t.num_bytes, size));
    }
  }
  return absl::OkStatus();
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

absl::Status WrongType(const std::string& path, const std::string& key,
                       const GgufValue& v, const char* want) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: metadata key %s is a %s, expected %s", path, key,
                      ValueTypeName(v.type), want));
}

absl::Status MissingKey(const std::string& path, const std::string& key) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: missing metadata key %s", path, key));
}

}  // namespace

absl::StatusOr<int64_t> GgufFile::GetInt(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (!v->is_integer()) return WrongType(path(), key, *v, "an integer");
  return v->int_value;
}

absl::StatusOr<double> GgufFile::GetFloat(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->is_float()) return v->float_value;
  if (v->is_integer()) return static_cast<double>(v->int_value);
  return WrongType(path(), key, *v, "a number");
}

absl::StatusOr<std::string> GgufFile::GetString(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->type != GgufValueType::kString) {
    return WrongType(path(), key, *v, "a string");
  }
  return v->string_value;
}

absl::StatusOr<bool> GgufFile::GetBool(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (!v->is_integer()) return WrongType(path(), key, *v, "a bool");
  return v->int_value != 0;
}

absl::StatusOr<int64_t> GgufFile::GetIntOr(const std::string& key,
                                           int64_t fallback) const {
  if (Find(key) == nullptr) return fallback;
  return GetInt(key);
}

absl::StatusOr<double> GgufFile::GetFloatOr(const std::string& key,
                                            double fallback) const {
  if (Find(key) == nullptr) return fallback;
  return GetFloat(key);
}

absl::StatusOr<bool> GgufFile::GetBoolOr(const std::string& key,
                                         bool fallback) const {
  if (Find(key) == nullptr) return fallback;
  return GetBool(key);
}

absl::StatusOr<const std::vector<std::string>*> GgufFile::GetStringArray(
    const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->type != GgufValueType::kArray ||
      v->element_type != GgufValueType::kString) {
    return WrongType(path(), key, *v, "an array of strings");
  }
  return &v->string_array;
}

absl::StatusOr<const std::vector<int64_t>*> GgufFile::GetIntArray(
    const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return MissingKey(path(), key);
  if (v->type != GgufValueType::kArray || !IsIntegerType(v->element_type)) {
    return WrongType(path(), key, *v, "an array of integers");
  }
  return &v->int_array;
}

const GgufTensorInfo* GgufFile::FindTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<std::vector<float>> GgufFile::ReadTensor(
    const GgufTensorInfo& t) const {
  const TypeTraits* traits = FindType(t.type);
  if (traits == nullptr || traits->dequant == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: tensor %s has type %s (id %d), which this loader cannot "
        "dequantize",
        path(), t.name, GgmlTypeName(t.type), t.type));
  }
  const int64_t n = t.num_elements();
  std::vector<float> out(n);
  const uint8_t* src = TensorData(t);
  const int64_t blocks = n / traits->block_elems;
  // Dequantizing is memory-bound but not free (a 7B model is ~7e9 values);
  // split big tensors by blocks across a few threads.
  constexpr int64_t kValuesPerThread = 1 << 20;
  const int threads = static_cast<int>(std::clamp<int64_t>(
      std::min<int64_t>(n / kValuesPerThread,
                        std::max(1u, std::thread::hardware_concurrency())),
      1, 16));
  const auto run = [&](int64_t b0, int64_t b1) {
    traits->dequant(src + b0 * traits->block_bytes, b1 - b0,
                    out.data() + b0 * traits->block_elems);
  };
  if (threads == 1) {
    run(0, blocks);
  } else {
    std::vector<std::thread> pool;
    const int64_t per = (blocks + threads - 1) / threads;
    for (int i = 0; i < threads; ++i) {
      const int64_t b0 = std::min(blocks, i * per);
      const int64_t b1 = std::min(blocks, b0 + per);
      pool.emplace_back(run, b0, b1);
    }
    for (auto& th : pool) th.join();
  }
  // The quantized bytes are not needed resident once converted: a loader
  // then holds the fp32 weights plus one tensor of the file at a time, not
  // the whole file besides.
  file_.DropPages(src, t.num_bytes);
  return out;
}

// ---------------------------------------------------------------------------
// Llama weights.

namespace {

absl::StatusOr<int> GetDim(const GgufFile& f, const std::string& key) {
  IG_ASSIGN_OR_RETURN(int64_t v, f.GetInt(key));
  if (v <= 0 || v > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s = %d is out of range", f.path(), key, v));
  }
  return static_cast<int>(v);
}

// The tensor `name` as fp32; its GGUF shape must be `shape` (innermost
// first).
absl::StatusOr<std::vector<float>> ReadExpected(
    const GgufFile& f, const std::string& name,
    const std::vector<int64_t>& shape) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: missing tensor %s", f.path(), name));
  }
  if (t->shape != shape) {
    GgufTensorInfo want;
    want.shape = shape;
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor %s has shape %s, the config wants %s",
                        f.path(), name, t->ShapeString(), want.ShapeString()));
  }
  return f.ReadTensor(*t);
}

absl::StatusOr<ModelConfig> LlamaConfig(const GgufFile& f) {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  IG_ASSIGN_OR_RETURN(c.dim, GetDim(f, "llama.embedding_length"));
  IG_ASSIGN_OR_RETURN(c.hidden_dim, GetDim(f, "llama.feed_forward_length"));
  IG_ASSIGN_OR_RETURN(c.n_layers, GetDim(f, "llama.block_count"));
  IG_ASSIGN_OR_RETURN(c.n_heads, GetDim(f, "llama.attention.head_count"));
  c.n_kv_heads = c.n_heads;
  if (f.Find("llama.attention.head_count_kv") != nullptr) {
    IG_ASSIGN_OR_RETURN(c.n_kv_heads,
                        GetDim(f, "llama.attention.head_count_kv"));
  }
  c.head_dim = c.dim / c.n_heads;
  if (f.Find("llama.attention.key_length") != nullptr) {
    IG_ASSIGN_OR_RETURN(c.head_dim, GetDim(f, "llama.attention.key_length"));
  }
  if (f.Find("llama.rope.dimension_count") != nullptr) {
    IG_ASSIGN_OR_RETURN(int rot, GetDim(f, "llama.rope.dimension_count"));
    if (rot != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: llama.rope.dimension_count %d differs from the head dim %d; "
          "partial rotary embeddings are not supported",
          f.path(), rot, c.head_dim));
    }
  }
  IG_ASSIGN_OR_RETURN(c.max_seq_len, GetDim(f, "llama.context_length"));
  IG_ASSIGN_OR_RETURN(double eps,
                      f.GetFloat("llama.attention.layer_norm_rms_epsilon"));
  c.norm_eps = static_cast<float>(eps);
  IG_ASSIGN_OR_RETURN(double theta,
                      f.GetFloatOr("llama.rope.freq_base", 10000.0));
  c.rope_theta = static_cast<float>(theta);

  if (f.Find("tokenizer.ggml.tokens") != nullptr) {
    IG_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens,
                        f.GetStringArray("tokenizer.ggml.tokens"));
    c.vocab_size = static_cast<int>(tokens->size());
  } else if (f.Find("llama.vocab_size") != nullptr) {
    IG_ASSIGN_OR_RETURN(c.vocab_size, GetDim(f, "llama.vocab_size"));
  } else if (const GgufTensorInfo* emb = f.FindTensor("token_embd.weight");
             emb != nullptr && emb->shape.size() == 2) {
    c.vocab_size = static_cast<int>(emb->shape[1]);
  }
  IG_ASSIGN_OR_RETURN(int64_t bos,
                      f.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  IG_ASSIGN_OR_RETURN(int64_t eos,
                      f.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  c.bos_id = static_cast<int>(bos);
  c.eos_id = static_cast<int>(eos);

  absl::Status s = c.Validate();
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", f.path(), s.message()));
  }
  return c;
}

std::string TypeHistogram(const GgufFile& f) {
  std::map<std::string, int> counts;
  for (const GgufTensorInfo& t : f.tensors()) ++counts[GgmlTypeName(t.type)];
  return absl::StrJoin(counts, ", ", [](std::string* out, const auto& kv) {
    absl::StrAppend(out, kv.first, " x", kv.second);
  });
}

}  // namespace

absl::StatusOr<Weights> LoadGgufWeights(const std::string& path) {
  IG_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Open(path));
  return LoadGgufWeights(f);
}

absl::StatusOr<Weights> LoadGgufWeights(const GgufFile& f) {
  const std::string& path = f.path();
  IG_ASSIGN_OR_RETURN(std::string arch, f.GetString("general.architecture"));
  if (arch != "llama") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unsupported architecture %s in %s (only llama is supported)", arch,
        path));
  }
  Weights w;
  IG_ASSIGN_OR_RETURN(w.config, LlamaConfig(f));
  const ModelConfig& c = w.config;
  const int64_t dim = c.dim, hid = c.hidden_dim, q = c.q_dim(), kv = c.kv_dim(),
                vocab = c.vocab_size;

  IG_ASSIGN_OR_RETURN(w.token_embedding,
                      ReadExpected(f, "token_embd.weight", {dim, vocab}));
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const auto name = [i](const char* t) {
      return absl::StrFormat("blk.%d.%s.weight", i, t);
    };
    IG_ASSIGN_OR_RETURN(l.attn_norm, ReadExpected(f, name("attn_norm"), {dim}));
    IG_ASSIGN_OR_RETURN(l.wq, ReadExpected(f, name("attn_q"), {dim, q}));
    IG_ASSIGN_OR_RETURN(l.wk, ReadExpected(f, name("attn_k"), {dim, kv}));
    IG_ASSIGN_OR_RETURN(l.wv, ReadExpected(f, name("attn_v"), {dim, kv}));
    IG_ASSIGN_OR_RETURN(l.wo, ReadExpected(f, name("attn_output"), {q, dim}));
    IG_ASSIGN_OR_RETURN(l.ffn_norm, ReadExpected(f, name("ffn_norm"), {dim}));
    IG_ASSIGN_OR_RETURN(l.w1, ReadExpected(f, name("ffn_gate"), {dim, hid}));
    IG_ASSIGN_OR_RETURN(l.w3, ReadExpected(f, name("ffn_up"), {dim, hid}));
    IG_ASSIGN_OR_RETURN(l.w2, ReadExpected(f, name("ffn_down"), {hid, dim}));
    // llama.cpp's converter interleaves each head's rotary pairs; undo it.
    PermuteInterleavedToHalfSplit(l.wq, c.n_heads, c.head_dim, c.dim);
    PermuteInterleavedToHalfSplit(l.wk, c.n_kv_heads, c.head_dim, c.dim);
  }
  IG_ASSIGN_OR_RETURN(w.final_norm,
                      ReadExpected(f, "output_norm.weight", {dim}));
  if (f.FindTensor("output.weight") != nullptr) {
    IG_ASSIGN_OR_RETURN(w.lm_head,
                        ReadExpected(f, "output.weight", {dim, vocab}));
  }
  absl::Status s = w.Validate();
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", path, s.message()));
  }
  IG_LOG(INFO) << "loaded GGUF v" << f.version() << " " << path << ": "
               << f.tensors().size() << " tensors (" << TypeHistogram(f)
               << "), " << c.DebugString()
               << (w.lm_head.empty() ? ", tied lm_head" : "");
  return w;
}

// ---------------------------------------------------------------------------
// Tokenizer.

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(
    const std::string& path) {
  IG_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Open(path));
  return LoadGgufTokenizer(f);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufTokenizer(
    const GgufFile& f) {
  const std::string& path = f.path();
  IG_ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
  if (model != "gpt2") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "unsupported tokenizer model %s in %s (only gpt2 byte-level BPE is "
        "supported)",
        model, path));
  }
  BpeVocabulary vocab;
  IG_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens,
                      f.GetStringArray("tokenizer.ggml.tokens"));
  vocab.tokens = *tokens;
  IG_ASSIGN_OR_RETURN(const std::vector<std::string>* merges,
                      f.GetStringArray("tokenizer.ggml.merges"));
  vocab.merges = *merges;
  if (f.Find("tokenizer.ggml.token_type") != nullptr) {
    IG_ASSIGN_OR_RETURN(const std::vector<int64_t>* types,
                        f.GetIntArray("tokenizer.ggml.token_type"));
    for (int64_t t : *types) {
      if (t < 0 || t > static_cast<int64_t>(TokenType::kByte)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: tokenizer.ggml.token_type holds unknown type %d", path, t));
      }
      vocab.types.push_back(static_cast<TokenType>(t));
    }
  }
  IG_ASSIGN_OR_RETURN(int64_t bos,
                      f.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  IG_ASSIGN_OR_RETURN(int64_t eos,
                      f.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  IG_ASSIGN_OR_RETURN(int64_t unk,
                      f.GetIntOr("tokenizer.ggml.unknown_token_id", -1));
  vocab.bos_id = static_cast<int>(bos);
  vocab.eos_id = static_cast<int>(eos);
  vocab.unk_id = static_cast<int>(unk);
  IG_ASSIGN_OR_RETURN(vocab.add_bos,
                      f.GetBoolOr("tokenizer.ggml.add_bos_token", false));

  // llama.cpp's pre-tokenizer names (llama-vocab.cpp): these split every
  // digit off before the GPT-2 rule; the rest of the known GPT-2-style ones
  // use the rule as is.
  std::string pre = "default";
  if (f.Find("tokenizer.ggml.pre") != nullptr) {
    IG_ASSIGN_OR_RETURN(pre, f.GetString("tokenizer.ggml.pre"));
  }
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" ||
      pre == "command-r" || pre == "codeshell" || pre == "exaone" ||
      pre == "minerva-7b") {
    vocab.pre_tokenizer = BpePreTokenizer::kDigitsThenGpt2;
  } else if (pre == "default" || pre == "gpt2" || pre == "gpt-2" ||
             pre == "mpt" || pre == "olmo" || pre == "jais") {
    vocab.pre_tokenizer = BpePreTokenizer::kGpt2;
  } else {
    IG_LOG(WARNING) << path << ": pre-tokenizer " << pre
                    << " is not implemented; using GPT-2's, so tokenization "
                       "may differ from the model's own";
    vocab.pre_tokenizer = BpePreTokenizer::kGpt2;
  }

  absl::StatusOr<std::unique_ptr<BpeTokenizer>> t =
      BpeTokenizer::Create(std::move(vocab));
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s", path, t.status().message()));
  }
  return std::unique_ptr<Tokenizer>(std::move(t).value());
}

}  // namespace infinigen::model
