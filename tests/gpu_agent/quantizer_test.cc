#include "specache/quantizer.h"

#include <algorithm>
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "testing/reference.h"

namespace specache {
namespace {

using testing::RandomHalves;
using testing::RefQuantizeDequantize;
using testing::ToDouble;

class QuantizerBitsTest : public ::testing::TestWithParam<int> {};

// |x - x'| <= s/2 for B >= 2 (nearest level) and <= (max-min)/4 for B = 1 (nearest quarter point),
// with a small allowance for s and z being stored in fp16.
TEST_P(QuantizerBitsTest, ErrorWithinHalfAStepAndMatchesFloat64Reference) {
  const int bits = GetParam();
  std::mt19937 rng(100 + bits);
  for (int group : {32, 64}) {
    for (int trial = 0; trial < 200; ++trial) {
      const std::vector<Half> x = RandomHalves(group, rng, 0.5f + trial % 7, (trial % 5) - 2.0f);
      std::vector<uint32_t> words(WordsPerGroup(group, bits));
      const ScaleZero sz = QuantizeRun(x.data(), group, 1, bits, words.data());
      std::vector<float> decoded(group);
      DequantizeRun(words.data(), sz, group, bits, decoded.data(), 1);
      const std::vector<double> xd = ToDouble(x);
      const double lo = *std::min_element(xd.begin(), xd.end());
      const double hi = *std::max_element(xd.begin(), xd.end());
      const double bound = (bits == 1 ? (hi - lo) / 4 : (hi - lo) / ((1 << bits) - 1) / 2) * 1.01 + 1e-3 * (hi - lo) +
                           1e-3 * std::max(std::fabs(lo), std::fabs(hi));
      const std::vector<double> ref = RefQuantizeDequantize(xd, bits);
      int mismatches = 0;
      for (int i = 0; i < group; ++i) {
        ASSERT_LE(std::fabs(decoded[i] - xd[i]), bound) << "bits " << bits << " element " << i;
        if (std::fabs(decoded[i] - ref[i]) > 1e-6 * (1 + std::fabs(ref[i]))) ++mismatches;
      }
      // float32 and float64 may pick different codes only for values at a rounding boundary.
      EXPECT_LE(mismatches, 1) << "bits " << bits << " trial " << trial;
    }
  }
}

TEST_P(QuantizerBitsTest, DegenerateGroupsDecodeExactly) {
  const int bits = GetParam();
  for (float v : {0.0f, 1.0f, -3.25f, 1000.0f, -65504.0f, 6.1e-5f, 5.96e-8f}) {
    const Half h = FloatToHalf(v);
    std::vector<Half> x(32, h);
    std::vector<uint32_t> words(WordsPerGroup(32, bits));
    const ScaleZero sz = QuantizeRun(x.data(), 32, 1, bits, words.data());
    EXPECT_EQ(HalfToFloat(sz.scale), 0.0f);
    std::vector<float> decoded(32);
    DequantizeRun(words.data(), sz, 32, bits, decoded.data(), 1);
    for (float d : decoded) EXPECT_EQ(d, HalfToFloat(h)) << "value " << v << " bits " << bits;
  }
}

TEST_P(QuantizerBitsTest, PackingRoundTripAndBitPositions) {
  const int bits = GetParam();
  std::mt19937 rng(7 * bits);
  std::uniform_int_distribution<int> code(0, (1 << bits) - 1);
  for (int n : {32, 64, 128}) {
    std::vector<uint8_t> codes(n), back(n);
    for (auto& c : codes) c = static_cast<uint8_t>(code(rng));
    std::vector<uint32_t> words(n * bits / 32);
    PackCodes(codes.data(), n, bits, words.data());
    UnpackCodes(words.data(), n, bits, back.data());
    EXPECT_EQ(codes, back);
    const int per_word = 32 / bits;
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ((words[i / per_word] >> ((i % per_word) * bits)) & ((1u << bits) - 1), codes[i]) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Bits, QuantizerBitsTest, ::testing::Values(1, 2, 4));

TEST(QuantizerTest, MeanErrorShrinksWithBits) {
  std::mt19937 rng(3);
  const std::vector<Half> x = RandomHalves(32 * 256, rng);
  double previous = 1e9;
  for (int bits : {1, 2, 4}) {
    double err = 0;
    for (int g = 0; g < 256; ++g) {
      std::vector<uint32_t> words(WordsPerGroup(32, bits));
      const ScaleZero sz = QuantizeRun(x.data() + g * 32, 32, 1, bits, words.data());
      std::vector<float> d(32);
      DequantizeRun(words.data(), sz, 32, bits, d.data(), 1);
      for (int i = 0; i < 32; ++i) err += std::fabs(d[i] - HalfToFloat(x[g * 32 + i]));
    }
    EXPECT_LT(err, previous * 0.7) << bits;
    previous = err;
  }
}

// SpeCache's 1-bit rule: below the midpoint -> (3 min + max)/4, at or above -> (min + 3 max)/4.
TEST(QuantizerTest, OneBitDecodesToQuarterPoints) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    const std::vector<Half> x = RandomHalves(64, rng, 2.0f, 1.0f);
    std::vector<uint32_t> words(2);
    const ScaleZero sz = QuantizeRun(x.data(), 64, 1, 1, words.data());
    const std::vector<double> xd = ToDouble(x);
    const double lo = *std::min_element(xd.begin(), xd.end());
    const double hi = *std::max_element(xd.begin(), xd.end());
    const float low_level = HalfToFloat(sz.zero);
    const float high_level = HalfToFloat(sz.zero) + HalfToFloat(sz.scale);
    EXPECT_NEAR(low_level, (3 * lo + hi) / 4, 2e-3 * (hi - lo) + 1e-3 * std::fabs(lo));
    EXPECT_NEAR(high_level, (lo + 3 * hi) / 4, 2e-3 * (hi - lo) + 1e-3 * std::fabs(hi));
    std::vector<float> d(64);
    DequantizeRun(words.data(), sz, 64, 1, d.data(), 1);
    const double mid = (lo + hi) / 2;
    for (int i = 0; i < 64; ++i) {
      ASSERT_TRUE(d[i] == low_level || d[i] == high_level);
      // Away from the midpoint (fp16 rounding of s and z can move it slightly) the side is fixed.
      if (xd[i] < mid - 0.01 * (hi - lo)) {
        EXPECT_EQ(d[i], low_level) << xd[i];
      }
      if (xd[i] > mid + 0.01 * (hi - lo)) {
        EXPECT_EQ(d[i], high_level) << xd[i];
      }
    }
  }
}

TEST(QuantizerTest, KeyGroupIsPerChannelAndValueTokenPerChannelGroup) {
  std::mt19937 rng(5);
  const int g = 32, d = 64, bits = 2;
  // Channel c has its own scale: per-channel quantization must keep each channel's error small.
  std::vector<Half> keys(g * d);
  for (int t = 0; t < g; ++t) {
    for (int c = 0; c < d; ++c) keys[t * d + c] = FloatToHalf(std::normal_distribution<float>(0, 1)(rng) * (c + 1));
  }
  std::vector<uint32_t> codes(d * WordsPerGroup(g, bits));
  std::vector<Half> scale(d), zero(d);
  QuantizeKeyGroup(keys.data(), g, d, bits, codes.data(), scale.data(), zero.data());
  std::vector<float> out(g * d);
  DequantizeKeyGroup(codes.data(), scale.data(), zero.data(), g, d, bits, out.data());
  for (int c = 0; c < d; ++c) {
    std::vector<double> column(g);
    for (int t = 0; t < g; ++t) column[t] = HalfToFloat(keys[t * d + c]);
    const std::vector<double> ref = RefQuantizeDequantize(column, bits);
    for (int t = 0; t < g; ++t) EXPECT_NEAR(out[t * d + c], ref[t], 1e-5 * (c + 1)) << c << "," << t;
  }
  // Value token: groups of G channels.
  std::vector<uint32_t> vcodes((d / g) * WordsPerGroup(g, bits));
  std::vector<Half> vscale(d / g), vzero(d / g);
  QuantizeValueToken(keys.data(), d, g, bits, vcodes.data(), vscale.data(), vzero.data());
  std::vector<float> vout(d);
  DequantizeValueToken(vcodes.data(), vscale.data(), vzero.data(), d, g, bits, vout.data());
  for (int grp = 0; grp < d / g; ++grp) {
    std::vector<double> run(g);
    for (int i = 0; i < g; ++i) run[i] = HalfToFloat(keys[grp * g + i]);
    const std::vector<double> ref = RefQuantizeDequantize(run, bits);
    for (int i = 0; i < g; ++i) EXPECT_NEAR(vout[grp * g + i], ref[i], 1e-4 * (1 + std::fabs(ref[i])));
  }
}

}  // namespace
}  // namespace specache
