// Top-k across the whole GPU. A segment of n candidates is cut into parts of P tokens (P chosen
// per launch so that there are several blocks per SM): each block selects its part's best k from
// the reduced scores held in shared memory, and the segment's last part to finish (a counter per
// segment) then selects the segment's best k among the parts' candidates (in part order, so
// ascending tokens and ties towards the lower token survive). Both selections use one
// block-wide radix select (digits of 10, 10, 10 and 2 bits, warp-aggregated histogram counts;
// phase one counts the first digit as it reduces the scores, and its later passes walk a list of
// the first digit's keys) and one ordered pass, except merges of at most 256 candidates, which
// rank them (a candidate a thread). With the adaptive budget, phase one also sums each run of 256
// scores it holds (one warp per run), and a second launch, a block per segment, sorts the k
// selected rows by rank, finds the cut and keeps the rows above it.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "decode_plan_slots.h"
#include "dependent_launch.cuh"
#include "device_info.h"
#include "launch_sets.h"
#include "shared_memory_opt_in.cuh"
#include "specache/cuda_fetch.h"
#include "specache/cuda_topk.h"
#include "topk_parts.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = kTopKThreads;  // topk_parts.h, with the parts' bounds
constexpr unsigned kAllLanes = 0xffffffffu;

// Monotone map from float to uint32 (larger float -> larger key); -inf is the smallest real key.
__device__ uint32_t OrderKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);  // ~u when negative, else u | 2^31
}

// A set's segments reach its kernels in a slot of the call's DecodePlan (in device memory, or
// read in place), the scalars as parameters; the segments' counters of finished parts are the
// slot's zeroed device bytes ([count], DecodePlan::Impl::Upload::zeroed), which the kernels leave
// zero.
static_assert(cpu::kMassRunTokens == kThreads && kThreads == 256, "a run of the mass is one block's width, 8 per lane");

// Adds 1 to histogram[bin] for every lane with `in`, one shared atomic per distinct bin per warp
// (the keys of one segment share their top digits, so plain atomics would serialise). Every lane
// of the warp must call it.
__device__ void CountInto(unsigned int* histogram, bool in, uint32_t bin) {
  const unsigned active = __ballot_sync(0xffffffffu, in);
  if (!in) return;
  const unsigned peers = __match_any_sync(active, bin);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&histogram[bin], static_cast<unsigned>(__popc(peers)));
}

// CountInto with every lane in: no ballot, and the peers' highest lane adds (one shift and compare
// instead of finding the lowest). Every lane of the warp must call it.
__device__ __forceinline__ void CountAllInto(unsigned int* histogram, uint32_t bin) {
  const unsigned peers = __match_any_sync(kAllLanes, bin);
  if ((peers >> (threadIdx.x & 31)) == 1u) atomicAdd(&histogram[bin], static_cast<unsigned>(__popc(peers)));
}

// The first radix digit (below) of a key: its top 10 bits.
constexpr int kFirstDigitShift = 22;

using Scan = cub::BlockScan<int, kThreads>;
constexpr int kWarpsPerBlock = kThreads / 32;
// The radix select's digits, from the top: 10, 10, 10 and 2 bits. The first is fine enough (for
// positive scores: the exponent and one mantissa bit, half an octave) that the later passes find
// few keys under their prefix. Given room for a list (phase one: kListKeys indices in shared
// memory), those keys' indices are listed once, after the first pass, and the later passes walk
// the list alone (ncu, 99 x 8K: the four passes over every key were ~35% of phase one's
// instructions). Otherwise, or when the first digit's bin holds more than kListKeys keys (scores
// barely spread), the later passes walk every key, counting only those under the prefix
// (CountInto). In a part of up to 32 kThreads keys whose first bin and the bins above it hold at
// most kListKeys keys (the usual case for k = 64), the list is built in ascending index from
// ballots and holds every key to take, so the final ordered pass walks the list too, not every
// key (H100, one layer: the top-k 25-27% faster at 32 x 8K, 176 x 8K and 46 x 32K;
// bench_results/topk_ordered_list_h100_r43.txt).
constexpr int kRadixBins = 1024;
constexpr int kBinsPerThread = kRadixBins / kThreads;
constexpr int kListKeys = 1024;
struct SelectShared {
  typename Scan::TempStorage scan;
  unsigned int histogram[kRadixBins];
  int warp_above[kWarpsPerBlock], warp_equal[kWarpsPerBlock];
  uint32_t prefix, mask;
  int remaining;
  int in_bin;      // keys in the bin the last pass chose
  int at_or_above;  // keys under the last pass's prefix in that bin or above it
  int list_count;  // -1: no list (the later passes walk every key)
  bool ordered;    // the list holds every key at or above the first digit's bin, in ascending index
};

// Appends j to the list when `in` (one shared atomic per warp; the list's order is not kept).
// Every lane of the warp must call it.
__device__ void ListInto(int32_t* list, int* count, bool in, int32_t j) {
  const unsigned in_lanes = __ballot_sync(0xffffffffu, in);
  if (in_lanes == 0) return;
  const int lane = threadIdx.x & 31, leader = __ffs(in_lanes) - 1;
  int at = 0;
  if (lane == leader) at = atomicAdd(count, __popc(in_lanes));
  at = __shfl_sync(0xffffffffu, at, leader);
  if (in) list[at + __popc(in_lanes & ((1u << lane) - 1))] = j;
}

