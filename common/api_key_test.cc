#include "common/api_key.h"

#include "gtest/gtest.h"

namespace infinigen {
namespace {

absl::StatusCode Check(const char* header, const char* key) {
  const absl::string_view h(header);
  return CheckApiKey(&h, key).code();
}

TEST(ApiKey, NoKeyTakesEverything) {
  EXPECT_TRUE(CheckApiKey(nullptr, "").ok());
  EXPECT_EQ(Check("Bearer anything", ""), absl::StatusCode::kOk);
}

TEST(ApiKey, OnlyTheBearerKeyItself) {
  EXPECT_EQ(Check("Bearer sk-1", "sk-1"), absl::StatusCode::kOk);
  for (const char* bad : {"Bearer sk-2", "Bearer sk-1x", "Bearer sk-", "sk-1",
                          "Basic sk-1", "Bearer ", "bearer sk-1"}) {
    EXPECT_EQ(Check(bad, "sk-1"), absl::StatusCode::kUnauthenticated) << bad;
  }
  const absl::Status missing = CheckApiKey(nullptr, "sk-1");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(missing.message().find("missing"), absl::string_view::npos);
  EXPECT_EQ(Check("", "sk-1"), absl::StatusCode::kUnauthenticated);
}

}  // namespace
}  // namespace infinigen
