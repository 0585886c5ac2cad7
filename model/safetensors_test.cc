#include "model/safetensors.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/safetensors_writer.h"

namespace infinigen::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;

// A fresh directory for one test.
std::string TestDir() {
  const testing::TestInfo* info =
      testing::UnitTest::GetInstance()->current_test_info();
  std::string name = absl::StrCat(info->test_suite_name(), "_", info->name());
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  const std::string dir =
      (fs::path(testing::TempDir()) / "safetensors_test" / name).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A safetensors file from a literal header and raw data bytes.
void WriteRaw(const std::string& path, const std::string& header,
              const std::string& data) {
  const uint64_t len = header.size();
  std::string bytes(reinterpret_cast<const char*>(&len), 8);
  ASSERT_TRUE(WriteTextFile(path, bytes + header + data).ok());
}

std::string ReadAll(const std::string& path) {
  absl::StatusOr<std::string> s = ReadFileToString(path);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : "";
}

void ExpectError(const absl::Status& status, absl::StatusCode code,
                 const std::vector<std::string>& mentions) {
  EXPECT_EQ(status.code(), code) << status;
  for (const std::string& m : mentions) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(m));
  }
}

// Within half an ulp of the stored format: relative for normal numbers,
// absolute (half the subnormal step) near zero.
testing::AssertionResult SameValues(const std::vector<float>& got,
                                    const std::vector<float>& want,
                                    SafetensorsDtype dtype,
                                    const std::string& name) {
  if (got.size() != want.size()) {
    return testing::AssertionFailure()
           << name << ": " << got.size() << " values, want " << want.size();
  }
  if (dtype == SafetensorsDtype::kF32) {
    if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
      return testing::AssertionFailure() << name << ": not bit-exact";
    }
    return testing::AssertionSuccess();
  }
  const float rel = dtype == SafetensorsDtype::kF16 ? 0x1p-11f : 0x1p-8f;
  const float abs = dtype == SafetensorsDtype::kF16 ? 0x1p-25f : 0x1p-134f;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] &&
        !(std::fabs(got[i] - want[i]) <= std::fabs(want[i]) * rel + abs)) {
      return testing::AssertionFailure()
             << name << "[" << i << "] = " << got[i] << ", want " << want[i]
             << " within " << SafetensorsDtypeName(dtype) << " rounding";
    }
  }
  return testing::AssertionSuccess();
}

struct Field {
  const std::vector<float>* got;
  std::string name;
};

std::vector<Field> LlamaFields(const Weights& w, bool with_lm_head) {
  std::vector<Field> f = {{&w.token_embedding, "model.embed_tokens.weight"},
                          {&w.final_norm, "model.norm.weight"}};
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    f.push_back({&l.attn_norm, p + "input_layernorm.weight"});
    f.push_back({&l.wq, p + "self_attn.q_proj.weight"});
    f.push_back({&l.wk, p + "self_attn.k_proj.weight"});
    f.push_back({&l.wv, p + "self_attn.v_proj.weight"});
    f.push_back({&l.wo, p + "self_attn.o_proj.weight"});
    f.push_back({&l.ffn_norm, p + "post_attention_layernorm.weight"});
    f.push_back({&l.w1, p + "mlp.gate_proj.weight"});
    f.push_back({&l.w3, p + "mlp.up_proj.weight"});
    f.push_back({&l.w2, p + "mlp.down_proj.weight"});
  }
  if (with_lm_head) f.push_back({&w.lm_head, "lm_head.weight"});
  return f;
}

