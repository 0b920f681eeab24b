// KvConfig::round_host_rows: a full-precision row rounded to the values an 8-bit host copy would
// hold (kv_config.h, HostRowRounding, says the formats). The CPU agent rounds each row it writes
// to the source with RoundHostRow.
#pragma once

#include <cstdint>

#include "specache/half.h"
#include "specache/kv_config.h"

namespace specache {

// The largest magnitude each format represents: a half-row's absolute maximum maps to it.
constexpr float kInt8Largest = 127.0f;
constexpr float kE4m3Largest = 448.0f;

// x (finite, |x| <= 448) rounded to the nearest E4M3 value, ties to even: normal values
// 2^e x (1 + m/8) for e in [-6, 8], subnormals m x 2^-9; |x| above 448 saturates to 448.
float RoundToE4m3(float x);

// `n` fp16 values rounded in place with one scale: their absolute maximum over the format's largest
// value, rounded to fp16 (the stored scale), and each value as code x scale, where the code is the
// value over the scale rounded to the format (kInt8: an integer in [-127, 127], round half away
// from zero; kE4m3: RoundToE4m3). All zeros (or a scale that rounds to 0) stay zeros; a non-finite
// value is left as it is (nothing an 8-bit format could store for it). kNone: unchanged.
void RoundHalfRow(HostRowRounding rounding, Half* values, int n);

// One source row, [2][head_dim] (key, then value): each half rounded with its own scale.
inline void RoundHostRow(HostRowRounding rounding, Half* row, int head_dim) {
  RoundHalfRow(rounding, row, head_dim);
  RoundHalfRow(rounding, row + head_dim, head_dim);
}

}  // namespace specache
