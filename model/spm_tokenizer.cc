#include "model/spm_tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <queue>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/utf8.h"

namespace infinigen::model {
namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581 '▁'

// "<0xNN>" (as llama.cpp spells byte tokens); -1 if `piece` is not one.
int ParseByteToken(const std::string& piece) {
  if (piece.size() != 6 || piece.compare(0, 3, "<0x") != 0 || piece[5] != '>')
    return -1;
  int value = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = piece[i];
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return -1;
    }
    value = value * 16 + digit;
  }
  return value;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SpmTokenizer>> SpmTokenizer::Create(
    SpmVocabulary vocab) {
  const int n = static_cast<int>(vocab.tokens.size());
  if (absl::Status s = CheckVocabulary(
          "SPM", n, vocab.types.size(), static_cast<long>(vocab.scores.size()),
          vocab.bos_id, vocab.eos_id, vocab.unk_id);
      !s.ok()) {
    return s;
  }

  std::unique_ptr<SpmTokenizer> t(new SpmTokenizer());
  t->tokens_ = std::move(vocab.tokens);
  t->scores_ = std::move(vocab.scores);
  if (t->scores_.empty()) t->scores_.assign(n, 0.0f);
  t->types_ = std::move(vocab.types);
  if (t->types_.empty()) t->types_.assign(n, TokenType::kNormal);
  t->bos_id_ = vocab.bos_id;
  t->eos_id_ = vocab.eos_id;
  t->unk_id_ = vocab.unk_id;
  t->add_bos_ = vocab.add_bos;
  t->add_space_prefix_ = vocab.add_space_prefix;

  // tokens_ is final from here on: the map's keys view its strings.
  t->token_ids_.reserve(n);
  t->decoded_.resize(n);
  for (int id = 0; id < n; ++id) {
    const std::string& piece = t->tokens_[id];
    t->token_ids_[piece] = id;
    std::string& text = t->decoded_[id];
    switch (t->types_[id]) {
      case TokenType::kNormal:
        for (size_t i = 0; i < piece.size();) {
          if (piece.compare(i, kSpaceMark.size(), kSpaceMark) == 0) {
            text += ' ';
            i += kSpaceMark.size();
          } else {
            text += piece[i++];
          }
        }
        break;
      case TokenType::kByte: {
        const int byte = ParseByteToken(piece);
        text = byte >= 0 ? std::string(1, static_cast<char>(byte)) : piece;
        break;
      }
      case TokenType::kUserDefined:
        text = piece;
        break;
      default:  // control, unknown, unused, undefined: nothing
        break;
    }
  }

  for (int b = 0; b < 256; ++b) {
    const std::string hex = absl::StrFormat("<0x%02X>", b);
    int id = t->TokenId(hex);
    if (id < 0) id = t->TokenId(std::string(1, static_cast<char>(b)));
    if (id < 0) id = t->unk_id_;
    t->byte_token_[b] = id;
  }

  // The trie of literal special tokens.
  t->trie_.emplace_back();
  for (int& c : t->root_child_) c = -1;
  for (int id = 0; id < n; ++id) {
    const TokenType type = t->types_[id];
    const bool special =
        type == TokenType::kUserDefined ||
        (vocab.parse_special &&
         (type == TokenType::kControl || type == TokenType::kUnknown));
    const std::string& piece = t->tokens_[id];
    if (!special || piece.empty()) continue;
    int node = 0;
    for (size_t i = 0; i < piece.size(); ++i) {
      const uint8_t byte = static_cast<uint8_t>(piece[i]);
      int next = -1;
      if (node == 0) {
        next = t->root_child_[byte];
      } else {
        for (const auto& [b, child] : t->trie_[node].children) {
          if (b == byte) {
            next = child;
            break;
          }
        }
      }
      if (next < 0) {
        next = static_cast<int>(t->trie_.size());
        t->trie_.emplace_back();
        if (node == 0) {
          t->root_child_[byte] = next;
        } else {
          t->trie_[node].children.emplace_back(byte, next);
        }
      }
      node = next;
    }
    // Duplicate texts: the last id wins, as for token_ids_.
    t->trie_[node].id = id;
  }
  return t;
}

int SpmTokenizer::TokenId(std::string_view piece) const {
  auto it = token_ids_.find(piece);
  return it == token_ids_.end() ? -1 : it->second;
}

