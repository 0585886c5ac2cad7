#include "model/gguf.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_writer.h"

namespace infinigen::model {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

std::string WriteBytes(const std::string& name, const std::string& bytes) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string WriteGguf(const std::string& name, const GgufWriter& w) {
  return WriteBytes(name, w.Serialize());
}

template <typename T>
void PutLE(std::string& s, size_t offset, T v) {
  std::memcpy(&s[offset], &v, sizeof(T));
}

uint32_t TypeId(GgmlType t) { return static_cast<uint32_t>(t); }

// ---------------------------------------------------------------------------
// Metadata.

TEST(GgufFileTest, ParsesEveryMetadataType) {
  GgufWriter w;
  w.AddUint8("u8", 200);
  w.AddInt8("i8", -100);
  w.AddUint16("u16", 60000);
  w.AddInt16("i16", -30000);
  w.AddUint32("u32", 4000000000u);
  w.AddInt32("i32", -2000000000);
  w.AddUint64("u64", 1ull << 40);
  w.AddInt64("i64", -(1ll << 40));
  w.AddFloat32("f32", 0.5f);
  w.AddFloat64("f64", -2.25);
  w.AddBool("yes", true);
  w.AddBool("no", false);
  w.AddString("str", "héllo");
  w.AddStringArray("strs", {"a", "", "Ġthe"});
  w.AddInt32Array("ints", {1, -2, 3});
  w.AddFloat32Array("floats", {1.5f, -0.25f});
  w.AddNestedUint8Array("nested", {{1, 2}, {}, {3}});
  w.set_version(2);
  const std::string path = WriteGguf("meta.gguf", w);

  absl::StatusOr<GgufFile> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->version(), 2u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->keys().size(), 17u);
  EXPECT_EQ(f->keys()[0], "u8");
  EXPECT_EQ(*f->GetInt("u8"), 200);
  EXPECT_EQ(*f->GetInt("i8"), -100);
  EXPECT_EQ(*f->GetInt("u16"), 60000);
  EXPECT_EQ(*f->GetInt("i16"), -30000);
  EXPECT_EQ(*f->GetInt("u32"), 4000000000ll);
  EXPECT_EQ(*f->GetInt("i32"), -2000000000);
  EXPECT_EQ(*f->GetInt("u64"), 1ll << 40);
  EXPECT_EQ(*f->GetInt("i64"), -(1ll << 40));
  EXPECT_EQ(*f->GetFloat("f32"), 0.5);
  EXPECT_EQ(*f->GetFloat("f64"), -2.25);
  EXPECT_EQ(*f->GetFloat("u8"), 200.0);  // integers widen to float
  EXPECT_TRUE(*f->GetBool("yes"));
  EXPECT_FALSE(*f->GetBool("no"));
  EXPECT_EQ(*f->GetString("str"), "héllo");
  EXPECT_THAT(**f->GetStringArray("strs"),
              ::testing::ElementsAre("a", "", "Ġthe"));
  EXPECT_THAT(**f->GetIntArray("ints"), ::testing::ElementsAre(1, -2, 3));
  const GgufValue* floats = f->Find("floats");
  ASSERT_NE(floats, nullptr);
  EXPECT_THAT(floats->float_array, ::testing::ElementsAre(1.5, -0.25));
  const GgufValue* nested = f->Find("nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->element_type, GgufValueType::kArray);
  ASSERT_EQ(nested->array_size(), 3u);
  EXPECT_THAT(nested->array_array[0].int_array, ::testing::ElementsAre(1, 2));
  EXPECT_EQ(nested->array_array[1].array_size(), 0u);
  EXPECT_THAT(nested->array_array[2].int_array, ::testing::ElementsAre(3));

  EXPECT_EQ(*f->GetIntOr("absent", 7), 7);
  EXPECT_EQ(f->Find("absent"), nullptr);
  absl::StatusOr<int64_t> missing = f->GetInt("absent");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(),
              AllOf(HasSubstr(path), HasSubstr("absent")));
  absl::StatusOr<int64_t> wrong = f->GetInt("str");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("is a string"));
  EXPECT_FALSE(f->GetString("u8").ok());
  EXPECT_FALSE(f->GetStringArray("ints").ok());
}