std::vector<Field> OptFields(const Weights& w, bool with_lm_head,
                             const std::string& d = "model.decoder.") {
  std::vector<Field> f = {{&w.token_embedding, d + "embed_tokens.weight"},
                          {&w.position_embedding, d + "embed_positions.weight"},
                          {&w.final_norm, d + "final_layer_norm.weight"},
                          {&w.final_norm_bias, d + "final_layer_norm.bias"}};
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat(d, "layers.", i, ".");
    f.push_back({&l.attn_norm, p + "self_attn_layer_norm.weight"});
    f.push_back({&l.attn_norm_bias, p + "self_attn_layer_norm.bias"});
    f.push_back({&l.wq, p + "self_attn.q_proj.weight"});
    f.push_back({&l.bq, p + "self_attn.q_proj.bias"});
    f.push_back({&l.wk, p + "self_attn.k_proj.weight"});
    f.push_back({&l.bk, p + "self_attn.k_proj.bias"});
    f.push_back({&l.wv, p + "self_attn.v_proj.weight"});
    f.push_back({&l.bv, p + "self_attn.v_proj.bias"});
    f.push_back({&l.wo, p + "self_attn.out_proj.weight"});
    f.push_back({&l.bo, p + "self_attn.out_proj.bias"});
    f.push_back({&l.ffn_norm, p + "final_layer_norm.weight"});
    f.push_back({&l.ffn_norm_bias, p + "final_layer_norm.bias"});
    f.push_back({&l.w1, p + "fc1.weight"});
    f.push_back({&l.b1, p + "fc1.bias"});
    f.push_back({&l.w2, p + "fc2.weight"});
    f.push_back({&l.b2, p + "fc2.bias"});
  }
  if (with_lm_head) f.push_back({&w.lm_head, "lm_head.weight"});
  return f;
}

// Every field holds its tensor (callers also check that the fields cover
// every tensor of the checkpoint).
void ExpectFields(const std::vector<Field>& fields, const TinyCheckpoint& ck,
                  SafetensorsDtype dtype) {
  for (const Field& f : fields) {
    auto it = ck.tensors.find(f.name);
    ASSERT_NE(it, ck.tensors.end()) << f.name;
    EXPECT_TRUE(SameValues(*f.got, it->second.values, dtype, f.name));
  }
}

void ExpectLlamaConfig(const ModelConfig& c) {
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.dim, 8);
  EXPECT_EQ(c.hidden_dim, 12);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 2);
  EXPECT_EQ(c.vocab_size, 16);
  EXPECT_EQ(c.max_seq_len, 32);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.bos_id, 1);
  EXPECT_EQ(c.eos_id, 2);
}

void ExpectOptConfig(const ModelConfig& c) {
  EXPECT_EQ(c.arch, Architecture::kOpt);
  EXPECT_EQ(c.dim, 8);
  EXPECT_EQ(c.hidden_dim, 16);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 2);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.vocab_size, 16);
  EXPECT_EQ(c.max_seq_len, 16);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-5f);
  EXPECT_EQ(c.bos_id, 2);
  EXPECT_EQ(c.eos_id, 2);
}

void ExpectNoOptTensors(const Weights& w) {
  EXPECT_TRUE(w.position_embedding.empty());
  EXPECT_TRUE(w.final_norm_bias.empty());
  for (const LayerWeights& l : w.layers) {
    EXPECT_TRUE(l.attn_norm_bias.empty() && l.ffn_norm_bias.empty());
    EXPECT_TRUE(l.bq.empty() && l.bk.empty() && l.bv.empty() && l.bo.empty());
    EXPECT_TRUE(l.b1.empty() && l.b2.empty());
  }
}

// --- Every tensor in its place, in each stored dtype ---

class LoadByDtype : public testing::TestWithParam<SafetensorsDtype> {};

