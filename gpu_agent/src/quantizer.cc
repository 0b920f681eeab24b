#include "specache/quantizer.h"

#include <algorithm>
#include <cstring>

namespace specache {

ScaleZero ComputeScaleZero(float min_value, float max_value, int bits) {
  const float range = max_value - min_value;
  float scale, zero;
  if (bits == 1) {
    // SpeCache: the two levels sit at the midpoints of the lower and upper halves of [min, max],
    // which minimises the expected error for uniformly spread values.
    zero = (3.0f * min_value + max_value) * 0.25f;
    scale = range * 0.5f;
  } else {
    zero = min_value;
    scale = range / static_cast<float>((1u << bits) - 1u);
  }
  return {FloatToHalf(scale), FloatToHalf(zero)};
}

void PackCodes(const uint8_t* codes, int n, int bits, uint32_t* words) {
  const int per_word = CodesPerWord(bits);
  for (int w = 0; w < n / per_word; ++w) {
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) word |= static_cast<uint32_t>(codes[w * per_word + i]) << (i * bits);
    words[w] = word;
  }
}

void UnpackCodes(const uint32_t* words, int n, int bits, uint8_t* codes) {
  for (int i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(UnpackCode(words, i, bits));
}

ScaleZero QuantizeRun(const Half* x, int n, int stride, int bits, uint32_t* words) {
  float lo = HalfToFloat(x[0]);
  float hi = lo;
  for (int i = 1; i < n; ++i) {
    const float v = HalfToFloat(x[static_cast<size_t>(i) * stride]);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const ScaleZero sz = ComputeScaleZero(lo, hi, bits);
  const float scale = HalfToFloat(sz.scale);
  const float zero = HalfToFloat(sz.zero);
  const int per_word = CodesPerWord(bits);
  for (int w = 0; w < n / per_word; ++w) {
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) {
      const float v = HalfToFloat(x[static_cast<size_t>(w * per_word + i) * stride]);
      word |= QuantizeOne(v, scale, zero, bits) << (i * bits);
    }
    words[w] = word;
  }
  return sz;
}

void DequantizeRun(const uint32_t* words, ScaleZero sz, int n, int bits, float* out, int stride) {
  const float scale = HalfToFloat(sz.scale);
  const float zero = HalfToFloat(sz.zero);
  for (int i = 0; i < n; ++i) {
    out[static_cast<size_t>(i) * stride] = DequantizeOne(UnpackCode(words, i, bits), scale, zero);
  }
}

void QuantizeKeyGroup(const Half* keys, int group_size, int head_dim, int bits, uint32_t* codes, Half* scale,
                      Half* zero) {
  const int words = WordsPerGroup(group_size, bits);
  for (int d = 0; d < head_dim; ++d) {
    const ScaleZero sz = QuantizeRun(keys + d, group_size, head_dim, bits, codes + static_cast<size_t>(d) * words);
    scale[d] = sz.scale;
    zero[d] = sz.zero;
  }
}

void DequantizeKeyGroup(const uint32_t* codes, const Half* scale, const Half* zero, int group_size, int head_dim,
                        int bits, float* out) {
  const int words = WordsPerGroup(group_size, bits);
  for (int d = 0; d < head_dim; ++d) {
    DequantizeRun(codes + static_cast<size_t>(d) * words, {scale[d], zero[d]}, group_size, bits, out + d, head_dim);
  }
}

void QuantizeValueToken(const Half* value, int head_dim, int group_size, int bits, uint32_t* codes, Half* scale,
                        Half* zero) {
  const int words = WordsPerGroup(group_size, bits);
  for (int g = 0; g < head_dim / group_size; ++g) {
    const ScaleZero sz = QuantizeRun(value + g * group_size, group_size, 1, bits, codes + g * words);
    scale[g] = sz.scale;
    zero[g] = sz.zero;
  }
}

void DequantizeValueToken(const uint32_t* codes, const Half* scale, const Half* zero, int head_dim, int group_size,
                          int bits, float* out) {
  const int words = WordsPerGroup(group_size, bits);
  for (int g = 0; g < head_dim / group_size; ++g) {
    DequantizeRun(codes + g * words, {scale[g], zero[g]}, group_size, bits, out + g * group_size, 1);
  }
}

}  // namespace specache
