#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <string>
#include <vector>

#include "specache/cuda_topk.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = 256;

// Monotone map from float to uint32 (larger float -> larger key); -inf is the smallest real key.
__device__ uint32_t OrderKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct TopKBatch {  // by value (kMaxTopKSegments x 32 bytes)
  TopKSegment segments[kMaxTopKSegments];
  int count;
};

// Adds 1 to histogram[bin] for every lane with `in`, one shared atomic per distinct bin per warp
// (the keys of one segment share their top digits, so plain atomics would serialise). Every lane
// of the warp must call it.
__device__ void CountInto(unsigned int* histogram, bool in, uint32_t bin) {
  const unsigned active = __ballot_sync(0xffffffffu, in);
  if (!in) return;
  const unsigned peers = __match_any_sync(active, bin);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&histogram[bin], static_cast<unsigned>(__popc(peers)));
}

// Block b: the top-k of segment b.
__global__ void TopKKernel(TopKBatch batch, int n_heads, int k, bool use_max) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ unsigned int histogram[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int remaining_s;

  const TopKSegment& seg = batch.segments[blockIdx.x];
  const int32_t n = seg.n;
  const float* p = seg.probs;
  float* score = seg.scratch;
  int32_t* out = seg.tokens;
  if (n <= 0) return;
  if (k >= n) {  // every token
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) out[j] = j;
    return;
  }

  // Reduced score per token, summed in head order as the CPU does.
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
    float s = use_max ? -INFINITY : 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      float v = p[static_cast<size_t>(h) * n + j];
      if (seg.stats) v = expf(v - seg.stats[2 * h]) / seg.stats[2 * h + 1];
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
    for (int32_t base = 0; base < n; base += blockDim.x) {  // whole warps iterate together
      const int32_t j = base + threadIdx.x;
      const uint32_t key = j < n ? OrderKey(score[j]) : 0;
      CountInto(histogram, j < n && (key & mask) == prefix, (key >> shift) & 0xFF);
    }
    __syncthreads();
    // The digit holding the k-th best: bins from the top, summed by one scan (thread t holds bin
    // 255 - t); exactly one digit has the running count cross `remaining`.
    const int remaining = remaining_s;
    const int count = static_cast<int>(histogram[255 - threadIdx.x]);
    int from_top = 0;
    Scan(scan_storage).InclusiveSum(count, from_top);
    if (from_top >= remaining && from_top - count < remaining) {
      prefix_s = prefix | (static_cast<uint32_t>(255 - threadIdx.x) << shift);
      mask_s = mask | (0xFFu << shift);
      remaining_s = remaining - (from_top - count);  // keys equal to the final threshold to take
    }
    __syncthreads();
  }
  const uint32_t threshold = prefix_s;
  const int take_equal = remaining_s;

  // Ordered pass: each thread owns a contiguous run of tokens; it counts what it takes, one scan
  // places the runs, and each writes its tokens in order (ascending overall). Of the keys equal to
  // the threshold, the take_equal with the lowest indices are taken.
  const int32_t per = (n + blockDim.x - 1) / blockDim.x;
  const int32_t lo = min(n, static_cast<int32_t>(threadIdx.x) * per), hi = min(n, lo + per);
  int above = 0, equal = 0;
  for (int32_t j = lo; j < hi; ++j) {
    const uint32_t key = OrderKey(score[j]);
    above += key > threshold;
    equal += key == threshold;
  }
  int equal_before = 0, equal_total = 0;
  Scan(scan_storage).ExclusiveSum(equal, equal_before, equal_total);
  __syncthreads();
  const int take_mine = max(0, min(equal, take_equal - equal_before));
  int pos = 0, taken = 0;
  Scan(scan_storage).ExclusiveSum(above + take_mine, pos, taken);
  int equal_taken = 0;
  for (int32_t j = lo; j < hi; ++j) {
    const uint32_t key = OrderKey(score[j]);
    if (key > threshold || (key == threshold && equal_taken++ < take_mine)) out[pos++] = j;
  }
}

}  // namespace

Status SelectTopKBatch(const TopKSegment* segments, int count, int n_heads, int k, GroupReduction reduction,
                       void* stream) {
  if (count < 0 || n_heads <= 0) return Status::InvalidArgument("bad top-k shape");
  if (k <= 0) return Status::Ok();
  for (int first = 0; first < count; first += kMaxTopKSegments) {
    TopKBatch batch;
    batch.count = std::min(kMaxTopKSegments, count - first);
    for (int i = 0; i < batch.count; ++i) {
      batch.segments[i] = segments[first + i];
      if (batch.segments[i].n < 0) return Status::InvalidArgument("negative candidate count");
    }
    TopKKernel<<<batch.count, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(batch, n_heads, k,
                                                                                 reduction == GroupReduction::kMax);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return Status::Unavailable(std::string("top-k kernel: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

Status SelectTopK(const float* probs, int segments, int n_heads, int32_t n, int k, GroupReduction reduction,
                  int32_t* tokens, float* scratch, void* stream) {
  if (segments < 0 || n_heads <= 0 || n < 0) return Status::InvalidArgument("bad top-k shape");
  if (segments == 0 || n == 0 || k <= 0) return Status::Ok();
  const int32_t kept = std::min<int32_t>(k, n);
  std::vector<TopKSegment> all(segments);
  for (int i = 0; i < segments; ++i) {
    all[i] = {probs + static_cast<size_t>(i) * n_heads * n, tokens + static_cast<size_t>(i) * kept,
              scratch + static_cast<size_t>(i) * n, n};
  }
  return SelectTopKBatch(all.data(), segments, n_heads, k, reduction, stream);
}

}  // namespace specache::cuda
