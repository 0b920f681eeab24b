// specache-run's option parsing shared by its commands: byte counts (--gpu-mem-budget).
#include <gtest/gtest.h>

#include "run_support.h"

namespace specache::run {
namespace {

TEST(ParseBytesTest, AcceptsDecimalAndBinaryUnits) {
  EXPECT_EQ(*ParseBytes("48GB"), 48'000'000'000u);
  EXPECT_EQ(*ParseBytes("48GiB"), uint64_t{48} << 30);
  EXPECT_EQ(*ParseBytes("512MiB"), uint64_t{512} << 20);
  EXPECT_EQ(*ParseBytes("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(*ParseBytes("48e9"), 48'000'000'000u);
  EXPECT_EQ(*ParseBytes("51539607552"), 51'539'607'552u);
}

TEST(ParseBytesTest, RefusesUnknownUnitsAndNonPositiveSizes) {
  EXPECT_EQ(ParseBytes("48TB").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("many").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("-1GB").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specache::run