// The min(k, n) best of score[0, n) (ties towards the lower index), emit(j, position) called for
// each in ascending j with positions 0, 1, ... The whole block calls it; score is read-only.
// list: kListKeys ints of shared memory for the later passes (above), or null. first_counted: the
// caller has counted every key's first digit into sh.histogram (ReduceInto, into a histogram
// it zeroed), so the first pass does not walk the keys. Inlined, so that scores in shared memory
// are read with shared loads.
template <bool kOrdered = true, typename Emit>
__device__ __forceinline__ void BlockTopK(const float* score, int32_t n, int k, SelectShared& sh, int32_t* list,
                                          bool first_counted, Emit emit) {
  if (k >= n) {
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) emit(j, j);
    return;
  }
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.mask = 0;
    sh.remaining = k;  // how many of the best we still have to place at or below the prefix
    sh.list_count = -1;
    sh.ordered = false;
  }
  __syncthreads();
  // Radix select of the k-th largest key, one digit at a time from the top.
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = pass < 3 ? kFirstDigitShift - 10 * pass : 0;
    const uint32_t digit_mask = pass < 3 ? 0x3FFu : 0x3u;
    const bool counted = pass == 0 && first_counted;
    if (!counted) {
      for (int i = threadIdx.x; i < kRadixBins; i += blockDim.x) sh.histogram[i] = 0;
    }
    __syncthreads();
    const uint32_t prefix = sh.prefix, mask = sh.mask;
    const int listed = sh.list_count;
    if (counted) {
      // the histogram is the caller's
    } else if (listed >= 0) {  // the keys under the prefix, listed after the first pass
      for (int32_t base = 0; base < listed; base += blockDim.x) {
        const int32_t i = base + threadIdx.x;
        const uint32_t key = i < listed ? OrderKey(score[list[i]]) : 0;
        CountInto(sh.histogram, i < listed && (key & mask) == prefix, (key >> shift) & digit_mask);
      }
    } else {
      for (int32_t base = 0; base < n; base += blockDim.x) {  // whole warps iterate together
        const int32_t j = base + threadIdx.x;
        const uint32_t key = j < n ? OrderKey(score[j]) : 0;
        CountInto(sh.histogram, j < n && (key & mask) == prefix, (key >> shift) & digit_mask);
      }
    }
    __syncthreads();
    // The digit holding the k-th best: thread t holds bins kRadixBins - 1 - (kBinsPerThread t + i)
    // (from the top); one scan sums the threads' counts, and the one thread whose run crosses
    // `remaining` walks its bins to the digit.
    const int remaining = sh.remaining;
    int bins[kBinsPerThread];
    int count = 0;
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) {
      bins[i] = static_cast<int>(sh.histogram[kRadixBins - 1 - (kBinsPerThread * threadIdx.x + i)]);
      count += bins[i];
    }
    int from_top = 0;
    Scan(sh.scan).InclusiveSum(count, from_top);
    int above = from_top - count;  // keys under the prefix in the bins above this thread's
    if (above < remaining && from_top >= remaining) {
#pragma unroll
      for (int i = 0; i < kBinsPerThread; ++i) {
        if (above + bins[i] >= remaining) {
          const uint32_t digit = kRadixBins - 1 - (kBinsPerThread * threadIdx.x + i);
          sh.prefix = prefix | (digit << shift);
          sh.mask = mask | (digit_mask << shift);
          sh.remaining = remaining - above;  // keys equal to the final threshold to take
          sh.in_bin = bins[i];
          sh.at_or_above = above + bins[i];
          break;
        }
        above += bins[i];
      }
    }
    __syncthreads();
    if (kOrdered && pass == 0 && list && sh.at_or_above <= kListKeys && n <= 32 * kThreads) {
      // The ordered list: every key at or above the first digit's bin (the k - remaining above
      // it and the bin's), in ascending index, for parts of up to 32 kThreads keys. A walk over
      // the keys writes their flags, a word of 32 consecutive keys per warp and step, into the
      // histogram (the scan has read it; pass 1 zeroes it again); thread t lists word t's keys,
      // placed by a scan.
      const uint32_t first_prefix = sh.prefix;  // keys >= it: the bin and the bins above
      unsigned int* words = sh.histogram;
      const bool word_lane = (threadIdx.x & 31) == 0;
      unsigned int* const warp_words = words + threadIdx.x / 32;  // base's word of the warp's 32 keys
      int32_t base = 0;
      for (; base + 4 * kThreads <= n; base += 4 * kThreads) {  // four steps' loads in flight, unguarded
        unsigned flags[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          flags[u] = __ballot_sync(kAllLanes, OrderKey(score[base + u * kThreads + threadIdx.x]) >= first_prefix);
        }
        if (word_lane) {
#pragma unroll
          for (int u = 0; u < 4; ++u) warp_words[(base >> 5) + u * kWarpsPerBlock] = flags[u];
        }
      }
      for (; base < n; base += kThreads) {
        const int32_t j = base + threadIdx.x;
        const unsigned flags = __ballot_sync(kAllLanes, j < n && OrderKey(score[j < n ? j : 0]) >= first_prefix);
        if (word_lane && j < n) words[j >> 5] = flags;
      }
      __syncthreads();
      unsigned bits = static_cast<int32_t>(32 * threadIdx.x) < n ? words[threadIdx.x] : 0u;  // thread t: keys [32 t, 32 t + 32)
      int at = 0;
      Scan(sh.scan).ExclusiveSum(__popc(bits), at);
      for (; bits != 0; bits &= bits - 1) list[at++] = 32 * static_cast<int32_t>(threadIdx.x) + __ffs(bits) - 1;
      if (threadIdx.x == 0) sh.list_count = sh.at_or_above, sh.ordered = true;
      __syncthreads();
    } else if (pass == 0 && list && sh.in_bin <= kListKeys) {  // list the first digit's keys for the later passes
      if (threadIdx.x == 0) sh.list_count = 0;
      __syncthreads();
      const uint32_t first_prefix = sh.prefix, first_mask = sh.mask;
      for (int32_t base = 0; base < n; base += blockDim.x) {
        const int32_t j = base + threadIdx.x;
        ListInto(list, &sh.list_count, j < n && (OrderKey(score[j < n ? j : 0]) & first_mask) == first_prefix, j);
      }
      __syncthreads();
    }
  }
  const uint32_t threshold = sh.prefix;
  const int take_equal = sh.remaining;
  if (kOrdered && sh.ordered) {
    // Every key taken is in the ordered list: thread t takes its run of it, [per t, per (t + 1)),
    // and one scan counts the keys above the threshold (high half) and equal to it (low half)
    // in the runs before; a key's position is the keys above before it plus the equal ones
    // before it, up to take_equal.
    constexpr int kPerThread = kListKeys / kThreads;
    const int listed = sh.list_count;
    const int per = (listed + kThreads - 1) / kThreads;
    const int e_lo = static_cast<int>(threadIdx.x) * per;
    int counts = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (i < per && e_lo + i < listed) {
        const uint32_t key = OrderKey(score[list[e_lo + i]]);
        counts += key > threshold ? 1 << 16 : key == threshold ? 1 : 0;
      }
    }
    int before = 0;
    Scan(sh.scan).ExclusiveSum(counts, before);
    int above_before = before >> 16, equal_before = before & 0xFFFF;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (i < per && e_lo + i < listed) {
        const int32_t j = list[e_lo + i];
        const uint32_t key = OrderKey(score[j]);
        if (key > threshold) {
          emit(j, above_before + min(equal_before, take_equal));
          ++above_before;
        } else if (key == threshold) {
          if (equal_before < take_equal) emit(j, above_before + equal_before);
          ++equal_before;
        }
      }
    }
    __syncthreads();  // `sh` and `score` may be reused by the caller
    return;
  }

  // Ordered pass: warp w owns a contiguous chunk of the keys and walks it 32 consecutive keys at a
  // time (conflict-free shared loads); ballots count and place what it takes. Of the keys equal
  // to the threshold, the take_equal with the lowest indices are taken.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned below_lane = (1u << lane) - 1;
  const int32_t chunk = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int32_t lo = min(n, warp * chunk), hi = min(n, lo + chunk);
  int above = 0, equal = 0;
  for (int32_t b = lo; b < hi; b += 32) {
    const int32_t j = b + lane;
    const uint32_t key = j < hi ? OrderKey(score[j]) : 0;
    above += __popc(__ballot_sync(kAllLanes, j < hi && key > threshold));
    equal += __popc(__ballot_sync(kAllLanes, j < hi && key == threshold));
  }
  if (lane == 0) sh.warp_above[warp] = above, sh.warp_equal[warp] = equal;
  __syncthreads();
  int equal_before = 0, taken_before = 0;
  for (int w = 0; w < warp; ++w) {
    taken_before += sh.warp_above[w] + max(0, min(sh.warp_equal[w], take_equal - equal_before));
    equal_before += sh.warp_equal[w];
  }
  const int take_mine = max(0, min(equal, take_equal - equal_before));
  int pos = taken_before, equal_seen = 0;
  for (int32_t b = lo; b < hi; b += 32) {
    const int32_t j = b + lane;
    const uint32_t key = j < hi ? OrderKey(score[j]) : 0;
    const bool is_equal = j < hi && key == threshold;
    const unsigned equals = __ballot_sync(kAllLanes, is_equal);
    const bool take = (j < hi && key > threshold) || (is_equal && equal_seen + __popc(equals & below_lane) < take_mine);
    const unsigned takes = __ballot_sync(kAllLanes, take);
    if (take) emit(j, pos + __popc(takes & below_lane));
    pos += __popc(takes);
    equal_seen += __popc(equals);
  }
  __syncthreads();  // `sh` and `score` may be reused by the caller
}

