// The tensor-core path of the decode attention (AttendDecodeBatch routes eligible items here).
//
// Work: each item's context is cut into units. The bulk units cover the tokens whose key and
// value are both quantized, in whole blocks of 32 tokens, as many units as fill one wave of the
// GPU (less the CTA slots the plan leaves free; see LowBitSet for the tails' place in it); up to 4
// tail units cover the rest (residual keys, value window, the step's new rows,
// causal among themselves), on the tensor cores for 1-bit replicas with one query tile
// (TailUnitMma), else on the CUDA cores. One warp runs one unit with an online softmax and
// writes a partial result (per query: running max, sum of exponentials, unnormalised output); a
// merge kernel combines an item's units in order, writes the outputs and the probabilities row's
// statistics (or the probabilities).
//
// Bulk block of 32 tokens, per warp (mma.m16n8k16, fp16 operands, fp32 accumulation), its bytes
// copied to shared memory a block ahead (cp.async):
//   scores [32 tokens x 8 queries] = (codes x key scale) [32 x d] x q [d x 8]: A exact in fp16 (a
//       code bit masks its fp16 scale; 2-bit codes are two bit planes), the queries as fp16 hi +
//       lo parts scaled by a power of two (~22 bits); plus the key zeros' term sum_c q_c z_c as one
//       more mma (A = the group's zeros).
//   out^T [d x 8] += (codes x value scale)^T [d x 32] x p [32 x 8], p as hi + lo parts, into
//       fresh accumulators per block added in fp32 (the tensor cores truncate); plus sum_t p_t z_t
//       as one more mma (A's row g = channel group g's zeros).
// Substituted rows: their scores are recomputed from the fetched key (fp32) before the softmax,
// their weight is taken out of the mma operand and their fetched value added in fp32.
//
// The lean path: items of replicas in the mma layout (DeviceReplicaView::mma_codes; 1-bit keys
// and values, at most 8 queries) have classes of their own, whose bulk units read each block's
// operand bits with one load per lane and one AND per operand register (mma_codes.h,
// LeanBulkUnit in lowbit_decode.cu for the arithmetic), and whose plan may run several waves of
// smaller units. Their scores and probabilities are exact as above; their outputs carry an fp16
// product per value operand (within 1e-3 of the fp32 reference).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "specache/cuda_attention.h"

