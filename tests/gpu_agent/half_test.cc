#include "specache/half.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace specache {
namespace {

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // rounds up to infinity
  EXPECT_EQ(FloatToHalf(5.9604644775390625e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(2.0e-8f), 0x0000);                 // below half of it
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(HalfTest, TiesRoundToEven) {
  EXPECT_EQ(HalfToFloat(FloatToHalf(2049.0f)), 2048.0f);  // halfway between 2048 and 2050
  EXPECT_EQ(HalfToFloat(FloatToHalf(2051.0f)), 2052.0f);
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<Half>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(HalfTest, NearestOnRandomFloats) {
  // The chosen half is at least as close as both neighbours.
  uint32_t state = 12345;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    const float f = std::ldexp(static_cast<float>(state % 1000003) / 1000003.0f, static_cast<int>(state % 40) - 24);
    const Half h = FloatToHalf(f);
    const float err = std::fabs(HalfToFloat(h) - f);
    ASSERT_LE(err, std::fabs(HalfToFloat(static_cast<Half>(h + 1)) - f)) << f;
    if (h > 0) {
      ASSERT_LE(err, std::fabs(HalfToFloat(static_cast<Half>(h - 1)) - f)) << f;
    }
  }
}

}  // namespace
}  // namespace specache