// exp(v - m) / l from a raw score and its head's statistics, as ex2 of one FFMA and one approximate
// division (~7 instructions; the correctly rounded expf and division took ~35, half of phase
// one's instructions per token). Within ~2.4e-6 relative of the exact value (the exact path was
// within ~2.4e-7 of the CPU's), and 0 below exp(-87.3) (flushed), where the CPU keeps subnormals:
// selections differ from the CPU's only between probabilities that close. Most agent tests
// compare selections exactly (fixed seeds): gpu_agent_device_test passed with it on an H200; run
// it again after any change here. The same inputs give the same bits, so BudgetKernel's
// recomputation equals phase one's. The division is e times the approximate reciprocal of l, the
// bits of __fdividef(e, l) for a normal l (a softmax's sum is >= 1), so that phase one takes each
// head's two constants (HeadScale) once per block from shared memory: per token and head it had
// loaded both statistics and recomputed them (~10 of its instructions; ncu, 24 x 32K).
constexpr float kLog2e = 1.4426950408889634f;
struct HeadScale {
  float neg_m_log2e;  // -m log2(e)
  float inv_l;        // 1 / l, approximate
};
__device__ __forceinline__ HeadScale HeadScaleOf(const float* stats, int h) {
  return {-stats[2 * h] * kLog2e, __fdividef(1.0f, stats[2 * h + 1])};
}
__device__ __forceinline__ float Normalised(float v, HeadScale hs) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(fmaf(v, kLog2e, hs.neg_m_log2e)));
  return e * hs.inv_l;
}