TEST(GgufFileTest, HonoursCustomAlignment) {
  GgufWriter w;
  w.SetAlignment(64);
  w.AddF32Tensor("a", {3}, {1, 2, 3});
  w.AddF32Tensor("b", {2, 2}, {4, 5, 6, 7});
  const std::string path = WriteGguf("align.gguf", w);
  absl::StatusOr<GgufFile> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->alignment(), 64u);
  EXPECT_EQ(f->data_offset() % 64, 0u);
  const GgufTensorInfo* b = f->FindTensor("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->offset, 64u);
  EXPECT_EQ(b->ShapeString(), "[2, 2]");
  EXPECT_THAT(*f->ReadTensor(*b), ::testing::ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(*f->ReadTensor(*f->FindTensor("a")),
              ::testing::ElementsAre(1, 2, 3));
}

// ---------------------------------------------------------------------------
// Dequantization, against values worked out by hand.

std::vector<float> ReadOne(const std::string& name, GgmlType type,
                           std::vector<int64_t> shape, std::string bytes) {
  GgufWriter w;
  w.AddTensor("t", shape, TypeId(type), std::move(bytes));
  const std::string path = WriteGguf(name, w);
  absl::StatusOr<GgufFile> f = GgufFile::Open(path);
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return {};
  absl::StatusOr<std::vector<float>> v = f->ReadTensor(f->tensors()[0]);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : std::vector<float>{};
}

// fp16 bit patterns used below: 0x3C00 = 1, 0x3800 = 0.5, 0x3400 = 0.25,
// 0x3000 = 0.125, 0xBC00 = -1, 0xC000 = -2.
TEST(GgufDequantizeTest, F16AndBF16) {
  std::string f16(10, '\0');
  const uint16_t halves[] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x3555};
  std::memcpy(f16.data(), halves, sizeof(halves));
  std::vector<float> v = ReadOne("f16.gguf", GgmlType::kF16, {5}, f16);
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -2.0f);
  EXPECT_EQ(v[2], std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(v[3], 65504.0f);               // largest finite
  EXPECT_EQ(v[4], 1365.0f / 4096.0f);      // 0x3555 = (1 + 341/1024) / 4

  std::string bf16(4, '\0');
  const uint16_t bf_bits[] = {0x3F80, 0xC040};
  std::memcpy(bf16.data(), bf_bits, sizeof(bf_bits));
  v = ReadOne("bf16.gguf", GgmlType::kBF16, {2}, bf16);
  EXPECT_THAT(v, ::testing::ElementsAre(1.0f, -3.0f));
}

TEST(GgufDequantizeTest, Q8_0IsScaleTimesQuant) {
  std::string b(34, '\0');
  PutLE<uint16_t>(b, 0, 0x3800);  // d = 0.5
  for (int j = 0; j < 32; ++j) b[2 + j] = static_cast<char>(j * 8 - 128);
  std::vector<float> v = ReadOne("q8_0.gguf", GgmlType::kQ8_0, {32}, b);
  ASSERT_EQ(v.size(), 32u);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(v[j], 0.5f * (j * 8 - 128)) << j;
}

TEST(GgufDequantizeTest, Q4_0AndQ4_1SplitLowAndHighNibbles) {
  // Byte j holds element j in its low nibble and element j + 16 in its high
  // nibble.
  std::string q4_0(18, '\0'), q4_1(20, '\0');
  PutLE<uint16_t>(q4_0, 0, 0x3400);  // d = 0.25
  PutLE<uint16_t>(q4_1, 0, 0x3800);  // d = 0.5
  PutLE<uint16_t>(q4_1, 2, 0xBC00);  // m = -1
  for (int j = 0; j < 16; ++j) {
    const uint8_t byte = static_cast<uint8_t>(j | ((15 - j) << 4));
    q4_0[2 + j] = static_cast<char>(byte);
    q4_1[4 + j] = static_cast<char>(byte);
  }
  std::vector<float> a = ReadOne("q4_0.gguf", GgmlType::kQ4_0, {32}, q4_0);
  std::vector<float> b = ReadOne("q4_1.gguf", GgmlType::kQ4_1, {32}, q4_1);
  ASSERT_EQ(a.size(), 32u);
  ASSERT_EQ(b.size(), 32u);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(a[j], 0.25f * (j - 8));
    EXPECT_EQ(a[j + 16], 0.25f * ((15 - j) - 8));
    EXPECT_EQ(b[j], 0.5f * j - 1.0f);
    EXPECT_EQ(b[j + 16], 0.5f * (15 - j) - 1.0f);
  }
}

