#include "model/spm_tokenizer.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "nlohmann/json.hpp"

namespace infinigen::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// A hand-made vocabulary. Ids are named for the expectations below.
enum : int {
  kUnk = 0,
  kBos = 1,
  kEos = 2,
  kCtl = 3,     // "<ctl>", control
  kBr = 4,      // "<br>", user-defined
  kBrBr = 5,    // "<br><br>", user-defined
  kSpace = 6,   // "▁"
  kA = 7,
  kB = 8,
  kC = 9,
  kAB = 10,     // score -2
  kBC = 11,     // score -1: beats "ab"
  kAA = 12,     // score -4
  kSpB = 13,    // "▁b", score -1.5
  kByteC3 = 14, // "<0xC3>": byte tokens sit anywhere, not at 3 + byte
  kByteA9 = 15,
  kByteLt = 16,  // '<'
  kByteT = 17,
  kByteL = 18,
  kByteGt = 19,  // '>'
};

SpmVocabulary TinyVocab() {
  SpmVocabulary v;
  const std::string sp = "\xE2\x96\x81";
  v.tokens = {"<unk>",  "<s>",    "</s>",   "<ctl>",  "<br>",
              "<br><br>", sp,     "a",      "b",      "c",
              "ab",     "bc",     "aa",     sp + "b", "<0xC3>",
              "<0xA9>", "<0x3C>", "<0x74>", "<0x6C>", "<0x3E>"};
  v.scores = {0,   0,   0,   0,  0,  0,    -10, -11, -12, -13,
              -2,  -1,  -4,  -1.5, 0, 0,   0,   0,   0,   0};
  using T = TokenType;
  v.types = {T::kUnknown, T::kControl, T::kControl, T::kControl,
             T::kUserDefined, T::kUserDefined, T::kNormal, T::kNormal,
             T::kNormal, T::kNormal, T::kNormal, T::kNormal,
             T::kNormal, T::kNormal, T::kByte, T::kByte,
             T::kByte, T::kByte, T::kByte, T::kByte};
  v.bos_id = kBos;
  v.eos_id = kEos;
  v.unk_id = kUnk;
  v.add_bos = true;
  v.add_space_prefix = false;
  return v;
}

std::unique_ptr<SpmTokenizer> Make(SpmVocabulary v) {
  absl::StatusOr<std::unique_ptr<SpmTokenizer>> t =
      SpmTokenizer::Create(std::move(v));
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(t).value();
}

TEST(SpmTokenizerTest, HigherScoreMergesFirst) {
  auto t = Make(TinyVocab());
  // "bc" (-1) beats "ab" (-2); "abc" is no piece, so a + bc stays.
  EXPECT_THAT(t->Encode("abc", false), ElementsAre(kA, kBC));
  EXPECT_THAT(t->Encode("ab", false), ElementsAre(kAB));
  // "▁bc": "bc" (-1) beats "▁b" (-1.5) although "▁b" is further left.
  EXPECT_THAT(t->Encode(" bc", false), ElementsAre(kSpace, kBC));
  // "a▁b": only "▁b" is a piece.
  EXPECT_THAT(t->Encode("a b", false), ElementsAre(kA, kSpB));
  EXPECT_THAT(t->Encode("b ab", false), ElementsAre(kB, kSpace, kAB));
}

TEST(SpmTokenizerTest, EqualScoresMergeLeftmostFirst) {
  auto t = Make(TinyVocab());
  EXPECT_THAT(t->Encode("aaa", false), ElementsAre(kAA, kA));
  EXPECT_THAT(t->Encode("aaaaa", false), ElementsAre(kAA, kAA, kA));
}

TEST(SpmTokenizerTest, ByteFallback) {
  auto t = Make(TinyVocab());
  // 'é' (C3 A9) is no piece: its bytes' tokens, looked up by name.
  EXPECT_THAT(t->Encode("a\xC3\xA9", false), ElementsAre(kA, kByteC3, kByteA9));
  // A byte with neither a byte token nor a piece: the unknown token.
  EXPECT_THAT(t->Encode("z", false), ElementsAre(kUnk));
}

