// KvConfig::round_host_rows: the 8-bit formats' rounding (host_row_rounding.h) against brute-force
// references, and the CPU agent writing rounded rows to its source.
#include "host_row_rounding.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/agent.h"
#include "specache/in_memory_source.h"
#include "testing/reference.h"

namespace specache {
namespace {

// Every finite non-negative E4M3 value with its mantissa field, by the format's definition:
// exponent field 0 holds subnormals m/8 x 2^-6, fields 1..15 hold (1 + m/8) x 2^(field - 7), and
// field 15 with m = 7 is NaN.
struct E4m3Value {
  float value;
  int mantissa;
};
std::vector<E4m3Value> E4m3Values() {
  std::vector<E4m3Value> out;
  for (int field = 0; field < 16; ++field) {
    for (int m = 0; m < 8; ++m) {
      if (field == 15 && m == 7) continue;
      const float v = field == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, field - 7);
      out.push_back({v, m});
    }
  }
  return out;
}

// The nearest value, a tie going to the even mantissa; beyond the largest, the largest.
float NearestE4m3(float x, const std::vector<E4m3Value>& values) {
  const float a = std::fabs(x);
  const E4m3Value* best = &values.front();
  for (const E4m3Value& v : values) {
    const float d = std::fabs(v.value - a), db = std::fabs(best->value - a);
    if (d < db || (d == db && v.mantissa % 2 == 0)) best = &v;
  }
  return std::copysign(best->value, x);
}

TEST(HostRowRoundingTest, E4m3IsTheNearestValueTiesToEven) {
  const std::vector<E4m3Value> values = E4m3Values();
  EXPECT_EQ(values.back().value, 448.0f);
  std::vector<float> xs = {0.0f, 1.0f, 1.0625f, 1.1875f, 3.3f, 447.0f, 448.0f, 460.0f, 1e4f, std::ldexp(1.0f, -9),
                           std::ldexp(0.5f, -9), std::ldexp(1.5f, -9), std::ldexp(0.4f, -9), std::ldexp(1.0f, -6)};
  for (const E4m3Value& v : values) {  // every value, and every midpoint between neighbours
    xs.push_back(v.value);
    xs.push_back(std::nextafter(v.value, 0.0f));
  }
  for (size_t i = 1; i < values.size(); ++i) xs.push_back((values[i - 1].value + values[i].value) / 2);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(exponent(rng)));
  for (float x : xs) {
    for (float signed_x : {x, -x}) {
      ASSERT_EQ(RoundToE4m3(signed_x), NearestE4m3(signed_x, values)) << signed_x;
    }
  }
  EXPECT_EQ(RoundToE4m3(1.0625f), 1.0f);     // a tie: to the even mantissa
  EXPECT_EQ(RoundToE4m3(1.1875f), 1.25f);    // a tie: to the even mantissa
  EXPECT_EQ(RoundToE4m3(1e4f), 448.0f);      // saturates
  EXPECT_TRUE(std::isnan(RoundToE4m3(std::numeric_limits<float>::quiet_NaN())));
}

// A [2][d] row whose key half is ~100x its value half: each half must get its own scale.
std::vector<Half> TwoScaleRow(int d, std::mt19937& rng) {
  std::vector<Half> row(2 * size_t(d));
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int i = 0; i < d; ++i) row[i] = FloatToHalf(40.0f * n(rng));
  for (int i = 0; i < d; ++i) row[d + i] = FloatToHalf(0.4f * n(rng));
  return row;
}

float LargestMagnitude(const Half* v, int n) {
  float m = 0;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(HalfToFloat(v[i])));
  return m;
}

TEST(HostRowRoundingTest, Int8GivesEachHalfItsOwnScaleAndIntegerCodes) {
  std::mt19937 rng(3);
  for (int d : {64, 128}) {
    for (int trial = 0; trial < 50; ++trial) {
      const std::vector<Half> row = TwoScaleRow(d, rng);
      std::vector<Half> rounded = row;
      RoundHostRow(HostRowRounding::kInt8, rounded.data(), d);
      for (int half = 0; half < 2; ++half) {
        const Half* in = row.data() + half * d;
        const Half* out = rounded.data() + half * d;
        const float scale = RoundToHalf(LargestMagnitude(in, d) / 127.0f);
        ASSERT_GT(scale, 0.0f);
        for (int i = 0; i < d; ++i) {
          const float x = HalfToFloat(in[i]), y = HalfToFloat(out[i]);
          const int code = static_cast<int>(std::clamp(std::round(x / scale), -127.0f, 127.0f));
          // The value is its integer code times the stored scale, rounded to fp16 (a code of 0 is +0).
          ASSERT_EQ(out[i], FloatToHalf(static_cast<float>(code) * scale)) << "d " << d << " half " << half;
          ASSERT_LE(std::fabs(x - y), 0.5f * scale + std::fabs(y) * std::ldexp(1.0f, -11)) << x << " -> " << y;
        }
      }
    }
  }
}