TEST_P(LoadByDtype, LlamaUntied) {
  const SafetensorsDtype dtype = GetParam();
  TinyCheckpointOptions opts;
  opts.dtype = dtype;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyLlamaCheckpoint(TestDir(), 7, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  absl::StatusOr<Weights> w = LoadSafetensorsModel(ck->dir);
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectLlamaConfig(w->config);
  ASSERT_EQ(w->layers.size(), 2u);
  ASSERT_FALSE(w->lm_head.empty());
  ExpectFields(LlamaFields(*w, /*with_lm_head=*/true), *ck, dtype);
  EXPECT_EQ(LlamaFields(*w, true).size(), ck->tensors.size());
  ExpectNoOptTensors(*w);
  EXPECT_EQ(w->classifier(), w->lm_head.data());
  if (dtype != SafetensorsDtype::kF32) {
    // The stored format really was narrower than fp32.
    EXPECT_NE(w->token_embedding,
              ck->tensors["model.embed_tokens.weight"].values);
  }
}

TEST_P(LoadByDtype, OptTied) {
  const SafetensorsDtype dtype = GetParam();
  TinyCheckpointOptions opts;
  opts.dtype = dtype;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyOptCheckpoint(TestDir(), 8, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_FALSE(ck->config.contains("tie_word_embeddings"));  // OPT's default
  absl::StatusOr<Weights> w = LoadSafetensorsModel(ck->dir);
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectOptConfig(w->config);
  ASSERT_EQ(w->layers.size(), 2u);
  EXPECT_TRUE(w->lm_head.empty());
  EXPECT_EQ(w->classifier(), w->token_embedding.data());
  EXPECT_EQ(w->position_embedding.size(), size_t(18 * 8));
  ExpectFields(OptFields(*w, /*with_lm_head=*/false), *ck, dtype);
  EXPECT_EQ(OptFields(*w, false).size(), ck->tensors.size());
  for (const LayerWeights& l : w->layers) EXPECT_TRUE(l.w3.empty());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LoadByDtype,
                         testing::Values(SafetensorsDtype::kF32,
                                         SafetensorsDtype::kF16,
                                         SafetensorsDtype::kBF16),
                         [](const testing::TestParamInfo<SafetensorsDtype>& p) {
                           return std::string(SafetensorsDtypeName(p.param));
                         });

// --- Tied and untied classifiers ---

TEST(SafetensorsLlama, TiedLeavesLmHeadEmpty) {
  TinyCheckpointOptions opts;
  opts.tie_word_embeddings = true;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyLlamaCheckpoint(TestDir(), 1, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_EQ(ck->tensors.count("lm_head.weight"), 0u);
  absl::StatusOr<Weights> w = LoadSafetensorsModel(ck->dir);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->lm_head.empty());
  EXPECT_EQ(w->classifier(), w->token_embedding.data());
  ExpectFields(LlamaFields(*w, false), *ck, SafetensorsDtype::kF32);
}

TEST(SafetensorsLlama, TiedConfigIgnoresStoredLmHead) {
  TinyCheckpointOptions opts;  // writes lm_head.weight...
  opts.config_overrides = {{"tie_word_embeddings", true}};  // ...but ties it
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyLlamaCheckpoint(TestDir(), 2, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_EQ(ck->tensors.count("lm_head.weight"), 1u);
  absl::StatusOr<Weights> w = LoadSafetensorsModel(ck->dir);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->lm_head.empty());
}

TEST(SafetensorsLlama, AbsentLmHeadIsTied) {
  const std::string dir = TestDir();
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(dir, 3);
  ASSERT_TRUE(ck.ok()) << ck.status();
  TensorMap t = ck->tensors;
  t.erase("lm_head.weight");
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model.safetensors", t, SafetensorsDtype::kF32)
          .ok());
  absl::StatusOr<Weights> w = LoadSafetensorsModel(dir);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->lm_head.empty());
}

