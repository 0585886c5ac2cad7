#include "model/bpe_tokenizer.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"

namespace infinigen::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// GPT-2's byte alphabet, written out independently of the implementation:
// printable Latin-1 bytes are themselves, the rest count up from U+0100.
std::string ByteChar(int b) {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int next = 256;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) ||
                             (c >= 174 && c <= 255);
      const int cp = printable ? c : next++;
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      t[c] = s;
    }
    return t;
  }();
  return table[b];
}

// A tiny vocabulary: <|endoftext|> (control, id 0), <tool> (user-defined,
// id 1), the 256 byte characters (ids 2..257), then merged tokens.
BpeVocabulary TinyVocab(const std::vector<std::string>& merges) {
  BpeVocabulary v;
  v.tokens = {"<|endoftext|>", "<tool>"};
  v.types = {TokenType::kControl, TokenType::kUserDefined};
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(ByteChar(b));
    v.types.push_back(TokenType::kNormal);
  }
  for (const std::string& m : merges) {
    const size_t space = m.find(' ');
    v.tokens.push_back(m.substr(0, space) + m.substr(space + 1));
    v.types.push_back(TokenType::kNormal);
  }
  v.merges = merges;
  v.bos_id = 0;
  v.eos_id = 0;
  return v;
}

int ByteId(char c) { return 2 + static_cast<uint8_t>(c); }

std::unique_ptr<BpeTokenizer> Make(BpeVocabulary v) {
  absl::StatusOr<std::unique_ptr<BpeTokenizer>> t =
      BpeTokenizer::Create(std::move(v));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(t).value() : nullptr;
}

const std::vector<std::string> kHelloMerges = {
    "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
};

TEST(BpeTokenizerTest, MergesAsciiWordsAndRoundTrips) {
  auto t = Make(TinyVocab(kHelloMerges));
  ASSERT_NE(t, nullptr);
  const int hello = t->TokenId("hello");
  const int world = t->TokenId("Ġworld");
  ASSERT_GE(hello, 258);
  ASSERT_GE(world, 258);
  EXPECT_THAT(t->Encode("hello world", false), ElementsAre(hello, world));
  EXPECT_THAT(t->Encode("hello world!", false),
              ElementsAre(hello, world, ByteId('!')));
  // "help": only "h e" applies; "l" and "p" stay bytes.
  EXPECT_THAT(t->Encode("help", false),
              ElementsAre(t->TokenId("he"), ByteId('l'), ByteId('p')));
  EXPECT_EQ(t->Decode(t->Encode("hello world", false)), "hello world");
  EXPECT_EQ(t->DecodeToken(-1, world), " world");
  EXPECT_EQ(t->vocab_size(), 258 + static_cast<int>(kHelloMerges.size()));
}

TEST(BpeTokenizerTest, Utf8AndArbitraryBytesRoundTrip) {
  auto t = Make(TinyVocab(kHelloMerges));
  ASSERT_NE(t, nullptr);
  for (const std::string& text :
       {std::string("héllo wörld — naïve café 日本語 😀"),
        std::string("\xff\xfe hello \xc3"),  // invalid UTF-8
        std::string("a\0b", 3), std::string("  \n\n\t x  ")}) {
    std::vector<int> ids = t->Encode(text, false);
    EXPECT_EQ(t->Decode(ids), text);
  }
  // "é" is two bytes, each its own token here.
  EXPECT_THAT(t->Encode("é", false),
              ElementsAre(ByteId('\xc3'), ByteId('\xa9')));
}

TEST(BpeTokenizerTest, LowerRankMergesFirst) {
  // "abc" with a+b ranked before b+c gives [ab, c]; the other way [a, bc].
  auto ab_first = Make(TinyVocab({"a b", "b c"}));
  auto bc_first = Make(TinyVocab({"b c", "a b"}));
  ASSERT_NE(ab_first, nullptr);
  ASSERT_NE(bc_first, nullptr);
  EXPECT_THAT(ab_first->Encode("abc", false),
              ElementsAre(ab_first->TokenId("ab"), ByteId('c')));
  EXPECT_THAT(bc_first->Encode("abc", false),
              ElementsAre(ByteId('a'), bc_first->TokenId("bc")));
  // Equal pairs merge leftmost first: "aaa" -> [aa, a].
  auto aa = Make(TinyVocab({"a a"}));
  EXPECT_THAT(aa->Encode("aaa", false),
              ElementsAre(aa->TokenId("aa"), ByteId('a')));
  EXPECT_THAT(aa->Encode("aaaa", false),
              ElementsAre(aa->TokenId("aa"), aa->TokenId("aa")));
  // A merge whose result is not a token is ignored.
  BpeVocabulary v = TinyVocab({"x y"});
  v.tokens.pop_back();
  v.types.pop_back();
  auto no_xy = Make(v);
  EXPECT_THAT(no_xy->Encode("xy", false),
              ElementsAre(ByteId('x'), ByteId('y')));
}

