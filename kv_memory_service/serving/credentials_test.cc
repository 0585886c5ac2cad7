#include "kv_memory_service/serving/credentials.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace infinigen::kv_memory_service {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<const Credential*> Present(const Credentials& c,
                                          absl::string_view token) {
  return c.Authenticate(&token);
}

TEST(Credentials, ParseNamespacesAndReadOnly) {
  auto c = Credentials::Parse(
      "# token namespace [read-only]\n"
      "tok-a  team-a\n"
      "\n"
      "tok-b\tteam-b\n"
      "tok-r team-a read-only\n"
      "  bare  \n",
      "tokens");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->size(), 4u);
  auto a = Present(*c, "Bearer tok-a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->prefix_namespace, "team-a");
  EXPECT_FALSE((*a)->read_only_prefixes);
  auto r = Present(*c, "Bearer tok-r");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->prefix_namespace, "team-a");
  EXPECT_TRUE((*r)->read_only_prefixes);
  auto bare = Present(*c, "Bearer bare");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ((*bare)->prefix_namespace, "");
  EXPECT_EQ(Present(*c, "Bearer tok-").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Present(*c, "tok-a").status().code(),  // not "Bearer TOKEN"
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Present(*c, "Bearer tok-aa").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(c->Authenticate(nullptr).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(Credentials, MalformedFilesSayWhere) {
  EXPECT_THAT(std::string(Credentials::Parse("a ns writer\n", "f")
                              .status()
                              .message()),
              HasSubstr("f line 1: want TOKEN [NAMESPACE [read-only]]"));
  EXPECT_THAT(std::string(Credentials::Parse("a\nb\na x\n", "f")
                              .status()
                              .message()),
              HasSubstr("f line 3: a token listed twice"));
  EXPECT_THAT(
      std::string(Credentials::Parse("# none\n\n", "f").status().message()),
      HasSubstr("f holds no token"));
}

TEST(Credentials, EmptyAcceptsEveryone) {
  const Credentials none;
  EXPECT_TRUE(none.empty());
  auto anyone = none.Authenticate(nullptr);
  ASSERT_TRUE(anyone.ok());
  EXPECT_EQ(*anyone, nullptr);
  EXPECT_TRUE(Credentials::Single("").empty());
  EXPECT_TRUE(Present(Credentials::Single("t"), "Bearer t").ok());
}

}  // namespace
}  // namespace infinigen::kv_memory_service