TEST(SafetensorsOpt, UntiedLoadsLmHead) {
  TinyCheckpointOptions opts;
  opts.tie_word_embeddings = false;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyOptCheckpoint(TestDir(), 4, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  absl::StatusOr<Weights> w = LoadSafetensorsModel(ck->dir);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_FALSE(w->lm_head.empty());
  ExpectFields(OptFields(*w, true), *ck, SafetensorsDtype::kF32);
}

TEST(SafetensorsOpt, NamesWithoutModelPrefix) {
  TinyCheckpointOptions opts;
  opts.opt_model_prefix = false;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyOptCheckpoint(TestDir(), 5, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_EQ(ck->tensors.count("decoder.embed_tokens.weight"), 1u);
  absl::StatusOr<Weights> w = LoadSafetensorsModel(ck->dir);
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectFields(OptFields(*w, false, "decoder."), *ck, SafetensorsDtype::kF32);
}

// --- Where the checkpoint lives ---

TEST(SafetensorsPaths, ShardedIndex) {
  TinyCheckpointOptions opts;
  opts.num_shards = 3;
  opts.dtype = SafetensorsDtype::kBF16;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyLlamaCheckpoint(TestDir(), 9, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ASSERT_FALSE(fs::exists(ck->dir + "/model.safetensors"));
  ASSERT_TRUE(fs::exists(ck->dir + "/model-00003-of-00003.safetensors"));
  for (const std::string& path :
       {ck->dir, ck->dir + "/model.safetensors.index.json"}) {
    absl::StatusOr<Weights> w = LoadSafetensorsModel(path);
    ASSERT_TRUE(w.ok()) << w.status();
    ExpectFields(LlamaFields(*w, true), *ck, SafetensorsDtype::kBF16);
  }
  absl::StatusOr<SafetensorsCheckpoint> c =
      SafetensorsCheckpoint::Open(ck->dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->TensorNames().size(), ck->tensors.size());
  EXPECT_THAT(c->path(), HasSubstr("model.safetensors.index.json"));
}

TEST(SafetensorsPaths, ShardedOpt) {
  TinyCheckpointOptions opts;
  opts.num_shards = 2;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyOptCheckpoint(TestDir(), 10, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  absl::StatusOr<Weights> w = LoadSafetensorsModel(ck->dir);
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectFields(OptFields(*w, false), *ck, SafetensorsDtype::kF32);
}

TEST(SafetensorsPaths, SafetensorsFileWithConfigBeside) {
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(TestDir(), 11);
  ASSERT_TRUE(ck.ok()) << ck.status();
  absl::StatusOr<Weights> w =
      LoadSafetensorsModel(ck->dir + "/model.safetensors");
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectFields(LlamaFields(*w, true), *ck, SafetensorsDtype::kF32);
}

// --- The file format itself ---

TEST(SafetensorsFileTest, SpecialValuesAndMetadata) {
  const std::string dir = TestDir();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> v = {0.0f,       -0.0f, 1.0f,   -2.5f,
                                65504.0f,   inf,   -inf,   6e-8f,
                                6.1033e-5f, 1e-3f, 1e-40f, 3.0e38f};
  TensorMap t = {{"x", {{3, 4}, v}}, {"empty", {{0, 4}, {}}}};
  for (SafetensorsDtype dtype : {SafetensorsDtype::kF32, SafetensorsDtype::kF16,
                                 SafetensorsDtype::kBF16}) {
    const std::string path = dir + "/" + SafetensorsDtypeName(dtype);
    ASSERT_TRUE(WriteSafetensors(path, t, dtype).ok());
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->metadata().at("format"), "pt");
    ASSERT_EQ(f->tensors().size(), 2u);
    EXPECT_EQ(f->tensors().at("x").dtype, SafetensorsDtypeName(dtype));
    EXPECT_EQ(f->tensors().at("x").shape, (std::vector<int64_t>{3, 4}));
    absl::StatusOr<std::vector<float>> x = f->ReadFloat32("x");
    ASSERT_TRUE(x.ok()) << x.status();
    ASSERT_EQ(x->size(), v.size());
    EXPECT_TRUE(std::signbit((*x)[1]));
    EXPECT_EQ((*x)[5], inf);
    EXPECT_EQ((*x)[6], -inf);
    if (dtype == SafetensorsDtype::kF16) {
      EXPECT_EQ((*x)[4], 65504.0f);         // largest half
      EXPECT_EQ((*x)[7], 0x1p-24f);         // smallest subnormal
      EXPECT_EQ((*x)[8], 1024 * 0x1p-24f);  // rounds up to 2^-14
      EXPECT_EQ((*x)[10], 0.0f);            // underflows
      EXPECT_EQ((*x)[11], inf);             // overflows
      EXPECT_TRUE(SameValues(std::vector<float>(x->begin(), x->begin() + 5),
                             std::vector<float>(v.begin(), v.begin() + 5),
                             dtype, "x"));
    } else {
      EXPECT_TRUE(SameValues(*x, v, dtype, "x"));
    }
    absl::StatusOr<std::vector<float>> e = f->ReadFloat32("empty");
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_TRUE(e->empty());
  }
}

TEST(SafetensorsFileTest, F64AndNonFloatDtypes) {
  const std::string path = TestDir() + "/raw.safetensors";
  const double d[2] = {0.1, -3.0};
  const int64_t i[1] = {42};
  std::string data(reinterpret_cast<const char*>(d), sizeof(d));
  data.append(reinterpret_cast<const char*>(i), sizeof(i));
  WriteRaw(path,
           R"({"d": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]},)"
           R"( "i": {"dtype": "I64", "shape": [], "data_offsets": [16, 24]}})",
           data);
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<std::vector<float>> x = f->ReadFloat32("d");
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(*x, (std::vector<float>{0.1f, -3.0f}));
  ExpectError(f->ReadFloat32("i").status(), absl::StatusCode::kInvalidArgument,
              {path, "I64"});
  ExpectError(f->ReadFloat32("nope").status(),
              absl::StatusCode::kInvalidArgument, {path, "nope"});
}

TEST(SafetensorsFileTest, SizeMismatchAndBadEntries) {
  const std::string dir = TestDir();
  struct Case {
    std::string header;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
       "needs 12 bytes"},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})",
       "data_offsets"},
      {R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})",
       "shape"},
      {R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", "dtype"},
      {R"({"w": [1, 2]})", "not a JSON object"},
      {R"([1, 2])", "not a JSON object"},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string path = absl::StrCat(dir, "/case", k, ".safetensors");
    WriteRaw(path, cases[k].header, std::string(8, '\0'));
    ExpectError(SafetensorsFile::Open(path).status(),
                absl::StatusCode::kInvalidArgument, {path, cases[k].mention});
  }
}