TEST(BpeTokenizerTest, MergesNeverCrossWords) {
  auto t = Make(TinyVocab({"o Ġ", "Ġ w"}));
  // "o w": the pre-tokenizer gives "o" and " w", so "o " never forms.
  EXPECT_THAT(t->Encode("o w", false),
              ElementsAre(ByteId('o'), t->TokenId("Ġw")));
}

std::vector<std::string> Pieces(const BpeTokenizer& t, std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : t.PreTokenize(text)) out.emplace_back(p);
  return out;
}

TEST(BpeTokenizerTest, PreTokenizesLikeTheGpt2Regex) {
  auto t = Make(TinyVocab({}));
  EXPECT_THAT(Pieces(*t, "I'm here, it's John's 'quote' and they'll've"),
              ElementsAre("I", "'m", " here", ",", " it", "'s", " John", "'s",
                          " '", "quote", "'", " and", " they", "'ll", "'ve"));
  // Contractions are case-sensitive.
  EXPECT_THAT(Pieces(*t, "Don't STOP'S"),
              ElementsAre("Don", "'t", " STOP", "'", "S"));
  // Whitespace: a run gives its last space to the next word.
  EXPECT_THAT(Pieces(*t, "a  b"), ElementsAre("a", " ", " b"));
  EXPECT_THAT(Pieces(*t, "x\n\ny"), ElementsAre("x", "\n", "\n", "y"));
  EXPECT_THAT(Pieces(*t, "end.  "), ElementsAre("end", ".", "  "));
  EXPECT_THAT(Pieces(*t, "   lead"), ElementsAre("  ", " lead"));
  EXPECT_THAT(Pieces(*t, "\n \nx"), ElementsAre("\n ", "\n", "x"));
  EXPECT_THAT(Pieces(*t, "tab\ttab"), ElementsAre("tab", "\t", "tab"));
  // Numbers stay together; punctuation runs together.
  EXPECT_THAT(Pieces(*t, "$12.5 in 2024 (a)[b]"),
              ElementsAre("$", "12", ".", "5", " in", " 2024", " (", "a", ")[",
                          "b", "]"));
  // Non-ASCII letters, numbers and symbols.
  EXPECT_THAT(
      Pieces(*t, "naïve café 日本語です ½x hi😀!"),
      ElementsAre("naïve", " café", " 日本語です", " ½", "x", " hi", "😀!"));
  EXPECT_THAT(Pieces(*t, "Привет,мир"), ElementsAre("Привет", ",", "мир"));
  EXPECT_THAT(Pieces(*t, "a\u00a0b"), ElementsAre("a", "\u00a0", "b"));
}

TEST(BpeTokenizerTest, SmolLmPreTokenizerSplitsDigits) {
  BpeVocabulary v = TinyVocab({});
  v.pre_tokenizer = BpePreTokenizer::kDigitsThenGpt2;
  auto t = Make(v);
  EXPECT_THAT(Pieces(*t, "$12.5 in 2024!"),
              ElementsAre("$", "1", "2", ".", "5", " in", " ", "2", "0", "2",
                          "4", "!"));
  EXPECT_THAT(Pieces(*t, "a1b ½"), ElementsAre("a", "1", "b", " ", "½"));
}

