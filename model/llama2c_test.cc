#include "model/llama2c.h"

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infinigen::model {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "models/stories260K/stories260K.bin";
constexpr char kTokenizer[] = "models/stories260K/tok512.bin";

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(data.data(), data.size());
}

TEST(Llama2cWeights, Stories260KFacts) {
  absl::StatusOr<Weights> w = LoadLlama2cWeights(kModel);
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelConfig& c = w->config;
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_TRUE(w->lm_head.empty()) << "stories260K shares its classifier";
  // 264,128 fp32 values, counting the two legacy RoPE tables we skip.
  size_t count = w->token_embedding.size() + w->final_norm.size();
  for (const LayerWeights& l : w->layers) {
    count += l.attn_norm.size() + l.wq.size() + l.wk.size() + l.wv.size() +
             l.wo.size() + l.ffn_norm.size() + l.w1.size() + l.w2.size() +
             l.w3.size();
  }
  count += 2 * size_t(c.max_seq_len) * c.head_dim / 2;
  EXPECT_EQ(count, 264128u);
  // The first embedding value is the first float after the 28-byte header.
  const std::string raw = ReadAll(kModel);
  float first;
  std::memcpy(&first, raw.data() + 28, 4);
  EXPECT_EQ(w->token_embedding[0], first);
}

TEST(Llama2cWeights, PermutesQueryRowsToHalfSplit) {
  absl::StatusOr<Weights> w = LoadLlama2cWeights(kModel);
  ASSERT_TRUE(w.ok());
  const std::string raw = ReadAll(kModel);
  const ModelConfig& c = w->config;
  // File layer 0 wq starts after the embedding and the rms_att weights.
  const size_t wq_offset =
      28 + 4 * (size_t(c.vocab_size) * c.dim + size_t(c.n_layers) * c.dim);
  auto file_wq = [&](int row, int col) {
    float v;
    std::memcpy(&v, raw.data() + wq_offset + 4 * (size_t(row) * c.dim + col), 4);
    return v;
  };
  // Interleaved row 2i+1 of head 1 becomes half-split row i + head_dim/2.
  const int h = 1, i = 2;
  EXPECT_EQ(w->layers[0].wq[(h * c.head_dim + i + c.head_dim / 2) * c.dim + 5],
            file_wq(h * c.head_dim + 2 * i + 1, 5));
  EXPECT_EQ(w->layers[0].wq[(h * c.head_dim + i) * c.dim + 7],
            file_wq(h * c.head_dim + 2 * i, 7));
}

TEST(Llama2cWeights, MissingFileIsNotFound) {
  absl::StatusOr<Weights> w = LoadLlama2cWeights("no/such/model.bin");
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("no/such/model.bin"));
}

TEST(Llama2cWeights, TruncatedFileNamesTheFileAndTensor) {
  const std::string raw = ReadAll(kModel);
  const std::string path = TempPath("truncated.bin");
  WriteAll(path, raw.substr(0, raw.size() / 2));
  absl::StatusOr<Weights> w = LoadLlama2cWeights(path);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(w.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("truncated"));
}

TEST(Llama2cWeights, GarbageHeaderIsRejected) {
  const std::string path = TempPath("garbage.bin");
  WriteAll(path, std::string(1000, '\x7f'));
  absl::StatusOr<Weights> w = LoadLlama2cWeights(path);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(w.status().message()), HasSubstr(path));
  WriteAll(path, "tiny");
  EXPECT_EQ(LoadLlama2cWeights(path).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Llama2cWeights, TrailingBytesAreRejected) {
  const std::string path = TempPath("trailing.bin");
  WriteAll(path, ReadAll(kModel) + std::string(12, '\0'));
  absl::StatusOr<Weights> w = LoadLlama2cWeights(path);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(w.status().message()), HasSubstr("trailing"));
}

