#include "common/utf8.h"

#include <string>

#include "gtest/gtest.h"

namespace infinigen::utf8 {
namespace {

TEST(Utf8Test, SequenceLengthsByLeadByte) {
  EXPECT_EQ(SequenceLength('a'), 1);
  EXPECT_EQ(SequenceLength(0xC3), 2);
  EXPECT_EQ(SequenceLength(0xE2), 3);
  EXPECT_EQ(SequenceLength(0xF0), 4);
  EXPECT_EQ(SequenceLength(0x80), 0);  // continuation
  EXPECT_EQ(SequenceLength(0xF8), 0);
  EXPECT_EQ(SequenceLength(0xFF), 0);
}

TEST(Utf8Test, DecodesWellFormedCharactersAndReplacesTheRest) {
  int len = 0;
  EXPECT_EQ(Decode("a", 0, &len), 'a');
  EXPECT_EQ(len, 1);
  EXPECT_EQ(Decode("\xC3\xA9", 0, &len), 0xE9u);  // é
  EXPECT_EQ(len, 2);
  EXPECT_EQ(Decode("x\xE2\x96\x81", 1, &len), 0x2581u);  // ▁
  EXPECT_EQ(len, 3);
  EXPECT_EQ(Decode("\xF0\x9F\x98\x80", 0, &len), 0x1F600u);
  EXPECT_EQ(len, 4);
  // Overlong, surrogate, beyond U+10FFFF, cut short, stray continuation:
  // one U+FFFD byte each.
  for (const std::string bad :
       {std::string("\xC0\xAF"), std::string("\xC1\xBF"),
        std::string("\xE0\x80\xAF"), std::string("\xED\xA0\x80"),
        std::string("\xF4\x90\x80\x80"), std::string("\xE2\x96"),
        std::string("\x80")}) {
    EXPECT_EQ(Decode(bad, 0, &len), 0xFFFDu) << bad;
    EXPECT_EQ(len, 1) << bad;
    EXPECT_FALSE(WellFormed(bad, 0, static_cast<int>(bad.size()))) << bad;
  }
  // A well-formed U+FFFD is itself, three bytes.
  EXPECT_EQ(Decode(kReplacement, 0, &len), 0xFFFDu);
  EXPECT_EQ(len, 3);
}

TEST(Utf8Test, WellFormedIsExactlyOneCharacter) {
  EXPECT_TRUE(WellFormed("a", 0, 1));
  EXPECT_TRUE(WellFormed("\xC3\xA9", 0, 2));
  EXPECT_FALSE(WellFormed("\xC3\xA9", 0, 1));  // a lead byte alone
  EXPECT_FALSE(WellFormed("ab", 0, 2));         // two characters
  EXPECT_FALSE(WellFormed("\xC3", 0, 2));       // past the end
  EXPECT_TRUE(WellFormed("ab\xF0\x9F\x98\x80", 2, 4));
}

TEST(Utf8Test, AppendRoundTripsEveryLength) {
  for (uint32_t cp : {0x41u, 0xE9u, 0x2581u, 0xFFFDu, 0x1F600u, 0x10FFFFu}) {
    std::string s;
    Append(cp, s);
    int len = 0;
    EXPECT_EQ(Decode(s, 0, &len), cp);
    EXPECT_EQ(len, static_cast<int>(s.size()));
    EXPECT_EQ(len, SequenceLength(static_cast<unsigned char>(s[0])));
  }
}

TEST(Utf8Test, LengthByLeadNibbleAsLlamaCpp) {
  EXPECT_EQ(LengthByLeadNibble('a'), 1u);
  EXPECT_EQ(LengthByLeadNibble('\x80'), 1u);  // stray continuation
  EXPECT_EQ(LengthByLeadNibble('\xC3'), 2u);
  EXPECT_EQ(LengthByLeadNibble('\xE2'), 3u);
  EXPECT_EQ(LengthByLeadNibble('\xF0'), 4u);
  EXPECT_EQ(LengthByLeadNibble('\xF8'), 4u);  // by its nibble alone
}

}  // namespace
}  // namespace infinigen::utf8
