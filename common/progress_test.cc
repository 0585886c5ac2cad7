#include "common/progress.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infinigen {
namespace {

using ::testing::HasSubstr;

std::string Read(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  return out;
}

TEST(Progress, LineHasTheRateAndTheTimeLeft) {
  EXPECT_EQ(Progress::Line("perplexity", 250, 1000, "tokens", 5.0, 0),
            "perplexity 25% 250/1000 tokens (50.0 tokens/s, 15 s left)");
  EXPECT_EQ(Progress::Line("skew", 0, 10, "tokens", 0.0, 0),
            "skew 0% 0/10 tokens (starting)");
  EXPECT_EQ(Progress::Line("x", 10, 10, "steps", 2.0, 0),
            "x 100% 10/10 steps (5.0 steps/s, 2 s)");
  EXPECT_EQ(Progress::Line("x", 5, 10, "steps", 1.0, 4),
            "x [==> ] 50% 5/10 steps (5.0 steps/s, 1 s left)");
  EXPECT_EQ(Progress::Line("x", 10, 10, "steps", 1.0, 4),
            "x [====] 100% 10/10 steps (10.0 steps/s, 1 s)");
}

TEST(Progress, PlainLinesAtMostOncePerIntervalAndAtTheEnd) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("run", 1000, "tokens", f, /*terminal=*/0,
               /*interval_seconds=*/3600);
    for (int i = 1; i <= 1000; ++i) p.Update(i);
  }
  const std::string out = Read(f);
  std::fclose(f);
  // Nothing for the first hour, then the end.
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_THAT(out, HasSubstr("run 100% 1000/1000 tokens"));
  EXPECT_EQ(out.find('\r'), std::string::npos);
}

TEST(Progress, ATerminalBarIsRedrawnInPlaceAroundNotes) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    Progress p("run", 4, "steps", f, /*terminal=*/1, /*interval_seconds=*/0);
    p.Update(1);
    p.Note("window 1: ppl 12.3");
    p.Update(2);
  }  // unfinished: the destructor ends the line
  const std::string out = Read(f);
  std::fclose(f);
  EXPECT_THAT(out, HasSubstr("\rrun [======>"));
  EXPECT_THAT(out, HasSubstr("\r\033[Kwindow 1: ppl 12.3\n"));
  EXPECT_EQ(out.back(), '\n');
  EXPECT_THAT(out, HasSubstr("50% 2/4 steps"));
}

}  // namespace
}  // namespace infinigen
