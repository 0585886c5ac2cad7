// UTF-8 as every part of the project reads it: the tokenizers (model/),
// the streaming of generated text (gpu_worker/serving/) and the API's JSON.
// Well-formed means what protobuf and JSON require: no overlong forms, no
// surrogates, no code point above U+10FFFF.
#ifndef INFINIGEN_COMMON_UTF8_H_
#define INFINIGEN_COMMON_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace infinigen::utf8 {

inline constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// The byte length of the sequence `lead` starts (1 to 4), or 0 if it
// starts none (a continuation byte, or 0xF8 and above).
int SequenceLength(unsigned char lead);

inline bool IsContinuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// The well-formed character at s[i], its byte length in *len. A byte that
// does not start one is a character of its own: U+FFFD, length 1.
uint32_t Decode(std::string_view s, size_t i, int* len);

// Whether s[i, i + len) is exactly one well-formed character.
bool WellFormed(std::string_view s, size_t i, int len);

// Appends code point `cp` (at most U+10FFFF) as UTF-8.
void Append(uint32_t cp, std::string& out);

// llama.cpp's unicode_len_utf8, which its SentencePiece tokenizer splits
// text by: the length by the lead byte's high nibble alone, a stray
// continuation byte counting as one character.
inline size_t LengthByLeadNibble(char c) {
  static constexpr size_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                      1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[static_cast<uint8_t>(c) >> 4];
}

}  // namespace infinigen::utf8

#endif  // INFINIGEN_COMMON_UTF8_H_