// int4 rounding: each half's values are integer multiples, in [-7, 7], of its fp16 scale
// (largest / 7), within half a step of the input.
TEST(HostRowRoundingTest, Int4GivesEachHalfItsOwnScaleAndCodesUpToSeven) {
  std::mt19937 rng(9);
  for (int d : {64, 128}) {
    for (int trial = 0; trial < 50; ++trial) {
      const std::vector<Half> row = TwoScaleRow(d, rng);
      std::vector<Half> rounded = row;
      RoundHostRow(HostRowRounding::kInt4, rounded.data(), d);
      for (int half = 0; half < 2; ++half) {
        const float scale = RoundToHalf(LargestMagnitude(row.data() + half * d, d) / 7.0f);
        ASSERT_GT(scale, 0.0f);
        for (int i = 0; i < d; ++i) {
          const float x = HalfToFloat(row[half * d + i]), y = HalfToFloat(rounded[half * d + i]);
          const float code = std::clamp(std::round(x / scale), -7.0f, 7.0f);
          ASSERT_EQ(rounded[half * d + i], FloatToHalf(code * scale)) << "d " << d << " half " << half;
          ASSERT_LE(std::fabs(x - y), 0.5f * scale * 1.01f + std::fabs(y) * std::ldexp(1.0f, -11)) << x << " -> " << y;
        }
      }
    }
  }
}

// int4-g16: each group of 16 values is int4-rounded with its own scale.
TEST(HostRowRoundingTest, Int4G16RoundsEachGroupOf16WithItsOwnScale) {
  std::mt19937 rng(13);
  const int d = 128;
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<Half> row = TwoScaleRow(d, rng);
    std::vector<Half> grouped = row, want = row;
    RoundHostRow(HostRowRounding::kInt4G16, grouped.data(), d);
    for (int at = 0; at < 2 * d; at += 16) RoundHalfRow(HostRowRounding::kInt4, want.data() + at, 16);
    ASSERT_EQ(grouped, want);
    for (int at = 0; at < 2 * d; at += 16) {  // a group's codes span its own largest value
      const float scale = RoundToHalf(LargestMagnitude(row.data() + at, 16) / 7.0f);
      for (int i = at; i < at + 16; ++i) {
        ASSERT_EQ(grouped[i], FloatToHalf(std::clamp(std::round(HalfToFloat(row[i]) / scale), -7.0f, 7.0f) * scale));
      }
    }
  }
}

TEST(HostRowRoundingTest, E4m3KeepsThreeMantissaBitsOfEachValue) {
  std::mt19937 rng(5);
  const int d = 128;
  for (int trial = 0; trial < 50; ++trial) {
    const std::vector<Half> row = TwoScaleRow(d, rng);
    std::vector<Half> rounded = row;
    RoundHostRow(HostRowRounding::kE4m3, rounded.data(), d);
    for (int half = 0; half < 2; ++half) {
      const float scale = RoundToHalf(LargestMagnitude(row.data() + half * d, d) / 448.0f);
      for (int i = 0; i < d; ++i) {
        const float x = HalfToFloat(row[half * d + i]), y = HalfToFloat(rounded[half * d + i]);
        ASSERT_EQ(rounded[half * d + i], FloatToHalf(RoundToE4m3(x / scale) * scale));
        // Normal codes (|x / scale| >= 2^-6) are within half a step of 3 mantissa bits.
        if (std::fabs(x / scale) >= std::ldexp(1.0f, -6)) {
          ASSERT_LE(std::fabs(x - y), std::fabs(x) * std::ldexp(1.0f, -4) * 1.01f) << x << " -> " << y;
        }
      }
    }
  }
}

