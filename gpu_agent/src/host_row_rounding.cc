#include "host_row_rounding.h"

#include <algorithm>
#include <cmath>

#include "specache/host_rows.h"

namespace specache {

float RoundToE4m3(float x) {
  const float a = std::fabs(x);
  if (!(a > 0.0f)) return x;  // zeros (and NaN) as they are
  if (a >= kE4m3Largest) return std::copysign(kE4m3Largest, x);
  int e = 0;
  std::frexp(a, &e);  // a = f x 2^e, f in [0.5, 1): a's leading bit is 2^(e - 1)
  // Three fraction bits below the leading one; subnormals share the smallest normal's step.
  const float step = std::ldexp(1.0f, std::max(e - 1, -6) - 3);
  const float rounded = std::nearbyint(a / step) * step;  // the default rounding mode: ties to even
  return std::copysign(std::min(rounded, kE4m3Largest), x);
}

void RoundHalfRow(HostRowRounding rounding, Half* values, int n) {
  if (rounding == HostRowRounding::kNone || n <= 0) return;
  // One definition of int8 (host_rows.h): the values a stored int8 row reads back.
  if (rounding == HostRowRounding::kInt8) return RoundTripInt8Half(values, n);
  if (rounding == HostRowRounding::kInt4G16) {  // int4 on each group of 16 values
    for (int at = 0; at < n; at += kInt4Group) RoundHalfRow(HostRowRounding::kInt4, values + at, std::min(kInt4Group, n - at));
    return;
  }
  float largest = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float v = std::fabs(HalfToFloat(values[i]));
    if (std::isfinite(v)) largest = std::max(largest, v);
  }
  const bool e4m3 = rounding == HostRowRounding::kE4m3;
  const float scale = RoundToHalf(largest / (e4m3 ? kE4m3Largest : kInt4Largest));  // as stored
  if (!(scale > 0.0f)) {
    for (int i = 0; i < n; ++i) {
      if (std::isfinite(HalfToFloat(values[i]))) values[i] = FloatToHalf(0.0f);
    }
    return;
  }
  for (int i = 0; i < n; ++i) {
    const float v = HalfToFloat(values[i]);
    if (!std::isfinite(v)) continue;
    // The stored scale may round up: a code times it can pass fp16's largest value, which the
    // format's own decoding would saturate, not overflow.
    constexpr float kHalfLargest = 65504.0f;
    const float q = v / scale;
    const float code = e4m3 ? RoundToE4m3(q) : std::clamp(std::round(q), -kInt4Largest, kInt4Largest);
    values[i] = FloatToHalf(std::clamp(code * scale, -kHalfLargest, kHalfLargest));
  }
}

}  // namespace specache