// One head's probability v of a token folded into its group's reduction s, in head order as the
// CPU folds them: normalised first when the segment has statistics (hs: that head's HeadScale in
// shared memory, else null; never a local's address, which would put the local in local memory);
// NaN is -inf.
__device__ __forceinline__ float FoldHead(float s, float v, const HeadScale* hs, bool use_max) {
  if (hs) v = Normalised(v, *hs);
  if (isnan(v)) v = -INFINITY;
  return use_max ? fmaxf(s, v) : __fadd_rn(s, v);
}
// FoldHead of the group's first head into the empty reduction (-inf for the max, 0 for the sum),
// the same bits without the empty reduction's value: fmaxf(-inf, v) is v (v is not NaN) and 0 + v
// is v + 0 (-0 becomes +0 either way).
__device__ __forceinline__ float FirstHead(float v, const HeadScale* hs, bool use_max) {
  if (hs) v = Normalised(v, *hs);
  if (isnan(v)) v = -INFINITY;
  return use_max ? v : __fadd_rn(v, 0.0f);
}

// The group's reduction after its last head: the max, or the sum / n_heads. inv_heads: 1 / n_heads
// when n_heads is a power of two (the sum times it is the sum / n_heads, bit for bit, without a
// correctly rounded division per token), else 0. Never NaN, as cpu::ReduceGroupScores: a sum of
// +inf and -inf (a head's NaN) is -inf, ranked lowest.
__device__ __forceinline__ float FinishedReduction(float s, int n_heads, float inv_heads, bool use_max) {
  if (use_max) return s;
  const float mean = inv_heads != 0.0f ? __fmul_rn(s, inv_heads) : __fdiv_rn(s, static_cast<float>(n_heads));
  return isnan(mean) ? -INFINITY : mean;
}

// Reduced score of token j: the GQA group's probabilities (normalised on the fly when the
// segment has statistics), summed in head order as the CPU does, or their max. `scales`: the heads'
// HeadScale in shared memory, or null to compute them here from the statistics (the same bits).
__device__ float ReducedScore(const TopKSegment& seg, int n_heads, float inv_heads, int32_t j, bool use_max,
                              const HeadScale* scales) {
  float s = 0.0f;
  for (int h = 0; h < n_heads; ++h) {  // n_heads >= 1
    float v = seg.probs[static_cast<size_t>(h) * seg.n + j];
    if (seg.stats) v = Normalised(v, scales ? scales[h] : HeadScaleOf(seg.stats, h));
    s = h == 0 ? FirstHead(v, nullptr, use_max) : FoldHead(s, v, nullptr, use_max);
  }
  return FinishedReduction(s, n_heads, inv_heads, use_max);
}

