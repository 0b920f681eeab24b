// PackMmaGroups: a warp per group copies the group's natural code words to shared memory, then
// each lane gathers the bits of its own mma-layout words (mma_codes.h) and writes them over the
// natural ones.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "mma_codes.h"
#include "decode_plan_slots.h"

namespace specache::cuda {
namespace {

constexpr int kWarps = 4;

template <int D>
__global__ void PackMmaGroupsKernel(const MmaGroupTask* __restrict__ tasks, int n) {
  constexpr int W = D / 32;  // words per lane, of the keys and of the values
  // The group's natural arrays: key codes, value codes [D words], then key scales, key zeros
  // [D halves], value scales, value zeros [32 x D / 32 = D halves]: 4 D words.
  __shared__ uint32_t natural[kWarps][4 * D];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int i = blockIdx.x * kWarps + warp;
  if (i >= n) return;
  const MmaGroupTask task = tasks[i];
  uint32_t* keys = natural[warp];
  uint32_t* values = natural[warp] + D;
  Half* halves = reinterpret_cast<Half*>(natural[warp] + 2 * D);  // [4][D]
  for (int w = lane; w < D; w += 32) keys[w] = task.key_codes[w], values[w] = task.value_codes[w];
  float bound = 0.0f;
  for (int c = lane; c < D; c += 32) {
    halves[c] = task.key_scale[c], halves[D + c] = task.key_zero[c];
    halves[2 * D + c] = task.value_scale[c], halves[3 * D + c] = task.value_zero[c];
    bound = fmaxf(bound, __half2float(__ushort_as_half(task.key_scale[c])));
  }
  for (int o = 16; o > 0; o >>= 1) bound = fmaxf(bound, __shfl_xor_sync(0xffffffffu, bound, o));
  __syncwarp();
  const int g = lane / 4, t = lane % 4;
  uint32_t kw[W] = {}, vw[W] = {};
  // Keys: combo c = 2 ks + kh in word c / 4, bits 4 (c % 4) + nt (+16: channel + 1).
  for (int c = 0; c < 2 * (D / 16); ++c) {
    const int ks = c / 2, kh = c % 2;
    for (int nt = 0; nt < 4; ++nt) {
      const int token = 8 * nt + g;
      for (int hi = 0; hi < 2; ++hi) {
        const int channel = 16 * ks + 8 * kh + 2 * t + hi;
        kw[c / 4] |= ((keys[channel] >> token) & 1u) << (4 * (c % 4) + nt + 16 * hi);
      }
    }
  }
  // Values: combo c = (2 r + ks) (D / 64) + mt / 4 in word c / 4, bits 4 (c % 4) + mt % 4 (+16: token + 1).
  for (int r = 0; r < 4; ++r) {
    const int rh = r % 2, kh = r / 2;
    for (int ks = 0; ks < 2; ++ks) {
      for (int mt = 0; mt < D / 16; ++mt) {
        const int c = (2 * r + ks) * (D / 64) + mt / 4;
        const int channel = 16 * mt + 8 * rh + g;
        for (int hi = 0; hi < 2; ++hi) {
          const int token = 16 * ks + 8 * kh + 2 * t + hi;
          vw[c / 4] |= ((values[token * W + channel / 32] >> (channel % 32)) & 1u) << (4 * (c % 4) + mt % 4 + 16 * hi);
        }
      }
    }
  }
  __syncwarp();  // every lane has read the natural words before any is overwritten
#pragma unroll
  for (int w = 0; w < W; ++w) task.key_codes[lane * W + w] = kw[w], task.value_codes[lane * W + w] = vw[w];
  for (int c = lane; c < D; c += 32) {
    task.key_scale[MmaKeyScaleAt(D, c)] = halves[c];
    task.key_zero[MmaKeyScaleAt(D, c)] = halves[D + c];
    task.value_scale[MmaValueScaleAt(D, c)] = halves[2 * D + c];
    task.value_zero[MmaValueZeroAt(D, c)] = halves[3 * D + c];
  }
  // Scales are non-negative: their bits order as their values.
  if (lane == 0 && task.scale_bound) atomicMax(reinterpret_cast<int*>(task.scale_bound), __float_as_int(bound));
}

}  // namespace

Status PackMmaGroups(const MmaGroupTask* tasks, int n, int head_dim, void* stream, DecodePlan* plan) {
  if (head_dim != 64 && head_dim != 128) return Status::InvalidArgument("mma codes: head_dim must be 64 or 128");
  if (n < 0) return Status::InvalidArgument("mma codes: negative task count");
  if (n == 0) return Status::Ok();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int blocks = (n + kWarps - 1) / kWarps;
  return WithDeviceTasks(plan, tasks, n, s, "mma codes", [&](const MmaGroupTask* on_device) {
    if (head_dim == 64) {
      PackMmaGroupsKernel<64><<<blocks, kWarps * 32, 0, s>>>(on_device, n);
    } else {
      PackMmaGroupsKernel<128><<<blocks, kWarps * 32, 0, s>>>(on_device, n);
    }
  });
}

NaturalGroupArrays UnpackMmaGroup(const MmaGroupArrays& mma, int head_dim) {
  const int D = head_dim, W = D / 32;
  NaturalGroupArrays n;
  n.key_codes.assign(D, 0u);
  n.value_codes.assign(D, 0u);
  for (int token = 0; token < 32; ++token) {
    for (int channel = 0; channel < D; ++channel) {
      const MmaBitPlace k = MmaKeyBit(D, token, channel), v = MmaValueBit(D, token, channel);
      n.key_codes[channel] |= ((mma.key_codes[k.lane * W + k.word] >> k.bit) & 1u) << token;
      n.value_codes[token * W + channel / 32] |= ((mma.value_codes[v.lane * W + v.word] >> v.bit) & 1u) << (channel % 32);
    }
  }
  for (int i = 0; i < D; ++i) {
    n.key_scale.push_back(mma.key_scale[MmaKeyScaleAt(D, i)]);
    n.key_zero.push_back(mma.key_zero[MmaKeyScaleAt(D, i)]);
    n.value_scale.push_back(mma.value_scale[MmaValueScaleAt(D, i)]);
    n.value_zero.push_back(mma.value_zero[MmaValueZeroAt(D, i)]);
  }
  return n;
}

}  // namespace specache::cuda