TEST(SpmTokenizerTest, UserDefinedTokensSplitTheText) {
  auto t = Make(TinyVocab());
  EXPECT_THAT(t->Encode("ab<br>bc", false), ElementsAre(kAB, kBr, kBC));
  // Longest match first.
  EXPECT_THAT(t->Encode("<br><br><br>", false), ElementsAre(kBrBr, kBr));
  // No merge across a special token: "a" + "a" around it stay apart.
  EXPECT_THAT(t->Encode("a<br>a", false), ElementsAre(kA, kBr, kA));
}

TEST(SpmTokenizerTest, ControlTokensParsedUnlessDisabled) {
  auto t = Make(TinyVocab());
  EXPECT_THAT(t->Encode("a<ctl>b", false), ElementsAre(kA, kCtl, kB));
  SpmVocabulary v = TinyVocab();
  v.parse_special = false;
  auto plain = Make(std::move(v));
  EXPECT_THAT(plain->Encode("a<ctl>b", false),
              ElementsAre(kA, kByteLt, kC, kByteT, kByteL, kByteGt, kB));
  // User-defined tokens still split.
  EXPECT_THAT(plain->Encode("a<br>b", false), ElementsAre(kA, kBr, kB));
}

TEST(SpmTokenizerTest, Bos) {
  auto t = Make(TinyVocab());
  EXPECT_TRUE(t->adds_bos());
  EXPECT_THAT(t->Encode("ab", true), ElementsAre(kBos, kAB));
  EXPECT_THAT(t->Encode("", true), ElementsAre(kBos));
  EXPECT_TRUE(t->Encode("", false).empty());
  SpmVocabulary v = TinyVocab();
  v.add_bos = false;
  auto no_bos = Make(std::move(v));
  EXPECT_FALSE(no_bos->adds_bos());
  EXPECT_THAT(no_bos->Encode("ab", true), ElementsAre(kAB));
}

TEST(SpmTokenizerTest, DecodeAndRoundTrip) {
  auto t = Make(TinyVocab());
  EXPECT_EQ(t->vocab_size(), 20);
  EXPECT_EQ(t->bos_id(), kBos);
  EXPECT_EQ(t->eos_id(), kEos);
  EXPECT_TRUE(t->IsControl(kBos));
  EXPECT_TRUE(t->IsControl(kEos));
  EXPECT_TRUE(t->IsControl(kCtl));
  EXPECT_FALSE(t->IsControl(kUnk));
  EXPECT_FALSE(t->IsControl(kBr));
  EXPECT_FALSE(t->IsControl(kA));
  EXPECT_FALSE(t->IsControl(-1));
  EXPECT_FALSE(t->IsControl(20));

  EXPECT_EQ(t->DecodeToken(-1, kSpace), " ");
  EXPECT_EQ(t->DecodeToken(kBos, kSpB), " b");  // no dummy prefix to strip
  EXPECT_EQ(t->DecodeToken(-1, kByteC3), "\xC3");
  EXPECT_EQ(t->DecodeToken(-1, kBr), "<br>");
  // Control and unknown tokens decode to nothing.
  EXPECT_EQ(t->DecodeToken(-1, kBos), "");
  EXPECT_EQ(t->DecodeToken(-1, kEos), "");
  EXPECT_EQ(t->DecodeToken(-1, kCtl), "");
  EXPECT_EQ(t->DecodeToken(-1, kUnk), "");
  EXPECT_EQ(t->DecodeToken(-1, 99), "");
  EXPECT_EQ(t->Decode({kBos, kA, kSpB, kByteC3, kByteA9, kBr, kCtl, kEos}),
            "a b\xC3\xA9<br>");

  for (const std::string text :
       {"a b abc \xC3\xA9<br>aaa", "  b  ", "<br><br><br>bc", "c<c<b",
        "\xC3\xA9\xC3\xA9 ab"}) {
    EXPECT_EQ(t->Decode(t->Encode(text, true)), text);
  }
}

