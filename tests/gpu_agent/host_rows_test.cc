// Stored host rows (host_rows.h): the int8 format's bytes against a reference written from its
// definition, on random rows; decoding in place; the edge values.
#include "specache/host_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/in_memory_source.h"
#include "specache/kv_config.h"

namespace specache {
namespace {

// Random [n][2][d] rows whose halves differ in scale by up to ~1000x, some halves all zero, and
// the format's corners: subnormal halves whose scale rounds down so far that codes clamp at 127
// (largest 1079 x 2^-24), halves whose scale rounds to 0 (largest <= 63 x 2^-24), and a scale of
// exactly 1 with quotients on .5 (rounded away from zero).
std::vector<Half> RandomRows(int64_t n, int d, std::mt19937& rng) {
  std::vector<Half> rows(static_cast<size_t>(n) * 2 * d);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 3.0f);
  const auto sign = [&rng](Half h) { return static_cast<Half>(h | (rng() % 2 ? 0x8000 : 0)); };
  for (int64_t half = 0; half < 2 * n; ++half) {
    Half* v = rows.data() + half * d;
    if (half % 11 == 4) {
      for (int i = 0; i < d; ++i) v[i] = sign(static_cast<Half>(rng() % 0x0438));
      v[rng() % d] = sign(0x0437);
    } else if (half % 13 == 5) {
      for (int i = 0; i < d; ++i) v[i] = sign(static_cast<Half>(rng() % 64));
    } else if (half % 17 == 6) {
      for (int i = 0; i < d; ++i) v[i] = FloatToHalf((rng() % 2 ? 1.0f : -1.0f) * (0.5f + static_cast<float>(rng() % 126)));
      v[rng() % d] = FloatToHalf(127.0f);
    } else {
      const float scale = half % 7 == 3 ? 0.0f : std::pow(10.0f, log_scale(rng));
      for (int i = 0; i < d; ++i) v[i] = FloatToHalf(scale * normal(rng));
    }
  }
  return rows;
}

// The format by its definition, one half: scale = fp16(largest / 127); code = clamp(round(x / scale)).
struct RefHalf {
  std::vector<int8_t> codes;
  Half scale;
};
RefHalf ReferenceHalf(const Half* x, int d) {
  float largest = 0;
  for (int i = 0; i < d; ++i) largest = std::max(largest, std::fabs(HalfToFloat(x[i])));
  RefHalf out{std::vector<int8_t>(d, 0), FloatToHalf(largest / 127.0f)};
  const float scale = HalfToFloat(out.scale);
  if (scale == 0) return out;
  for (int i = 0; i < d; ++i) {
    const float q = HalfToFloat(x[i]) / scale;  // a float quotient, as the format defines the code
    out.codes[i] = static_cast<int8_t>(std::clamp(std::round(q), -127.0f, 127.0f));
  }
  return out;
}

TEST(HostRowsTest, Int8RowsAreTheirHalvesCodesThenScalesThenZeros) {
  std::mt19937 rng(17);
  for (int d : {64, 128, 256}) {
    const int64_t n = 37, row_bytes = HostRowBytes(HostRowFormat::kInt8, d);
    ASSERT_EQ(row_bytes, 2 * d + 16);
    ASSERT_EQ(row_bytes % 16, 0);
    const std::vector<Half> rows = RandomRows(n, d, rng);
    std::vector<uint8_t> stored(static_cast<size_t>(n * row_bytes), 0xAB);
    EncodeHostRows(HostRowFormat::kInt8, rows.data(), n, d, stored.data());
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* at = stored.data() + r * row_bytes;
      for (int half = 0; half < 2; ++half) {
        const RefHalf ref = ReferenceHalf(rows.data() + (2 * r + half) * d, d);
        Half scale;
        std::memcpy(&scale, at + 2 * d + 2 * half, sizeof scale);
        ASSERT_EQ(scale, ref.scale) << "d " << d << " row " << r << " half " << half;
        for (int i = 0; i < d; ++i) {
          ASSERT_EQ(static_cast<int8_t>(at[half * d + i]), ref.codes[i]) << "row " << r << " half " << half << " i " << i;
        }
      }
      for (int b = 2 * d + 4; b < row_bytes; ++b) ASSERT_EQ(at[b], 0) << "tail byte " << b;
    }
    // Decoding gives code x scale, rounded to fp16, within half a step of the input.
    std::vector<Half> back(rows.size());
    DecodeHostRows(HostRowFormat::kInt8, stored.data(), n, d, back.data());
    for (int64_t r = 0; r < n; ++r) {
      const uint8_t* at = stored.data() + r * row_bytes;
      for (int half = 0; half < 2; ++half) {
        Half scale_bits;
        std::memcpy(&scale_bits, at + 2 * d + 2 * half, sizeof scale_bits);
        const float scale = HalfToFloat(scale_bits);
        for (int i = 0; i < d; ++i) {
          const size_t k = static_cast<size_t>((2 * r + half) * d + i);
          const int code = static_cast<int8_t>(at[half * d + i]);
          ASSERT_EQ(back[k], FloatToHalf(code * scale));
          const float x = HalfToFloat(rows[k]), y = HalfToFloat(back[k]);
          // (A clamped code, or a scale that rounded to 0, is further off, by the format's definition.)
          if (std::abs(code) < 127 && scale > 0) {
            ASSERT_LE(std::fabs(x - y), 0.5f * scale * 1.01f + std::fabs(y) * std::ldexp(1.0f, -11)) << x << " -> " << y;
          }
        }
      }
    }
  }
}