TEST(GgufDequantizeTest, Q5_0AndQ5_1TakeTheFifthBitFromQh) {
  // Element j's fifth bit is bit j of the little-endian uint32 qh.
  const uint32_t qh = 0xA5A5F00F;
  std::string q5_0(22, '\0'), q5_1(24, '\0');
  PutLE<uint16_t>(q5_0, 0, 0x3C00);  // d = 1
  PutLE<uint16_t>(q5_1, 0, 0x3400);  // d = 0.25
  PutLE<uint16_t>(q5_1, 2, 0x3000);  // m = 0.125
  PutLE<uint32_t>(q5_0, 2, qh);
  PutLE<uint32_t>(q5_1, 4, qh);
  for (int j = 0; j < 16; ++j) {
    const uint8_t byte = static_cast<uint8_t>((j * 7) & 0xFF);
    q5_0[6 + j] = static_cast<char>(byte);
    q5_1[8 + j] = static_cast<char>(byte);
  }
  std::vector<float> a = ReadOne("q5_0.gguf", GgmlType::kQ5_0, {32}, q5_0);
  std::vector<float> b = ReadOne("q5_1.gguf", GgmlType::kQ5_1, {32}, q5_1);
  ASSERT_EQ(a.size(), 32u);
  ASSERT_EQ(b.size(), 32u);
  for (int j = 0; j < 32; ++j) {
    const uint8_t byte = static_cast<uint8_t>(((j % 16) * 7) & 0xFF);
    const int low = j < 16 ? (byte & 0xF) : (byte >> 4);
    const int q = low | (((qh >> j) & 1) << 4);
    EXPECT_EQ(a[j], 1.0f * (q - 16)) << j;
    EXPECT_EQ(b[j], 0.25f * q + 0.125f) << j;
  }
}

TEST(GgufDequantizeTest, Q8_KIsFloatScaleTimesQuant) {
  std::string b(292, '\0');
  PutLE<float>(b, 0, 0.75f);
  for (int j = 0; j < 256; ++j) b[4 + j] = static_cast<char>(j);
  std::vector<float> v = ReadOne("q8_k.gguf", GgmlType::kQ8_K, {256}, b);
  ASSERT_EQ(v.size(), 256u);
  for (int j = 0; j < 256; ++j) {
    EXPECT_EQ(v[j], 0.75f * static_cast<int8_t>(j)) << j;
  }
}

TEST(GgufDequantizeTest, Q4_KByHand) {
  // One super-block: scales/mins for sub-blocks 0..3 are the low 6 bits of
  // scales[0..3] / scales[4..7]; sub-blocks 4..7 take 4 bits from
  // scales[8..11] and their top 2 bits from the top of scales[0..7].
  std::string b(144, '\0');
  PutLE<uint16_t>(b, 0, 0x3C00);  // d = 1
  PutLE<uint16_t>(b, 2, 0x3800);  // dmin = 0.5
  const uint8_t scales[12] = {0x41, 0x02, 0x03, 0xC4, 0x05, 0x06,
                              0x87, 0x08, 0x21, 0x32, 0x43, 0x54};
  std::memcpy(&b[4], scales, 12);
  for (int i = 0; i < 128; ++i) b[16 + i] = static_cast<char>(0x5A ^ i);
  // (scale, min) per sub-block of 32, worked out from the bytes above.
  const int sc[8] = {
      1, 2, 3, 4, 1 | (1 << 4), 2 | (0 << 4), 3 | (0 << 4), 4 | (3 << 4)};
  const int mn[8] = {
      5, 6, 7, 8, 2 | (0 << 4), 3 | (0 << 4), 4 | (2 << 4), 5 | (0 << 4)};
  std::vector<float> v = ReadOne("q4_k.gguf", GgmlType::kQ4_K, {256}, b);
  ASSERT_EQ(v.size(), 256u);
  for (int e = 0; e < 256; ++e) {
    const int sub = e / 32;  // chunks of 64 hold sub-blocks 2c (low nibbles)
    const uint8_t byte = static_cast<uint8_t>(0x5A ^ ((sub / 2) * 32 + e % 32));
    const int q = sub % 2 == 0 ? (byte & 0xF) : (byte >> 4);
    EXPECT_EQ(v[e], 1.0f * sc[sub] * q - 0.5f * mn[sub]) << e;
  }
}

// Blocks of pseudo-random bytes (fp16 scales overwritten with 0.25 and
// 0.125, or -1 for Q4_1/Q5_1 mins) dequantized by the gguf Python package
// (gguf-py 0.19.0, gguf.quants.dequantize), which reimplements ggml's
// reference in numpy: the weighted sum over all values plus a few samples.
struct Reference {
  GgmlType type;
  uint32_t seed;
  double weighted_sum;  // sum of v[i] * (i % 7 + 1)
  std::vector<std::pair<int, float>> samples;
};

std::string RandomBlock(uint32_t seed, int bytes) {
  std::string b(bytes, '\0');
  uint32_t s = seed;
  for (int i = 0; i < bytes; ++i) {
    s = s * 1103515245u + 12345u;
    b[i] = static_cast<char>((s >> 16) & 0xFF);
  }
  return b;
}