namespace specache::cuda {

struct DeviceItemSet;  // decode_common.cuh

// The tensor-core path's warp orders (LowBitSet, DeviceItemSet::tail_order): DecodePlan::UnitOrder
// less kChosen.
enum TailOrder : int32_t { kTailsShared = 0, kTailsFirst = 1, kTailsLast = 2 };

// Warps (units) per CTA of the tensor-core attention.
constexpr int kLowBitWarpsPerCta = 4;
// Warps of the units that run first in the tails-first or -last order (the tail units, or the
// bulk units), rounded up to whole CTAs (the padding warps exit at once). A CTA stays resident
// until its last warp ends, so a CTA holding both a short tail unit and a long bulk unit would
// keep the tail's slot for the bulk's time instead of handing it to the wave's next unit.
SPECACHE_HOST_DEVICE inline int32_t PaddedWarps(int32_t units) {
  return (units + kLowBitWarpsPerCta - 1) / kLowBitWarpsPerCta * kLowBitWarpsPerCta;
}
// Warps the launch runs: every unit, plus the padding of the tails-first or -last order.
SPECACHE_HOST_DEVICE inline int32_t LaunchWarps(int32_t units, int32_t tail_units, int32_t order) {
  if (order == kTailsFirst) return PaddedWarps(tail_units) + (units - tail_units);
  if (order == kTailsLast) return PaddedWarps(units - tail_units) + tail_units;
  return units;
}
// How many of the entries 0, 1, ..., n - 1 satisfy `below` (which holds on a prefix of them and
// not after it, as for "entry < x" over an ascending array). On the device the whole warp
// searches (every lane calls it with the same n and predicate; blocks of whole warps along x):
// each round every lane tests the last entry of one 32nd of the range left and a ballot narrows
// it to one 32nd, so that n entries take ceil(log32 n) rounds of loads instead of log2 n dependent
// ones (~8 of them for a layer's 256 items, at every warp's start, where nothing hides them). On
// the host, a binary search.
template <class Below>
SPECACHE_HOST_DEVICE inline int PrefixLength(int n, Below below) {
  int lo = 0, hi = n;  // the answer is in [lo, hi]
#ifdef __CUDA_ARCH__
  const int lane = static_cast<int>(threadIdx.x & 31);
  while (hi > lo) {
    const int step = (hi - lo + 31) / 32;  // 1 in the last round: lane i tests entry lo + i
    const int at = lo + (lane + 1) * step - 1;
    const int c = __popc(__ballot_sync(0xffffffffu, at < hi && below(at)));  // a prefix of the lanes
    if (step == 1) return lo + c;
    hi = min(hi, lo + (c + 1) * step - 1);  // lane c's entry fails (or lies past hi)
    lo += c * step;
  }
#else
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (below(mid)) lo = mid + 1; else hi = mid;
  }
#endif
  return lo;
}
// The last i in [0, count) with begin(i) <= w, begin(i) = first[i] - (less ? less[i] : 0)
// ascending from 0 (PrefixLength: on the device, called by the whole warp).
SPECACHE_HOST_DEVICE inline int ItemOfWarp(const int32_t* first, const int32_t* less, int count, int w) {
  return PrefixLength(count, [&](int i) { return first[i] - (less ? less[i] : 0) <= w; }) - 1;
}
// Which unit warp w of a launch runs (DeviceItemSet's unit_begin and tail_begin over `count`
// items, `order` a TailOrder): true with its item and the unit's index among the item's units
// (its bulk units first, then its tail units), false for a warp past the units or a padding warp.
// kTailsShared: warp w runs unit w (the items' units in order). kTailsFirst: every item's tail
// units, then from the next whole CTA every item's bulk units. kTailsLast: the bulk units, then
// from the next whole CTA the tail units. An item's bulk units begin at unit_begin less the tail
// units before it. On the device every lane of the warp calls it (ItemOfWarp).
SPECACHE_HOST_DEVICE inline bool UnitOfWarp(const int32_t* unit_begin, const int32_t* tail_begin, int count,
                                            int32_t order, int w, int* item, int* unit) {
  if (w >= LaunchWarps(unit_begin[count], tail_begin[count], order)) return false;
  const int32_t tails = tail_begin[count], bulk = unit_begin[count] - tails;
  int wt = -1, wb = -1;  // the launch's tail unit, or bulk unit, this warp runs
  if (order == kTailsFirst) {
    if (w < tails) {
      wt = w;
    } else if (w >= PaddedWarps(tails)) {
      wb = w - PaddedWarps(tails);
    }
  } else if (order == kTailsLast) {
    if (w < bulk) {
      wb = w;
    } else if (w >= PaddedWarps(bulk)) {
      wt = w - PaddedWarps(bulk);
    }
  } else {
    *item = ItemOfWarp(unit_begin, nullptr, count, w);
    *unit = w - unit_begin[*item];
    return true;
  }
  if (wt >= 0) {
    const int i = ItemOfWarp(tail_begin, nullptr, count, wt);
    *item = i;
    *unit = unit_begin[i + 1] - unit_begin[i] - (tail_begin[i + 1] - tail_begin[i]) + (wt - tail_begin[i]);
    return true;
  }
  if (wb >= 0) {
    const int i = ItemOfWarp(unit_begin, tail_begin, count, wb);
    *item = i;
    *unit = wb - (unit_begin[i] - tail_begin[i]);
    return true;
  }
  return false;  // padding up to the next order's first CTA
}

// Whether the current device runs the tensor-core path (sm_80+).
bool LowBitDecodeAvailable();
// Most queries (rows x GQA heads) of an item the lean path takes: one n-tile of the values' mma.
constexpr int kLeanMaxQueries = 8;
// Whether `item` can take the tensor-core path (see above for the conditions; an item of a
// replica in the mma layout only with at most 8 queries, on its lean path), `available` being
// LowBitDecodeAvailable() (asked once per batch: it asks the driver for the current device).
bool LowBitDecodeEligible(const DeviceDecodeItem& item, bool available);