TEST(BpeTokenizerTest, SpecialTokensInText) {
  BpeVocabulary v = TinyVocab({"h i"});
  auto t = Make(v);
  const int hi = t->TokenId("hi");
  EXPECT_THAT(t->Encode("<|endoftext|>hi<tool> hi<|endoftext|>", false),
              ElementsAre(0, hi, 1, ByteId(' '), hi, 0));
  // Control tokens decode to nothing, user-defined ones to their text.
  EXPECT_EQ(t->Decode(t->Encode("<|endoftext|>hi<tool>", false)), "hi<tool>");
  EXPECT_EQ(t->DecodeToken(-1, 0), "");
  EXPECT_EQ(t->DecodeToken(-1, 1), "<tool>");
  EXPECT_EQ(t->DecodeToken(-1, 100000), "");
  EXPECT_EQ(t->DecodeToken(-1, -5), "");

  v.parse_special = false;
  auto literal = Make(v);
  std::vector<int> ids = literal->Encode("<tool>", false);
  EXPECT_EQ(ids.size(), 6u);
  EXPECT_EQ(literal->Decode(ids), "<tool>");
}

TEST(BpeTokenizerTest, BosOnlyWhenTheModelAsksForIt) {
  BpeVocabulary v = TinyVocab({});
  v.bos_id = 0;
  v.add_bos = false;
  auto no_bos = Make(v);
  EXPECT_THAT(no_bos->Encode("a", true), ElementsAre(ByteId('a')));
  v.add_bos = true;
  auto bos = Make(v);
  EXPECT_THAT(bos->Encode("a", true), ElementsAre(0, ByteId('a')));
  EXPECT_THAT(bos->Encode("a", false), ElementsAre(ByteId('a')));
  EXPECT_THAT(bos->Encode("", true), ElementsAre(0));
  EXPECT_EQ(bos->bos_id(), 0);
}

