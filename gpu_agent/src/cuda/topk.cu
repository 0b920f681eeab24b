// Top-k across the whole GPU. A segment of n candidates is cut into parts of P tokens (P chosen
// per launch so that there are several blocks per SM): phase one selects each part's best k in
// its own block, from the reduced scores held in shared memory; phase two selects the segment's
// best k among the parts' candidates (in part order, so ascending tokens and ties towards the
// lower token survive). A segment of one part is finished in phase one. Both phases use one
// block-wide radix select (4 passes of 8 bits, warp-aggregated histogram counts) and one ordered
// pass.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <string>
#include <vector>

#include "device_info.h"
#include "specache/cuda_topk.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPartTokens = 8192;  // shared memory of phase one: 32 KiB of scores
constexpr int kMinPartTokens = 512;

// Monotone map from float to uint32 (larger float -> larger key); -inf is the smallest real key.
__device__ uint32_t OrderKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct TopKBatch {  // by value (kMaxTopKSegments x 40 bytes)
  TopKSegment segments[kMaxTopKSegments];
  int count;
  int part_tokens;  // P
  int k;
};

// Parts of a segment of n candidates: several when their candidates (score + token per slot)
// fit the segment's scratch, else one.
__host__ __device__ int PartsOf(int32_t n, int part_tokens, int k) {
  if (n <= part_tokens) return 1;
  const int parts = (n + part_tokens - 1) / part_tokens;
  return 2 * static_cast<int64_t>(k) * parts <= n ? parts : 1;
}

// Adds 1 to histogram[bin] for every lane with `in`, one shared atomic per distinct bin per warp
// (the keys of one segment share their top digits, so plain atomics would serialise). Every lane
// of the warp must call it.
__device__ void CountInto(unsigned int* histogram, bool in, uint32_t bin) {
  const unsigned active = __ballot_sync(0xffffffffu, in);
  if (!in) return;
  const unsigned peers = __match_any_sync(active, bin);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&histogram[bin], static_cast<unsigned>(__popc(peers)));
}

using Scan = cub::BlockScan<int, kThreads>;
struct SelectShared {
  typename Scan::TempStorage scan;
  unsigned int histogram[256];
  uint32_t prefix, mask;
  int remaining;
};

// The min(k, n) best of score[0, n) (ties towards the lower index), emit(j, position) called for
// each in ascending j with positions 0, 1, ... The whole block calls it; score is read-only.
template <typename Emit>
__device__ void BlockTopK(const float* score, int32_t n, int k, SelectShared& sh, Emit emit) {
  if (k >= n) {
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) emit(j, j);
    return;
  }
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.mask = 0;
    sh.remaining = k;  // how many of the best we still have to place at or below the prefix
  }
  __syncthreads();
  // Radix select of the k-th largest key, 8 bits at a time from the top.
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sh.histogram[i] = 0;
    __syncthreads();
    const uint32_t prefix = sh.prefix, mask = sh.mask;
    for (int32_t base = 0; base < n; base += blockDim.x) {  // whole warps iterate together
      const int32_t j = base + threadIdx.x;
      const uint32_t key = j < n ? OrderKey(score[j]) : 0;
      CountInto(sh.histogram, j < n && (key & mask) == prefix, (key >> shift) & 0xFF);
    }
    __syncthreads();
    // The digit holding the k-th best: bins from the top, summed by one scan (thread t holds bin
    // 255 - t); exactly one digit has the running count cross `remaining`.
    const int remaining = sh.remaining;
    const int count = static_cast<int>(sh.histogram[255 - threadIdx.x]);
    int from_top = 0;
    Scan(sh.scan).InclusiveSum(count, from_top);
    if (from_top >= remaining && from_top - count < remaining) {
      sh.prefix = prefix | (static_cast<uint32_t>(255 - threadIdx.x) << shift);
      sh.mask = mask | (0xFFu << shift);
      sh.remaining = remaining - (from_top - count);  // keys equal to the final threshold to take
    }
    __syncthreads();
  }
  const uint32_t threshold = sh.prefix;
  const int take_equal = sh.remaining;

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
  Scan(sh.scan).ExclusiveSum(equal, equal_before, equal_total);
  __syncthreads();
  const int take_mine = max(0, min(equal, take_equal - equal_before));
  int pos = 0, taken = 0;
  Scan(sh.scan).ExclusiveSum(above + take_mine, pos, taken);
  int equal_taken = 0;
  for (int32_t j = lo; j < hi; ++j) {
    const uint32_t key = OrderKey(score[j]);
    if (key > threshold || (key == threshold && equal_taken++ < take_mine)) emit(j, pos++);
  }
  __syncthreads();  // `sh` and `score` may be reused by the caller
}

// Reduced score of token j: the GQA group's probabilities (normalised on the fly when the
// segment has statistics), summed in head order as the CPU does, or their max; NaN is -inf.
__device__ float ReducedScore(const TopKSegment& seg, int n_heads, int32_t j, bool use_max) {
  float s = use_max ? -INFINITY : 0.0f;
  for (int h = 0; h < n_heads; ++h) {
    float v = seg.probs[static_cast<size_t>(h) * seg.n + j];
    if (seg.stats) v = expf(v - seg.stats[2 * h]) / seg.stats[2 * h + 1];
    if (isnan(v)) v = -INFINITY;
    s = use_max ? fmaxf(s, v) : __fadd_rn(s, v);
  }
  return use_max ? s : __fdiv_rn(s, static_cast<float>(n_heads));
}