// score[j] = the reduced score of token lo + j, j < m, the block's threads striding over j (with
// the heads' HeadScale from `scales`: shared memory for groups of up to 8 heads with statistics,
// else null: without statistics, or computed per token for larger groups), and
// each key's first radix digit counted into `histogram` (BlockTopK's first pass, here while the
// next loads are in flight instead of in a pass of its own over the scores; ncu, 24 x 32K: that
// pass was ~26% of phase one's stall samples). A warp's lanes iterate together (CountInto).
// kHeads > 0 is the group's size known when compiled: a thread issues the loads of all its
// kTokens tokens' heads (16 loads, in the 64 registers of four blocks an SM; with 8 loads and five
// blocks, 48 registers, the top-k took 3-4% longer at 176 x 8K and 46 x 32K, 1.4% at 32 x 8K, where
// with the adaptive budget it took 2.2% less: H100, bench_results/variants_goals_h100_r41.txt)
// before it folds any.
// With a loop over a run-time head count a thread had about one load in flight, and phase one read
// its scores at under 1 TB/s. kHeads = 0: any n_heads, four tokens at a time. A thread's stores
// come after all its loads either way: the compiler keeps a load behind an earlier store that may
// alias it (score may be global scratch).
template <int kHeads, bool kFullWarps = true>
__device__ __forceinline__ void ReduceInto(float* score, const TopKSegment& seg, int n_heads, float inv_heads,
                                           int32_t lo, int32_t m, bool use_max, const HeadScale* scales,
                                           unsigned int* histogram) {
  constexpr int kTokens = kHeads == 0 ? 4 : kHeads >= 16 ? 1 : 16 / kHeads;
  const int32_t stride = static_cast<int32_t>(blockDim.x);
  const int lane = threadIdx.x & 31;
  for (int32_t w0 = threadIdx.x - lane; w0 < m; w0 += kTokens * stride) {
    const int32_t j0 = w0 + lane;
    float reduced[kTokens];
    if constexpr (kHeads > 0) {
      float v[kTokens][kHeads];
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        const int32_t j = j0 + u * stride;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) v[u][h] = j < m ? seg.probs[static_cast<size_t>(h) * seg.n + lo + j] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        float s = FirstHead(v[u][0], scales, use_max);
#pragma unroll
        for (int h = 1; h < kHeads; ++h) s = FoldHead(s, v[u][h], scales ? scales + h : nullptr, use_max);
        reduced[u] = FinishedReduction(s, kHeads, inv_heads, use_max);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        const int32_t j = j0 + u * stride;
        reduced[u] = j < m ? ReducedScore(seg, n_heads, inv_heads, lo + j, use_max, scales) : 0.0f;
      }
    }
    if (kFullWarps && w0 + (kTokens - 1) * stride + 32 <= m) {  // the warp's tokens all below m (most steps)
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        score[j0 + u * stride] = reduced[u];
        CountAllInto(histogram, OrderKey(reduced[u]) >> kFirstDigitShift);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        const int32_t j = j0 + u * stride;
        if (j < m) score[j] = reduced[u];
        CountInto(histogram, j < m, OrderKey(reduced[u]) >> kFirstDigitShift);
      }
    }
  }
}

// The positive part of a reduced score: what the candidates' mass adds.
__device__ float MassOf(float score) { return score > 0.0f ? score : 0.0f; }

// cpu::CandidateMass's run sums of score[0, m), which starts at token `first` (a multiple of 256):
// warp w sums runs w, w + 8, ... Lane l holds x[l + 32 i] (i < 8): the tree's levels 128, 64 and
// 32 add within the lane, levels 16 to 1 across lanes (lane l adds lane l + h's value), so every
// addition is the CPU's. Run r's sum goes to run_sums[first / 256 + r].
__device__ void SumRuns(const float* score, int32_t m, int32_t first, float* run_sums) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int32_t r = warp; r * 256 < m; r += warps) {
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int32_t j = r * 256 + lane + 32 * i;
      x[i] = j < m ? MassOf(score[j]) : 0.0f;
    }
#pragma unroll
    for (int h = 4; h >= 1; h /= 2) {
#pragma unroll
      for (int i = 0; i < h; ++i) x[i] = __fadd_rn(x[i], x[i + h]);
    }
#pragma unroll
    for (int h = 16; h >= 1; h /= 2) x[0] = __fadd_rn(x[0], __shfl_down_sync(0xffffffffu, x[0], h));
    if (lane == 0) run_sums[first / 256 + r] = x[0];
  }
}

// A segment's merge holds every part's k candidates (score and token) in shared memory: at most
// kMaxMergeCandidates (topk_parts.h; 48 KiB of them, beside the list and the static arrays: the opt-in).

// TopKPartKernel's dynamic shared memory: `room` floats for the part's scores or, in a segment's
// last part, the parts' candidates (2 k parts), then the radix select's list.
constexpr int ScoreRoom(int part_tokens, int k, int most_parts) {
  return most_parts > 1 ? std::max(part_tokens, 2 * k * most_parts) : part_tokens;
}
constexpr size_t PartSharedBytes(int room) { return (static_cast<size_t>(room) + kListKeys) * sizeof(float); }