TEST(BpeTokenizerTest, CreateRejectsBadVocabularies) {
  EXPECT_EQ(BpeTokenizer::Create(BpeVocabulary{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  BpeVocabulary bad_merge = TinyVocab({});
  bad_merge.merges = {"ab"};
  absl::Status s = BpeTokenizer::Create(bad_merge).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("merge 0"));
  BpeVocabulary bad_bos = TinyVocab({});
  bad_bos.bos_id = 100000;
  EXPECT_EQ(BpeTokenizer::Create(bad_bos).status().code(),
            absl::StatusCode::kInvalidArgument);
  BpeVocabulary bad_types = TinyVocab({});
  bad_types.types.pop_back();
  EXPECT_EQ(BpeTokenizer::Create(bad_types).status().code(),
            absl::StatusCode::kInvalidArgument);
}

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

TEST(LoadGgufTokenizerTest, ReadsTheGgufKeys) {
  BpeVocabulary v = TinyVocab(kHelloMerges);
  v.pre_tokenizer = BpePreTokenizer::kDigitsThenGpt2;
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddString("tokenizer.ggml.pre", "smollm");
  w.AddStringArray("tokenizer.ggml.tokens", v.tokens);
  std::vector<int32_t> types;
  for (TokenType t : v.types) types.push_back(static_cast<int32_t>(t));
  w.AddInt32Array("tokenizer.ggml.token_type", types);
  w.AddStringArray("tokenizer.ggml.merges", v.merges);
  w.AddUint32("tokenizer.ggml.bos_token_id", 0);
  w.AddUint32("tokenizer.ggml.eos_token_id", 0);
  w.AddBool("tokenizer.ggml.add_bos_token", true);
  const std::string path = TempPath("tok.gguf");
  ASSERT_TRUE(w.WriteFile(path).ok());

  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadGgufTokenizer(path);
  ASSERT_TRUE(t.ok()) << t.status();
  auto reference = Make(v);
  EXPECT_EQ((*t)->vocab_size(), reference->vocab_size());
  EXPECT_EQ((*t)->bos_id(), 0);
  const std::string text = "<|endoftext|>hello world 42";
  const std::vector<int> plain = reference->Encode(text, false);
  EXPECT_EQ((*t)->Encode(text, false), plain);
  std::vector<int> with_bos = {0};  // add_bos_token is true in this file
  with_bos.insert(with_bos.end(), plain.begin(), plain.end());
  EXPECT_EQ((*t)->Encode(text, true), with_bos);
  EXPECT_EQ((*t)->Decode((*t)->Encode(text, true)), "hello world 42");
}

TEST(LoadGgufTokenizerTest, RejectsOtherTokenizerModels) {
  GgufWriter w;
  w.AddString("tokenizer.ggml.model", "t5");  // Unigram: not implemented
  const std::string path = TempPath("t5.gguf");
  ASSERT_TRUE(w.WriteFile(path).ok());
  absl::Status s = LoadGgufTokenizer(path).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(path));
  EXPECT_THAT(s.message(), HasSubstr("unsupported tokenizer model t5"));

  GgufWriter no_model;
  const std::string empty = TempPath("nomodel.gguf");
  ASSERT_TRUE(no_model.WriteFile(empty).ok());
  s = LoadGgufTokenizer(empty).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tokenizer.ggml.model"));
}

// ---------------------------------------------------------------------------
// The real SmolLM2 tokenizer. Expected ids come from Hugging Face
// `tokenizers` (0.22) built from this file's tokens and merges with
// SmolLM2's pre-tokenizer (Digits(individual_digits) + ByteLevel).

std::string SmolLm2Path() {
  const char* root = std::getenv("INFINIGEN_ROOT");
  if (root == nullptr || *root == '\0') return "";
  const std::string path = absl::StrCat(
      root, "/models_cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
  return std::ifstream(path).good() ? path : "";
}

class SmolLm2TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = SmolLm2Path();
    if (path.empty()) {
      GTEST_SKIP() << "SmolLM2 not fetched (scripts/fetch_smollm2.sh) or "
                      "INFINIGEN_ROOT unset";
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadGgufTokenizer(path);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::move(t).value();
  }
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(SmolLm2TokenizerTest, KnownIds) {
  EXPECT_EQ(tok_->vocab_size(), 49152);
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  const std::string text = "Hello world, this is a test.";
  const std::vector<int> ids = tok_->Encode(text, /*add_bos=*/true);
  // add_bos_token is false in the file, so no BOS even when asked.
  EXPECT_THAT(ids, ElementsAre(19556, 905, 28, 451, 314, 253, 1028, 30));
  EXPECT_EQ(tok_->Decode(ids), text);

  EXPECT_THAT(tok_->Encode("In 2024, the price was $1,234.56!", false),
              ElementsAre(788, 216, 34, 32, 34, 36, 28, 260, 4319, 436, 1885,
                          33, 28, 34, 35, 36, 30, 37, 38, 17));
  EXPECT_THAT(tok_->Encode("<|im_start|>user\nHéllo wörld — naïve café 日本語 "
                           "😀<|im_end|>",
                           false),
              ElementsAre(1, 4093, 198, 56, 2756, 31394, 267, 29989, 400, 1841,
                          15486, 46494, 37366, 17097, 241, 115, 40993, 179, 120,
                          248, 40303, 218, 2));
  EXPECT_THAT(
      tok_->Encode("  two  spaces\n \nx \t y   ", false),
      ElementsAre(216, 827, 216, 5600, 3805, 198, 104, 216, 197, 329, 333));
  EXPECT_THAT(
      tok_->Encode("I'm here, it's John's 'quote' and they'll've", false),
      ElementsAre(57, 5248, 1535, 28, 357, 506, 2322, 506, 637, 31942, 23, 284,
                  502, 3060, 3543));
  EXPECT_THAT(tok_->Encode("Don't STOP'S you're", false),
              ElementsAre(8084, 982, 5022, 7627, 23, 67, 346, 2316));
}

TEST_F(SmolLm2TokenizerTest, EncodesAMegabyteQuickly) {
  // ~1.3 MB of varied text (numbers change, so words do too).
  std::string text;
  for (int i = 0; text.size() < 1300000; ++i) {
    absl::StrAppend(&text, "Paragraph ", i, ": The quick brown fox (#", i * 7,
                    ") jumps over the lazy dog; naïve café façade — ",
                    "it's 3.14159 × r² ≈ area.\n\n");
  }
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int> ids = tok_->Encode(text, false);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  std::cout << "encoded " << text.size() << " bytes into " << ids.size()
            << " tokens in " << seconds << " s\n";
  EXPECT_EQ(tok_->Decode(ids), text);
  EXPECT_LT(seconds, 20.0);  // generous: a few seconds even unoptimized
}

}  // namespace
}  // namespace infinigen::model