TEST(SpmTokenizerTest, SpacePrefix) {
  SpmVocabulary v = TinyVocab();
  v.add_space_prefix = true;
  auto t = Make(std::move(v));
  // "b" -> "▁b"; after a special token the fragment gets a space again.
  EXPECT_THAT(t->Encode("b", true), ElementsAre(kBos, kSpB));
  EXPECT_THAT(t->Encode("a<br>b", false), ElementsAre(kSpace, kA, kBr, kSpB));
  // Decoding drops the prefix of the first piece only.
  EXPECT_EQ(t->Decode(t->Encode("b", true)), "b");
  EXPECT_EQ(t->Decode(t->Encode("b", false)), "b");
  EXPECT_EQ(t->Decode({kSpB, kSpB}), "b b");
}

TEST(SpmTokenizerTest, CreateRejectsBadVocabularies) {
  EXPECT_FALSE(SpmTokenizer::Create(SpmVocabulary{}).ok());
  SpmVocabulary v = TinyVocab();
  v.scores.pop_back();
  EXPECT_THAT(SpmTokenizer::Create(v).status().message(), HasSubstr("scores"));
  v = TinyVocab();
  v.types.pop_back();
  EXPECT_THAT(SpmTokenizer::Create(v).status().message(),
              HasSubstr("token types"));
  v = TinyVocab();
  v.bos_id = 20;
  EXPECT_THAT(SpmTokenizer::Create(v).status().message(), HasSubstr("bos"));
  v = TinyVocab();
  v.scores.clear();  // all 0
  v.types.clear();   // all normal
  EXPECT_TRUE(SpmTokenizer::Create(v).ok());
}

// ---------------------------------------------------------------------------
// LoadGgufTokenizer with tokenizer.ggml.model == "llama".

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

TEST(LoadGgufSpmTokenizerTest, ReadsTheGgufKeys) {
  const SpmVocabulary v = TinyVocab();
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddString("tokenizer.ggml.model", "llama");
  w.AddString("tokenizer.ggml.pre", "default");
  w.AddStringArray("tokenizer.ggml.tokens", v.tokens);
  w.AddFloat32Array("tokenizer.ggml.scores", v.scores);
  std::vector<int32_t> types;
  for (TokenType t : v.types) types.push_back(static_cast<int32_t>(t));
  w.AddInt32Array("tokenizer.ggml.token_type", types);
  w.AddUint32("tokenizer.ggml.bos_token_id", kBos);
  w.AddUint32("tokenizer.ggml.eos_token_id", kEos);
  w.AddUint32("tokenizer.ggml.unknown_token_id", kUnk);
  w.AddBool("tokenizer.ggml.add_bos_token", true);
  w.AddBool("tokenizer.ggml.add_space_prefix", false);
  const std::string path = TempPath("spm_tok.gguf");
  ASSERT_TRUE(w.WriteFile(path).ok());

  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadGgufTokenizer(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 20);
  EXPECT_EQ((*t)->bos_id(), kBos);
  EXPECT_EQ((*t)->eos_id(), kEos);
  EXPECT_TRUE((*t)->adds_bos());
  EXPECT_TRUE((*t)->IsControl(kCtl));
  EXPECT_THAT((*t)->Encode(" bc<ctl>a\xC3\xA9", true),
              ElementsAre(kBos, kSpace, kBC, kCtl, kA, kByteC3, kByteA9));
}

