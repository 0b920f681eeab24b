// KvConfig::round_host_rows: a full-precision row rounded to the values an 8-bit host copy would
// hold (kv_config.h, HostRowRounding, says the formats). The CPU agent rounds each row it writes
// to the source with RoundHostRow.
#pragma once

#include <cstdint>

#include "specache/half.h"
#include "specache/kv_config.h"

namespace specache {

// The largest magnitude E4M3 and int4 codes represent: a half-row's absolute maximum maps to it.
constexpr float kE4m3Largest = 448.0f;
constexpr float kInt4Largest = 7.0f;
constexpr int kInt4Group = 16;  // kInt4G16's values a scale

// x (finite, |x| <= 448) rounded to the nearest E4M3 value, ties to even: normal values
// 2^e x (1 + m/8) for e in [-6, 8], subnormals m x 2^-9; |x| above 448 saturates to 448.
float RoundToE4m3(float x);

// `n` fp16 values rounded in place with one scale. kInt8: what a stored int8 row reads back
// (host_rows.h, RoundTripInt8Half: one definition of the format; a half with a non-finite value
// reads back all NaN). kE4m3 and kInt4: the scale is the values' largest finite magnitude over
// the format's largest (448, 7), rounded to fp16, and each value becomes its code x scale, the
// code RoundToE4m3(value / scale) or value / scale rounded half away from zero to an integer in
// [-7, 7]; all zeros (or a scale that rounds to 0) stay zeros, and a non-finite value is left as
// it is. kInt4G16: kInt4 on each group of 16 values. kNone: unchanged.
void RoundHalfRow(HostRowRounding rounding, Half* values, int n);

// One source row, [2][head_dim] (key, then value): each half rounded with its own scale.
inline void RoundHostRow(HostRowRounding rounding, Half* row, int head_dim) {
  RoundHalfRow(rounding, row, head_dim);
  RoundHalfRow(rounding, row + head_dim, head_dim);
}

}  // namespace specache