TEST(GgufDequantizeTest, MatchesGgufPyReference) {
  // clang-format off
  const std::vector<Reference> refs = {
      {GgmlType::kQ4_0, 1034, -77.5,
       {{0, -2}, {1, -1.5}, {15, -0.75}, {16, 1.5},
        {31, -0.75}, {35, -0.5}, {63, 0.25}}},
      {GgmlType::kQ4_1, 1051, 195.5,
       {{0, 2.5}, {1, 2}, {15, 1.75}, {16, 2}, {31, 0}, {35, 2.5}, {63, -0.5}}},
      {GgmlType::kQ5_0, 1102, -29.75,
       {{0, -2}, {1, 1}, {15, -1.75}, {16, 0.75},
        {31, 0.25}, {35, -2.75}, {63, -2}}},
      {GgmlType::kQ5_1, 1119, 725.25,
       {{0, 3.5}, {1, 1.75}, {15, -0.25}, {16, 4.5},
        {31, 6.5}, {35, 2.75}, {63, 4.75}}},
      {GgmlType::kQ8_0, 1136, -553.25,
       {{0, -1.75}, {1, 14}, {15, 27.5}, {16, -9.75},
        {31, -22.75}, {35, -15.75}, {63, -31.25}}},
      {GgmlType::kQ2_K, 1170, 4223.75,
       {{0, 0.875}, {1, -0.625}, {127, -0.25}, {128, 1.875},
        {255, 6}, {259, 3.875}, {511, 0.75}}},
      {GgmlType::kQ3_K, 1187, 1561,
       {{0, -21.75}, {1, 29}, {127, 26}, {128, 0},
        {255, 6}, {259, -4}, {511, 7.5}}},
      {GgmlType::kQ4_K, 1204, 128025.375,
       {{0, 19.875}, {1, 119.875}, {127, 35.125}, {128, 1.875},
        {255, 128}, {259, 19.375}, {511, 37.125}}},
      {GgmlType::kQ5_K, 1221, 221995.5,
       {{0, 39.5}, {1, 309.5}, {127, 49.625}, {128, -0.125},
        {255, 22.5}, {259, 1.25}, {511, 60.375}}},
      {GgmlType::kQ6_K, 1238, 2071.5,
       {{0, -12.25}, {1, -367.5}, {127, -551}, {128, 104},
        {255, -3.5}, {259, 258.5}, {511, -170}}},
  };
  // clang-format on
  // Offsets of the fp16 fields in each block (ggml-common.h).
  struct Halves {
    GgmlType type;
    std::vector<std::pair<int, uint16_t>> fields;
  };
  const std::vector<Halves> halves = {
      {GgmlType::kQ4_0, {{0, 0x3400}}},
      {GgmlType::kQ4_1, {{0, 0x3400}, {2, 0xBC00}}},
      {GgmlType::kQ5_0, {{0, 0x3400}}},
      {GgmlType::kQ5_1, {{0, 0x3400}, {2, 0xBC00}}},
      {GgmlType::kQ8_0, {{0, 0x3400}}},
      {GgmlType::kQ2_K, {{80, 0x3400}, {82, 0x3000}}},
      {GgmlType::kQ3_K, {{108, 0x3400}}},
      {GgmlType::kQ4_K, {{0, 0x3400}, {2, 0x3000}}},
      {GgmlType::kQ5_K, {{0, 0x3400}, {2, 0x3000}}},
      {GgmlType::kQ6_K, {{208, 0x3400}}},
  };
  ASSERT_EQ(refs.size(), halves.size());
  for (size_t r = 0; r < refs.size(); ++r) {
    const Reference& ref = refs[r];
    ASSERT_EQ(ref.type, halves[r].type);
    int64_t elems = 0, bytes = 0;
    ASSERT_TRUE(GgmlBlockLayout(TypeId(ref.type), &elems, &bytes));
    std::string data;
    for (int blk = 0; blk < 2; ++blk) {
      std::string b = RandomBlock(ref.seed + blk, bytes);
      for (auto [off, v] : halves[r].fields) PutLE<uint16_t>(b, off, v);
      data += b;
    }
    std::vector<float> out(2 * elems);
    ASSERT_TRUE(Dequantize(TypeId(ref.type),
                           reinterpret_cast<const uint8_t*>(data.data()),
                           2 * elems, out.data())
                    .ok());
    double sum = 0;
    for (size_t i = 0; i < out.size(); ++i) sum += out[i] * (i % 7 + 1);
    const std::string name = GgmlTypeName(TypeId(ref.type));
    EXPECT_DOUBLE_EQ(sum, ref.weighted_sum) << name;
    for (auto [i, v] : ref.samples) EXPECT_EQ(out[i], v) << name << " " << i;

    // The same through a file, as a 2-row tensor.
    std::vector<float> via_file =
        ReadOne(name + ".gguf", ref.type, {elems, 2}, data);
    EXPECT_EQ(via_file, out) << name;
  }
}

