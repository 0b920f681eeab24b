// Device helpers shared by the decode attention kernels (attention.cu, lowbit_decode.cu): where a
// query lives in q/out, and the key and value the attention uses for one token and channel, with
// the precedence of cpu::AttendDecodeRows (new rows, residual/window, substituted rows, replica).
#pragma once

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lowbit_decode.h"
#include "specache/cuda_attention.h"

namespace specache::cuda {

// One launch's items in device memory (a DecodePlan slot holds one per launch): this header, then
// unit_begin[count + 1] (the tensor-core path: item i's units are [unit_begin[i],
// unit_begin[i + 1]), its bulk units first, then its tail units), tail_begin[count + 1] (item i's
// tail units are the launch's [tail_begin[i], tail_begin[i + 1]) in the tails-first and -last
// orders), then
// the items at `items_offset` bytes from the header (16-byte aligned).
struct DeviceItemSet {
  int32_t count = 0;
  int32_t chunk_blocks = 0;   // the tensor-core path: 32-token blocks per bulk unit
  int32_t items_offset = 0;
  int32_t tail_units = 0;     // the tensor-core path: most tail units per item
  // The tensor-core path's warp order (LowBitSet, TailOrder): kTailsShared, warp w runs unit w
  // (the items' units in order); kTailsFirst, the warps run every item's tail units, then from
  // the next whole CTA the bulk units; kTailsLast, the bulk units, then from the next whole CTA
  // the tail units.
  int32_t tail_order = 0;
  // The lean path: nonzero, its copies of code groups ask L2 to evict those lines first and its
  // score stores to keep theirs last (LowBitSet::codes_evict_first); 0, both normal.
  int32_t codes_evict_first = 0;
};

__host__ __device__ inline const int32_t* UnitBegin(const DeviceItemSet* s) {
  return reinterpret_cast<const int32_t*>(s + 1);
}
__host__ __device__ inline const int32_t* TailBegin(const DeviceItemSet* s) { return UnitBegin(s) + s->count + 1; }
__host__ __device__ inline const DeviceDecodeItem* SetItems(const DeviceItemSet* s) {
  return reinterpret_cast<const DeviceDecodeItem*>(reinterpret_cast<const char*>(s) + s->items_offset);
}

// The header's offset of the items, and the set's bytes (a multiple of 16).
inline size_t ItemSetItemsOffset(int count) {
  return (sizeof(DeviceItemSet) + 2 * sizeof(int32_t) * (static_cast<size_t>(count) + 1) + 15) / 16 * 16;
}
inline size_t ItemSetBytes(int count) {
  return (ItemSetItemsOffset(count) + sizeof(DeviceDecodeItem) * static_cast<size_t>(count) + 15) / 16 * 16;
}
// What the tensor-core path adds to a set's items (lowbit_decode.h's LowBitSet); the CUDA-core
// path leaves it empty (the arrays are written as zeros).
struct ItemSetUnits {
  const std::vector<int32_t>* unit_begin = nullptr;  // [count + 1]
  const std::vector<int32_t>* tail_begin = nullptr;  // [count + 1]
  int chunk_blocks = 0, tail_units = 0;
  TailOrder tail_order = kTailsShared;
  bool codes_evict_first = false;
};
// Writes a set at `host` (ItemSetBytes(items.size()) bytes). The alignment padding is left as it
// is (no kernel reads it).
inline void WriteItemSet(void* host, const std::vector<DeviceDecodeItem>& items, const ItemSetUnits& units) {
  const int count = static_cast<int>(items.size());
  DeviceItemSet header;
  header.count = count;
  header.chunk_blocks = units.chunk_blocks;
  header.tail_units = units.tail_units;
  header.tail_order = units.tail_order;
  header.codes_evict_first = units.codes_evict_first ? 1 : 0;
  header.items_offset = static_cast<int32_t>(ItemSetItemsOffset(count));
  char* at = static_cast<char*>(host);
  std::memcpy(at, &header, sizeof(header));
  const size_t array_bytes = sizeof(int32_t) * (static_cast<size_t>(count) + 1);
  auto write_array = [&](char* to, const std::vector<int32_t>* array) {
    if (array == nullptr) {
      std::memset(to, 0, array_bytes);
    } else {
      std::memcpy(to, array->data(), array_bytes);
    }
  };
  write_array(at + sizeof(header), units.unit_begin);
  write_array(at + sizeof(header) + array_bytes, units.tail_begin);
  std::memcpy(at + header.items_offset, items.data(), sizeof(DeviceDecodeItem) * items.size());
}

namespace decode {

__device__ inline float H2F(Half h) { return __half2float(__ushort_as_half(h)); }

// 2^e, exact, for e in [-126, 127].
__device__ __forceinline__ float Pow2(int e) { return __int_as_float((e + 127) << 23); }
// QueryOperand (cpu_attention.h) on the device, in two halves: the exponent e of a query whose
// largest |channel| is `mx`, and one channel rounded at that exponent. Every decode kernel scores
// with these, so that the CPU reference's scores are the GPU's up to the order of fp32 sums.
__device__ __forceinline__ int QueryOperandExponent(float mx) {
  const int exponent = ((__float_as_int(mx) >> 23) & 0xff) - 127;  // floor(log2), -127 for denormals
  return mx > 0.0f && isfinite(mx) ? min(max(13 - exponent, -126), 126) : 0;
}
__device__ __forceinline__ float QueryOperandChannel(float x, int e) {
  return __half2float(__float2half_rn(x * Pow2(e))) * Pow2(-e);
}
// A query's QueryOperand exponent when the 32 lanes of a warp hold its channels (lane, lane + 32,
// ..): every lane returns it.
__device__ __forceinline__ int WarpQueryOperandExponent(const float* q, int d, int lane) {
  float mx = 0.0f;
  for (int c = lane; c < d; c += 32) mx = fmaxf(mx, fabsf(q[c]));
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  return QueryOperandExponent(mx);
}

__device__ inline uint32_t Code(const uint32_t* words, int i, int bits) {
  const int per_word = 32 / bits;
  return (words[i / per_word] >> ((i % per_word) * bits)) & ((1u << bits) - 1u);
}

// Where a row's raw scores go: `probs` for the probabilities row, `real_probs` for row 0 when that
// is another row, else nowhere.
__device__ inline float* ScoresOfRow(const DeviceDecodeRows& r, int row) {
  return row == r.probs_row ? r.probs : row == 0 ? r.real_probs : nullptr;
}
// Where row 0's softmax statistics go when the union rule asked for them (real_probs), else null.
__device__ inline float* RealRowStats(const DeviceDecodeRows& r, int row) {
  return row == 0 && row != r.probs_row && r.real_probs ? r.real_probs_stats : nullptr;
}

// Where query qi (row qi / n_heads, head qi % n_heads) starts in q and out. Strides are resolved
// on the host (AttendDecodeBatch), never 0 here.
__device__ inline int64_t QueryAt(const DeviceDecodeRows& r, int qi, int d) {
  return (qi / r.n_heads) * r.q_stride + static_cast<int64_t>(qi % r.n_heads) * d;
}

// Channel c of the key the scores use for `token`; `sub` is its index among the substituted rows
// or -1.
__device__ inline float KeyAt(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t token, int sub, int c) {
  const int d = v.head_dim;
  if (token >= v.length) return H2F(r.new_keys[(token - v.length) * r.kv_stride + c]);
  if (token >= v.quantized_keys) return H2F(v.residual_keys[static_cast<size_t>(token - v.quantized_keys) * d + c]);
  if (sub >= 0) return H2F(SubstitutedRow(r, sub, d)[c]);
  if (v.key_bits == 16) return H2F(KeyHalf(v, token)[c]);
  const int g = token / v.group_size, t = token % v.group_size;
  const int words = v.group_size * v.key_bits / 32;
  return static_cast<float>(Code(KeyCodes(v, g) + c * words, t, v.key_bits)) * H2F(KeyScales(v, g)[c]) +
         H2F(KeyZeros(v, g)[c]);
}

// Channel c of the value the output uses for `token`.
__device__ inline float ValueAt(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t token, int sub, int c) {
  const int d = v.head_dim;
  if (sub >= 0) return H2F(SubstitutedRow(r, sub, d)[d + c]);
  if (token >= v.length) return H2F(r.new_values[(token - v.length) * r.kv_stride + c]);
  if (token >= v.quantized_values) return H2F(v.window_values[static_cast<size_t>(token - v.quantized_values) * d + c]);
  if (v.value_bits == 16) return H2F(ValueHalf(v, token)[c]);
  const int g = c / v.group_size;
  const int words = v.group_size * v.value_bits / 32;
  return static_cast<float>(Code(ValueCodes(v, token) + g * words, c % v.group_size, v.value_bits)) *
             H2F(ValueScales(v, token)[g]) + H2F(ValueZeros(v, token)[g]);
}

// Index of `token` among the (ascending) substituted rows, or -1; only quantized keys are
// substituted.
__device__ inline int FindSubstitute(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t token) {
  if (token >= v.quantized_keys) return -1;
  int lo = 0, hi = r.n_sub;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (r.sub_tokens[mid] < token) lo = mid + 1; else hi = mid;
  }
  return lo < r.n_sub && r.sub_tokens[lo] == token ? lo : -1;
}

}  // namespace decode
}  // namespace specache::cuda
