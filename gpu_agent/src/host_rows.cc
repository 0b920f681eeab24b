#include "specache/host_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace specache {
namespace {

constexpr float kInt8Largest = 127.0f;
constexpr float kHalfLargest = 65504.0f;
constexpr Half kHalfNaN = 0x7E00;
constexpr int kTailBytes = 16;  // the two scales and 12 zero bytes

// Encodes one half ([n] values) to codes and returns its stored scale (host_rows.h: the format).
Half EncodeInt8Half(const Half* values, int n, int8_t* codes) {
  if (n <= 0) return FloatToHalf(0.0f);
  float largest = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    const float v = HalfToFloat(values[i]);
    if (!std::isfinite(v)) finite = false;
    else largest = std::max(largest, std::fabs(v));
  }
  std::fill(codes, codes + n, int8_t{0});
  if (!finite) return kHalfNaN;
  const Half stored = FloatToHalf(largest / kInt8Largest);
  const float scale = HalfToFloat(stored);
  if (!(scale > 0.0f)) return FloatToHalf(0.0f);
  for (int i = 0; i < n; ++i) {
    // The stored scale may round below largest / 127: such codes clamp to the range.
    const float code = std::clamp(std::round(HalfToFloat(values[i]) / scale), -kInt8Largest, kInt8Largest);
    codes[i] = static_cast<int8_t>(code);
  }
  return stored;
}

void DecodeInt8Half(const int8_t* codes, Half stored_scale, int n, Half* values) {
  const float scale = HalfToFloat(stored_scale);
  if (std::isnan(scale)) {
    std::fill(values, values + n, kHalfNaN);
    return;
  }
  // The stored scale may also round up: 127 x scale can pass fp16's largest value, which reads
  // back saturated, not as infinity.
  for (int i = 0; i < n; ++i) values[i] = FloatToHalf(std::clamp(codes[i] * scale, -kHalfLargest, kHalfLargest));
}

void EncodeInt8Row(const Half* row, int d, uint8_t* stored) {
  int8_t* codes = reinterpret_cast<int8_t*>(stored);
  const Half scales[2] = {EncodeInt8Half(row, d, codes), EncodeInt8Half(row + d, d, codes + d)};
  std::memcpy(stored + 2 * d, scales, sizeof scales);
  std::memset(stored + 2 * d + sizeof scales, 0, kTailBytes - sizeof scales);
}

void DecodeInt8Row(const uint8_t* stored, int d, Half* row) {
  const int8_t* codes = reinterpret_cast<const int8_t*>(stored);
  Half scales[2];
  std::memcpy(scales, stored + 2 * d, sizeof scales);
  DecodeInt8Half(codes, scales[0], d, row);
  DecodeInt8Half(codes + d, scales[1], d, row + d);
}

// Every format this build knows: what names, checks and listings accept.
constexpr HostRowFormat kKnownFormats[] = {HostRowFormat::kFp16, HostRowFormat::kInt8};

bool Known(HostRowFormat format) {
  for (HostRowFormat f : kKnownFormats) {
    if (f == format) return true;
  }
  return false;
}

}  // namespace

std::string_view HostRowFormatName(HostRowFormat format) {
  switch (format) {
    case HostRowFormat::kFp16: return "fp16";
    case HostRowFormat::kInt8: return "int8";
  }
  return "?";
}

std::string HostRowFormatNameOrNumber(uint32_t value) {
  const auto format = static_cast<HostRowFormat>(value);
  return Known(format) ? std::string(HostRowFormatName(format)) : std::to_string(value);
}

Status CheckHostRowFormat(HostRowFormat format, int head_dim) {
  if (!Known(format)) {
    return Status::InvalidArgument("unknown host row format " + std::to_string(static_cast<uint32_t>(format)));
  }
  if (format == HostRowFormat::kInt8 && (head_dim <= 0 || head_dim % 8 != 0)) {
    return Status::InvalidArgument("int8 host rows need head_dim a positive multiple of 8 (16-byte rows); head_dim is " +
                                   std::to_string(head_dim));
  }
  return Status::Ok();
}

Result<HostRowFormat> ParseHostRowFormat(std::string_view name) {
  for (HostRowFormat f : kKnownFormats) {
    if (name == HostRowFormatName(f)) return f;
  }
  return Status::InvalidArgument("unknown host row format '" + std::string(name) + "' (expected fp16 or int8)");
}

void EncodeHostRows(HostRowFormat format, const Half* rows, int64_t n, int head_dim, uint8_t* stored) {
  const int64_t row_bytes = HostRowBytes(format, head_dim);
  if (format == HostRowFormat::kFp16) {
    std::memmove(stored, rows, static_cast<size_t>(n * row_bytes));
    return;
  }
  for (int64_t r = 0; r < n; ++r) EncodeInt8Row(rows + r * 2 * head_dim, head_dim, stored + r * row_bytes);
}

void DecodeHostRows(HostRowFormat format, const uint8_t* stored, int64_t n, int head_dim, Half* rows) {
  const int64_t row_bytes = HostRowBytes(format, head_dim);
  if (format == HostRowFormat::kFp16) {
    std::memmove(rows, stored, static_cast<size_t>(n * row_bytes));
    return;
  }
  const auto* out = reinterpret_cast<const uint8_t*>(rows);
  const int64_t out_bytes = n * HostRowBytes(HostRowFormat::kFp16, head_dim), in_bytes = n * row_bytes;
  if (out + out_bytes <= stored || stored + in_bytes <= out) {
    for (int64_t r = 0; r < n; ++r) DecodeInt8Row(stored + r * row_bytes, head_dim, rows + r * 2 * head_dim);
    return;
  }
  if (out == stored) {
    // In place: last to first, each stored row copied out before its fp16 row (larger, starting
    // no earlier: 2 x head_dim + 16 <= 4 x head_dim for head_dim >= 8) is written, so no stored
    // byte is overwritten before it is read.
    std::vector<uint8_t> copy(static_cast<size_t>(row_bytes));
    for (int64_t r = n; r-- > 0;) {
      std::memcpy(copy.data(), stored + r * row_bytes, copy.size());
      DecodeInt8Row(copy.data(), head_dim, rows + r * 2 * head_dim);
    }
    return;
  }
  // Any other overlap (no caller's): through a copy of all of them.
  const std::vector<uint8_t> copy(stored, stored + in_bytes);
  for (int64_t r = 0; r < n; ++r) DecodeInt8Row(copy.data() + r * row_bytes, head_dim, rows + r * 2 * head_dim);
}

void RoundTripInt8Half(Half* values, int n) {
  if (n <= 0) return;
  std::vector<int8_t> codes(static_cast<size_t>(n));
  DecodeInt8Half(codes.data(), EncodeInt8Half(values, n, codes.data()), n, values);
}

}  // namespace specache