TEST(GgufDequantizeTest, RejectsPartialBlocksAndUnknownTypes) {
  float out[32];
  uint8_t in[64] = {};
  EXPECT_EQ(Dequantize(TypeId(GgmlType::kQ8_0), in, 16, out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Dequantize(16 /* IQ2_XXS */, in, 256, out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GgmlTypeName(16), "IQ2_XXS");
  EXPECT_EQ(GgmlTypeName(99), "type99");
}

// ---------------------------------------------------------------------------
// Llama weights.

ModelConfig TinyConfig() {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.dim = 32;
  c.hidden_dim = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 16;
  c.max_seq_len = 128;
  c.norm_eps = 1e-6f;
  c.rope_theta = 500000.0f;
  c.bos_id = 1;
  c.eos_id = 2;
  return c;
}

std::vector<float> Ramp(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + 0.001f * i;
  return v;
}

Weights TinyWeights(bool tied) {
  Weights w;
  w.config = TinyConfig();
  const ModelConfig& c = w.config;
  const size_t dim = c.dim, hid = c.hidden_dim;
  w.token_embedding = Ramp(c.vocab_size * dim, 1);
  w.layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    LayerWeights& l = w.layers[i];
    const float base = 10.0f * (i + 1);
    l.attn_norm = Ramp(dim, base + 1);
    l.wq = Ramp(c.q_dim() * dim, base + 2);
    l.wk = Ramp(c.kv_dim() * dim, base + 3);
    l.wv = Ramp(c.kv_dim() * dim, base + 4);
    l.wo = Ramp(dim * c.q_dim(), base + 5);
    l.ffn_norm = Ramp(dim, base + 6);
    l.w1 = Ramp(hid * dim, base + 7);
    l.w3 = Ramp(hid * dim, base + 8);
    l.w2 = Ramp(dim * hid, base + 9);
  }
  w.final_norm = Ramp(dim, 100);
  if (!tied) w.lm_head = Ramp(c.vocab_size * dim, 200);
  return w;
}

void ExpectSameWeights(const Weights& a, const Weights& b) {
  EXPECT_EQ(a.config.DebugString(), b.config.DebugString());
  EXPECT_EQ(a.config.norm_eps, b.config.norm_eps);
  EXPECT_EQ(a.config.rope_theta, b.config.rope_theta);
  EXPECT_EQ(a.config.bos_id, b.config.bos_id);
  EXPECT_EQ(a.config.eos_id, b.config.eos_id);
  EXPECT_EQ(a.token_embedding, b.token_embedding);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const LayerWeights& x = a.layers[i];
    const LayerWeights& y = b.layers[i];
    EXPECT_EQ(x.attn_norm, y.attn_norm) << i;
    EXPECT_EQ(x.wq, y.wq) << i;
    EXPECT_EQ(x.wk, y.wk) << i;
    EXPECT_EQ(x.wv, y.wv) << i;
    EXPECT_EQ(x.wo, y.wo) << i;
    EXPECT_EQ(x.ffn_norm, y.ffn_norm) << i;
    EXPECT_EQ(x.w1, y.w1) << i;
    EXPECT_EQ(x.w2, y.w2) << i;
    EXPECT_EQ(x.w3, y.w3) << i;
  }
  EXPECT_EQ(a.final_norm, b.final_norm);
  EXPECT_EQ(a.lm_head, b.lm_head);
}