TEST(LoadGgufSpmTokenizerTest, DefaultsAndErrors) {
  // Only tokens: llama.cpp's defaults (bos 1, eos 2, BOS added, a space
  // prefix, scores 0, all normal).
  const SpmVocabulary v = TinyVocab();
  GgufWriter w;
  w.AddString("tokenizer.ggml.model", "llama");
  w.AddStringArray("tokenizer.ggml.tokens", v.tokens);
  const std::string path = TempPath("spm_defaults.gguf");
  ASSERT_TRUE(w.WriteFile(path).ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadGgufTokenizer(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->bos_id(), 1);
  EXPECT_EQ((*t)->eos_id(), 2);
  EXPECT_TRUE((*t)->adds_bos());
  EXPECT_EQ((*t)->Encode("b", true), std::vector<int>({1, kSpB}));

  GgufWriter bad;
  bad.AddString("tokenizer.ggml.model", "llama");
  bad.AddStringArray("tokenizer.ggml.tokens", v.tokens);
  bad.AddFloat32Array("tokenizer.ggml.scores", {1.0f, 2.0f});
  const std::string bad_path = TempPath("spm_bad.gguf");
  ASSERT_TRUE(bad.WriteFile(bad_path).ok());
  absl::Status s = LoadGgufTokenizer(bad_path).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(bad_path));
  EXPECT_THAT(s.message(), HasSubstr("scores"));

  GgufWriter no_tokens;
  no_tokens.AddString("tokenizer.ggml.model", "llama");
  const std::string empty_path = TempPath("spm_empty.gguf");
  ASSERT_TRUE(no_tokens.WriteFile(empty_path).ok());
  s = LoadGgufTokenizer(empty_path).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tokenizer.ggml.tokens"));
}

// ---------------------------------------------------------------------------
// The real Gemma 3 tokenizer (scripts/fetch_gemma3.sh). Reference ids come
// from Hugging Face (model/testdata/gemma3_tokenizer_reference.py).

std::string Root() {
  const char* root = std::getenv("INFINIGEN_ROOT");
  return root == nullptr ? "" : root;
}

std::string Gemma3Path() {
  if (Root().empty()) return "";
  const std::string path =
      Root() + "/models_cache/gemma3-270m/gemma-3-270m-q4_k_m.gguf";
  return std::ifstream(path).good() ? path : "";
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class Gemma3TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = Gemma3Path();
    if (path.empty()) return;
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadGgufTokenizer(path);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::move(t).value().release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (tok_ == nullptr) {
      GTEST_SKIP() << "Gemma 3 not fetched (scripts/fetch_gemma3.sh) or "
                      "INFINIGEN_ROOT unset";
    }
  }
  static Tokenizer* tok_;
};

Tokenizer* Gemma3TokenizerTest::tok_ = nullptr;

TEST_F(Gemma3TokenizerTest, Metadata) {
  EXPECT_EQ(tok_->vocab_size(), 262144);
  EXPECT_EQ(tok_->bos_id(), 2);
  EXPECT_EQ(tok_->eos_id(), 1);
  EXPECT_TRUE(tok_->adds_bos());
  EXPECT_TRUE(tok_->IsControl(105));   // <start_of_turn>
  EXPECT_TRUE(tok_->IsControl(106));   // <end_of_turn>
  EXPECT_FALSE(tok_->IsControl(107));  // "\n", user-defined
  EXPECT_EQ(tok_->DecodeToken(-1, 105), "");
  EXPECT_EQ(tok_->DecodeToken(-1, 107), "\n");
  EXPECT_EQ(tok_->DecodeToken(2, 9259), "Hello");  // no dummy prefix
  EXPECT_EQ(tok_->DecodeToken(9259, 1902), " world");
  EXPECT_EQ(tok_->Encode("Hello world", true),
            std::vector<int>({2, 9259, 1902}));
  EXPECT_EQ(tok_->Encode("Hello world", false),
            std::vector<int>({9259, 1902}));
}

