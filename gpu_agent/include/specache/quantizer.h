// KIVI group quantization with SpeCache's 1-bit variant, and the bit layout the CPU and CUDA
// backends share.
//
// Rules (docs/method.md, "The low-bit replica"):
//   B in {2, 4}: z = min X, s = (max X - min X) / (2^B - 1)
//   B = 1:       z = (3 min X + max X) / 4, s = (max X - min X) / 2   (codes clamped to {0, 1})
//   code = clamp(floor((x - z) / s + 0.5), 0, 2^B - 1)   (round half up; s == 0 gives code 0)
//   x'   = code * s + z
// s and z are stored as fp16 and the codes are computed with the stored (rounded) s and z, so a
// decoder needs nothing but what is stored. Inputs are fp16 values (the full-precision K/V), hence
// a degenerate group (max == min) has s = 0, z = min exactly, and decodes exactly to its value.
// B = 16 is a pass-through: the fp16 values themselves are stored, no (s, z).
//
// Bit packing: codes go into uint32 words, 32/B codes per word, code i of a run at bits
// [(i % (32/B)) * B, +B) of word i / (32/B). A quantization group of G elements (G a multiple of
// 32) therefore fills exactly G*B/32 words.
//
// Keys are quantized per channel over G consecutive tokens. One key group of one KV head:
//   codes  uint32 [head_dim][G*B/32]   run = the G tokens of one channel
//   scale  Half   [head_dim]
//   zero   Half   [head_dim]
// Values are quantized per token over G consecutive channels. One value token of one KV head:
//   codes  uint32 [head_dim/G][G*B/32] run = the G channels of one channel group
//   scale  Half   [head_dim/G]
//   zero   Half   [head_dim/G]
// Word w of a key-group channel holds tokens w*32/B .. w*32/B + 32/B - 1, so a warp that owns the
// 32 tokens of a group reads each channel's codes with one or a few coalesced words.
#pragma once

#include <cstdint>

#include "specache/half.h"

namespace specache {

// Bit widths with packed codes (16 is the pass-through and is not packed).
inline bool IsPackedBitWidth(int bits) { return bits == 1 || bits == 2 || bits == 4; }
inline int CodesPerWord(int bits) { return 32 / bits; }
// uint32 words holding one run of `group_size` codes.
inline int WordsPerGroup(int group_size, int bits) { return group_size * bits / 32; }

struct ScaleZero {
  Half scale = 0;
  Half zero = 0;
};

// (s, z) of a group with the given extremes, rounded to fp16 as stored. Precondition: packed bits.
ScaleZero ComputeScaleZero(float min_value, float max_value, int bits);

// Code of x under the stored (s, z); see the rule above.
inline uint32_t QuantizeOne(float x, float scale, float zero, int bits) {
  if (!(scale > 0.0f)) return 0;
  const float level = __builtin_floorf((x - zero) / scale + 0.5f);
  const float top = static_cast<float>((1u << bits) - 1u);
  if (!(level > 0.0f)) return 0;  // also maps NaN to 0
  return static_cast<uint32_t>(level < top ? level : top);
}

inline float DequantizeOne(uint32_t code, float scale, float zero) {
  return static_cast<float>(code) * scale + zero;
}

// Code i of a packed run.
inline uint32_t UnpackCode(const uint32_t* words, int i, int bits) {
  const int per_word = 32 / bits;
  return (words[i / per_word] >> ((i % per_word) * bits)) & ((1u << bits) - 1u);
}

// Packs n codes (each < 2^bits, n a multiple of 32/bits) into n*bits/32 words.
void PackCodes(const uint8_t* codes, int n, int bits, uint32_t* words);
// Inverse of PackCodes.
void UnpackCodes(const uint32_t* words, int n, int bits, uint8_t* codes);

// Quantizes one run of n fp16 values read at x[0], x[stride], ...; writes n*bits/32 words.
// Precondition: packed bits, n a multiple of 32/bits.
ScaleZero QuantizeRun(const Half* x, int n, int stride, int bits, uint32_t* words);

// Decodes one run into out[0], out[stride], ...
void DequantizeRun(const uint32_t* words, ScaleZero sz, int n, int bits, float* out, int stride);

// One key group: keys [group_size][head_dim] fp16 (token-major), layout as described above.
void QuantizeKeyGroup(const Half* keys, int group_size, int head_dim, int bits, uint32_t* codes, Half* scale,
                      Half* zero);
// Writes [group_size][head_dim] floats.
void DequantizeKeyGroup(const uint32_t* codes, const Half* scale, const Half* zero, int group_size, int head_dim,
                        int bits, float* out);

// One value token: value [head_dim] fp16, layout as described above.
void QuantizeValueToken(const Half* value, int head_dim, int group_size, int bits, uint32_t* codes, Half* scale,
                        Half* zero);
// Writes [head_dim] floats.
void DequantizeValueToken(const uint32_t* codes, const Half* scale, const Half* zero, int head_dim, int group_size,
                          int bits, float* out);

}  // namespace specache