TEST(LoadGgufWeightsTest, RoundTripsUntiedModel) {
  const Weights w = TinyWeights(/*tied=*/false);
  GgufWriter writer;
  AddLlamaModel(w, nullptr, writer);
  const std::string path = WriteGguf("untied.gguf", writer);
  absl::StatusOr<Weights> loaded = LoadGgufWeights(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameWeights(*loaded, w);
  EXPECT_FALSE(loaded->lm_head.empty());
  EXPECT_EQ(loaded->classifier(), loaded->lm_head.data());
}

TEST(LoadGgufWeightsTest, MissingOutputMeansTiedEmbeddings) {
  const Weights w = TinyWeights(/*tied=*/true);
  GgufWriter writer;
  AddLlamaModel(w, nullptr, writer);
  const std::string path = WriteGguf("tied.gguf", writer);
  absl::StatusOr<Weights> loaded = LoadGgufWeights(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameWeights(*loaded, w);
  EXPECT_TRUE(loaded->lm_head.empty());
  EXPECT_EQ(loaded->classifier(), loaded->token_embedding.data());
}

// Writes the tiny model but replaces `name` by `bytes` of `type`/`shape`
// (or drops it when type is negative).
std::string WriteTinyWith(const std::string& file, const std::string& name,
                          int type, std::vector<int64_t> shape,
                          const std::string& bytes,
                          const std::string& arch = "llama") {
  const Weights w = TinyWeights(/*tied=*/true);
  GgufWriter full;
  AddLlamaModel(w, nullptr, full);
  // Re-read the full file's tensors and re-emit them with the replacement.
  const std::string full_path = WriteGguf(file + ".full", full);
  absl::StatusOr<GgufFile> f = GgufFile::Open(full_path);
  EXPECT_TRUE(f.ok()) << f.status();
  GgufWriter out;
  for (const std::string& key : f->keys()) {
    const GgufValue* v = f->Find(key);
    if (key == "general.architecture") {
      out.AddString(key, arch);
    } else if (v->type == GgufValueType::kString) {
      out.AddString(key, v->string_value);
    } else if (v->type == GgufValueType::kFloat32) {
      out.AddFloat32(key, static_cast<float>(v->float_value));
    } else {
      out.AddUint32(key, static_cast<uint32_t>(v->int_value));
    }
  }
  for (const GgufTensorInfo& t : f->tensors()) {
    if (t.name == name) {
      if (type >= 0) out.AddTensor(t.name, shape, type, bytes);
      continue;
    }
    out.AddTensor(t.name, t.shape, t.type,
                  std::string(reinterpret_cast<const char*>(f->TensorData(t)),
                              t.num_bytes));
  }
  return WriteGguf(file, out);
}

TEST(LoadGgufWeightsTest, QuantizedTensorsAreDequantized) {
  // token_embd as Q8_0: 16 rows of 32 -> one block per row, d = 0.5,
  // q = row - col.
  std::string emb;
  for (int row = 0; row < 16; ++row) {
    std::string b(34, '\0');
    PutLE<uint16_t>(b, 0, 0x3800);
    for (int col = 0; col < 32; ++col)
      b[2 + col] = static_cast<char>(row - col);
    emb += b;
  }
  const std::string path =
      WriteTinyWith("q8emb.gguf", "token_embd.weight", TypeId(GgmlType::kQ8_0),
                    {32, 16}, emb);
  absl::StatusOr<Weights> loaded = LoadGgufWeights(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (int row = 0; row < 16; ++row) {
    for (int col = 0; col < 32; ++col) {
      EXPECT_EQ(loaded->token_embedding[row * 32 + col], 0.5f * (row - col));
    }
  }
}

TEST(LoadGgufWeightsTest, PermutesQueryAndKeyRowsToHalfSplit) {
  // File rows hold their own index; within each head of 8, GGUF's row 2i
  // is rotary pair i's first half and 2i+1 its second half, so the loaded
  // (half-split) row order per head is 0 2 4 6 1 3 5 7.
  const ModelConfig c = TinyConfig();
  std::vector<float> q(c.q_dim() * c.dim), k(c.kv_dim() * c.dim);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i / c.dim);
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i / c.dim);
  std::string qb(q.size() * 4, '\0'), kb(k.size() * 4, '\0');
  std::memcpy(qb.data(), q.data(), qb.size());
  std::memcpy(kb.data(), k.data(), kb.size());
  // Bypass AddLlamaModel's own permutation: replace Q, then K, by hand.
  const std::string base =
      WriteTinyWith("perm_q.gguf", "blk.0.attn_q.weight",
                    TypeId(GgmlType::kF32), {c.dim, c.q_dim()}, qb);
  absl::StatusOr<GgufFile> f = GgufFile::Open(base);
  ASSERT_TRUE(f.ok());
  GgufWriter out;
  for (const std::string& key : f->keys()) {
    const GgufValue* v = f->Find(key);
    if (v->type == GgufValueType::kString) {
      out.AddString(key, v->string_value);
    } else if (v->type == GgufValueType::kFloat32) {
      out.AddFloat32(key, static_cast<float>(v->float_value));
    } else {
      out.AddUint32(key, static_cast<uint32_t>(v->int_value));
    }
  }
  for (const GgufTensorInfo& t : f->tensors()) {
    std::string bytes(reinterpret_cast<const char*>(f->TensorData(t)),
                      t.num_bytes);
    out.AddTensor(t.name, t.shape, t.type,
                  t.name == "blk.0.attn_k.weight" ? kb : bytes);
  }
  absl::StatusOr<Weights> loaded =
      LoadGgufWeights(WriteGguf("perm_qk.gguf", out));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (int h = 0; h < c.n_heads; ++h) {
    for (int r = 0; r < 8; ++r) {
      for (int col = 0; col < c.dim; ++col) {
        ASSERT_EQ(loaded->layers[0].wq[(h * 8 + r) * c.dim + col],
                  h * 8 + order[r])
            << "head " << h << " row " << r;
      }
    }
  }
  for (int h = 0; h < c.n_kv_heads; ++h) {
    for (int r = 0; r < 8; ++r) {
      EXPECT_EQ(loaded->layers[0].wk[(h * 8 + r) * c.dim], h * 8 + order[r]);
    }
  }
}

// ---------------------------------------------------------------------------
// Errors: each names the file.

void ExpectInvalid(const absl::Status& s, const std::string& path,
                   const std::string& what) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr(what));
}

