// host_rows.h's int8 row format on the device: the same arithmetic as EncodeHostRows and
// DecodeHostRows on the host (a half's scale is fp16(largest / 127), rounded to nearest even; a
// code is value / scale as a float quotient, rounded half away from zero and clamped to
// [-127, 127]; a value reads back as fp16(code x scale) clamped to +-65504; a half with a
// non-finite value stores scale NaN and reads back NaN), so bytes and values match the CPU's bit
// for bit. A stored row: [K codes: head_dim][V codes: head_dim][K scale][V scale][12 zero bytes].
//
// Work is split in pieces of 16 values: 16 codes are one 16-byte vector of a stored row, and 16
// fp16 values are two 16-byte vectors of a computed row. Needs no -use_fast_math (the quotients
// must be IEEE divisions, as on the host).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace specache::cuda::int8_rows {

constexpr int kValuesPerPiece = 16;
constexpr int kTailBytes = 16;  // the two scales and 12 zero bytes
constexpr unsigned short kNaNBits = 0x7E00;
constexpr float kLargestCode = 127.0f;
constexpr float kHalfLargest = 65504.0f;

__host__ __device__ constexpr int64_t StoredRowBytes(int head_dim) { return int64_t{2} * head_dim + kTailBytes; }

// Pieces of one half: head_dim / 16 (head_dim a multiple of 16).
__host__ __device__ constexpr int HalfPieces(int head_dim) { return head_dim / kValuesPerPiece; }

// The smallest power of two >= n (n <= 32): a lane group's width, for shuffles within it.
__host__ __device__ constexpr int GroupWidth(int n) {
  int w = 1;
  while (w < n) w *= 2;
  return w;
}

// 16 codes with their half's stored scale (fp16 bits) -> 16 fp16 values, as two 16-byte vectors.
__device__ __forceinline__ void DecodePiece(uint4 codes, unsigned short scale_bits, uint4* first, uint4* second) {
  const float scale = __half2float(__ushort_as_half(scale_bits));
  const bool nan = isnan(scale);
  const auto* c = reinterpret_cast<const int8_t*>(&codes);
  __align__(16) __half v[kValuesPerPiece];
#pragma unroll
  for (int i = 0; i < kValuesPerPiece; ++i) {
    v[i] = nan ? __ushort_as_half(kNaNBits)
               : __float2half_rn(fminf(fmaxf(static_cast<float>(c[i]) * scale, -kHalfLargest), kHalfLargest));
  }
  *first = reinterpret_cast<const uint4*>(v)[0];
  *second = reinterpret_cast<const uint4*>(v)[1];
}

// One lane's 16 values of a half ([16] fp16 as two vectors; `has` false for a lane past the half's
// pieces, which adds nothing) -> the half's stored scale (fp16 bits) and this lane's 16 codes. The
// half's lanes are one aligned group of `width` lanes (a power of two): every lane of the warp
// calls it (the group's largest magnitude and non-finite flag are shuffled within the group).
__device__ __forceinline__ unsigned short EncodePiece(uint4 first, uint4 second, bool has, int width, uint4* codes) {
  __align__(16) __half v[kValuesPerPiece];
  reinterpret_cast<uint4*>(v)[0] = first;
  reinterpret_cast<uint4*>(v)[1] = second;
  float largest = 0.0f;
  int bad = 0;
  if (has) {
#pragma unroll
    for (int i = 0; i < kValuesPerPiece; ++i) {
      const float f = __half2float(v[i]);
      if (isfinite(f)) largest = fmaxf(largest, fabsf(f));
      else bad = 1;
    }
  }
  for (int offset = width / 2; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset, width));
    bad |= __shfl_xor_sync(0xffffffffu, bad, offset, width);
  }
  __align__(16) int8_t out[kValuesPerPiece] = {};
  unsigned short scale_bits = 0;  // +0: all zeros, or a scale that rounds to 0
  if (bad) {
    scale_bits = kNaNBits;
  } else {
    const __half stored = __float2half_rn(largest / kLargestCode);
    const float scale = __half2float(stored);
    if (scale > 0.0f) {
      scale_bits = __half_as_ushort(stored);
#pragma unroll
      for (int i = 0; i < kValuesPerPiece; ++i) {
        out[i] = static_cast<int8_t>(fminf(fmaxf(roundf(__half2float(v[i]) / scale), -kLargestCode), kLargestCode));
      }
    }
  }
  *codes = *reinterpret_cast<const uint4*>(out);
  return scale_bits;
}

}  // namespace specache::cuda::int8_rows
