#include "specache/half.h"

#include <array>
#include <bit>

namespace specache {
namespace {

uint32_t FloatBits(float f) { return std::bit_cast<uint32_t>(f); }

constexpr float DecodeHalfBits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));  // inf/NaN
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Built by the compiler: no static-initialisation order to worry about.
constexpr std::array<float, 65536> BuildTable() {
  std::array<float, 65536> table{};
  for (uint32_t i = 0; i < 65536; ++i) table[i] = DecodeHalfBits(static_cast<uint16_t>(i));
  return table;
}

constexpr std::array<float, 65536> kTable = BuildTable();

}  // namespace

namespace internal {
const float* const kHalfToFloatTable = kTable.data();
}  // namespace internal

Half FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) {  // inf or NaN; keep NaN quiet and non-zero
    return static_cast<Half>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477FF000u) return static_cast<Half>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): value / 2^-24 rounded to nearest even integer.
    if (abs < 0x33000000u) return static_cast<Half>(sign);  // < 2^-25: rounds to zero
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24 for this range
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return static_cast<Half>(sign | result);
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  uint32_t result = ((abs >> 13) - (112u << 10));
  const uint32_t remainder = abs & 0x1FFFu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return static_cast<Half>(sign | result);
}

}  // namespace specache
