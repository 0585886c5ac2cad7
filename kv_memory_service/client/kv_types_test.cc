// The prefix annotations' encoding that the shm slot and the fetch socket
// carry after an append's rows: what a client encodes decodes to the same
// annotations, and bytes from a hostile client are refused, never read
// past their end.
#include "kv_memory_service/client/kv_types.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace infinigen::kv_memory_service {
namespace {

TEST(PrefixMetaTest, WhatIsEncodedDecodesToTheSameAnnotations) {
  const std::vector<std::string> meta = {"", "one", std::string(5000, 'x'),
                                         std::string("\0\1\2", 3)};
  AppendBlock block;
  block.prefix_meta = meta;
  block.prefix_meta_first_block = 7;
  const std::string bytes = EncodePrefixMeta(block);
  std::vector<std::string> got;
  int32_t first = -1;
  ASSERT_TRUE(DecodePrefixMeta(bytes, &got, &first).ok());
  EXPECT_EQ(got, meta);
  EXPECT_EQ(first, 7);

  AppendBlock none;
  EXPECT_EQ(EncodePrefixMeta(none), "");
  ASSERT_TRUE(DecodePrefixMeta("", &got, &first).ok());
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(first, 0);
}

TEST(PrefixMetaTest, BytesThatDoNotAddUpAreRefused) {
  const std::vector<std::string> meta = {"ab", "cde"};
  AppendBlock block;
  block.prefix_meta = meta;
  const std::string good = EncodePrefixMeta(block);
  std::vector<std::string> got;
  int32_t first = 0;
  auto code = [&](const std::string& bytes) {
    return DecodePrefixMeta(bytes, &got, &first).code();
  };
  EXPECT_EQ(code(good.substr(0, 5)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(good.substr(0, good.size() - 1)),
            absl::StatusCode::kInvalidArgument);  // one byte short
  EXPECT_EQ(code(good + "z"), absl::StatusCode::kInvalidArgument);
  std::string many = good;
  const uint32_t count = 0xffffffffu;  // more sizes than bytes
  std::memcpy(many.data(), &count, 4);
  EXPECT_EQ(code(many), absl::StatusCode::kInvalidArgument);
  std::string huge(12 + (kMaxPrefixMetaBytes + 1), '\0');
  const uint32_t one = 1, size = kMaxPrefixMetaBytes + 1;
  std::memcpy(huge.data(), &one, 4);
  std::memcpy(huge.data() + 8, &size, 4);
  EXPECT_EQ(code(huge), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(got.empty());
}

}  // namespace
}  // namespace infinigen::kv_memory_service