// Block (part, segment). A segment of one part writes its tokens; otherwise the part's candidates
// go to the segment's scratch (scores at [part * k], tokens at [parts * k + part * k]) and the
// segment's last part to finish (its counter in the slot's zeroed bytes) merges them: the best k
// of the parts' candidates, which took a kernel of its own before (10 us a layer at 32 x 8K under
// ncu, for selections of a few hundred candidates a segment).
// Four blocks per SM (64 registers: phase one's loads in flight, ReduceInto; ptxas: 20 bytes of
// spill stores and 84 of loads, against 40 and 140 at five blocks and 48 registers). The cut
// (ChooseTopKParts) reads the blocks an SM from the occupancy API; its one-wave cuts were measured
// again at four (topk_parts.h).
// The set's scalars are parameters (constant-bank operands) and the block's segment is copied
// into shared memory first: read from the slot in global memory, the compiler held them in
// registers through the selection (ptxas: 164 bytes of spill loads; 76 this way, none when the
// whole batch was a parameter). Measured no slower than the parameter: one layer's top-k at
// 32 x 8K 0.039 -> 0.036 ms, 99 x 8K 0.117 -> 0.114 (H200).
__global__ void __launch_bounds__(kThreads, 4) TopKPartKernel(const TopKSegment* __restrict__ segments,
                                                               unsigned int* __restrict__ parts_done, int k,
                                                               int part_tokens, int room, bool mass, int n_heads,
                                                               bool use_max) {
  // [room]: the part's scores (when they fit) or the segment's candidates; then the list [kListKeys]
  extern __shared__ float part_scores[];
  __shared__ SelectShared sh;
  __shared__ TopKSegment seg;
  __shared__ bool last_part;
  if (threadIdx.x == 0) seg = segments[blockIdx.y];
  for (int i = threadIdx.x; i < kRadixBins; i += blockDim.x) sh.histogram[i] = 0;  // ReduceInto counts into it
  WaitForPrerequisite();  // the scores and statistics of the kernels before (LaunchAfter)
  AllowDependentLaunch();
  __syncthreads();
  const int32_t n = seg.n;
  const int parts = PartsOf(n, part_tokens, k);
  const int32_t lo = parts == 1 ? 0 : static_cast<int32_t>(blockIdx.x) * part_tokens;
  if ((parts == 1 && blockIdx.x > 0) || lo >= n || n <= 0) return;
  const int32_t m = parts == 1 ? n : min(part_tokens, n - lo);
  int32_t* list = reinterpret_cast<int32_t*>(part_scores + room);
  const float inv_heads = (n_heads & (n_heads - 1)) == 0 ? 1.0f / static_cast<float>(n_heads) : 0.0f;
  // The heads' HeadScale, for groups of up to 8 heads (the compiled ones and 3, 5, 6, 7).
  constexpr int kScaledHeads = 8;
  __shared__ HeadScale head_scales[kScaledHeads];
  const HeadScale* scales = seg.stats != nullptr && n_heads <= kScaledHeads ? head_scales : nullptr;
  if (scales && threadIdx.x < n_heads) head_scales[threadIdx.x] = HeadScaleOf(seg.stats, threadIdx.x);
  __syncthreads();
  // The part's reduced scores at `score`, then its selection. Called with the shared array or
  // the segment's scratch, each inlined, so that the compiler knows shared memory's accesses.
  // in_shared: std::true_type with the shared array, whose instances take BlockTopK's ordered
  // list and ReduceInto's full-warp counts; the scratch's (a lone part longer than shared memory,
  // rare) keep the code before those (with them ptxas spilled in its ReduceInto loops).
  auto reduce_and_select = [&](float* score, auto in_shared) {
    switch (n_heads) {  // the common GQA groups compiled; 3, 5, 6, 7 and larger take the loop
      case 1: ReduceInto<1, decltype(in_shared)::value>(score, seg, n_heads, inv_heads, lo, m, use_max, scales, sh.histogram); break;
      case 2: ReduceInto<2, decltype(in_shared)::value>(score, seg, n_heads, inv_heads, lo, m, use_max, scales, sh.histogram); break;
      case 4: ReduceInto<4, decltype(in_shared)::value>(score, seg, n_heads, inv_heads, lo, m, use_max, scales, sh.histogram); break;
      case 8: ReduceInto<8, decltype(in_shared)::value>(score, seg, n_heads, inv_heads, lo, m, use_max, scales, sh.histogram); break;
      default: ReduceInto<0, decltype(in_shared)::value>(score, seg, n_heads, inv_heads, lo, m, use_max, scales, sh.histogram); break;
    }
    __syncthreads();
    if (mass) SumRuns(score, m, lo, seg.scratch + n);  // beyond the candidates' and scores' [0, n)
    if (parts == 1) {
      BlockTopK<decltype(in_shared)::value>(score, m, k, sh, list, true, [&](int32_t j, int pos) { seg.tokens[pos] = j; });
      return;
    }
    float* cand_score = seg.scratch + static_cast<size_t>(blockIdx.x) * k;
    int32_t* cand_token = reinterpret_cast<int32_t*>(seg.scratch) + static_cast<size_t>(parts + blockIdx.x) * k;
    BlockTopK<decltype(in_shared)::value>(score, m, k, sh, list, true, [&](int32_t j, int pos) {
      cand_score[pos] = score[j];
      cand_token[pos] = lo + j;
    });
  };
  // A lone part longer than shared memory holds keeps its scores in the segment's scratch.
  if (m <= part_tokens) {
    reduce_and_select(part_scores, std::true_type{});
  } else {
    reduce_and_select(seg.scratch, std::false_type{});
  }
  if (parts == 1) return;
  // The last part: every thread's candidate stores made visible before the block counts itself
  // done (BlockTopK ended with a barrier); the block that counts last merges.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* done = parts_done + blockIdx.y;
    last_part = atomicAdd(done, 1u) == static_cast<unsigned>(parts - 1);
    if (last_part) *done = 0;  // every part has counted: zero for the slot's next call (or a graph's replay)
    __threadfence();
  }
  __syncthreads();
  if (!last_part) return;
  // The parts' candidates in part order (the last part may leave fewer than k: it has min(k, m)),
  // read past L1 (other SMs wrote them).
  const int32_t count = (parts - 1) * k + min(k, n - (parts - 1) * part_tokens);
  if (count <= kThreads) {
    // A candidate a thread, taken when fewer than k others rank above it (a larger key, or an
    // equal key at a lower index: BlockTopK's rule), placed by a scan in candidate order. One
    // pass over the keys in shared memory: the radix select's four passes and their barriers,
    // run by the last block while the segment's other parts had freed their slots, made the
    // merged top-k 2% slower at 99 x 8K than the merge kernel it replaced (H200).
    uint32_t* keys = reinterpret_cast<uint32_t*>(part_scores);
    const int32_t i = threadIdx.x;
    uint32_t key = 0;
    int32_t token = 0;
    if (i < count) {
      const int p = i / k, c = i % k;
      key = OrderKey(__ldcg(seg.scratch + static_cast<size_t>(p) * k + c));
      token = __ldcg(reinterpret_cast<const int32_t*>(seg.scratch) + static_cast<size_t>(parts + p) * k + c);
      keys[i] = key;
    }
    __syncthreads();
    int above = 0;
    if (i < count) {
      for (int32_t j = 0; j < count; ++j) {
        const uint32_t other = keys[j];
        above += other > key || (other == key && j < i);
      }
    }
    const bool take = i < count && above < k;
    int pos = 0;
    Scan(sh.scan).ExclusiveSum(take ? 1 : 0, pos);
    if (take) seg.tokens[pos] = token;
    return;
  }
  float* merged = part_scores;
  int32_t* tokens = reinterpret_cast<int32_t*>(part_scores + count);
  for (int32_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int p = i / k, c = i % k;
    merged[i] = __ldcg(seg.scratch + static_cast<size_t>(p) * k + c);
    tokens[i] = __ldcg(reinterpret_cast<const int32_t*>(seg.scratch) + static_cast<size_t>(parts + p) * k + c);
  }
  __syncthreads();
  BlockTopK(merged, count, k, sh, list, false, [&](int32_t j, int pos) { seg.tokens[pos] = tokens[j]; });
}