TEST(HostRowsTest, Fp16RowsAreStoredAsTheyAre) {
  std::mt19937 rng(2);
  const int d = 64;
  const std::vector<Half> rows = RandomRows(9, d, rng);
  std::vector<uint8_t> stored(9 * HostRowBytes(HostRowFormat::kFp16, d));
  EncodeHostRows(HostRowFormat::kFp16, rows.data(), 9, d, stored.data());
  EXPECT_EQ(std::memcmp(stored.data(), rows.data(), stored.size()), 0);
  std::vector<Half> back(rows.size());
  DecodeHostRows(HostRowFormat::kFp16, stored.data(), 9, d, back.data());
  EXPECT_EQ(back, rows);
}

// A read lands n stored rows at the front of the fp16 rows' buffer (a remote read): decoding in
// place gives what decoding into another buffer gives.
TEST(HostRowsTest, DecodingInPlaceEqualsDecodingApart) {
  std::mt19937 rng(5);
  for (int d : {64, 128}) {
    for (int64_t n : {1, 2, 31}) {
      const std::vector<Half> rows = RandomRows(n, d, rng);
      std::vector<uint8_t> stored(static_cast<size_t>(n * HostRowBytes(HostRowFormat::kInt8, d)));
      EncodeHostRows(HostRowFormat::kInt8, rows.data(), n, d, stored.data());
      std::vector<Half> apart(rows.size()), in_place(rows.size());
      DecodeHostRows(HostRowFormat::kInt8, stored.data(), n, d, apart.data());
      std::memcpy(in_place.data(), stored.data(), stored.size());
      DecodeHostRows(HostRowFormat::kInt8, reinterpret_cast<const uint8_t*>(in_place.data()), n, d, in_place.data());
      ASSERT_EQ(in_place, apart) << "d " << d << " n " << n;
    }
  }
}

TEST(HostRowsTest, EdgeValues) {
  const int d = 64;
  auto round_trip = [&](std::vector<Half> row) {
    std::vector<uint8_t> stored(HostRowBytes(HostRowFormat::kInt8, d));
    EncodeHostRows(HostRowFormat::kInt8, row.data(), 1, d, stored.data());
    DecodeHostRows(HostRowFormat::kInt8, stored.data(), 1, d, row.data());
    return row;
  };
  // Zeros, and a half so small its scale rounds to 0: zeros back. The other half is untouched by it.
  std::vector<Half> row(2 * d, FloatToHalf(0.0f));
  row[d] = FloatToHalf(1e-7f);  // fp16's smallest subnormal is ~6e-8: 1e-7 / 127 rounds to 0
  row[d + 1] = FloatToHalf(-1e-7f);
  for (Half h : round_trip(row)) EXPECT_EQ(HalfToFloat(h), 0.0f);
  // fp16's largest magnitude: the scale rounds up, and 127 x scale saturates to 65504, not inf.
  row.assign(2 * d, FloatToHalf(1.0f));
  row[0] = FloatToHalf(65504.0f);
  row[1] = FloatToHalf(-65504.0f);
  std::vector<Half> back = round_trip(row);
  EXPECT_EQ(HalfToFloat(back[0]), 65504.0f);
  EXPECT_EQ(HalfToFloat(back[1]), -65504.0f);
  // A non-finite value poisons its half (all NaN), never the other half.
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    row.assign(2 * d, FloatToHalf(0.25f));
    row[d + 5] = FloatToHalf(bad);
    back = round_trip(row);
    for (int i = 0; i < d; ++i) ASSERT_EQ(HalfToFloat(back[i]), 0.25f);
    for (int i = d; i < 2 * d; ++i) ASSERT_TRUE(std::isnan(HalfToFloat(back[i]))) << bad;
  }
}

// A format outside the enum, or int8 rows that would not be whole 16-byte vectors, are refused by
// the config's validation and by a source, before any row is written.
TEST(HostRowsTest, LayoutsTheFormatCannotServeAreRefused) {
  EXPECT_TRUE(CheckHostRowFormat(HostRowFormat::kInt8, 64).ok());
  EXPECT_EQ(CheckHostRowFormat(HostRowFormat::kInt8, 12).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckHostRowFormat(HostRowFormat::kFp16, 12).ok());
  EXPECT_EQ(CheckHostRowFormat(static_cast<HostRowFormat>(7), 64).code(), StatusCode::kInvalidArgument);
  InMemorySource source;
  EXPECT_EQ(source.CreateSequence(1, {1, 1, 12, HostRowFormat::kInt8}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(source.CreateSequence(1, {1, 1, 64, static_cast<HostRowFormat>(7)}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(source.CreateSequence(1, {1, 1, 64, HostRowFormat::kInt8}).ok());
  KvConfig c;
  c.host_row_format = static_cast<HostRowFormat>(7);
  EXPECT_EQ(ValidateKvConfig(c, {2, 4, 2, 64}).code(), StatusCode::kInvalidArgument);
}

TEST(HostRowsTest, NamesRoundTripAndUnknownOnesAreRefused) {
  for (HostRowFormat f : {HostRowFormat::kFp16, HostRowFormat::kInt8}) EXPECT_EQ(*ParseHostRowFormat(HostRowFormatName(f)), f);
  const auto bad = ParseHostRowFormat("int4");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fp16 or int8"), std::string::npos);
  EXPECT_EQ(HostRowFormatNameOrNumber(1), "int8");
  EXPECT_EQ(HostRowFormatNameOrNumber(7), "7");
}

}  // namespace
}  // namespace specache
