// Block formats (ggml): a block of 32 elements unless noted, little-endian.
//   Q4_0: fp16 d, 16 bytes of nibbles; x = (q - 8) * d
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; x = q * d + m
//   Q8_0: fp16 d, 32 int8; x = q * d
// Byte j of the nibbles holds element j (low nibble) and element j + 16 (high nibble).
#include <cstring>

#include "specache/gguf.h"
#include "specache/half.h"

namespace specache::gguf {
namespace {

struct TypeTraits {
  uint32_t type;
  const char* name;
  uint64_t block_elements;
  uint64_t block_bytes;
};

constexpr TypeTraits kTraits[] = {
    {0, "F32", 1, 4},      {1, "F16", 1, 2},       {2, "Q4_0", 32, 18},   {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},   {7, "Q5_1", 32, 24},    {8, "Q8_0", 32, 34},   {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84}, {11, "Q3_K", 256, 110}, {12, "Q4_K", 256, 144}, {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210}, {15, "Q8_K", 256, 292}, {30, "BF16", 1, 2},
};

const TypeTraits* Traits(uint32_t type) {
  for (const TypeTraits& t : kTraits) {
    if (t.type == type) return &t;
  }
  return nullptr;
}

float ReadHalf(const uint8_t* p) {
  Half h;
  std::memcpy(&h, p, sizeof h);
  return HalfToFloat(h);
}

}  // namespace

std::string TensorTypeName(uint32_t type) {
  const TypeTraits* t = Traits(type);
  return t ? t->name : "type#" + std::to_string(type);
}

bool CanDequantize(uint32_t type) {
  return type == 0 || type == 1 || type == 2 || type == 3 || type == 8;
}

Result<uint64_t> StoredBytes(uint32_t type, uint64_t n) {
  const TypeTraits* t = Traits(type);
  if (!t) return Status::InvalidArgument("unknown tensor type " + std::to_string(type));
  if (n % t->block_elements != 0) {
    return Status::InvalidArgument(std::to_string(n) + " elements is not a whole number of " + t->name + " blocks");
  }
  return n / t->block_elements * t->block_bytes;
}

Status DequantizeRow(uint32_t type, const uint8_t* src, uint64_t n, float* dst) {
  if (!CanDequantize(type)) {
    return Status::Unimplemented("type " + TensorTypeName(type) +
                                 " cannot be dequantized by this reader (F32, F16, Q4_0, Q4_1, Q8_0)");
  }
  SPECACHE_RETURN_IF_ERROR(StoredBytes(type, n).status());  // whole blocks only
  switch (type) {
    case 0:
      std::memcpy(dst, src, n * sizeof(float));
      return Status::Ok();
    case 1:
      for (uint64_t i = 0; i < n; ++i) dst[i] = ReadHalf(src + 2 * i);
      return Status::Ok();
    case 2:  // Q4_0
      for (uint64_t b = 0; b < n / 32; ++b, src += 18, dst += 32) {
        const float d = ReadHalf(src);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>((src[2 + j] & 0x0F) - 8) * d;
          dst[j + 16] = static_cast<float>((src[2 + j] >> 4) - 8) * d;
        }
      }
      return Status::Ok();
    case 3:  // Q4_1
      for (uint64_t b = 0; b < n / 32; ++b, src += 20, dst += 32) {
        const float d = ReadHalf(src), m = ReadHalf(src + 2);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>(src[4 + j] & 0x0F) * d + m;
          dst[j + 16] = static_cast<float>(src[4 + j] >> 4) * d + m;
        }
      }
      return Status::Ok();
    case 8:  // Q8_0
      for (uint64_t b = 0; b < n / 32; ++b, src += 34, dst += 32) {
        const float d = ReadHalf(src);
        for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(static_cast<int8_t>(src[2 + j])) * d;
      }
      return Status::Ok();
  }
  return Status::Internal("unreachable dequantizer case");
}

}  // namespace specache::gguf
