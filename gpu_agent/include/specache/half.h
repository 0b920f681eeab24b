// IEEE 754 binary16 ("fp16") storage on the host.
//
// Full-precision K/V are stored as fp16 bit patterns (uint16_t) everywhere: in the residual window,
// in the fetched rows and in the host pages of the full-precision source. The CUDA backend reads
// the same bits as `__half`. Conversion float -> half rounds to nearest, ties to even, overflows
// to infinity and keeps NaN a NaN; half -> float is exact.
#pragma once

#include <cstdint>
#include <cstring>

namespace specache {

using Half = uint16_t;  // binary16 bit pattern

// Exact widening. A 64K-entry table built once (thread-safe static init): the decode hot path
// converts every residual and fetched element, and the table is ~5x faster than bit twiddling.
float HalfToFloat(Half h);

// Round-to-nearest-even narrowing.
Half FloatToHalf(float f);

// The float that `f` becomes after a round trip through fp16.
inline float RoundToHalf(float f) { return HalfToFloat(FloatToHalf(f)); }

namespace internal {
extern const float* const kHalfToFloatTable;  // [65536], constant-initialised
}  // namespace internal

inline float HalfToFloat(Half h) { return internal::kHalfToFloatTable[h]; }

}  // namespace specache