// Block (part, segment), phase one. A segment of one part writes its tokens; otherwise the part's
// candidates go to the segment's scratch: scores at [part * k], tokens at [parts * k + part * k].
__global__ void TopKPartKernel(TopKBatch batch, int n_heads, bool use_max) {
  extern __shared__ float part_scores[];  // [P] when the part fits, else unused
  __shared__ SelectShared sh;
  const TopKSegment& seg = batch.segments[blockIdx.y];
  const int32_t n = seg.n;
  const int k = batch.k;
  const int parts = PartsOf(n, batch.part_tokens, k);
  const int32_t lo = parts == 1 ? 0 : static_cast<int32_t>(blockIdx.x) * batch.part_tokens;
  if ((parts == 1 && blockIdx.x > 0) || lo >= n || n <= 0) return;
  const int32_t m = parts == 1 ? n : min(batch.part_tokens, n - lo);
  // A lone part longer than shared memory holds keeps its scores in the segment's scratch.
  float* score = m <= batch.part_tokens ? part_scores : seg.scratch;
  for (int32_t j = threadIdx.x; j < m; j += blockDim.x) score[j] = ReducedScore(seg, n_heads, lo + j, use_max);
  __syncthreads();
  if (parts == 1) {
    BlockTopK(score, m, k, sh, [&](int32_t j, int pos) { seg.tokens[pos] = j; });
    return;
  }
  float* cand_score = seg.scratch + static_cast<size_t>(blockIdx.x) * k;
  int32_t* cand_token = reinterpret_cast<int32_t*>(seg.scratch) + static_cast<size_t>(parts + blockIdx.x) * k;
  BlockTopK(score, m, k, sh, [&](int32_t j, int pos) {
    cand_score[pos] = score[j];
    cand_token[pos] = lo + j;
  });
}

// Block per segment, phase two: the best k of its parts' candidates.
__global__ void TopKMergeKernel(TopKBatch batch) {
  extern __shared__ float merged[];  // scores [parts * k], then tokens [parts * k]
  __shared__ SelectShared sh;
  const TopKSegment& seg = batch.segments[blockIdx.x];
  const int32_t n = seg.n;
  const int k = batch.k;
  const int parts = PartsOf(n, batch.part_tokens, k);
  if (parts == 1 || n <= 0) return;
  int32_t* tokens = reinterpret_cast<int32_t*>(merged + static_cast<size_t>(parts) * k);
  // Candidates in part order; a part of m tokens left min(k, m).
  int32_t count = 0;
  for (int p = 0; p < parts; ++p) {
    const int32_t m = min(k, min(batch.part_tokens, n - p * batch.part_tokens));
    const float* cand_score = seg.scratch + static_cast<size_t>(p) * k;
    const int32_t* cand_token = reinterpret_cast<const int32_t*>(seg.scratch) + static_cast<size_t>(parts + p) * k;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      merged[count + i] = cand_score[i];
      tokens[count + i] = cand_token[i];
    }
    count += m;
  }
  __syncthreads();
  BlockTopK(merged, count, k, sh, [&](int32_t j, int pos) { seg.tokens[pos] = tokens[j]; });
}


}  // namespace

Status SelectTopKBatch(const TopKSegment* segments, int count, int n_heads, int k, GroupReduction reduction,
                       void* stream) {
  if (count < 0 || n_heads <= 0) return Status::InvalidArgument("bad top-k shape");
  if (k <= 0) return Status::Ok();
  auto* s = static_cast<cudaStream_t>(stream);
  for (int first = 0; first < count; first += kMaxTopKSegments) {
    TopKBatch batch;
    batch.count = std::min(kMaxTopKSegments, count - first);
    batch.k = k;
    int64_t total = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.segments[i] = segments[first + i];
      if (batch.segments[i].n < 0) return Status::InvalidArgument("negative candidate count");
      total += batch.segments[i].n;
    }
    // About 8 phase-one blocks per SM over the launch, in whole 256-token steps.
    const int64_t per_block = (total + int64_t{8} * MultiprocessorCount() - 1) / (int64_t{8} * MultiprocessorCount());
    batch.part_tokens = static_cast<int>(std::clamp<int64_t>((per_block + 255) / 256 * 256, kMinPartTokens, kMaxPartTokens));
    // k candidates per part must fit the merge's shared memory (48 KiB: 6K scores + tokens).
    while (batch.part_tokens < kMaxPartTokens) {
      int most = 1;
      for (int i = 0; i < batch.count; ++i) most = std::max(most, PartsOf(batch.segments[i].n, batch.part_tokens, k));
      if (most == 1 || int64_t{most} * k <= 6144) break;
      batch.part_tokens *= 2;
    }
    int max_parts = 1;
    for (int i = 0; i < batch.count; ++i) max_parts = std::max(max_parts, PartsOf(batch.segments[i].n, batch.part_tokens, k));
    if (max_parts > 1 && int64_t{max_parts} * k > 6144) {
      return Status::InvalidArgument("top-k: more than 6144 candidates to merge (k " + std::to_string(k) +
                                     " over segments of up to " + std::to_string(int64_t{max_parts} * batch.part_tokens) +
                                     " tokens)");
    }
    const unsigned n = static_cast<unsigned>(batch.count);
    TopKPartKernel<<<dim3(max_parts, n), kThreads, size_t{static_cast<unsigned>(batch.part_tokens)} * sizeof(float), s>>>(
        batch, n_heads, reduction == GroupReduction::kMax);
    if (max_parts > 1) TopKMergeKernel<<<n, kThreads, size_t(max_parts) * k * 2 * sizeof(float), s>>>(batch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return Status::Unavailable(std::string("top-k kernels: ") + cudaGetErrorString(err));
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