// One launch of the tensor-core path: items of one (key bits, value bits, head_dim, query tiles)
// class, each item's work cut into units (bulk units of chunk_blocks blocks of 32 tokens, then up
// to 4 tail units). Either all units share one wave of the GPU (kTailsShared), or the tail units
// run first and the bulk units alone fill the wave, taking the tails' slots as they finish
// (kTailsFirst), or the bulk units run first and the tails' CTAs take the slots the bulk leaves
// empty or frees first (kTailsLast). Sharing the wave, a short tail's warp sits idle in its CTA
// while the bulk runs (at 99 x 8K, 792 of 1984 warps). The general kernels' plan puts the tails
// first when they are short next to a bulk unit, else shares; the lean path's puts the tails last
// (PlanSet: the H200 sweep behind it).
// The kernel classes of the lean path (LowBitSet::kernel_class): head_dim 64, then 128; the other
// classes are below.
constexpr int kFirstLeanClass = 16;
struct LowBitSet {
  int kernel_class = 0;
  int chunk_blocks = 0;
  int tail_units = 0;  // most tail units per item
  TailOrder tail_order = kTailsShared;
  std::vector<DeviceDecodeItem> items;  // strides resolved, all eligible
  std::vector<int32_t> unit_begin;      // [items + 1]: item i's units are [unit_begin[i], unit_begin[i + 1])
  std::vector<int32_t> tail_begin;      // [items + 1]: prefix sums of the items' tail units
  // The lean class: its copies of code groups evict-first and its score stores evict-last in L2
  // (CodesEvictFirst, or as LowBitPlanArgs::forced_codes_l2 forces); false for the other classes.
  bool codes_evict_first = false;
};

// The lean path's L2 rule (DecodePlan::CodesL2::kChosen). A layer's code groups are read once, and
// while they stream through L2 in the normal priority they push out the scores the top-k reads
// next and the units' partial results the merge reads, which come back from DRAM. Copied
// evict-first (the scores stored evict-last), those stay. Measured on an H100 (50 MB L2), the
// lean kernel against normal copies (specache-bench attend; gpu_agent/bench_results/
// codes_l2_halfmma_goals_h100_r49.txt): 8 x 8K (34 MB of groups a layer) -9%, 32 x 8K (134 MB)
// -2.5 to -4.5%, 8 x 32K (134 MB) even, 24 x 32K (403 MB) +1.3%, 176 x 8K (738 MB) +2.4%,
// 46 x 32K (772 MB) +4.0%; the whole 32-layer step at 32 x 8K -2.1%. On the H200 (50 MB;
// codes_l2_landed_goals_h200_r50.txt): 8 x 8K -5%, 32 x 8K -2.4%, and evict-first forced
// at 64 x 8K (268 MB) +2.1%; there the copies' hint alone gained as much as both hints in one
// layer's attention (but without the store hint an H100's 32-layer step came out 1-1.7% slower
// in one round: l2_plan_fresh_inputs_h100_r51.txt; it stays). So evict-first while the groups
// are at most this many times the L2 (a bound between the points measured, not tuned).
constexpr int64_t kCodesEvictFirstL2Multiple = 4;
inline bool CodesEvictFirst(int64_t code_bytes, int64_t l2_bytes) {
  return l2_bytes > 0 && code_bytes <= kCodesEvictFirstL2Multiple * l2_bytes;
}
// What a plan takes besides its items. The forced fields are DecodePlan's (force_units,
// force_codes_l2: benchmarks and tests); their defaults leave each choice to the plan.
struct LowBitPlanArgs {
  // CTA slots of the GPU's one wave left to other work (DecodePlan::set_free_slots).
  int free_slots = 0;
  // The device's L2 bytes (CurrentDeviceL2Bytes) for the lean path's rule (CodesEvictFirst over
  // a set's bulk blocks times the class's group bytes); 0: unknown, normal copies.
  int64_t l2_bytes = 0;
  int forced_chunk_blocks = 0;  // > 0: 32-token blocks a bulk unit (at least 2)
  DecodePlan::UnitOrder forced_order = DecodePlan::UnitOrder::kChosen;
  DecodePlan::CodesL2 forced_codes_l2 = DecodePlan::CodesL2::kChosen;  // no effect on the other classes
};
// The arguments AttendDecodeBatch plans with under `plan`: its free slots and forces, and the
// current device's L2 (CurrentDeviceL2Bytes). Benchmarks call it to print the plan a launch took.
LowBitPlanArgs PlanArgsOf(const DecodePlan& plan);
// One set per class present among `items`, its units one wave of the GPU less the free slots, or
// as forced; each lean set's L2 policy by the rule or as forced. Items of one class move into
// their set uncopied.
Status PlanLowBitDecode(std::vector<DeviceDecodeItem> items, const LowBitPlanArgs& args, std::vector<LowBitSet>* sets);

// The attention kernel and the merge of a planned set, whose bytes (WriteItemSet of its items,
// unit_begin, tail_begin and tail_order) are at `device`.
Status LaunchLowBitSet(const LowBitSet& set, const DeviceItemSet* device, cudaStream_t stream);

}  // namespace specache::cuda