std::pair<size_t, int> SpmTokenizer::MatchSpecial(std::string_view text,
                                                  size_t pos) const {
  std::pair<size_t, int> best = {0, -1};
  int node = root_child_[static_cast<uint8_t>(text[pos])];
  size_t i = pos;
  while (node >= 0) {
    if (trie_[node].id >= 0) best = {i + 1 - pos, trie_[node].id};
    if (++i >= text.size()) break;
    const uint8_t byte = static_cast<uint8_t>(text[i]);
    int next = -1;
    for (const auto& [b, child] : trie_[node].children) {
      if (b == byte) {
        next = child;
        break;
      }
    }
    node = next;
  }
  return best;
}

void SpmTokenizer::EncodeFragment(std::string_view text,
                                  std::vector<int>& out) const {
  if (text.empty()) return;
  // The symbols: UTF-8 characters at first, merged pieces later, in a linked
  // list; a merged-away symbol keeps n == 0.
  struct Symbol {
    uint32_t offset;
    uint32_t n;
    int prev;
    int next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  for (size_t offset = 0; offset < text.size();) {
    const size_t len = std::min(utf8::LengthByLeadNibble(text[offset]), text.size() - offset);
    const int index = static_cast<int>(symbols.size());
    symbols.push_back({static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(len), index - 1,
                       offset + len == text.size() ? -1 : index + 1});
    offset += len;
  }

  // A candidate merge of two adjacent symbols; `size` (their bytes when
  // queued) tells a stale entry from a live one.
  struct Bigram {
    float score;
    int left;
    int right;
    uint32_t size;
  };
  // Highest score first; on ties the leftmost pair.
  const auto lower = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  std::priority_queue<Bigram, std::vector<Bigram>, decltype(lower)> queue(
      lower);
  const auto try_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const uint32_t size = symbols[left].n + symbols[right].n;
    const int id = TokenId(text.substr(symbols[left].offset, size));
    if (id < 0) return;
    queue.push({scores_[id], left, right, size});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) {
    try_add(i - 1, i);
  }

  while (!queue.empty()) {
    const Bigram bigram = queue.top();
    queue.pop();
    Symbol& left = symbols[bigram.left];
    Symbol& right = symbols[bigram.right];
    // Skip a pair one of whose symbols has merged since it was queued.
    if (left.n == 0 || right.n == 0 || left.n + right.n != bigram.size) {
      continue;
    }
    left.n += right.n;
    right.n = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add(left.prev, bigram.left);
    try_add(bigram.left, left.next);
  }

  // Every merged symbol is a piece (a pair is queued only when its text is
  // one), so llama.cpp's rev_merge resegmentation never applies: a symbol is
  // either a piece or a single character the vocabulary lacks, which falls
  // back to its bytes.
  for (int i = 0; i != -1; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    const std::string_view piece = text.substr(s.offset, s.n);
    const int id = TokenId(piece);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (char c : piece) {
      const int byte_id = byte_token_[static_cast<uint8_t>(c)];
      if (byte_id >= 0) out.push_back(byte_id);
    }
  }
}

std::vector<int> SpmTokenizer::Encode(std::string_view text,
                                      bool add_bos) const {
  std::vector<int> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos && add_bos_ && bos_id_ >= 0) out.push_back(bos_id_);

  std::string fragment;
  bool after_special = true;  // the text's start counts as one
  const auto encode_raw = [&](size_t begin, size_t end) {
    if (end <= begin) return;
    fragment.clear();
    if (add_space_prefix_ && after_special) fragment += kSpaceMark;
    for (size_t i = begin; i < end; ++i) {
      if (text[i] == ' ') {
        fragment += kSpaceMark;
      } else {
        fragment += text[i];
      }
    }
    EncodeFragment(fragment, out);
    after_special = false;
  };

  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    if (root_child_[static_cast<uint8_t>(text[i])] >= 0) {
      const auto [len, id] = MatchSpecial(text, i);
      if (len > 0) {
        encode_raw(start, i);
        out.push_back(id);
        after_special = true;
        i += len;
        start = i;
        continue;
      }
    }
    ++i;
  }
  encode_raw(start, text.size());
  return out;
}

std::string SpmTokenizer::DecodeToken(int prev, int token) const {
  if (token < 0 || token >= vocab_size()) return "";
  const std::string& text = decoded_[token];
  // SentencePiece's dummy prefix: the space it added before the text.
  if (add_space_prefix_ && (prev < 0 || prev == bos_id_) &&
      types_[token] == TokenType::kNormal && !text.empty() && text[0] == ' ') {
    return text.substr(1);
  }
  return text;
}

}  // namespace infinigen::model
