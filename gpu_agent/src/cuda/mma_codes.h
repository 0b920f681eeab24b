// The mma layout of a 32-token group's 1-bit codes: the low-bit decode's lean path
// (lowbit_decode.cu) reads each lane's operand bits of a whole group with one 16-byte load and
// makes every fp16x2 mma operand register with one AND.
//
// Which groups: a replica made with mma codes (DeviceHeadReplica::Create, MmaCodesEligible)
// rewrites, in place, the key and value code words of every group whose keys and values are both
// quantized (tokens below min(quantized_keys, quantized_values) rounded down to 32), once they
// are: PackMmaGroups, queued after the quantization on the replica's stream. Their scales and
// zeros are reordered in place too, so that each lane reads its operands' with 16-byte loads. The
// other groups keep the layout of cuda_attention.h (only the tail path reads them).
//
// Layout, D = head_dim (64 or 128), G = 32, key and value bits 1; lane L = 4 g + t (g = L / 4,
// t = L % 4) owns D / 32 consecutive words of the group's keys, and D / 32 of its values:
//   keys (S = Q K^T, B = the key bits, k = channels, n = tokens):
//     token 8 nt + g, channel 16 ks + 8 kh + 2 t + hi  ->  combo c = 2 ks + kh,
//     word c / 4 of lane L, bit 4 (c % 4) + nt + 16 hi
//   values (out^T = V^T P^T, A = the value bits, rows = channels, k = tokens), register r = rh + 2 kh:
//     channel 16 mt + 8 rh + g, token 16 ks + 8 kh + 2 t + hi  ->  combo c = (2 r + ks) (D / 64) + mt / 4,
//     word c / 4 of lane L, bit 4 (c % 4) + mt % 4 + 16 hi
// So each 4-bit group of a half is one operand's n-tiles (keys) or four m-tiles (values): shifted
// to bits 10..13, bit 10 + i of a half alone is the normal fp16 2^-14, 2^-13, 2^-11, 2^-7 for i =
// 0..3 (MmaBitWeight), which the kernel divides out of its fp32 results.
// Scales and zeros (fp16, KS = D / 16, NGV = D / 32), as fp16 pairs (hi: the second half):
//   key scales, key zeros:  pair (t, ks, kh) at t 2KS + 2 ks + kh = channels 16 ks + 8 kh + 2 t, +1
//   value scales:           pair (t, ks, kh, cg) at (t 4 + 2 ks + kh) NGV + cg = tokens 16 ks + 8 kh + 2 t, +1
//                           of channel group cg
//   value zeros:            pair (cg, t, ks, kh) at (cg 4 + t) 4 + 2 ks + kh = the same tokens' zeros
#pragma once

#include <cstdint>
#include <vector>

#include "specache/cuda_attention.h"
#include "specache/head_replica.h"
#include "specache/status.h"