// --- config.json ---

TEST(HfConfig, LlamaDefaultsAndExplicitKeys) {
  absl::StatusOr<HfModelConfig> hf = ParseHfConfig(
      R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 100,
          "num_hidden_layers": 3, "num_attention_heads": 4,
          "vocab_size": 50, "rms_norm_eps": 1e-6})",
      "cfg.json");
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ(hf->config.n_kv_heads, 4);
  EXPECT_EQ(hf->config.head_dim, 16);
  EXPECT_EQ(hf->config.max_seq_len, 2048);
  EXPECT_FLOAT_EQ(hf->config.rope_theta, 10000.0f);
  EXPECT_FLOAT_EQ(hf->config.norm_eps, 1e-6f);
  EXPECT_EQ(hf->config.bos_id, 1);
  EXPECT_EQ(hf->config.eos_id, 2);
  EXPECT_FALSE(hf->tie_word_embeddings);

  // Mistral-style keys; head_dim not hidden/heads; a list of EOS ids (first
  // wins); no BOS.
  hf = ParseHfConfig(
      R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 100,
          "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 50,
          "max_position_embeddings": 4096, "rope_theta": 1000000.0,
          "sliding_window": null, "tie_word_embeddings": true,
          "bos_token_id": null, "eos_token_id": [7, 8]})",
      "cfg.json");
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ(hf->config.n_kv_heads, 2);
  EXPECT_EQ(hf->config.head_dim, 32);
  EXPECT_EQ(hf->config.q_dim(), 128);
  EXPECT_EQ(hf->config.max_seq_len, 4096);
  EXPECT_FLOAT_EQ(hf->config.rope_theta, 1e6f);
  EXPECT_EQ(hf->config.bos_id, -1);
  EXPECT_EQ(hf->config.eos_id, 7);
  EXPECT_TRUE(hf->tie_word_embeddings);
}

TEST(HfConfig, OptDefaults) {
  absl::StatusOr<HfModelConfig> hf = ParseHfConfig(
      R"({"model_type": "opt", "hidden_size": 768, "ffn_dim": 3072,
          "num_hidden_layers": 12, "num_attention_heads": 12,
          "vocab_size": 50272, "max_position_embeddings": 2048})",
      "cfg.json");
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ(hf->config.head_dim, 64);
  EXPECT_EQ(hf->config.n_kv_heads, 12);
  EXPECT_EQ(hf->config.bos_id, 2);
  EXPECT_EQ(hf->config.eos_id, 2);
  EXPECT_TRUE(hf->tie_word_embeddings);
}

