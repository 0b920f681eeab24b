// Block-wide helpers of the kernels that work through one list per block of 256 threads: the row
// cache's update (fetch.cu) and its seeding at prefill (seed_rows.cu). An exclusive scan of
// per-thread counts, a reduction, and a radix select of 64-bit keys.
#pragma once

#include <cstdint>

namespace specache::cuda {

constexpr int kListThreads = 256;  // the block size of every kernel that calls these

// The sum of `value` over the block's threads before this one; *total (when given) the sum over
// all. kListThreads threads, all calling; between two calls the block must pass a __syncthreads.
__device__ inline int BlockExclusiveSum(int value, int* total = nullptr) {
  __shared__ int warp_sums[kListThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
  for (int d = 1; d < 32; d <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kListThreads / 32; ++w) {
    if (w < warp) before += warp_sums[w];
    all += warp_sums[w];
  }
  if (total) *total = all;
  return before + inclusive - value;
}

// `x` reduced over the block with `op` (associative and commutative, or the order the warps' lanes
// meet in matters to the caller); every thread gets the result. kListThreads threads, all calling.
template <typename T, typename Op>
__device__ T BlockAllReduce(T x, Op op) {
  __shared__ T warp_results[kListThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();  // a previous call's results may still be read
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  x = warp_results[0];
  for (int w = 1; w < kListThreads / 32; ++w) x = op(x, warp_results[w]);
  return x;
}

// The k-th largest of the keys of entries [0, n) that take part (key_of(i, &key) says whether
// entry i does and writes its key), 0 < k <= their number, the keys distinct: exactly the k
// largest are at or above it. A radix select over the key's bytes, most significant first: each
// pass counts the next byte of the keys that match the bytes found so far, a bin per thread, and
// takes the byte where the count of larger keys reaches what is still wanted. kListThreads
// threads, all calling.
template <typename KeyOf>
__device__ uint64_t KthLargestKey(int32_t n, int32_t k, KeyOf key_of) {
  static_assert(kListThreads == 256, "a bin of a byte per thread");
  __shared__ int bins[256];
  __shared__ int chosen_byte, chosen_larger;
  uint64_t prefix = 0, mask = 0;
  int32_t want = k;  // the sought key is the want-th largest of the keys matching prefix
  for (int shift = 56; shift >= 0; shift -= 8) {
    bins[threadIdx.x] = 0;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < n; i += kListThreads) {
      uint64_t key = 0;
      if (key_of(i, &key) && (key & mask) == prefix) atomicAdd(&bins[(key >> shift) & 0xff], 1);
    }
    __syncthreads();
    const int byte = 255 - static_cast<int>(threadIdx.x), count = bins[byte];
    const int larger = BlockExclusiveSum(count);  // matching keys with a larger byte here
    if (larger < want && want <= larger + count) chosen_byte = byte, chosen_larger = larger;
    __syncthreads();
    prefix |= uint64_t(chosen_byte) << shift;
    mask |= uint64_t{0xff} << shift;
    want -= chosen_larger;
    __syncthreads();  // bins, chosen_* and the scan's sums are written again
  }
  return prefix;
}

}  // namespace specache::cuda