TEST(HostRowRoundingTest, ZerosStayZerosAndNonFiniteValuesAsEachFormatKeepsThem) {
  for (HostRowRounding r : {HostRowRounding::kInt8, HostRowRounding::kE4m3}) {
    std::vector<Half> zeros(64, FloatToHalf(0.0f));
    RoundHalfRow(r, zeros.data(), 64);
    for (Half h : zeros) EXPECT_EQ(HalfToFloat(h), 0.0f);
    std::vector<Half> odd(64, FloatToHalf(1.5f));
    odd[3] = FloatToHalf(std::numeric_limits<float>::infinity());
    odd[9] = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
    odd[10] = FloatToHalf(-3.0f);
    RoundHalfRow(r, odd.data(), 64);
    if (r == HostRowRounding::kInt8) {
      // A stored int8 half has no code for them: the whole half reads back NaN (host_rows.h).
      for (Half h : odd) EXPECT_TRUE(std::isnan(HalfToFloat(h)));
      continue;
    }
    // E4M3 rounding leaves them as they are.
    EXPECT_TRUE(std::isinf(HalfToFloat(odd[3])));
    EXPECT_TRUE(std::isnan(HalfToFloat(odd[9])));
    EXPECT_EQ(HalfToFloat(odd[10]), -3.0f);  // the largest finite magnitude is exact
    EXPECT_NEAR(HalfToFloat(odd[0]), 1.5f, 1.5f / 16);
  }
  // fp16's largest value: its scale rounds up, and a code times it would pass 65504 (inf).
  for (HostRowRounding r : {HostRowRounding::kInt8, HostRowRounding::kE4m3}) {
    std::vector<Half> big(64, FloatToHalf(1.0f));
    big[0] = FloatToHalf(65504.0f);
    big[1] = FloatToHalf(-65504.0f);
    RoundHalfRow(r, big.data(), 64);
    EXPECT_EQ(HalfToFloat(big[0]), 65504.0f) << HostRowRoundingName(r);
    EXPECT_EQ(HalfToFloat(big[1]), -65504.0f) << HostRowRoundingName(r);
  }
  std::mt19937 rng(1);
  const std::vector<Half> row = TwoScaleRow(64, rng);
  std::vector<Half> same = row;
  RoundHostRow(HostRowRounding::kNone, same.data(), 64);
  EXPECT_EQ(same, row);
}

TEST(HostRowRoundingTest, NamesRoundTripAndUnknownOnesAreRefused) {
  for (HostRowRounding r : {HostRowRounding::kNone, HostRowRounding::kInt8, HostRowRounding::kE4m3, HostRowRounding::kInt4,
                            HostRowRounding::kInt4G16}) {
    EXPECT_EQ(*ParseHostRowRounding(HostRowRoundingName(r)), r);
  }
  const auto bad = ParseHostRowRounding("fp8");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("int8"), std::string::npos);
  KvConfig c;
  c.round_host_rows = HostRowRounding::kE4m3;
  EXPECT_NE(DescribeKvConfig(c).find("host-round=e4m3"), std::string::npos);
  c.host_row_format = HostRowFormat::kInt8;
  EXPECT_NE(DescribeKvConfig(c).find("host-rows=int8"), std::string::npos);
}