namespace specache::cuda {

// Replicas whose groups can be kept in the mma layout.
inline bool MmaCodesEligible(const ReplicaParams& p) {
  return p.key_bits == 1 && p.value_bits == 1 && p.group_size == 32 && (p.head_dim == 64 || p.head_dim == 128);
}
// Bytes of one group's parts: key and value codes (4 D each), key scales and zeros (2 D each),
// value scales and zeros (2 D each). A replica with mma codes keeps its blocks interleaved by
// group (MakeReplicaBlockLayout), so ReplicaBlockLayout::group_bytes is this, and the lean path
// copies a group as one piece of this many bytes.
SPECACHE_HOST_DEVICE constexpr int MmaGroupBytes(int head_dim) { return 16 * head_dim; }

struct MmaBitPlace {
  int lane, word, bit;  // word within the lane's D / 32
};
SPECACHE_HOST_DEVICE inline MmaBitPlace MmaKeyBit(int head_dim, int token, int channel) {
  const int nt = token / 8, g = token % 8, ks = channel / 16, kh = (channel / 8) % 2, t = (channel % 8) / 2,
            hi = channel % 2;
  const int c = 2 * ks + kh;
  (void)head_dim;
  return {4 * g + t, c / 4, 4 * (c % 4) + nt + 16 * hi};
}
// Where the mma layout puts half `i` of a group's natural key scales or zeros (channel i), value
// scales (token i / NGV, channel group i % NGV) and value zeros (the same).
SPECACHE_HOST_DEVICE inline int MmaKeyScaleAt(int head_dim, int channel) {
  const int ks = channel / 16, kh = (channel / 8) % 2, t = (channel % 8) / 2, hi = channel % 2;
  return 2 * (t * 2 * (head_dim / 16) + 2 * ks + kh) + hi;
}
SPECACHE_HOST_DEVICE inline int MmaValueScaleAt(int head_dim, int i) {
  const int ngv = head_dim / 32, token = i / ngv, cg = i % ngv;
  const int ks = token / 16, kh = (token / 8) % 2, t = (token % 8) / 2, hi = token % 2;
  return 2 * ((t * 4 + 2 * ks + kh) * ngv + cg) + hi;
}
SPECACHE_HOST_DEVICE inline int MmaValueZeroAt(int head_dim, int i) {
  const int ngv = head_dim / 32, token = i / ngv, cg = i % ngv;
  const int ks = token / 16, kh = (token / 8) % 2, t = (token % 8) / 2, hi = token % 2;
  return 2 * ((cg * 4 + t) * 4 + 2 * ks + kh) + hi;
}
SPECACHE_HOST_DEVICE inline MmaBitPlace MmaValueBit(int head_dim, int token, int channel) {
  const int mt = channel / 16, rh = (channel / 8) % 2, g = channel % 8;
  const int ks = token / 16, kh = (token / 8) % 2, t = (token % 8) / 2, hi = token % 2;
  const int c = (2 * (rh + 2 * kh) + ks) * (head_dim / 64) + mt / 4;
  return {4 * g + t, c / 4, 4 * (c % 4) + mt % 4 + 16 * hi};
}
// The fp16 value of an operand bit at bit 10 + i of its half, and its inverse (exact).
SPECACHE_HOST_DEVICE inline float MmaBitWeight(int i) {
  return i == 0 ? 1.0f / 16384 : i == 1 ? 1.0f / 8192 : i == 2 ? 1.0f / 2048 : 1.0f / 128;
}
SPECACHE_HOST_DEVICE inline float MmaBitUnweight(int i) {
  return i == 0 ? 16384.0f : i == 1 ? 8192.0f : i == 2 ? 2048.0f : 128.0f;
}

// One group to rewrite, in the natural layout (cuda_attention.h): its key codes (head_dim words),
// key scales and zeros (head_dim fp16 each), its 32 tokens' value codes (32 x head_dim / 32 words),
// value scales and zeros (32 x head_dim / 32 fp16 each), and the replica's key scale bound (a
// float that the group's largest key scale is max-ed into, atomically:
// DeviceReplicaView::key_scale_bound).
struct MmaGroupTask {
  uint32_t* key_codes = nullptr;
  Half* key_scale = nullptr;
  Half* key_zero = nullptr;
  uint32_t* value_codes = nullptr;
  Half* value_scale = nullptr;
  Half* value_zero = nullptr;
  float* scale_bound = nullptr;
};
// Rewrites the groups in the mma layout, queued on `stream` (after their quantization), in one
// launch; the tasks go through a slot of `plan` (null: a plan of the call's own, which waits).
Status PackMmaGroups(const MmaGroupTask* tasks, int n, int head_dim, void* stream, DecodePlan* plan = nullptr);

// Host-side inverse, for tests: a group's natural arrays (each the size of its mma-layout one)
// from the mma layout.
struct MmaGroupArrays {
  const uint32_t* key_codes;
  const Half *key_scale, *key_zero;
  const uint32_t* value_codes;
  const Half *value_scale, *value_zero;
};
struct NaturalGroupArrays {
  std::vector<uint32_t> key_codes, value_codes;
  std::vector<Half> key_scale, key_zero, value_scale, value_zero;
};
NaturalGroupArrays UnpackMmaGroup(const MmaGroupArrays& mma, int head_dim);

}  // namespace specache::cuda
