// The mma layout's placement functions (gpu_agent/src/cuda/mma_codes.h) on the host: every code
// bit of a group has its own place among the lanes' words, every scale and zero its own slot, and
// the places are the ones the layout's comment and the lean path's reads assume. Runs without a
// GPU (the device round trip is CudaReplicaTest.MmaCodesHoldTheCpuReplicasCodes).
#include <gtest/gtest.h>

#include <set>
#include <tuple>
#include <vector>

#include "cuda/mma_codes.h"

namespace specache {
namespace {

TEST(MmaCodesLayoutTest, EveryBitOfAGroupHasItsOwnPlace) {
  for (int d : {64, 128}) {
    const int words = d / 32;  // per lane, of the keys and of the values
    std::set<std::tuple<int, int, int>> keys, values;
    for (int token = 0; token < 32; ++token) {
      for (int channel = 0; channel < d; ++channel) {
        const cuda::MmaBitPlace k = cuda::MmaKeyBit(d, token, channel), v = cuda::MmaValueBit(d, token, channel);
        for (const cuda::MmaBitPlace& p : {k, v}) {
          ASSERT_GE(p.lane, 0);
          ASSERT_LT(p.lane, 32);
          ASSERT_GE(p.word, 0);
          ASSERT_LT(p.word, words);
          ASSERT_GE(p.bit, 0);
          ASSERT_LT(p.bit, 32);
        }
        keys.insert({k.lane, k.word, k.bit});
        values.insert({v.lane, v.word, v.bit});
        // A key bit's lane holds its token's n-tile row (g = token % 8) and its channel pair
        // (t); a value bit's, its channel's row and its token pair.
        EXPECT_EQ(k.lane, 4 * (token % 8) + (channel % 8) / 2) << "d=" << d;
        EXPECT_EQ(v.lane, 4 * (channel % 8) + (token % 8) / 2) << "d=" << d;
        // Bit 16 + i holds the pair's second element: the operand register's high half.
        EXPECT_EQ(k.bit >= 16, channel % 2 == 1);
        EXPECT_EQ(v.bit >= 16, token % 2 == 1);
        // Within a half, the 4-bit group is the operand and the bit in it the n-tile (keys) or
        // the m-tile mod 4 (values): what GroupAt10 and BitOperand take apart.
        EXPECT_EQ(k.bit % 16 % 4, token / 8);
        EXPECT_EQ(v.bit % 16 % 4, channel / 16 % 4);
      }
    }
    EXPECT_EQ(keys.size(), size_t(32) * d) << "d=" << d;
    EXPECT_EQ(values.size(), size_t(32) * d) << "d=" << d;
  }
}

TEST(MmaCodesLayoutTest, ScalesAndZerosArePermutations) {
  for (int d : {64, 128}) {
    std::vector<int> key(d, 0), value(d, 0), zero(d, 0);
    for (int i = 0; i < d; ++i) {
      ++key.at(cuda::MmaKeyScaleAt(d, i));
      ++value.at(cuda::MmaValueScaleAt(d, i));
      ++zero.at(cuda::MmaValueZeroAt(d, i));
    }
    EXPECT_EQ(key, std::vector<int>(d, 1)) << "d=" << d;
    EXPECT_EQ(value, std::vector<int>(d, 1)) << "d=" << d;
    EXPECT_EQ(zero, std::vector<int>(d, 1)) << "d=" << d;
    // The pairs a lane loads: key channels 16 ks + 8 kh + 2t, +1 at word t 2KS + 2 ks + kh.
    const int ks_count = d / 16;
    for (int t = 0; t < 4; ++t)
      for (int ks = 0; ks < ks_count; ++ks)
        for (int kh = 0; kh < 2; ++kh) {
          const int channel = 16 * ks + 8 * kh + 2 * t;
          EXPECT_EQ(cuda::MmaKeyScaleAt(d, channel), 2 * (t * 2 * ks_count + 2 * ks + kh));
          EXPECT_EQ(cuda::MmaKeyScaleAt(d, channel + 1), 2 * (t * 2 * ks_count + 2 * ks + kh) + 1);
        }
  }
}

TEST(MmaCodesLayoutTest, BitWeightsAreTheFp16ValuesOfBitsTenToThirteen) {
  for (int i = 0; i < 4; ++i) {
    const Half bit = static_cast<Half>(0x0400u << i);  // bit 10 + i of a half, alone
    EXPECT_EQ(HalfToFloat(bit), cuda::MmaBitWeight(i)) << i;
    EXPECT_EQ(cuda::MmaBitWeight(i) * cuda::MmaBitUnweight(i), 1.0f) << i;
  }
  EXPECT_TRUE(cuda::MmaCodesEligible({128, 1, 1, 32, 64}));
  EXPECT_TRUE(cuda::MmaCodesEligible({64, 1, 1, 32, 64}));
  EXPECT_FALSE(cuda::MmaCodesEligible({128, 2, 2, 32, 64}));
  EXPECT_FALSE(cuda::MmaCodesEligible({128, 1, 1, 64, 128}));
  EXPECT_FALSE(cuda::MmaCodesEligible({96, 1, 1, 32, 64}));
}

}  // namespace
}  // namespace specache
