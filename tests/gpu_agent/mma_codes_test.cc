// The mma layout's placement functions (gpu_agent/src/cuda/mma_codes.h) on the host: every code
// bit of a group has its own place among the lanes' words, every scale and zero its own slot, and
// the places are the ones the layout's comment and the lean path's reads assume. Runs without a
// GPU (the device round trip is CudaReplicaTest.MmaCodesHoldTheCpuReplicasCodes).
#include <gtest/gtest.h>

#include <set>
#include <tuple>
#include <vector>

#include "cuda/mma_codes.h"
#ifdef SPECACHE_TEST_HAVE_CUDA
#include "specache/cuda_replica.h"
#endif

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

#ifdef SPECACHE_TEST_HAVE_CUDA
// One replica block on the host and a view of replicas of `p` whose only block it is, for the
// kernels' accessors (whose pointers then lie in `bytes`).
struct HostBlock {
  HostBlock(const ReplicaParams& p, const cuda::ReplicaBlockLayout& l) : bytes(l.bytes), table{bytes.data()} {
    view.head_dim = p.head_dim, view.group_size = p.group_size, view.key_bits = p.key_bits, view.value_bits = p.value_bits;
    view.layout = l;
    view.blocks = table;
  }
  HostBlock(const HostBlock&) = delete;
  std::vector<uint8_t> bytes;
  const uint8_t* table[1];
  cuda::DeviceReplicaView view;
};

// Every byte a block's parts cover, through the kernels' accessors (on a host block): each byte
// of the block in at most one part, and in one exactly when `whole` (no padding between parts).
void ExpectPartsTileTheBlock(const ReplicaParams& p, const cuda::ReplicaBlockLayout& l, bool whole) {
  const HostBlock host(p, l);
  const std::vector<uint8_t>& block = host.bytes;
  const cuda::DeviceReplicaView& v = host.view;
  std::vector<int> covered(l.bytes, 0);
  auto mark = [&](const void* at, int64_t bytes) {
    const int64_t from = static_cast<const uint8_t*>(at) - block.data();
    ASSERT_GE(from, 0);
    ASSERT_LE(from + bytes, l.bytes);
    for (int64_t i = from; i < from + bytes; ++i) ++covered[i];
  };
  const int d = p.head_dim, G = p.group_size;
  for (int g = 0; g < l.block_tokens / G; ++g) {
    mark(cuda::KeyCodes(v, g), int64_t{d} * G * p.key_bits / 8);
    mark(cuda::KeyScales(v, g), 2 * d);
    mark(cuda::KeyZeros(v, g), 2 * d);
  }
  for (int t = 0; t < l.block_tokens; ++t) {
    mark(cuda::ValueCodes(v, t), int64_t{d} * p.value_bits / 8);
    mark(cuda::ValueScales(v, t), 2 * (d / G));
    mark(cuda::ValueZeros(v, t), 2 * (d / G));
  }
  for (int64_t i = 0; i < l.bytes; ++i) {
    ASSERT_LE(covered[i], 1) << "byte " << i << " of a block in two parts";
    if (whole) {
      ASSERT_EQ(covered[i], 1) << "byte " << i << " of a block in no part";
    }
  }
}

// Replicas with mma codes keep each 32-token group's parts together, in the order the lean path
// stages them (key codes, key scales, key zeros, value codes, value scales, value zeros), in
// blocks as large as the other layout's (one pool serves both).
TEST(MmaCodesLayoutTest, BlocksInterleavedByGroupHoldEachGroupAsOnePiece) {
  for (int d : {64, 128}) {
    for (int R : {32, 64, 128, 96}) {
      const ReplicaParams p{d, 1, 1, 32, R};
      const cuda::ReplicaBlockLayout natural = cuda::MakeReplicaBlockLayout(p);
      const cuda::ReplicaBlockLayout l = cuda::MakeReplicaBlockLayout(p, true);
      SCOPED_TRACE("d=" + std::to_string(d) + " R=" + std::to_string(R));
      EXPECT_EQ(natural.group_bytes, 0);
      EXPECT_EQ(l.group_bytes, cuda::MmaGroupBytes(d));
      EXPECT_EQ(l.bytes, natural.bytes);
      EXPECT_EQ(l.block_tokens, natural.block_tokens);
      ExpectPartsTileTheBlock(p, l, l.bytes == l.block_tokens / 32 * l.group_bytes);
      ExpectPartsTileTheBlock(p, natural, false);
      const HostBlock host(p, l);
      const cuda::DeviceReplicaView& v = host.view;
      for (int g = 0; g < l.block_tokens / 32; ++g) {
        const uint8_t* group = host.bytes.data() + int64_t{g} * l.group_bytes;
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::KeyCodes(v, g)), group);
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::KeyScales(v, g)), group + 4 * d);
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::KeyZeros(v, g)), group + 6 * d);
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::ValueCodes(v, 32 * g)), group + 8 * d);
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::ValueScales(v, 32 * g)), group + 12 * d);
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::ValueZeros(v, 32 * g)), group + 14 * d);
        // Token 32 g + 31's value parts: the last rows of the group's value parts.
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::ValueCodes(v, 32 * g + 31)), group + 8 * d + 31 * (d / 8));
        EXPECT_EQ(reinterpret_cast<const uint8_t*>(cuda::ValueZeros(v, 32 * g + 31)), group + 14 * d + 31 * (d / 16));
      }
    }
  }
  // Only packed keys and values with G = 32 interleave.
  EXPECT_EQ(cuda::MakeReplicaBlockLayout({128, 16, 1, 32, 64}, true).group_bytes, 0);
  EXPECT_EQ(cuda::MakeReplicaBlockLayout({128, 1, 1, 64, 128}, true).group_bytes, 0);
  EXPECT_EQ(cuda::MakeReplicaBlockLayout({128, 2, 2, 32, 64}, true).group_bytes, 2 * cuda::MmaGroupBytes(128) - 8 * 128);
}
#endif

}  // namespace
}  // namespace specache