// run.c's encode(), transcribed literally (quadratic): the reference the
// heap-based encoder must match token for token.
std::vector<int> RunCEncode(const std::vector<std::string>& vocab,
                            const std::vector<float>& scores,
                            const std::string& text) {
  auto lookup = [&](const std::string& s) {
    for (size_t i = 0; i < vocab.size(); ++i) {
      if (vocab[i] == s) return static_cast<int>(i);
    }
    return -1;
  };
  std::vector<int> tokens = {1};
  if (!text.empty()) tokens.push_back(lookup(" "));
  std::string buf;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((text[i] & 0xC0) != 0x80) buf.clear();
    buf += text[i];
    if (i + 1 < text.size() && (text[i + 1] & 0xC0) == 0x80 && buf.size() < 4) {
      continue;
    }
    int id = lookup(buf);
    if (id != -1) {
      tokens.push_back(id);
    } else {
      for (unsigned char ch : buf) tokens.push_back(ch + 3);
    }
    buf.clear();
  }
  while (true) {
    float best = -1e10f;
    int best_id = -1, best_idx = -1;
    for (size_t i = 1; i + 1 < tokens.size(); ++i) {
      int id = lookup(vocab[tokens[i]] + vocab[tokens[i + 1]]);
      if (id != -1 && scores[id] > best) {
        best = scores[id];
        best_id = id;
        best_idx = static_cast<int>(i);
      }
    }
    if (best_idx == -1) break;
    tokens[best_idx] = best_id;
    tokens.erase(tokens.begin() + best_idx + 1);
  }
  return tokens;
}

class Llama2cTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = Llama2cTokenizer::Load(kTokenizer, 512);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::move(*t);
    const std::string raw = ReadAll(kTokenizer);
    size_t off = 4;
    for (int i = 0; i < 512; ++i) {
      float s;
      int len;
      std::memcpy(&s, raw.data() + off, 4);
      std::memcpy(&len, raw.data() + off + 4, 4);
      vocab_.push_back(raw.substr(off + 8, len));
      scores_.push_back(s);
      off += 8 + len;
    }
  }
  std::unique_ptr<Llama2cTokenizer> tok_;
  std::vector<std::string> vocab_;
  std::vector<float> scores_;
};

TEST_F(Llama2cTokenizerTest, MatchesRunCOnText) {
  for (const std::string text :
       {"Once upon a time", "Hello world! 123 ~ [x] |y|", "", "a",
        "The café naïve coöperation — “quoted” ☃ 日本",
        "  leading and   repeated   spaces\nand\ttabs\n"}) {
    EXPECT_EQ(tok_->Encode(text, true), RunCEncode(vocab_, scores_, text))
        << text;
  }
}

TEST_F(Llama2cTokenizerTest, MatchesRunCOnRandomText) {
  std::mt19937 rng(7);
  const std::string alphabet = "abcdefghijklmnopqrstuvwxyz      .,!?'\nTHE";
  for (int trial = 0; trial < 20; ++trial) {
    std::string text;
    for (int i = 0; i < 120; ++i) text += alphabet[rng() % alphabet.size()];
    EXPECT_EQ(tok_->Encode(text, true), RunCEncode(vocab_, scores_, text))
        << text;
  }
}

TEST_F(Llama2cTokenizerTest, RoundTrips) {
  for (const std::string text :
       {"Once upon a time, there was a little girl named Lily.",
        "Bytes: ☃ 日本 ümlaut", "x"}) {
    std::vector<int> ids = tok_->Encode(text, true);
    EXPECT_EQ(ids.front(), 1);
    EXPECT_EQ(tok_->Decode(ids), text);
  }
}

TEST_F(Llama2cTokenizerTest, DecodeDropsSpaceAfterBosAndControlTokens) {
  const int once = tok_->Encode("Once", false).back();
  EXPECT_EQ(tok_->DecodeToken(1, once)[0], 'O');
  EXPECT_EQ(tok_->DecodeToken(5, once)[0], ' ');
  EXPECT_EQ(tok_->DecodeToken(-1, 1), "");
  EXPECT_EQ(tok_->DecodeToken(-1, 2), "");
  EXPECT_EQ(tok_->DecodeToken(-1, 0x41 + 3), "A");  // byte token <0x41>
}

TEST(Llama2cTokenizer, ShortFileIsRejected) {
  auto t = Llama2cTokenizer::Load(kTokenizer, 600);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("truncated"));
  EXPECT_EQ(Llama2cTokenizer::Load("missing.bin", 512).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace infinigen::model