// The largest float f with OrderKey(f) == key.
__device__ float FromOrderKey(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Block per segment, after the top k: the adaptive budget (cpu::BudgetRows). The kept = min(k, n)
// selected rows, ascending in `tokens`, are sorted by rank (score descending, then token
// ascending: a 64-bit key of the score's order key and the complement of the row's index) in
// shared memory; one thread walks the ranks summing the positive scores until the goal (after
// k_min rows); the rows above the cut keep their ascending order, the rest become kNoToken. The
// block's segment is copied to shared memory first, while the selection may still run (the slot
// may be read in place, over the link).
__global__ void BudgetKernel(const TopKSegment* __restrict__ segments, int k, int n_heads, bool use_max,
                             TopKBudget budget) {
  extern __shared__ unsigned long long keys[];  // [width]: a power of two >= kept
  __shared__ unsigned char keep[kMaxBudgetRows];
  __shared__ int32_t cut;
  __shared__ Scan::TempStorage scan;
  __shared__ TopKSegment seg;
  if (threadIdx.x == 0) seg = segments[blockIdx.x];
  WaitForPrerequisite();  // the selection (LaunchAfter)
  __syncthreads();
  const int32_t n = seg.n;
  if (n <= 0) return;
  const int kept = min(k, n);
  int width = 1;
  while (width < kept) width *= 2;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    // Scores are recomputed as phase one computed them: the same function and inputs, dividing by
    // the group where phase one multiplies by its power-of-two inverse (the same bits).
    keys[i] = i < kept ? (static_cast<unsigned long long>(OrderKey(ReducedScore(seg, n_heads, 0.0f, seg.tokens[i], use_max, nullptr))) << 32) |
                             (0xFFFFFFFFu - static_cast<uint32_t>(i))
                       : 0ull;  // below every real key (OrderKey(-inf) > 0)
  }
  __syncthreads();
  // Bitonic sort, descending.
  for (int size = 2; size <= width; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const int j = i ^ stride;
        if (j <= i) continue;
        const bool descending = (i & size) == 0;
        const unsigned long long a = keys[i], b = keys[j];
        if (descending ? a < b : a > b) {
          keys[i] = b;
          keys[j] = a;
        }
      }
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) {
    const float* run_sums = seg.scratch + n;
    float total = 0.0f;
    for (int32_t r = 0; r * 256 < n; ++r) total = __fadd_rn(total, run_sums[r]);
    const float goal = __fmul_rn(budget.mass, total);
    float sum = 0.0f;
    int c = kept;
    for (int i = 0; i < kept; ++i) {
      sum = __fadd_rn(sum, MassOf(FromOrderKey(static_cast<uint32_t>(keys[i] >> 32))));
      if (i + 1 >= budget.k_min && sum >= goal) {
        c = i + 1;
        break;
      }
    }
    cut = c;
    if (seg.count) *seg.count = c;
    if (budget.rows) atomicAdd(budget.rows, static_cast<unsigned long long>(c));
  }
  __syncthreads();
  const int c = cut;
  for (int r = threadIdx.x; r < kept; r += blockDim.x) {
    keep[0xFFFFFFFFu - static_cast<uint32_t>(keys[r] & 0xFFFFFFFFu)] = r < c ? 1 : 0;
  }
  __syncthreads();
  // Compaction in place: each thread reads its run of the list first, one scan places the runs.
  constexpr int kPerThread = kMaxBudgetRows / kThreads;
  const int per = (kept + blockDim.x - 1) / blockDim.x;
  const int lo = min(kept, static_cast<int>(threadIdx.x) * per), hi = min(kept, lo + per);
  int32_t mine[kPerThread];
  int count = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (lo + i < hi && keep[lo + i]) mine[count++] = seg.tokens[lo + i];
  }
  int pos = 0;
  Scan(scan).ExclusiveSum(count, pos);
  __syncthreads();  // every row is read before any is written
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (i < count) seg.tokens[pos + i] = mine[i];
  }
  for (int i = c + threadIdx.x; i < kept; i += blockDim.x) seg.tokens[i] = kNoToken;
}

