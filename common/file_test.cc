#include "common/file.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace infinigen {
namespace {

std::string Write(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/" + name;
  FILE* f = std::fopen(path.c_str(), "w");
  EXPECT_NE(f, nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
  return path;
}

TEST(ReadTokenFile, StripsSurroundingWhitespace) {
  auto token = ReadTokenFile(Write("token", "  s3cret token\n\n"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "s3cret token");
}

TEST(ReadTokenFile, EmptyOrBlankIsInvalidArgumentNamingTheFile) {
  const std::string path = Write("blank_token", " \n\t\n");
  auto token = ReadTokenFile(path);
  EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(token.status().message()).find(path),
            std::string::npos);
}

TEST(ReadTokenFile, MissingFileIsNotFound) {
  auto token = ReadTokenFile("/nonexistent/token");
  EXPECT_EQ(token.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace infinigen
