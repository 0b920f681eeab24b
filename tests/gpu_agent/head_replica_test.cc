#include "specache/head_replica.h"

#include <random>

#include <gtest/gtest.h>

#include "specache/quantizer.h"
#include "testing/reference.h"

namespace specache {
namespace {

constexpr int kDim = 64;
constexpr int kGroup = 32;
constexpr int kResidual = 64;

ReplicaParams Params(int key_bits = 1, int value_bits = 1) {
  return {kDim, key_bits, value_bits, kGroup, kResidual};
}

class FlushBoundaryTest : public ::testing::TestWithParam<int> {};

// After n tokens: floor(n/R)*R keys quantized, n mod R in the residual, max(0, n-R) values quantized.
TEST_P(FlushBoundaryTest, CountsFollowTheStreamingRules) {
  const int n = GetParam();
  std::mt19937 rng(n);
  const auto k = testing::RandomHalves(static_cast<size_t>(n) * kDim, rng);
  const auto v = testing::RandomHalves(static_cast<size_t>(n) * kDim, rng);
  HeadReplica bulk(Params());
  bulk.Append(k.data(), v.data(), n);
  EXPECT_EQ(bulk.length(), n);
  EXPECT_EQ(bulk.quantized_keys(), n / kResidual * kResidual);
  EXPECT_EQ(bulk.residual_keys(), n % kResidual);
  EXPECT_EQ(bulk.quantized_values(), std::max(0, n - kResidual));
  EXPECT_EQ(bulk.window_values(), std::min(n, kResidual));

  // Prefill of n tokens == n single-token appends, bit for bit.
  HeadReplica streamed(Params());
  for (int t = 0; t < n; ++t) streamed.Append(k.data() + t * kDim, v.data() + t * kDim, 1);
  std::vector<float> a, b;
  bulk.DequantizeKeys(n, &a);
  streamed.DequantizeKeys(n, &b);
  EXPECT_EQ(a, b);
  bulk.DequantizeValues(n, &a);
  streamed.DequantizeValues(n, &b);
  EXPECT_EQ(a, b);
  EXPECT_EQ(bulk.device_bytes(), streamed.device_bytes());

  // Residual keys and window values are the exact fp16 inputs.
  bulk.DequantizeKeys(n, &a);
  for (int t = bulk.quantized_keys(); t < n; ++t) {
    for (int c = 0; c < kDim; ++c) ASSERT_EQ(a[t * kDim + c], HalfToFloat(k[t * kDim + c]));
  }
  bulk.DequantizeValues(n, &a);
  for (int t = bulk.quantized_values(); t < n; ++t) {
    for (int c = 0; c < kDim; ++c) ASSERT_EQ(a[t * kDim + c], HalfToFloat(v[t * kDim + c]));
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, FlushBoundaryTest,
                         ::testing::Values(1, 5, kGroup, kResidual - 1, kResidual, kResidual + 1, 3 * kGroup,
                                           2 * kResidual - 1, 2 * kResidual, 2 * kResidual + 1, 10 * kGroup + 7));

// Quantized keys are the per-channel quantization of exactly their own G tokens.
TEST(HeadReplicaTest, QuantizedKeysAndValuesMatchFloat64Reference) {
  std::mt19937 rng(42);
  const int n = 3 * kResidual + 10;
  const auto k = testing::RandomHalves(static_cast<size_t>(n) * kDim, rng);
  const auto v = testing::RandomHalves(static_cast<size_t>(n) * kDim, rng);
  for (int bits : {1, 2, 4}) {
    HeadReplica r(Params(bits, bits));
    r.Append(k.data(), v.data(), n);
    std::vector<float> keys, values;
    r.DequantizeKeys(n, &keys);
    r.DequantizeValues(n, &values);
    int mismatches = 0;
    for (int g = 0; g < r.quantized_keys() / kGroup; ++g) {
      for (int c = 0; c < kDim; ++c) {
        std::vector<double> run(kGroup);
        for (int t = 0; t < kGroup; ++t) run[t] = HalfToFloat(k[(g * kGroup + t) * kDim + c]);
        const auto ref = testing::RefQuantizeDequantize(run, bits);
        for (int t = 0; t < kGroup; ++t) mismatches += std::fabs(keys[(g * kGroup + t) * kDim + c] - ref[t]) > 1e-5;
      }
    }
    for (int t = 0; t < r.quantized_values(); ++t) {
      for (int g = 0; g < kDim / kGroup; ++g) {
        std::vector<double> run(kGroup);
        for (int i = 0; i < kGroup; ++i) run[i] = HalfToFloat(v[t * kDim + g * kGroup + i]);
        const auto ref = testing::RefQuantizeDequantize(run, bits);
        for (int i = 0; i < kGroup; ++i) mismatches += std::fabs(values[t * kDim + g * kGroup + i] - ref[i]) > 1e-5;
      }
    }
    EXPECT_LE(mismatches, 3) << "bits " << bits;  // only rounding-boundary elements may differ
  }
}

TEST(HeadReplicaTest, SixteenBitPassThroughIsExact) {
  std::mt19937 rng(1);
  const int n = 2 * kResidual + 33;
  const auto k = testing::RandomHalves(static_cast<size_t>(n) * kDim, rng);
  const auto v = testing::RandomHalves(static_cast<size_t>(n) * kDim, rng);
  HeadReplica r(Params(16, 16));
  r.Append(k.data(), v.data(), n);
  std::vector<float> keys, values;
  r.DequantizeKeys(n, &keys);
  r.DequantizeValues(n, &values);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_EQ(keys[i], HalfToFloat(k[i]));
    ASSERT_EQ(values[i], HalfToFloat(v[i]));
  }
  EXPECT_EQ(r.device_bytes(), int64_t{n} * kDim * 2 * 2);
}

// 1 bit, G = 32: 1 code bit + 2 x 16 bits of (s, z) per 32 elements = 2 bits per element.
TEST(HeadReplicaTest, DeviceBytesCountCodesScalesResidualAndWindow) {
  std::mt19937 rng(9);
  const int n = 4 * kResidual + 5;
  const auto k = testing::RandomHalves(static_cast<size_t>(n) * kDim, rng);
  HeadReplica r(Params(1, 1));
  r.Append(k.data(), k.data(), n);
  const int64_t qk = r.quantized_keys(), qv = r.quantized_values();
  const int64_t expected = qk * kDim / 8 + qk / kGroup * kDim * 4       // key codes + (s, z) per channel
                           + qv * kDim / 8 + qv * (kDim / kGroup) * 4  // value codes + (s, z) per group
                           + (n - qk) * kDim * 2 + (n - qv) * kDim * 2;  // residual + window in fp16
  EXPECT_EQ(r.device_bytes(), expected);
}

}  // namespace
}  // namespace specache