TEST(GgufErrorsTest, MissingFileIsNotFound) {
  const std::string path = TempPath("does_not_exist.gguf");
  absl::StatusOr<Weights> w = LoadGgufWeights(path);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), HasSubstr(path));
  EXPECT_EQ(LoadGgufTokenizer(path).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(GgufErrorsTest, WrongMagic) {
  GgufWriter w;
  w.set_magic(0x4C4C4747);  // "GGLL"
  const std::string path = WriteGguf("magic.gguf", w);
  ExpectInvalid(LoadGgufWeights(path).status(), path, "not a GGUF file");
  const std::string empty = WriteBytes("empty.gguf", "");
  ExpectInvalid(GgufFile::Open(empty).status(), empty, "truncated");
}

TEST(GgufErrorsTest, UnsupportedVersion) {
  GgufWriter w;
  w.set_version(1);
  const std::string path = WriteGguf("v1.gguf", w);
  ExpectInvalid(GgufFile::Open(path).status(), path, "version 1");
  w.set_version(0x03000000);  // a big-endian file read little-endian
  const std::string be = WriteGguf("be.gguf", w);
  ExpectInvalid(GgufFile::Open(be).status(), be, "big-endian");
}

TEST(GgufErrorsTest, TruncatedAnywhere) {
  GgufWriter writer;
  AddLlamaModel(TinyWeights(/*tied=*/true), nullptr, writer);
  const std::string bytes = writer.Serialize();
  absl::StatusOr<GgufFile> whole =
      GgufFile::Open(WriteBytes("whole.gguf", bytes));
  ASSERT_TRUE(whole.ok()) << whole.status();
  const size_t header_end = whole->data_offset();
  // Cuts inside the header, the metadata, the tensor infos and the data.
  for (size_t cut : {size_t{3}, size_t{10}, size_t{30}, size_t{200},
                     header_end - 100, header_end + 100, bytes.size() - 1}) {
    const std::string path =
        WriteBytes(absl::StrCat("cut", cut, ".gguf"), bytes.substr(0, cut));
    absl::Status s = LoadGgufWeights(path).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << cut << s;
    EXPECT_THAT(s.message(), HasSubstr(path)) << cut;
    if (cut < header_end) {
      EXPECT_THAT(s.message(), HasSubstr("truncated")) << cut;
    } else {
      EXPECT_THAT(s.message(), HasSubstr("beyond the end of the file")) << cut;
    }
  }
}

TEST(GgufErrorsTest, HugeCountsDoNotAllocate) {
  GgufWriter w;
  w.AddStringArray("tokens", {"a", "b"});
  std::string bytes = w.Serialize();
  // Patch the array's element count (after magic, version, counts, key,
  // value type, element type) to 2^60.
  const size_t count_at = 4 + 4 + 8 + 8 + 8 + 6 + 4 + 4;
  PutLE<uint64_t>(bytes, count_at, 1ull << 60);
  const std::string path = WriteBytes("huge.gguf", bytes);
  ExpectInvalid(GgufFile::Open(path).status(), path, "truncated");
}

TEST(GgufErrorsTest, UnknownArchitecture) {
  const std::string path = WriteTinyWith("gpt2arch.gguf", "", -1, {}, "",
                                         /*arch=*/"gpt2");
  absl::Status s = LoadGgufWeights(path).status();
  ExpectInvalid(s, path, "unsupported architecture gpt2 in " + path);
}

TEST(GgufErrorsTest, UnknownTensorType) {
  const std::string path = WriteTinyWith("type99.gguf", "blk.1.ffn_up.weight",
                                         99, {32, 64}, std::string(8192, 0));
  absl::Status s = LoadGgufWeights(path).status();
  ExpectInvalid(s, path, "blk.1.ffn_up.weight");
  EXPECT_THAT(s.message(), HasSubstr("99"));
}

TEST(GgufErrorsTest, KnownButUnsupportedTensorType) {
  // IQ2_XXS (256 values in 66 bytes): the layout is known, so the file
  // opens, but reading the tensor fails.
  const std::string path = WriteTinyWith("iq2.gguf", "token_embd.weight", 16,
                                         {256, 2}, std::string(2 * 66, 0));
  absl::StatusOr<GgufFile> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  absl::Status s = f->ReadTensor(*f->FindTensor("token_embd.weight")).status();
  ExpectInvalid(s, path, "token_embd.weight");
  EXPECT_THAT(s.message(), HasSubstr("IQ2_XXS (id 16)"));
}

TEST(GgufErrorsTest, MissingTensor) {
  const std::string path =
      WriteTinyWith("missing.gguf", "blk.1.attn_v.weight", -1, {}, "");
  ExpectInvalid(LoadGgufWeights(path).status(), path,
                "missing tensor blk.1.attn_v.weight");
}

TEST(GgufErrorsTest, ShapeMismatch) {
  const std::string path = WriteTinyWith("shape.gguf", "blk.0.ffn_down.weight",
                                         TypeId(GgmlType::kF32), {32, 64},
                                         std::string(32 * 64 * 4, 0));
  ExpectInvalid(LoadGgufWeights(path).status(), path,
                "blk.0.ffn_down.weight has shape [32, 64], the config wants "
                "[64, 32]");
}

TEST(GgufErrorsTest, RowsNotWholeBlocks) {
  const std::string path =
      WriteTinyWith("rows.gguf", "blk.0.attn_norm.weight",
                    TypeId(GgmlType::kQ8_0), {16}, std::string(34, 0));
  ExpectInvalid(GgufFile::Open(path).status(), path, "block size");
}

// ---------------------------------------------------------------------------
// The real SmolLM2-135M-Instruct file, when scripts/fetch_smollm2.sh has
// fetched it (INFINIGEN_ROOT points at the workspace).

std::string SmolLm2Path() {
  const char* root = std::getenv("INFINIGEN_ROOT");
  if (root == nullptr || *root == '\0') return "";
  const std::string path = absl::StrCat(
      root, "/models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
  return std::ifstream(path).good() ? path : "";
}

TEST(SmolLm2Test, LoadsConfigAndWeights) {
  const std::string path = SmolLm2Path();
  if (path.empty()) {
    GTEST_SKIP() << "SmolLM2 not fetched (scripts/fetch_smollm2.sh) or "
                    "INFINIGEN_ROOT unset";
  }
  absl::StatusOr<Weights> w = LoadGgufWeights(path);
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelConfig& c = w->config;
  EXPECT_EQ(c.n_layers, 30);
  EXPECT_EQ(c.n_heads, 9);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.dim, 576);
  EXPECT_EQ(c.hidden_dim, 1536);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.max_seq_len, 8192);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_EQ(c.rope_theta, 100000.0f);
  EXPECT_EQ(c.bos_id, 1);
  EXPECT_EQ(c.eos_id, 2);
  EXPECT_TRUE(w->lm_head.empty());  // tied

  // Values dequantized independently by gguf-py (gguf.quants.dequantize).
  const auto at = [](const std::vector<float>& t, int row, int cols, int col) {
    return t[static_cast<size_t>(row) * cols + col];
  };
  // token_embd (Q8_0).
  EXPECT_EQ(at(w->token_embedding, 0, 576, 0), -0.10654449462890625f);
  EXPECT_EQ(at(w->token_embedding, 0, 576, 2), 0.048198699951171875f);
  EXPECT_EQ(at(w->token_embedding, 49151, 576, 575), -0.0417022705078125f);
  EXPECT_EQ(at(w->token_embedding, 19556, 576, 7), 0.22481536865234375f);
  // blk.0.ffn_down (Q4_1), [576 out, 1536 in].
  EXPECT_EQ(at(w->layers[0].w2, 0, 1536, 1), 0.3460693359375f);
  EXPECT_EQ(at(w->layers[0].w2, 575, 1536, 1535), -0.181365966796875f);
  // output_norm (F32).
  EXPECT_EQ(w->final_norm[0], 1.7578125f);
  // Q/K rows: GGUF row 2i + t of a head is half-split row i + 32 t.
  EXPECT_EQ(at(w->layers[0].wq, 1, 576, 0), -0.1591796875f);      // gguf 2
  EXPECT_EQ(at(w->layers[0].wq, 32, 576, 5), 0.1846923828125f);   // gguf 1
  EXPECT_EQ(at(w->layers[0].wq, 97, 576, 10), -0.0048828125f);    // gguf 67
  EXPECT_EQ(at(w->layers[29].wk, 32, 576, 0), 0.0501708984375f);  // gguf 1
  EXPECT_EQ(at(w->layers[29].wk, 101, 576, 100),
            0.008514404296875f);  // gguf 75
}

}  // namespace
}  // namespace infinigen::model