// Phase-one blocks one SM holds at once (its registers bind first), at the largest part's shared
// memory; asked once per device.
int PartBlocksPerSm() {
  static std::atomic<int> known[kMaxKnownDevices] = {};
  return KnownForCurrentDevice(known, 4, [](int) {
    int blocks = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, TopKPartKernel, kThreads,
                                                         PartSharedBytes(kMaxPartTokens)) == cudaSuccess &&
                   blocks >= 1
               ? blocks : 4;
  });
}

}  // namespace

Status SelectTopKBatch(const TopKSegment* segments, int count, int n_heads, int k, GroupReduction reduction,
                       void* stream, const TopKBudget* budget, DecodePlan* plan) {
  if (plan == nullptr) {
    return WithOwnPlan(static_cast<cudaStream_t>(stream), DecodePlan::SlotReads::kDeviceCopy, [&](DecodePlan* own) {
      return SelectTopKBatch(segments, count, n_heads, k, reduction, stream, budget, own);
    });
  }
  if (count < 0 || n_heads <= 0) return Status::InvalidArgument("bad top-k shape");
  if (k <= 0) return Status::Ok();
  if (budget && (!(budget->mass > 0 && budget->mass <= 1) || budget->k_min < 1 || k > kMaxBudgetRows)) {
    return Status::InvalidArgument("top-k budget: mass must lie in (0, 1], k_min be positive and k at most " +
                                   std::to_string(kMaxBudgetRows) + " (k " + std::to_string(k) + ")");
  }
  auto* s = static_cast<cudaStream_t>(stream);
  const int per_set = EqualLaunchSize(count, kMaxTopKSegments);  // one set unless the grid's rows run out
  for (int first = 0; first < count; first += per_set) {
    const int set_count = std::min(per_set, count - first);
    const TopKSegment* const set = segments + first;
    TopKParts cut;
    SPECACHE_RETURN_IF_ERROR(plan->forced_topk_part_tokens() > 0
                                 ? ForcedTopKParts(set, set_count, k, plan->forced_topk_part_tokens(), &cut)
                                 : ChooseTopKParts(set, set_count, k, MultiprocessorCount(), PartBlocksPerSm(), &cut));
    const int max_parts = cut.max_parts;
    const int room = ScoreRoom(cut.part_tokens, k, max_parts);
    if (max_parts > 1) {  // before anything is queued: a refusal leaves the stream as it was
      static std::atomic<bool> allowed[kMaxOptInDevices] = {};
      const cudaError_t err =
          AllowDynamicSharedMemory(TopKPartKernel, PartSharedBytes(2 * kMaxMergeCandidates), allowed);
      if (err != cudaSuccess) return Status::Unavailable(std::string("top-k merge: ") + cudaGetErrorString(err));
    }
    // The segments to the device, or read in place (as kernel parameters they cost the host ~3x a
    // plain launch and capped a set at 640 segments), read there by the set's kernels; the parts'
    // counters (segments of several parts only) in the slot's zeroed device bytes.
    const size_t segment_bytes = static_cast<size_t>(set_count) * sizeof(TopKSegment);
    const size_t counter_bytes = max_parts > 1 ? static_cast<size_t>(set_count) * sizeof(unsigned int) : 0;
    SPECACHE_ASSIGN_OR_RETURN(const DecodePlan::Impl::Upload up, plan->impl()->Begin(segment_bytes, s, counter_bytes));
    std::memcpy(up.host, set, segment_bytes);
    SPECACHE_RETURN_IF_ERROR(plan->impl()->Send(up, segment_bytes, s));  // released if it failed
    const auto* device_segments = static_cast<const TopKSegment*>(up.device);
    auto* parts_done = static_cast<unsigned int*>(up.zeroed);
    const unsigned n = static_cast<unsigned>(set_count);
    // Each kernel as its predecessor's programmatic dependent (dependent_launch.cuh). With a
    // budget, phase one also sums the runs of scores into scratch[n, n + runs) (its total).
    cudaError_t err = LaunchAfter<TopKPartKernel>(dim3(max_parts, n), dim3(kThreads), PartSharedBytes(room), s,
                                  device_segments, parts_done, k, cut.part_tokens, room, budget != nullptr, n_heads,
                                  reduction == GroupReduction::kMax);
    if (budget) {
      int32_t most = 0;
      for (int i = 0; i < set_count; ++i) most = std::max(most, std::min<int32_t>(k, set[i].n));
      size_t width = 1;
      while (width < static_cast<size_t>(most)) width *= 2;
      if (err == cudaSuccess) {
        err = LaunchAfter<BudgetKernel>(dim3(n), dim3(kThreads), width * sizeof(unsigned long long), s,
                          device_segments, k, n_heads, reduction == GroupReduction::kMax,
                          *budget);
      }
    }
    if (err != cudaSuccess) (void)cudaGetLastError();  // returned here, not left for the next check
    SPECACHE_RETURN_IF_ERROR(plan->impl()->Finish(up, s));
    SPECACHE_RETURN_IF_ERROR(CudaStatus(err, "top-k kernels"));
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