TEST(HfConfig, Rejections) {
  const std::string opt =
      R"("model_type": "opt", "hidden_size": 8, "ffn_dim": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 16)";
  const std::string llama =
      R"("model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 16)";
  struct Case {
    std::string json;
    absl::StatusCode code;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {"{" + opt + R"(, "word_embed_proj_dim": 4})",
       absl::StatusCode::kUnimplemented, "word_embed_proj_dim"},
      {"{" + opt + R"(, "do_layer_norm_before": false})",
       absl::StatusCode::kUnimplemented, "do_layer_norm_before"},
      {"{" + opt + R"(, "activation_function": "gelu"})",
       absl::StatusCode::kUnimplemented, "gelu"},
      {"{" + llama + R"(, "rope_scaling": {"type": "linear", "factor": 2.0}})",
       absl::StatusCode::kUnimplemented, "rope_scaling"},
      {"{" + llama + R"(, "attention_bias": true})",
       absl::StatusCode::kUnimplemented, "attention_bias"},
      {R"({"model_type": "llama", "hidden_size": "8"})",
       absl::StatusCode::kInvalidArgument, "hidden_size"},
      {R"({"model_type": "llama", "hidden_size": 8})",
       absl::StatusCode::kInvalidArgument, "intermediate_size"},
      {"{" + llama + R"(, "num_key_value_heads": 3})",
       absl::StatusCode::kInvalidArgument, "n_kv_heads"},
      {R"({"model_type": "gpt2"})", absl::StatusCode::kInvalidArgument,
       "unsupported architecture gpt2"},
      {R"({"hidden_size": 8})", absl::StatusCode::kInvalidArgument,
       "unsupported architecture"},
      {R"({"model_type": )", absl::StatusCode::kInvalidArgument,
       "not valid JSON"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    ExpectError(ParseHfConfig(c.json, "/some/config.json").status(), c.code,
                {"/some/config.json", c.mention});
  }
}

// --- Errors from LoadSafetensorsModel: each names the file ---

TEST(SafetensorsErrors, TruncatedFile) {
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(TestDir(), 1);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const std::string file = ck->dir + "/model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 4);
  // The last tensor in the data section (names are sorted) is cut short.
  ExpectError(LoadSafetensorsModel(ck->dir).status(),
              absl::StatusCode::kInvalidArgument,
              {file, "model.norm.weight", "truncated"});
}

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(TestDir(), 1);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const std::string file = ck->dir + "/model.safetensors";
  std::string bytes = ReadAll(file);
  const uint64_t len = bytes.size();
  std::memcpy(bytes.data(), &len, 8);
  ASSERT_TRUE(WriteTextFile(file, bytes).ok());
  ExpectError(LoadSafetensorsModel(ck->dir).status(),
              absl::StatusCode::kInvalidArgument, {file, "header length"});

  // A file too short to hold the length at all.
  ASSERT_TRUE(WriteTextFile(file, "abc").ok());
  ExpectError(LoadSafetensorsModel(ck->dir).status(),
              absl::StatusCode::kInvalidArgument, {file, "too short"});
}

TEST(SafetensorsErrors, BadJsonHeader) {
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(TestDir(), 1);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const std::string file = ck->dir + "/model.safetensors";
  WriteRaw(file, R"({"model.norm.weight": {"dtype": "F32", "shape": [8],)",
           std::string(32, '\0'));
  ExpectError(LoadSafetensorsModel(ck->dir).status(),
              absl::StatusCode::kInvalidArgument, {file, "not valid JSON"});
}

