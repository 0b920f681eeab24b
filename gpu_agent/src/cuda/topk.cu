#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <string>

#include "specache/cuda_topk.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = 256;

// Monotone map from float to uint32 (larger float -> larger key); -inf is the smallest real key.
__device__ uint32_t OrderKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void TopKKernel(const float* probs, int n_heads, int32_t n, int k, bool use_max, int32_t* tokens,
                           float* scratch) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ unsigned int histogram[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int remaining_s, selected_base;

  const int seg = blockIdx.x;
  const float* p = probs + static_cast<size_t>(seg) * n_heads * n;
  float* score = scratch + static_cast<size_t>(seg) * n;
  int32_t* out = tokens + static_cast<size_t>(seg) * k;

  // Reduced score per token, summed in head order as the CPU does.
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
    float s = use_max ? -INFINITY : 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      float v = p[static_cast<size_t>(h) * n + j];
      if (isnan(v)) v = -INFINITY;
      s = use_max ? fmaxf(s, v) : __fadd_rn(s, v);
    }
    score[j] = use_max ? s : __fdiv_rn(s, static_cast<float>(n_heads));
  }
  if (threadIdx.x == 0) {
    prefix_s = 0;
    mask_s = 0;
    remaining_s = k;  // how many of the best we still have to place at or below the prefix
  }
  __syncthreads();

  // Radix select of the k-th largest key, 8 bits at a time from the top.
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) histogram[i] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s, mask = mask_s;
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
      const uint32_t key = OrderKey(score[j]);
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xFF], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int remaining = remaining_s;
      int digit = 255;
      for (; digit > 0; --digit) {
        if (static_cast<int>(histogram[digit]) >= remaining) break;
        remaining -= static_cast<int>(histogram[digit]);
      }
      prefix_s = prefix | (static_cast<uint32_t>(digit) << shift);
      mask_s = mask | (0xFFu << shift);
      remaining_s = remaining;  // keys equal to the final threshold to take (lowest indices first)
    }
    __syncthreads();
  }
  const uint32_t threshold = prefix_s;
  const int take_equal = remaining_s;
  if (threadIdx.x == 0) selected_base = 0;
  __syncthreads();

  // Ordered pass: tokens above the threshold, and the first take_equal tokens equal to it.
  int equal_seen = 0;  // equal keys before this chunk (same in every thread)
  for (int32_t base = 0; base < n; base += blockDim.x) {
    const int32_t j = base + threadIdx.x;
    const uint32_t key = j < n ? OrderKey(score[j]) : 0;
    const int is_equal = j < n && key == threshold;
    int equal_before = 0, equal_total = 0;
    Scan(scan_storage).ExclusiveSum(is_equal, equal_before, equal_total);
    __syncthreads();
    const int take = j < n && (key > threshold || (is_equal && equal_seen + equal_before < take_equal));
    int pos = 0, taken = 0;
    Scan(scan_storage).ExclusiveSum(take, pos, taken);
    if (take) out[selected_base + pos] = j;
    __syncthreads();
    if (threadIdx.x == 0) selected_base += taken;
    equal_seen += equal_total;
    __syncthreads();
  }
}

__global__ void AllTokensKernel(int32_t* tokens, int segments, int32_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < static_cast<int64_t>(segments) * n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    tokens[i] = static_cast<int32_t>(i % n);
  }
}

}  // namespace

Status SelectTopK(const float* probs, int segments, int n_heads, int32_t n, int k, GroupReduction reduction,
                  int32_t* tokens, float* scratch, void* stream) {
  if (segments < 0 || n_heads <= 0 || n < 0) return Status::InvalidArgument("bad top-k shape");
  if (segments == 0 || n == 0 || k <= 0) return Status::Ok();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (k >= n) {
    AllTokensKernel<<<std::min<int64_t>(1024, (int64_t(segments) * n + 255) / 256), 256, 0, s>>>(tokens, segments, n);
  } else {
    TopKKernel<<<segments, kThreads, 0, s>>>(probs, n_heads, n, k, reduction == GroupReduction::kMax, tokens, scratch);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : Status::Unavailable(std::string("top-k kernel: ") + cudaGetErrorString(err));
}

}  // namespace specache::cuda