// The rows the CPU agent writes to its source, at prefill and for the real token of a decode
// step, are the inputs' fp16 rows rounded as configured, or stored as int8 rows: what every later
// fetch reads back. Stored int8 rows read back exactly int8 rounding's values, in 2 x head_dim + 16
// bytes a row.
TEST(HostRowRoundingTest, TheCpuAgentWritesRoundedOrEncodedRowsToItsSource) {
  const ModelShape shape{2, 4, 2, 64};
  const int d = shape.head_dim, n = 70;
  const size_t qw = size_t(shape.n_q_heads) * d, kw = size_t(shape.n_kv_heads) * d;
  struct Variant {
    HostRowRounding rounding;
    HostRowFormat format;
    HostRowRounding expect;  // the values read back
  };
  std::vector<std::vector<float>> outputs;  // each variant's decode outputs, in order
  for (const Variant variant : {Variant{HostRowRounding::kNone, HostRowFormat::kFp16, HostRowRounding::kNone},
                                Variant{HostRowRounding::kInt8, HostRowFormat::kFp16, HostRowRounding::kInt8},
                                Variant{HostRowRounding::kE4m3, HostRowFormat::kFp16, HostRowRounding::kE4m3},
                                Variant{HostRowRounding::kNone, HostRowFormat::kInt8, HostRowRounding::kInt8}}) {
    const HostRowRounding r = variant.expect;
    KvConfig c;
    c.top_k = 8;
    c.round_host_rows = variant.rounding;
    c.host_row_format = variant.format;
    InMemorySource source;
    auto agent = CreateCpuAgent(shape, c, &source);
    ASSERT_TRUE(agent.ok()) << agent.status().ToString();
    Agent& a = **agent;
    std::mt19937 rng(11);
    std::vector<float> q = testing::RandomFloats(n * qw, rng, 0.5f), k = testing::RandomFloats(n * kw, rng, 3.0f),
                       v = testing::RandomFloats(n * kw, rng), out(q.size());
    const SequenceId ids[] = {5};
    const int32_t offsets[] = {0, n};
    ASSERT_TRUE(a.AddSequence(5).ok());
    for (int l = 0; l < shape.n_layers; ++l) ASSERT_TRUE(a.PrefillLayer(l, {ids, offsets, q.data(), k.data(), v.data(), out.data()}).ok());
    // One step that appends nothing (pre-decode), one that appends its real row.
    std::vector<float> last_k, last_v;
    for (StepKind kind : {StepKind::kPreDecode, StepKind::kDecode}) {
      const int rows = a.RowsPerSequence(kind);
      ASSERT_TRUE(a.BeginStep(kind, ids).ok());
      for (int l = 0; l < shape.n_layers; ++l) {
        std::vector<float> sq = testing::RandomFloats(rows * qw, rng, 0.5f), sk = testing::RandomFloats(rows * kw, rng, 3.0f),
                           sv = testing::RandomFloats(rows * kw, rng), so(sq.size());
        ASSERT_TRUE(a.DecodeLayer(l, {sq.data(), sk.data(), sv.data(), so.data()}).ok());
        if (l == 0 && kind == StepKind::kPreDecode) outputs.emplace_back();
        outputs.back().insert(outputs.back().end(), so.begin(), so.end());
        ASSERT_TRUE(a.StartPrefetch(l).ok());
        ASSERT_TRUE(a.WaitPrefetch(l).ok());
        if (l == shape.n_layers - 1) last_k.assign(sk.begin(), sk.begin() + kw), last_v.assign(sv.begin(), sv.begin() + kw);
      }
      ASSERT_TRUE(a.EndStep().ok());
    }
    EXPECT_EQ(source.stored_bytes(), int64_t{n + 1} * shape.n_layers * shape.n_kv_heads * HostRowBytes(variant.format, d));
    const int layer = shape.n_layers - 1;
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      ASSERT_EQ(*source.Length(5, layer, h), n + 1);
      std::vector<int32_t> tokens(n + 1);
      for (int t = 0; t <= n; ++t) tokens[t] = t;
      std::vector<Half> stored(size_t(n + 1) * 2 * d);
      ASSERT_TRUE(source.ReadRows(5, layer, h, tokens.data(), n + 1, stored.data()).ok());
      for (int t = 0; t <= n; ++t) {
        const float* key = t < n ? k.data() + t * kw + h * d : last_k.data() + h * d;
        const float* value = t < n ? v.data() + t * kw + h * d : last_v.data() + h * d;
        std::vector<Half> expected(2 * size_t(d));
        for (int i = 0; i < d; ++i) expected[i] = FloatToHalf(key[i]), expected[d + i] = FloatToHalf(value[i]);
        RoundHostRow(r, expected.data(), d);
        const std::vector<Half> got(stored.begin() + size_t(t) * 2 * d, stored.begin() + size_t(t + 1) * 2 * d);
        ASSERT_EQ(got, expected) << HostRowRoundingName(variant.rounding) << " " << HostRowFormatName(variant.format)
                                 << " head " << h << " token " << t;
      }
    }
  }
  // The attention over fetched rows: int8 rounding and stored int8 rows compute the same outputs,
  // and not fp16 rows' outputs.
  ASSERT_EQ(outputs.size(), 4u);
  EXPECT_EQ(outputs[1], outputs[3]);
  EXPECT_NE(outputs[0], outputs[3]);
}

}  // namespace
}  // namespace specache