TEST(SafetensorsErrors, UnknownModelType) {
  TinyCheckpointOptions opts;
  opts.config_overrides = {{"model_type", "gpt_neox"}};
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyLlamaCheckpoint(TestDir(), 1, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ExpectError(
      LoadSafetensorsModel(ck->dir).status(),
      absl::StatusCode::kInvalidArgument,
      {"unsupported architecture gpt_neox in", ck->dir + "/config.json"});
}

TEST(SafetensorsErrors, MissingTensor) {
  const std::string dir = TestDir();
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyOptCheckpoint(dir, 1);
  ASSERT_TRUE(ck.ok()) << ck.status();
  TensorMap t = ck->tensors;
  t.erase("model.decoder.layers.1.fc2.bias");
  const std::string file = dir + "/model.safetensors";
  ASSERT_TRUE(WriteSafetensors(file, t, SafetensorsDtype::kF32).ok());
  ExpectError(LoadSafetensorsModel(dir).status(),
              absl::StatusCode::kInvalidArgument,
              {file, "missing tensor model.decoder.layers.1.fc2.bias"});
}

TEST(SafetensorsErrors, MissingTensorInShardedCheckpoint) {
  const std::string dir = TestDir();
  TinyCheckpointOptions opts;
  opts.num_shards = 2;
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(dir, 1, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  TensorMap t = ck->tensors;
  t.erase("model.layers.0.mlp.up_proj.weight");
  ASSERT_TRUE(
      WriteHfCheckpoint(dir, ck->config, t, SafetensorsDtype::kF32, 2).ok());
  ExpectError(LoadSafetensorsModel(dir).status(),
              absl::StatusCode::kInvalidArgument,
              {dir + "/model.safetensors.index.json",
               "missing tensor model.layers.0.mlp.up_proj.weight"});
}

TEST(SafetensorsErrors, WrongShape) {
  const std::string dir = TestDir();
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(dir, 1);
  ASSERT_TRUE(ck.ok()) << ck.status();
  TensorMap t = ck->tensors;
  // Same number of values, transposed shape: (kv_dim, dim) = (4, 8) -> (8, 4).
  t["model.layers.1.self_attn.k_proj.weight"].shape = {8, 4};
  const std::string file = dir + "/model.safetensors";
  ASSERT_TRUE(WriteSafetensors(file, t, SafetensorsDtype::kF32).ok());
  ExpectError(
      LoadSafetensorsModel(dir).status(), absl::StatusCode::kInvalidArgument,
      {file, "model.layers.1.self_attn.k_proj.weight", "[8, 4]", "[4, 8]"});
}

TEST(SafetensorsErrors, MissingConfigJson) {
  absl::StatusOr<TinyCheckpoint> ck = WriteTinyLlamaCheckpoint(TestDir(), 1);
  ASSERT_TRUE(ck.ok()) << ck.status();
  fs::remove(ck->dir + "/config.json");
  ExpectError(LoadSafetensorsModel(ck->dir).status(),
              absl::StatusCode::kNotFound, {ck->dir + "/config.json"});
  ExpectError(LoadSafetensorsModel(ck->dir + "/model.safetensors").status(),
              absl::StatusCode::kNotFound, {ck->dir + "/config.json"});
}

TEST(SafetensorsErrors, MissingPathsAndShards) {
  const std::string dir = TestDir();
  ExpectError(LoadSafetensorsModel(dir + "/nowhere").status(),
              absl::StatusCode::kNotFound, {dir + "/nowhere"});
  // A directory with a config but no weights.
  ASSERT_TRUE(WriteTextFile(dir + "/config.json",
                            R"({"model_type": "opt", "hidden_size": 8,
                                "ffn_dim": 16, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "vocab_size": 16})")
                  .ok());
  ExpectError(LoadSafetensorsModel(dir).status(), absl::StatusCode::kNotFound,
              {dir, "model.safetensors"});

  // An index naming a shard that is not there.
  TinyCheckpointOptions opts;
  opts.num_shards = 2;
  absl::StatusOr<TinyCheckpoint> ck =
      WriteTinyLlamaCheckpoint(dir + "/sharded", 1, opts);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const std::string shard = ck->dir + "/model-00002-of-00002.safetensors";
  fs::remove(shard);
  ExpectError(LoadSafetensorsModel(ck->dir).status(),
              absl::StatusCode::kNotFound, {shard});

  // An index mapping a tensor to a shard that lacks it.
  ASSERT_TRUE(WriteTinyLlamaCheckpoint(ck->dir, 1, opts).ok());
  const std::string index = ck->dir + "/model.safetensors.index.json";
  json j = json::parse(ReadAll(index));
  json& entry = j["weight_map"]["model.norm.weight"];
  entry = entry == "model-00001-of-00002.safetensors"
              ? "model-00002-of-00002.safetensors"
              : "model-00001-of-00002.safetensors";
  ASSERT_TRUE(WriteTextFile(index, j.dump()).ok());
  ExpectError(LoadSafetensorsModel(ck->dir).status(),
              absl::StatusCode::kInvalidArgument,
              {index, "has no such tensor"});
}

}  // namespace
}  // namespace infinigen::model