TEST_F(Gemma3TokenizerTest, MatchesReference) {
  const std::string json_path = "model/testdata/gemma3_tokenizer_reference.json";
  const std::string json = ReadFile(json_path);
  ASSERT_FALSE(json.empty()) << json_path;
  const nlohmann::json ref = nlohmann::json::parse(json);
  int hf_exact = 0;
  int n = 0;
  for (const auto& c : ref["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int> hf = c["ids"].get<std::vector<int>>();
    // Where llama.cpp (whose behaviour this follows) and Hugging Face
    // differ, the file gives llama.cpp's ids too, with the reason.
    const std::vector<int> expected =
        c.contains("llama_cpp_ids") ? c["llama_cpp_ids"].get<std::vector<int>>()
                                    : hf;
    const std::vector<int> ids = tok_->Encode(text, true);
    EXPECT_EQ(ids, expected) << "text: " << text;
    ++n;
    if (ids == hf) ++hf_exact;
    // Decoding gives the text back, less the control tokens' texts.
    bool has_control = false;
    for (size_t i = 1; i < ids.size(); ++i) has_control |= tok_->IsControl(ids[i]);
    if (!has_control) {
      EXPECT_EQ(tok_->Decode(ids), text);
    }
  }
  std::cout << "Gemma 3 reference: " << hf_exact << " of " << n
            << " texts match Hugging Face exactly\n";
  EXPECT_GE(n, 10);
}

TEST_F(Gemma3TokenizerTest, ChatMarkersAreControlTokens) {
  const std::vector<int> ids = tok_->Encode(
      "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", true);
  EXPECT_THAT(ids, ElementsAre(2, 105, 2364, 107, 10979, 106, 107, 105, 4368,
                               107));
  EXPECT_EQ(tok_->Decode(ids), "user\nHi\nmodel\n");
}

TEST_F(Gemma3TokenizerTest, LongSpaceAndNewlineRuns) {
  // Runs up to 31 are one user-defined token; longer ones split longest
  // first, as llama.cpp and SentencePiece do.
  EXPECT_EQ(tok_->Encode(std::string(31, ' '), false),
            std::vector<int>({167}));
  EXPECT_EQ(tok_->Encode(std::string(40, ' '), false),
            std::vector<int>({167, 145}));
  EXPECT_EQ(tok_->Encode(std::string(33, '\n'), false),
            std::vector<int>({137, 108}));
  EXPECT_EQ(tok_->Encode(std::string(3, '\t'), false),
            std::vector<int>({255970}));
}

TEST_F(Gemma3TokenizerTest, EncodesALongTextQuickly) {
  // Not a timed assertion: the log shows the time.
  std::string text;
  for (const std::string& path :
       {Root() + "/../shared/data/pride_and_prejudice.txt",
        Root() + "/shared/data/pride_and_prejudice.txt"}) {
    text = ReadFile(path);
    if (!text.empty()) break;
  }
  if (text.empty()) {
    GTEST_SKIP() << "shared/data/pride_and_prejudice.txt not found";
  }
  text.resize(std::min<size_t>(text.size(), 200 * 1024));
  auto start = std::chrono::steady_clock::now();
  const std::vector<int> ids = tok_->Encode(text, true);
  double seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();
  std::cout << "encoded " << text.size() << " bytes of Pride and Prejudice "
            << "into " << ids.size() << " tokens in " << seconds * 1e3
            << " ms\n";
  EXPECT_EQ(tok_->Decode(ids), text);

  // One fragment with no special token in it: newlines and space runs
  // become single spaces.
  std::string flat;
  flat.reserve(text.size());
  for (char c : text) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
    if (c == ' ' && !flat.empty() && flat.back() == ' ') continue;
    flat += c;
  }
  start = std::chrono::steady_clock::now();
  const std::vector<int> flat_ids = tok_->Encode(flat, false);
  seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                          start)
                .count();
  std::cout << "encoded one fragment of " << flat.size() << " bytes into "
            << flat_ids.size() << " tokens in " << seconds * 1e3 << " ms\n";
  EXPECT_EQ(tok_->Decode(flat_ids), flat);
}

}  // namespace
}  // namespace infinigen::model
