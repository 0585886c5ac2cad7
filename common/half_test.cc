#include "common/half.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace infinigen {
namespace {

TEST(Half, KnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);            // overflow to inf
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);        // smallest subnormal
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3c00);  // tie rounds to even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.5f)), 1.5f);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3f80);  // tie to even
}

TEST(Half, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToHalf(f), h) << h;
  }
}

TEST(Half, BulkMatchesScalar) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  std::vector<float> x(1003);
  for (float& v : x) v = normal(rng);
  std::vector<uint16_t> h(x.size());
  FloatToHalf(x.data(), x.size(), h.data());
  std::vector<float> back(x.size());
  HalfToFloat(h.data(), h.size(), back.data());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(h[i], FloatToHalf(x[i])) << i;
    EXPECT_EQ(back[i], HalfToFloat(h[i])) << i;
  }
}

}  // namespace
}  // namespace infinigen
