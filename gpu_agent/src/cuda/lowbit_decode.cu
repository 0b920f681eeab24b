// Tensor-core decode attention over 1/2-bit replicas; the plan of work is in lowbit_decode.h.
//
// mma.m16n8k16's register layouts: mma_fp16.cuh.
//
// Operands. A holds codes times scales, exact in fp16 (a 1-bit code selects its fp16 scale or 0;
// 2-bit codes are two bit planes, the second against B doubled): a "row word" per channel (keys)
// or token (values) puts, one per byte msb, the code bits of the rows this lane needs (one shift
// by g and a mask); one prmt with sign replication turns two of them into a 0x0000/0xFFFF mask
// pair, ANDed with the two scales. B holds the queries (keys) or the probabilities (values). A
// query is one fp16 operand, QueryOperand (cpu_attention.h: scaled by the power of two that puts
// its largest channel in [2^13, 2^14)), which the CPU reference scores with too. Probabilities
// are fp16 hi + lo parts (~22 bits) times 2^14: the reference keeps them in fp32, and rounding
// them to one fp16 part (1-bit attention per layer at 32 x 8K on the H200: 0.198 instead of 0.206
// ms) moves the outputs by up to ~2e-4 relative, which the agents' CPU comparisons would then
// have to allow for. The tensor cores accumulate with truncation, so the values' sums go through
// fresh accumulators per block of 32 tokens and are added in fp32.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

#include "cp_async.cuh"
#include "cuda_status.h"
#include "decode_common.cuh"
#include "dependent_launch.cuh"
#include "device_info.h"
#include "lowbit_decode.h"
#include "mma_codes.h"
#include "mma_fp16.cuh"
#include "shared_memory_opt_in.cuh"

namespace specache::cuda {
namespace {

using decode::FindSubstitute;
using mma::AsU32;
using mma::Mma;
using mma::Split;
using decode::H2F;
using decode::QueryAt;

constexpr int kWarps = kLowBitWarpsPerCta;  // warps (units) per CTA
// CTAs per SM the one-tile kernels are compiled for: 128 registers, 16 warps per SM. H200, 1-bit,
// attention per layer: 0.49 ms at 32 x 8K and 0.25 ms at 8 x 32K, against 0.50 and 0.30 at 3 CTAs
// (168 registers; fewer warps to hide the latency of each block's dependent chain). More warps do
// not pay either: the lean kernel at 5 and 6 CTAs (96 and 80 registers, the loop's accumulators
// spilled) took 1.15x and 1.7x the time at 176 x 8K on the H100, 1.10x and 1.44x at 46 x 32K
// (bench_results/lean_ctas_gather_bound_h100_r37.txt).
constexpr int kMinCtasOneTile = 4;
constexpr int kMaxQ = 16;        // queries (rows x GQA heads) per item: two n-tiles of 8
constexpr int kGroup = 32;       // quantization group size this path handles
constexpr unsigned kAll = 0xffffffffu;

// Tokens [0, BulkEnd) have quantized keys and values: whole blocks of 32 tokens.
__host__ __device__ inline int32_t BulkEnd(const DeviceReplicaView& v) {
  const int32_t qv = v.quantized_values & ~31;
  return (v.quantized_keys < qv ? v.quantized_keys : qv) & ~31;
}
__host__ __device__ inline int BulkUnits(const DeviceReplicaView& v, int chunk_blocks) {
  return (BulkEnd(v) / 32 + chunk_blocks - 1) / chunk_blocks;
}
// The tail is cut into at most `most` (<= kMaxTailUnits) units of whole 32-token blocks (the
// scratch is sized for kMaxTailUnits: DecodeScratchFloats). A tail unit holds its warp's slot for
// the whole wave, so the plan lowers `most` when items are many (DeviceItemSet::tail_units).
constexpr int kMaxTailUnits = 4;
__host__ __device__ inline int32_t TailBlocks(const DeviceDecodeItem& it) {
  return (it.replica.length + it.rows.n_rows - BulkEnd(it.replica) + 31) / 32;
}
__host__ __device__ inline int TailUnits(const DeviceDecodeItem& it, int most) {
  const int32_t blocks = TailBlocks(it);
  return blocks < most ? blocks : most;
}
// Tokens per tail unit (whole blocks).
__host__ __device__ inline int32_t TailUnitTokens(const DeviceDecodeItem& it, int most) {
  return (TailBlocks(it) + TailUnits(it, most) - 1) / TailUnits(it, most) * 32;
}

// Words of one block's bytes staged in shared memory: key codes [D][KB], key scales and zeros
// [D] halves each, value codes [32][D * VB / 32], value scales and zeros [32][D / 32] halves each.
template <int KB, int VB, int D>
__host__ __device__ constexpr int StageWords() { return D * KB + D + 32 * (D * VB / 32) + 32 * (D / kGroup); }

// Per-warp shared memory, in 32-bit words: two stages (bulk) or the scaled queries [Q][D] and 32
// value-row pointers (tail), then p [32 tokens][Q + 4], value zero terms [Q][4], the substituted
// rows of the block [32] (row index * 32 + token in block).
template <int KB, int VB, int D, int NT>
__host__ __device__ constexpr int StagesWords() {
  return 2 * StageWords<KB, VB, D>() > 8 * NT * D + 64 ? 2 * StageWords<KB, VB, D>() : 8 * NT * D + 64;
}
// Then the bulk's query B operands, [nt][k-step][lane] x 2 words (see BulkUnit).
// Then the warp's copy of its item (read all through the unit: from global memory the compiler
// would load its fields again after every global store).
constexpr int kItemWords = (sizeof(DeviceDecodeItem) + 15) / 16 * 4;
template <int KB, int VB, int D, int NT>
__host__ __device__ constexpr int ItemOffsetWords() {
  return StagesWords<KB, VB, D, NT>() + 32 * (8 * NT + 4) + 8 * NT * 4 + 32 + NT * (D / 16) * 32 * 2;
}
template <int KB, int VB, int D, int NT>
__host__ __device__ constexpr int WarpWords() {
  return ItemOffsetWords<KB, VB, D, NT>() + kItemWords;
}

// Mask pair for A: 0xFFFF where the msb of x.byte[b] (low half) / y.byte[b] (high half) is set.
__device__ __forceinline__ uint32_t MaskPair(uint32_t x, uint32_t y, int b) {
  const uint32_t sel = (b | 8) | ((b | 8) << 4) | (((4 + b) | 8) << 8) | (((4 + b) | 8) << 12);
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(x), "r"(y), "r"(sel));
  return d;
}

// x0, x1 rounded to fp16x2 (to nearest even).
__device__ __forceinline__ uint32_t HalfPairOf(float x0, float x1) { return AsU32(__floats2half2_rn(x0, x1)); }
__device__ __forceinline__ uint32_t Twice(uint32_t h2) {  // exact
  const __half2 h = *reinterpret_cast<__half2*>(&h2);
  return AsU32(__hadd2(h, h));
}

constexpr float kLog2e = 1.4426950408889634f;
// exp(x - m) as one FFMA and one MUFU.EX2: m_log2e = m * log2(e), computed once per column and
// block (0 where m is -inf: a column of padding queries, whose scores are -inf, gets p = 0).
// __expf(x - m) spends ~11 instructions on its subnormal range and the -inf guards.
__device__ __forceinline__ float ExpFrom(float x, float m_log2e) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(x, kLog2e, -m_log2e)));
  return y;
}
// A store to global memory that the compiler does not treat as a possible write to shared memory
// (a generic store makes it reload the shared copy of the item after each one). For outputs this
// kernel never reads back.
__device__ __forceinline__ void StoreGlobalOutput(float* p, float v) {
  asm volatile("st.global.f32 [%0], %1;" ::"l"(p), "f"(v));
}
// The same for two floats at p (8-byte aligned), kEvictLast asking L2 to keep the lines last (an
// L2 cache policy): the lean path's scores, which the top-k reads next, into the same buffer
// each layer.
template <bool kEvictLast = false>
__device__ __forceinline__ void StoreGlobalOutputPair(float* p, float v0, float v1) {
  if constexpr (kEvictLast) {
    asm volatile(
        "{\n .reg .b64 policy;\n createpolicy.fractional.L2::evict_last.b64 policy, 1.0;\n"
        " st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, policy;\n}\n" ::"l"(p), "f"(v0), "f"(v1));
  } else {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v0), "f"(v1));
  }
}

// A operand from four row words: rows 0, 1 masked by the scale pair s01 (a0 at byte b_lo, a1 at
// byte b_hi), rows 2, 3 by s23 (a2, a3).
__device__ __forceinline__ void MaskedA(const uint32_t (&row)[4], int b_lo, int b_hi, uint32_t s01, uint32_t s23,
                                        uint32_t (&a)[4]) {
  a[0] = MaskPair(row[0], row[1], b_lo) & s01;
  a[1] = MaskPair(row[0], row[1], b_hi) & s01;
  a[2] = MaskPair(row[2], row[3], b_lo) & s23;
  a[3] = MaskPair(row[2], row[3], b_hi) & s23;
}

// c += A x B; for bit plane 1, B doubled (the plane's weight, exact).
__device__ __forceinline__ void MmaPlane(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, int plane) {
  Mma(c, a[0], a[1], a[2], a[3], plane ? Twice(b0) : b0, plane ? Twice(b1) : b1);
}
// The same over B's hi and lo parts (b0, b1: [hi, lo]).
__device__ __forceinline__ void MmaParts(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b0)[2],
                                         const uint32_t (&b1)[2], int plane) {
  MmaPlane(c, a, b0[0], b1[0], plane);
  MmaPlane(c, a, b0[1], b1[1], plane);
}

// Copies kBytes (a multiple of 16, both ends 16-byte aligned) with the warp's lanes: unrolled, the
// last piece predicated (a loop on the lane's offset cost a branch and its bookkeeping per copy).
// The lane's two addresses are formed once; the pieces are constant offsets from them (an int
// offset per piece cost a sign extension and a 64-bit add each).
template <int kBytes>
__device__ __forceinline__ void StageCopy(uint32_t* dst, const void* src, int lane) {
  static_assert(kBytes % 16 == 0, "whole 16-byte pieces");
  char* const to = reinterpret_cast<char*>(dst) + lane * 16;
  const char* const from = static_cast<const char*>(src) + lane * 16;
#pragma unroll
  for (int i0 = 0; i0 < kBytes; i0 += 32 * 16) {
    if (kBytes - i0 >= 32 * 16 || i0 + lane * 16 < kBytes) CpAsync16(to + i0, from + i0);
  }
}

// Starts the copy of a 32-token block's key and value bytes into `stage` (StageWords layout): the
// block at token `in` of the replica block at `base`. The block is one key group (G = 32) inside
// one replica block (block_tokens is a multiple of 32), so each part is one contiguous piece: the
// accessors' arithmetic (cuda_attention.h) with the replica block already known.
template <int KB, int VB, int D>
__device__ __forceinline__ void IssueBlock(const ReplicaBlockLayout& l, const uint8_t* base, int32_t in, uint32_t* stage,
                                           int lane) {
  constexpr int VW = D * VB / 32, NGV = D / kGroup;
  const int32_t group = in / kGroup;
  StageCopy<D * KB * 4>(stage, base + l.key_codes + group * (D * KB * 4), lane);
  StageCopy<D * 2>(stage + D * KB, base + l.key_scale + group * (D * 2), lane);
  StageCopy<D * 2>(stage + D * KB + D / 2, base + l.key_zero + group * (D * 2), lane);
  uint32_t* values = stage + D * KB + D;
  StageCopy<32 * VW * 4>(values, base + l.value_codes + in * (VW * 4), lane);
  StageCopy<32 * NGV * 2>(values + 32 * VW, base + l.value_scale + in * (NGV * 2), lane);
  StageCopy<32 * NGV * 2>(values + 32 * VW + 16 * NGV, base + l.value_zero + in * (NGV * 2), lane);
}

// The replica blocks a unit walks, 32 tokens at a time: the table entry of the next block to copy
// is loaded one block ahead of its use, so the copy never waits for the table.
struct BlockWalk {
  const DeviceReplicaView& v;
  int32_t index, in;       // the next block to copy: table index and first token within it
  const uint8_t* ahead;    // its table entry
  __device__ BlockWalk(const DeviceReplicaView& view, int32_t t0) : v(view) {
    index = t0 / v.layout.block_tokens;
    in = t0 - index * v.layout.block_tokens;
    ahead = v.blocks[index];
  }
  // Copies the next block, then loads the entry of the one after if `more` (it exists).
  template <int KB, int VB, int D>
  __device__ __forceinline__ void Issue(uint32_t* stage, int lane, bool more) {
    IssueBlock<KB, VB, D>(v.layout, ahead, in, stage, lane);
    Advance(more);
  }
  // The same for a replica block interleaved by group (ReplicaBlockLayout::group_bytes): the
  // group's parts are already in the stage's order, one piece of StageWords (LowBitDecodeEligible:
  // the lean path's items have group_bytes = MmaGroupBytes(D)). evict_first: the copies ask L2 to
  // evict the group's lines first (DeviceItemSet::codes_evict_first; uniform over the warp).
  template <int D>
  __device__ __forceinline__ void IssueGroup(uint32_t* stage, int lane, bool more, bool evict_first) {
    constexpr int kBytes = 4 * StageWords<1, 1, D>();
    static_assert(kBytes == MmaGroupBytes(D), "a group's parts in the stage's order");
    // The group's offset unsigned (in >= 0) and the pieces' offsets immediates of the instructions:
    // through StageCopy the compiler folded the group's int offset into each piece's address (a
    // 64-bit add and a sign extension a piece).
    static_assert(kBytes % (32 * 16) == 0, "whole pieces of the warp");
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(stage)) + lane * 16;
    const uint8_t* const from = ahead + (static_cast<uint32_t>(in) / 32u * kBytes + static_cast<uint32_t>(lane) * 16u);
    if (evict_first) {
      CpAsync16Pieces<kBytes / (32 * 16), 32 * 16, L2Policy::kEvictFirst>(to, from);
    } else {
      CpAsync16Pieces<kBytes / (32 * 16), 32 * 16>(to, from);
    }
    Advance(more);
  }
  __device__ __forceinline__ void Advance(bool more) {
    in += 32;
    if (in == v.layout.block_tokens) in = 0, ++index;
    if (more) ahead = v.blocks[index];
  }
};

// Channel of k-step ks (16 channels) and slot j (0..3) that lane quad position t feeds to B.
__device__ __forceinline__ int ChannelOf(int ks, int j, int t) { return 16 * ks + 2 * t + (j & 1) + 8 * (j >> 1); }

// Row word of key channel c, bit plane P: byte KeyByte(r8)'s msb is bit P of the code of token
// g + 8 r8 of the block (w: the channel's KB words). Only the bytes' msbs are defined: MaskPair
// reads nothing else, so no mask clears the rest.
template <int KB, int P>
__device__ __forceinline__ uint32_t KeyRowWord(const uint32_t* w, int g) {
  if constexpr (KB == 1) {
    return w[0] << (7 - g);  // the other bits of each byte are never read (MaskPair reads msbs)
  } else {  // tokens 0-15 in w[0], 16-31 in w[1], 2 bits each
    return (((w[0] >> (2 * g + P)) & 0x00010001u) << 7) | (((w[1] >> (2 * g + P)) & 0x00010001u) << 15);
  }
}
template <int KB>
__device__ __forceinline__ int KeyByte(int r8) { return KB == 1 ? r8 : ((r8 & 1) << 1) | (r8 >> 1); }

// Row word of one value word, bit plane P: for VB = 1 byte i's msb is channel 32 k + g + 8 i of
// word k; for VB = 2 bytes 0 and 2 hold channels g and g + 8 of the word's 16.
template <int VB, int P>
__device__ __forceinline__ uint32_t ValueRowWord(uint32_t w, int g) {
  if constexpr (VB == 1) {
    return w << (7 - g);
  } else {
    return (w >> (2 * g + P)) << 7;  // bytes 1 and 3 hold other bits, never read
  }
}

// fp16 bits of halves i and j of a word array, as (low, high).
__device__ __forceinline__ uint32_t HalfPair(const uint32_t* words, int i, int j) {
  const Half* h = reinterpret_cast<const Half*>(words);
  return static_cast<uint32_t>(h[i]) | (static_cast<uint32_t>(h[j]) << 16);
}

// The index of the first substituted row at or after token t0 (the list is ascending), searched
// by the whole warp (PrefixLength: two rounds of loads for up to 1024 rows; a binary search by one
// lane took log2 n dependent loads at a unit's start).
__device__ __forceinline__ int FirstSubstituteFrom(const DeviceDecodeRows& r, int32_t t0) {
  return PrefixLength(r.n_sub, [&](int i) { return r.sub_tokens[i] < t0; });
}

// The OR of the warp's x. (__reduce_or_sync is sm_80+; the kernels that call this run on sm_80+
// only, but the file also builds for older targets.)
__device__ __forceinline__ uint32_t BitsOfWarp(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_or_sync(kAll, x);
#else
  for (int o = 16; o > 0; o >>= 1) x |= __shfl_xor_sync(kAll, x, o);
  return x;
#endif
}

// Row `row` of the group of `rows` substituted rows listed from sub_list[s0] (entries: row index
// * 32 + token in block): its fetched key (part 0) or value (part 1) halves as 32-bit channel
// pairs, from pair `pair`; null past the group (the mma operands' zero rows).
template <int D>
__device__ __forceinline__ const uint32_t* GroupRowWords(const DeviceDecodeRows& r, const int* sub_list, int s0, int rows,
                                                         int row, int part, int pair) {
  if (row >= rows) return nullptr;
  return reinterpret_cast<const uint32_t*>(r.sub_rows + static_cast<int64_t>(sub_list[s0 + row] >> 5) * 2 * D + part * D) +
         pair;
}

// The substituted rows ahead of a unit's current block, a window of 32 held a lane each: lane i
// has entry `base + i` of the item's ascending list (token INT32_MAX past its end), and the
// entries before `used` are listed already. Warp-uniform but for the lane's own entry.
struct SubstituteWindow {
  int base, used = 0;
  int32_t token, slot;
  // The token of entry `used` (INT32_MAX past the list's end), or INT32_MIN when the window is used
  // up (used = 32): a block before it holds none of the rows, known without a ballot (MaskBlock).
  int32_t next;

  // From the first entry at or after token t0.
  __device__ SubstituteWindow(const DeviceDecodeRows& r, int32_t t0, int lane) : base(FirstSubstituteFrom(r, t0)) {
    Load(r, lane);
    Refresh();
  }
  __device__ __forceinline__ void Refresh() {
    const int32_t at = __shfl_sync(kAll, token, used & 31);
    next = used < 32 ? at : INT32_MIN;
  }
  __device__ __forceinline__ void Load(const DeviceDecodeRows& r, int lane) {
    const int i = base + lane;
    token = i < r.n_sub ? r.sub_tokens[i] : INT32_MAX;
    slot = i < r.n_sub ? (r.sub_slots ? r.sub_slots[i] : i) : 0;
  }
  // Prefetches into L1 the fetched key and value rows of the window's tokens in [from, to).
  template <int D>
  __device__ __forceinline__ void Prefetch(const DeviceDecodeRows& r, int32_t from, int32_t to, int lane) const {
    if (lane < used || token < from || token >= to) return;
    constexpr int kLines = 4 * D / 128;  // a fetched key and value row: 2 D halves
    const char* row = reinterpret_cast<const char*>(r.sub_rows + static_cast<int64_t>(slot) * 2 * D);
#pragma unroll
    for (int l = 0; l < kLines; ++l) asm volatile("prefetch.global.L1 [%0];" ::"l"(row + l * 128));
  }
  // Lists block [b0, b0 + 32)'s rows in `list` (row index * 32 + token in block, ascending; with
  // kList only), sets their bits in `mask` and returns their count; the window moves on by 32 when
  // used up.
  template <bool kList = true>
  __device__ __forceinline__ int ListBlock(const DeviceDecodeRows& r, int32_t b0, int lane, int* list, uint32_t& mask) {
    int n = 0;
    for (;;) {
      const bool mine = lane >= used && token < b0 + 32;  // the entries are ascending: a run from `used`
      const unsigned in = __ballot_sync(kAll, mine);
      if constexpr (kList) {
        if (mine) list[n + lane - used] = slot * 32 + (token - b0);
      }
      mask |= BitsOfWarp(mine ? 1u << (token - b0) : 0u);
      const int c = __popc(in);
      n += c, used += c;
      if (used < 32) {
        if (c > 0) Refresh();
        return n;
      }
      base += 32, used = 0;
      Load(r, lane);
      Refresh();
    }
  }
  // Block [b0, b0 + 32)'s rows as a mask of their tokens in the block (ListBlock without the list).
  // Most blocks hold none: those return at the first test (the ballots and the OR took ~25
  // instructions a block of the lean path).
  __device__ __forceinline__ uint32_t MaskBlock(const DeviceDecodeRows& r, int32_t b0, int lane) {
    if (next >= b0 + 32) return 0u;
    uint32_t mask = 0;
    ListBlock<false>(r, b0, lane, nullptr, mask);
    return mask;
  }
  // The next rows before token t1, at most the rest of the window (<= 32): list[i] = row index *
  // 32 and tokens[i] its token, in ascending order; returns their count, 0 when none is left.
  // Their fetched key and value rows are prefetched into L1 as they are listed, so that the
  // loads of all of them are in flight at once (D: the rows' halves).
  template <int D>
  __device__ __forceinline__ int ListBefore(const DeviceDecodeRows& r, int32_t t1, int lane, int* list, int* tokens) {
    if (used == 32) base += 32, used = 0, Load(r, lane);
    Prefetch<D>(r, INT32_MIN, t1, lane);
    const bool mine = lane >= used && token < t1;  // the entries are ascending: a run from `used`
    if (mine) list[lane - used] = slot * 32, tokens[lane - used] = token;
    const int n = __popc(__ballot_sync(kAll, mine));
    used += n;
    Refresh();
    return n;
  }
};

// The values of a block's n substituted rows (n > 0, listed in sub_list), weighted by each
// query's p, added to out^T's accumulators: sixteen rows at a time, one mma per m-tile, n-tile and
// p part. A = the rows' fetched values transposed (channels x rows: lane (g, t) loads row g's
// channel pairs 16 mt + 2t, + 8 as 32-bit words, as for the keys' scores, and movmatrix gives A's
// registers), B = p as hi + lo fp16 parts (k = row, n = query), each product summed in fresh
// accumulators (C: channels 16 mt + g (+ 8), queries 8 nt + 2t, + 1, out^T's layout) that `add`
// takes: add(mt, nt, c). p_at(row, nt): p of the list's row `row` for query 8 nt + g, in the
// scale B takes (fp16's normal range). (Row by row on the CUDA cores this took ~117 instructions
// a row; with specache-run's row cache attended, ~4 rows a block.)
template <int D, int NT, class PAt, class Add>
__device__ __forceinline__ void AddSubstitutedValues(const DeviceDecodeRows& r, const int* sub_list, int n, int lane,
                                                     PAt p_at, Add add) {
  constexpr int MT = D / 16;
  const int g = lane >> 2, t = lane & 3;
  for (int s0 = 0; s0 < n; s0 += 16) {
    const int rows = min(16, n - s0);
    // Rows g and g + 8 of the group: their value halves, from channel pair 2t. Every word is loaded
    // before p and the first mma, so that the group waits on memory once: loaded an m-tile at a
    // time, each m-tile's mma waited on its own loads (the attention 3.4% slower at 32 x 8K with
    // 128 rows a head, 4.6% at 8 x 8K, 8% with 256 rows; H100).
    const uint32_t* v_lo = GroupRowWords<D>(r, sub_list, s0, rows, g, 1, t);
    const uint32_t* v_hi = GroupRowWords<D>(r, sub_list, s0, rows, g + 8, 1, t);
    uint32_t lo[MT][2], hi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        lo[mt][j] = v_lo ? __ldg(v_lo + 8 * mt + 4 * j) : 0u;
        hi[mt][j] = v_hi ? __ldg(v_hi + 8 * mt + 4 * j) : 0u;
      }
    uint32_t bh[NT][2], bl[NT][2];  // [nt][b0, b1]: rows 2t, 2t + 1 and 2t + 8, 2t + 9 of the group
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float pk[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 2 * t + (i & 1) + 8 * (i >> 1);
        pk[i] = row < rows ? p_at(s0 + row, nt) : 0.0f;
      }
      Split(pk[0], pk[1], bh[nt][0], bl[nt][0]);
      Split(pk[2], pk[3], bh[nt][1], bl[nt][1]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint32_t a0 = mma::Transposed8x8(lo[mt][0]), a1 = mma::Transposed8x8(lo[mt][1]);
      const uint32_t a2 = mma::Transposed8x8(hi[mt][0]), a3 = mma::Transposed8x8(hi[mt][1]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        Mma(c, a0, a1, a2, a3, bh[nt][0], bh[nt][1]);
        Mma(c, a0, a1, a2, a3, bl[nt][0], bl[nt][1]);
        add(mt, nt, c);
      }
    }
  }
}

// One bulk unit: tokens [t0, t1) (whole blocks of 32, quantized keys and values), each block's
// bytes copied to shared memory one block ahead of the compute (cp.async, two stages).
template <int KB, int VB, int D, int NT>
__device__ void BulkUnit(const DeviceDecodeItem& it, int u, int units, int32_t t0, int32_t t1, uint32_t* ws, int lane) {
  constexpr int Q = 8 * NT, PS = Q + 4, KS = D / 16, MT = D / 16, NGV = D / kGroup;
  constexpr int VW = D * VB / 32;  // words of one token's value codes
  constexpr int SW = StageWords<KB, VB, D>();
  constexpr float kPScale = 16384.0f;  // p in [0, 1] scaled into fp16's normal range
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int g = lane >> 2, t = lane & 3;
  const int queries = r.n_rows * r.n_heads;
  float* psm = reinterpret_cast<float*>(ws + StagesWords<KB, VB, D, NT>());
  float* zsm = psm + 32 * PS;
  int* sub_list = reinterpret_cast<int*>(zsm + Q * 4);
  // The lane's B operands of the queries, [nt][ks][lane] as (b0, b1): one 8-byte load per k-step
  // instead of 2 * KS registers held through the loop.
  uint2* bqs = reinterpret_cast<uint2*>(sub_list + 32);

  BlockWalk walk(v, t0);
  walk.Issue<KB, VB, D>(ws, lane, t0 + 32 < t1);
  CpAsyncCommit();

  // This lane's share of the queries: query 8 nt + g at channels ChannelOf(ks, j, t), as fp16 B
  // operands times 2^e_n, which puts the query's largest channel in [2^13, 2^14) (QueryOperand).
  float q_unscale[NT][2];  // 2^-e * scale of the C columns' queries 8 nt + 2t + j (0: padding)
  float q_bias[NT][2];     // 0, or -inf for a padding column
  float row_unscale[NT];   // 2^-e * scale of this lane's query 8 nt + g
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int n = 8 * nt + g;
    // Found once: QueryAt divides by the item's head count, which the compiler kept in the loop.
    const float* query = n < queries ? r.q + QueryAt(r, n, D) : nullptr;
    float x[KS * 4];
    float mx = 0.0f;
#pragma unroll
    for (int i = 0; i < KS * 4; ++i) {
      x[i] = query ? query[ChannelOf(i / 4, i % 4, t)] : 0.0f;
      mx = fmaxf(mx, fabsf(x[i]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, 2));
    const int e = decode::QueryOperandExponent(mx);
    const float up = decode::Pow2(e);  // exact scaling
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      bqs[(nt * KS + ks) * 32 + lane] =
          make_uint2(HalfPairOf(x[4 * ks] * up, x[4 * ks + 1] * up), HalfPairOf(x[4 * ks + 2] * up, x[4 * ks + 3] * up));
    }
    row_unscale[nt] = decode::Pow2(-e) * r.scale;
    q_unscale[nt][0] = __shfl_sync(kAll, row_unscale[nt], 8 * t);
    q_unscale[nt][1] = __shfl_sync(kAll, row_unscale[nt], 8 * t + 4);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool padding = 8 * nt + 2 * t + j >= queries;
      q_bias[nt][j] = padding ? -INFINITY : 0.0f;
      if (padding) q_unscale[nt][j] = 0.0f;  // its operands are 0: 0 * 0 + -inf
    }
  }
  // Whether C column (nt, j) is the probabilities row's (or the real row's, for the union rule),
  // and where its scores go.
  // probs_end[nt][j]: the column's candidates end (0: none), so one compare per store.
  float* probs_at[NT][2];
  int32_t probs_end[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int q = 8 * nt + 2 * t + j;
      float* const scores = q < queries ? decode::ScoresOfRow(r, q / r.n_heads) : nullptr;
      probs_at[nt][j] = scores ? scores + static_cast<size_t>(q % r.n_heads) * r.n_candidates : nullptr;
      probs_end[nt][j] = scores ? r.n_candidates : 0;
    }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
  // zv: the values' zeros' term, C of the zeros' mma (row g = channel group, columns 2t + j).
  float m[NT][2], l[NT][2], zv[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    m[nt][0] = m[nt][1] = -INFINITY;
    l[nt][0] = l[nt][1] = 0.0f;
    zv[nt][0] = zv[nt][1] = 0.0f;
  }
  // The substituted rows ahead, a lane each; their fetched rows prefetched a block ahead.
  SubstituteWindow subs(r, t0, lane);
  subs.Prefetch<D>(r, t0, min(t1, t0 + 32), lane);

  int stage = 0;
  for (int32_t b0 = t0; b0 < t1; b0 += 32, stage ^= 1) {
    if (b0 + 32 < t1) walk.Issue<KB, VB, D>(ws + (stage ^ 1) * SW, lane, b0 + 64 < t1);
    subs.Prefetch<D>(r, b0 + 32, min(t1, b0 + 64), lane);
    CpAsyncCommit();
    CpAsyncWaitButOne();
    __syncwarp();
    const uint32_t* kc = ws + stage * SW;
    const uint32_t* kscale = kc + D * KB;
    const uint32_t* kzero = kscale + D / 2;
    const uint32_t* vcodes = kzero + D / 2;
    const uint32_t* vscale = vcodes + 32 * VW;
    const uint32_t* vzero = vscale + 16 * NGV;

    // ---- scores of the block's 32 tokens: sc[mt][nt] is C of tokens 16 mt + .., queries 8 nt + ..;
    // zk[nt] the zeros' term (a block is one key group: every token row of A holds the zeros, so
    // one m-tile gives it for all; rows g and g + 8 are equal).
    float sc[2][NT][4];
    float zk[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[0][nt][i] = sc[1][nt][i] = zk[nt][i] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const int c0 = 16 * ks + 2 * t;
      const uint32_t* w01 = kc + c0 * KB;
      const uint32_t* w89 = kc + (c0 + 8) * KB;
      const uint32_t s01 = kscale[c0 / 2], s89 = kscale[c0 / 2 + 4];
      const uint32_t z01 = kzero[c0 / 2], z89 = kzero[c0 / 2 + 4];
      uint2 bq[NT];  // [nt] (b0, b1)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        bq[nt] = bqs[(nt * KS + ks) * 32 + lane];
        const uint32_t za[4] = {z01, z01, z89, z89};
        MmaPlane(zk[nt], za, bq[nt].x, bq[nt].y, 0);
      }
#pragma unroll
      for (int plane = 0; plane < KB; ++plane) {
        uint32_t row[4];
        if (plane == 0) {
          row[0] = KeyRowWord<KB, 0>(w01, g), row[1] = KeyRowWord<KB, 0>(w01 + KB, g);
          row[2] = KeyRowWord<KB, 0>(w89, g), row[3] = KeyRowWord<KB, 0>(w89 + KB, g);
        } else {
          row[0] = KeyRowWord<KB, 1>(w01, g), row[1] = KeyRowWord<KB, 1>(w01 + KB, g);
          row[2] = KeyRowWord<KB, 1>(w89, g), row[3] = KeyRowWord<KB, 1>(w89 + KB, g);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t a[4];
          MaskedA(row, KeyByte<KB>(2 * mt), KeyByte<KB>(2 * mt + 1), s01, s89, a);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) MmaPlane(sc[mt][nt], a, bq[nt].x, bq[nt].y, plane);
        }
      }
    }
    float score[2][NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = i & 1;
          score[mt][nt][i] = fmaf(sc[mt][nt][i] + zk[nt][j], q_unscale[nt][j], q_bias[nt][j]);
        }
    // Substituted rows in this block: listed, then scored sixteen at a time by an mma over their
    // fetched keys (A: rows g, g + 8 x channels, loaded as 32-bit channel pairs; B: the queries'
    // operands; exact fp16 products summed in fp32), staged in psm (free until the softmax writes
    // p) at [token in block][query] and then taken by the lanes whose C slots hold those tokens.
    // (Assigned straight into `score` by a runtime test per slot, the compiler kept the whole
    // array in local memory, stored and reloaded every block.)
    uint32_t sub_mask = 0;  // tokens of the block that are substituted
    const int n_block_subs = subs.ListBlock(r, b0, lane, sub_list, sub_mask);
    if (n_block_subs > 0) {
      __syncwarp();  // sub_list written
      for (int s0 = 0; s0 < n_block_subs; s0 += 16) {
        const int rows = min(16, n_block_subs - s0);
        // Rows g and g + 8 of the group: their key halves, from channel pair 2t.
        const uint32_t* k_lo = GroupRowWords<D>(r, sub_list, s0, rows, g, 0, t);
        const uint32_t* k_hi = GroupRowWords<D>(r, sub_list, s0, rows, g + 8, 0, t);
        float c[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) c[nt][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const uint32_t a0 = k_lo ? __ldg(k_lo + 8 * ks) : 0u, a2 = k_lo ? __ldg(k_lo + 8 * ks + 4) : 0u;
          const uint32_t a1 = k_hi ? __ldg(k_hi + 8 * ks) : 0u, a3 = k_hi ? __ldg(k_hi + 8 * ks + 4) : 0u;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint2 b = bqs[(nt * KS + ks) * 32 + lane];
            Mma(c[nt], a0, a1, a2, a3, b.x, b.y);
          }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // C: the group's rows g (+ 8), queries 8 nt + 2t (+ 1)
            const int row = g + 8 * (e >> 1), q = 8 * nt + 2 * t + (e & 1);
            if (row < rows && q < queries) psm[(sub_list[s0 + row] & 31) * PS + q] = c[nt][e] * q_unscale[nt][e & 1];
          }
      }
    }
    if (sub_mask != 0) {
      __syncwarp();
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * mt + g + 8 * (e >> 1);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const int q = 8 * nt + 2 * t + (e & 1);
            if (((sub_mask >> i) & 1u) && q < queries) score[mt][nt][e] = psm[i * PS + q];
          }
        }
    }
    // Raw scores of the probabilities row's candidates, for the top-k.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float* at = probs_at[nt][e & 1];
        const int32_t end = probs_end[nt][e & 1];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int32_t tok = b0 + 16 * mt + g + 8 * (e >> 1);
          if (tok < end) StoreGlobalOutput(at + tok, score[mt][nt][e]);
        }
      }
    // Online softmax per query column; p goes to shared memory for the values' B operand.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float bm = fmaxf(fmaxf(score[0][nt][j], score[0][nt][j + 2]), fmaxf(score[1][nt][j], score[1][nt][j + 2]));
        bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, 4));
        bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, 8));
        bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, 16));
        const float mn = fmaxf(m[nt][j], bm);
        // Rescaled only when some query's max grew (after the first blocks, rarely).
        if (__any_sync(kAll, mn != m[nt][j])) {
          const float alpha = mn == -INFINITY || mn == m[nt][j] ? 1.0f : __expf(m[nt][j] - mn);
          l[nt][j] *= alpha;
          zv[nt][j] *= alpha;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) acc[mt][nt][j] *= alpha, acc[mt][nt][j + 2] *= alpha;
        }
        m[nt][j] = mn;
        const float mn_log2e = mn == -INFINITY ? 0.0f : mn * kLog2e;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float p = ExpFrom(score[mt][nt][j + 2 * h], mn_log2e);
            l[nt][j] += p;
            psm[(16 * mt + g + 8 * h) * PS + 8 * nt + 2 * t + j] = p;
          }
      }
    __syncwarp();
    // Substituted rows: their fetched values (p kPScale from psm; acc holds p-weighted sums), and
    // out of the mma operand.
    if (n_block_subs > 0) {
      AddSubstitutedValues<D, NT>(
          r, sub_list, n_block_subs, lane,
          [&](int row, int nt) { return psm[(sub_list[row] & 31) * PS + 8 * nt + g] * kPScale; },
          [&](int mt, int nt, const float (&c)[4]) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = fmaf(c[e], 1.0f / kPScale, acc[mt][nt][e]);
          });
    }
    __syncwarp();
    for (int k = 0; k < n_block_subs; ++k) {
      if (lane < Q) psm[(sub_list[k] & 31) * PS + lane] = 0.0f;
    }
    __syncwarp();
    // ---- values: out^T [d x Q] += (codes * scale)^T [d x 32] x p [32 x Q], each m-tile's two
    // k-steps into fresh accumulators added in fp32.
    // The zeros' term goes through the tensor cores too: A's row g < NGV holds group g's zeros of
    // the k-step's tokens (other rows 0), so C's row g is that group's sum over the block.
    uint32_t s01[2][NGV], s23[2][NGV];  // scales of token pairs (jt0, jt1), (jt2, jt3) per group
    uint32_t bp[2][NT][2][2];           // [ks][nt][b0, b1][hi, lo]
    float zfresh[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) zfresh[nt][i] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const int j0 = 16 * ks + 2 * t;  // B's rows 2t, 2t+1, 2t+8, 2t+9 are tokens j0, j0+1, j0+8, j0+9
#pragma unroll
      for (int k = 0; k < NGV; ++k) {
        s01[ks][k] = HalfPair(vscale, j0 * NGV + k, (j0 + 1) * NGV + k);
        s23[ks][k] = HalfPair(vscale, (j0 + 8) * NGV + k, (j0 + 9) * NGV + k);
      }
      const int zg = g < NGV ? g : 0;
      const uint32_t za[4] = {g < NGV ? HalfPair(vzero, j0 * NGV + zg, (j0 + 1) * NGV + zg) : 0u, 0u,
                              g < NGV ? HalfPair(vzero, (j0 + 8) * NGV + zg, (j0 + 9) * NGV + zg) : 0u, 0u};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float p0 = psm[j0 * PS + 8 * nt + g], p1 = psm[(j0 + 1) * PS + 8 * nt + g];
        const float p2 = psm[(j0 + 8) * PS + 8 * nt + g], p3 = psm[(j0 + 9) * PS + 8 * nt + g];
        Split(p0 * kPScale, p1 * kPScale, bp[ks][nt][0][0], bp[ks][nt][0][1]);
        Split(p2 * kPScale, p3 * kPScale, bp[ks][nt][1][0], bp[ks][nt][1][1]);
        MmaParts(zfresh[nt], za, bp[ks][nt][0], bp[ks][nt][1], 0);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) zv[nt][0] += zfresh[nt][0] * (1.0f / kPScale), zv[nt][1] += zfresh[nt][1] * (1.0f / kPScale);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // Channels 16 mt + g and + 8: word and bytes of the row words, channel group.
      const int word = VB == 1 ? mt / 2 : mt;
      const int b_lo = VB == 1 ? 2 * (mt & 1) : 0, b_hi = VB == 1 ? 2 * (mt & 1) + 1 : 2;
      const int k = (16 * mt) / kGroup;
      float fresh[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) fresh[nt][i] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int j0 = 16 * ks + 2 * t;
        const uint32_t w0 = vcodes[j0 * VW + word], w1 = vcodes[(j0 + 1) * VW + word];
        const uint32_t w8 = vcodes[(j0 + 8) * VW + word], w9 = vcodes[(j0 + 9) * VW + word];
#pragma unroll
        for (int plane = 0; plane < VB; ++plane) {
          uint32_t row[4];
          if (plane == 0) {
            row[0] = ValueRowWord<VB, 0>(w0, g), row[1] = ValueRowWord<VB, 0>(w1, g);
            row[2] = ValueRowWord<VB, 0>(w8, g), row[3] = ValueRowWord<VB, 0>(w9, g);
          } else {
            row[0] = ValueRowWord<VB, 1>(w0, g), row[1] = ValueRowWord<VB, 1>(w1, g);
            row[2] = ValueRowWord<VB, 1>(w8, g), row[3] = ValueRowWord<VB, 1>(w9, g);
          }
          uint32_t a[4];
          MaskedA(row, b_lo, b_hi, s01[ks][k], s23[ks][k], a);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) MmaParts(fresh[nt], a, bp[ks][nt][0], bp[ks][nt][1], plane);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] += fresh[nt][i] * (1.0f / kPScale);
    }
    __syncwarp();  // psm and this stage are rewritten by the next blocks
  }

  // ---- the unit's partial result: per query max, sum, and out + the zeros' term.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      l[nt][j] += __shfl_xor_sync(kAll, l[nt][j], 4);
      l[nt][j] += __shfl_xor_sync(kAll, l[nt][j], 8);
      l[nt][j] += __shfl_xor_sync(kAll, l[nt][j], 16);
    }
    if (g < NGV) zsm[(8 * nt + 2 * t) * 4 + g] = zv[nt][0], zsm[(8 * nt + 2 * t + 1) * 4 + g] = zv[nt][1];
  }
  __syncwarp();
  float* partial = r.scratch + static_cast<size_t>(u) * queries * D;
  float* stats = r.scratch + static_cast<size_t>(units) * queries * D + static_cast<size_t>(u) * queries * 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = 8 * nt + 2 * t + (e & 1), c = 16 * mt + g + 8 * (e >> 1);
        if (q < queries) partial[q * D + c] = acc[mt][nt][e] + zsm[q * 4 + c / kGroup];
      }
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int q = 8 * nt + 2 * t + j;
        if (q < queries) stats[q * 2] = m[nt][j], stats[q * 2 + 1] = l[nt][j];
      }
  }
}

// ---- The lean path: items of replicas in the mma layout (mma_codes.h), 1-bit keys and values, at
// most 8 queries. Per 32-token block and warp:
//   S [queries x 32 tokens] = (q (x) key scale) [q x d] x bits [d x 32]: A = the fp16 query operand
//       (QueryOperand, times 2^-k so that no product with a key scale overflows: key_scale_bound)
//       times the block's channel scales, as an exact hi + lo pair of fp16 products (rows g and
//       g + 8 of A: C's rows g and g + 8 are summed); B = one AND
//       per register of the lane's mma-layout key words (a bit as a normal fp16 power of two,
//       divided out of C); plus the key zeros' term sum_c q_c z_c as one mma per k-step. Exact
//       products, fp32 sums: the scores are the CPU reference's up to the order of the sums.
//   out^T [d x queries] += bits^T [d x 32] x (p kP (x) value scale) [32 x queries]: S's C
//       registers are the values' B operand (P^T) without shared memory; B = the fp16 product of
//       fp16(p kP) and the token's group scale (outputs within 1e-3 relative of the fp32
//       reference, up to 4.9e-4 measured on random rows); A = one AND per register of the lane's
//       value words; the zeros' term as one mma
//       per k-step (A's row g = channel group g's zeros).
// Substituted rows: their scores by an mma over the fetched keys before the softmax, their p out
// of B, and their fetched values added as an mma (A = the values transposed, B = p as hi + lo).
// p scaled before its fp16 rounding, so that fp16(p kLeanP) * scale stays normal for the weights
// that matter; a value scale must stay below 1023 (65504 / kLeanP) for the product to be finite.
constexpr float kLeanP = 64.0f;
constexpr float kLeanPLog2 = 6.0f;  // log2(kLeanP): the exponent adds it, so p comes out times kLeanP

// Group j (bits 4j..4j+3 of each half) of a word at bits 10..13, where each bit alone is a normal
// fp16 power of two (MmaBitWeight).
__device__ __forceinline__ uint32_t GroupAt10(uint32_t w, int j) { return j < 3 ? w << (10 - 4 * j) : w >> 2; }
__device__ __forceinline__ uint32_t BitOperand(uint32_t x, int i) { return x & (0x04000400u << i); }
__device__ __forceinline__ uint32_t Mul2(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return AsU32(r);
}
// a * b - hi, rounded: with hi = Mul2(a, b), the exact rest of the product (22 bits fit two fp16).
__device__ __forceinline__ uint32_t Rest2(uint32_t a, uint32_t b, uint32_t hi) {
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
                            __hneg2(*reinterpret_cast<const __half2*>(&hi)));
  return AsU32(r);
}

// The lane's W words of a group's mma-layout codes (or W words at `codes` with lane 0) in shared
// memory, 8-byte (W = 2) or 16-byte (W = 4) aligned: WarpWords and StageWords are multiples of 4.
template <int W>
__device__ __forceinline__ void LaneWords(const uint32_t* codes, int lane, uint32_t (&w)[W]) {
  if constexpr (W == 4) {
    const uint4 x = reinterpret_cast<const uint4*>(codes)[lane];
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else {
    static_assert(W == 2, "head_dim 64 or 128");
    const uint2 x = reinterpret_cast<const uint2*>(codes)[lane];
    w[0] = x.x, w[1] = x.y;
  }
}

// The lean unit's online softmax: query g's running max m raised to mn (>= m; every lane of the
// warp calls it). Only when some query's max grew are its sum l (this lane's part), out^T's
// accumulators (queries 2t, 2t + 1 of this lane: the alphas of lanes 8t and 8t + 4) and the
// zeros' terms zv rescaled by exp(m - mn) (0 from m = -inf).
// `grew`: whether mn != m for some query of the warp (the overload below votes on it).
template <int MT>
__device__ __forceinline__ void RaiseRunningMax(float& m, float mn, float& l, float (&acc)[MT][4], float (&zv)[4],
                                                int t, bool grew) {
  if (grew) {
    const float alpha = mn == m ? 1.0f : __expf(m - mn);
    l *= alpha;
    const float a_even = __shfl_sync(kAll, alpha, 8 * t), a_odd = __shfl_sync(kAll, alpha, 8 * t + 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] *= a_even, acc[mt][2] *= a_even, acc[mt][1] *= a_odd, acc[mt][3] *= a_odd;
    zv[0] *= a_even, zv[1] *= a_odd;
  }
  m = mn;
}
template <int MT>
__device__ __forceinline__ void RaiseRunningMax(float& m, float mn, float& l, float (&acc)[MT][4], float (&zv)[4],
                                                int t) {
  RaiseRunningMax(m, mn, l, acc, zv, t, __any_sync(kAll, mn != m));
}

// The zeros' term of two k-steps from one mma: A = the quad of their query operands (rows g:
// k-step 2kk's, rows g + 8: 2kk + 1's, as they are stored), B = the lanes' key zeros of k-step
// 2kk + (g & 1), so that the even columns hold 2kk's zeros and the odd ones 2kk + 1's. C's
// [g][2t] (c[0]) is then query g's 2kk term and [g + 8][2t + 1] (c[3]) its 2kk + 1 term; the
// other two are cross terms, unused. (One mma per k-step with A = {q, 0, q', 0} took four moves
// to build each A: 8 mma and ~32 moves a block, now 4 and none.)
__device__ __forceinline__ float ZeroTermOfPair(const float (&zc)[4]) { return zc[0] + zc[3]; }

// evict_first: the set's L2 policy (DeviceItemSet::codes_evict_first): the blocks' copies
// evict-first, the score stores evict-last.
template <int D>
__device__ void LeanBulkUnit(const DeviceDecodeItem& it, int u, int units, int32_t t0, int32_t t1, uint32_t* ws,
                             int lane, bool evict_first) {
  constexpr int KS = D / 16, MT = D / 16, NGV = D / kGroup, W = D / 32;
  constexpr int SW = StageWords<1, 1, D>();
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int g = lane >> 2, t = lane & 3;
  const int queries = r.n_rows * r.n_heads;  // <= kLeanMaxQueries (LowBitDecodeEligible)
  // Per warp, after the stages: up to 32 substituted rows (row index * 32),
  // then the lanes' query operands of k-steps 2kk and 2kk + 1 as one quad [kk][lane] (one 16-byte
  // load per two k-steps instead of 2 KS registers held through the loop; the quad is also the
  // zeros' term's A, ZeroTermOfPair), then the substituted rows' scores [32 rows][8 queries] and
  // their tokens [32].
  int* sub_list = reinterpret_cast<int*>(ws + StagesWords<1, 1, D, 1>());
  uint4* qquads = reinterpret_cast<uint4*>(ws + StagesWords<1, 1, D, 1>() + 32);
  float* sub_scores = reinterpret_cast<float*>(ws + StagesWords<1, 1, D, 1>() + 32 + 2 * 32 * KS);
  int* sub_tokens = reinterpret_cast<int*>(sub_scores + 32 * kLeanMaxQueries);
  static_assert(StagesWords<1, 1, D, 1>() + 32 + 2 * 32 * KS + 32 * kLeanMaxQueries + 32 <= ItemOffsetWords<1, 1, D, 1>(),
                "room for the operands and the substituted rows' scores and tokens");

  BlockWalk walk(v, t0);
  walk.IssueGroup<D>(ws, lane, t0 + 32 < t1, evict_first);
  CpAsyncCommit();
  // Query g's channels 16 ks + 2t, +1 ([ks][0], [ks][1]) and + 8, + 9 ([ks][2], [ks][3]), loaded
  // before the window's search so that both wait for memory together (loaded after it, their
  // latency was ~2.6% of the kernel's stall samples at 32 x 8K).
  float x[KS][4];
  const float bound = v.key_scale_bound ? *v.key_scale_bound : 0.0f;  // the key scales' (key_scale_bound)
  {
    const float* query = g < queries ? r.q + QueryAt(r, g, D) : nullptr;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int j = 0; j < 4; ++j) x[ks][j] = query ? query[16 * ks + 2 * t + (j & 1) + 8 * (j >> 1)] : 0.0f;
  }
  // The substituted rows, a lane each (SubstituteWindow). A block only masks its rows' tokens out
  // of its softmax (one ballot: `subs`); the rows are attended after the unit's blocks, up to 32
  // at a time (`unit_subs`, below the loop). Attended in their blocks, a block's one or two rows
  // took a path of ~365 instructions of their own (ncu, 99 x 8K, 64 rows: 14% of the kernel's
  // stall samples); after the blocks they share their mma and their loads' latency.
  // Found while the first block's copy and the query's loads are in flight.
  SubstituteWindow subs(r, t0, lane);
  SubstituteWindow unit_subs = subs;  // the same entries (one search and load for both)

  // Query g's A operands: its channels (x) at their QueryOperand rounding, times 2^-k: the largest
  // channel is below 2^14, so with k >= the bound's exponent every product with a key scale stays
  // below 2^15 (fp16 holds 65504).
  float unscale;  // 2^(k - e) * scale: C to scores
  {
    float mx = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int j = 0; j < 4; ++j) mx = fmaxf(mx, fabsf(x[ks][j]));
    mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, 2));
    const int e = decode::QueryOperandExponent(mx);
    const int k = max(0, ((__float_as_int(bound) >> 23) & 0xff) - 127);  // bound < 2^(k + 1)
    const float up = decode::Pow2(e);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      // Rounded at 2^e like the CPU's QueryOperand, then scaled by 2^-k (exact but where tiny).
      const __half2 h01 = __floats2half2_rn(x[ks][0] * up, x[ks][1] * up), h89 = __floats2half2_rn(x[ks][2] * up, x[ks][3] * up);
      const __half2 down = __float2half2_rn(decode::Pow2(-k));
      uint32_t* quad = reinterpret_cast<uint32_t*>(qquads + (ks / 2) * 32 + lane);
      quad[ks % 2] = AsU32(__hmul2(h01, down)), quad[2 + ks % 2] = AsU32(__hmul2(h89, down));
    }
    unscale = decode::Pow2(k - e) * r.scale;
  }
  // Query g's raw scores, for the top-k (the probabilities row, or the real row for the union rule).
  float* scores_out = nullptr;
  if (g < queries) {
    float* const row = decode::ScoresOfRow(r, g / r.n_heads);
    if (row) scores_out = row + static_cast<size_t>(g % r.n_heads) * r.n_candidates;
  }
  const int32_t scores_end = r.n_candidates;
  // A block's scores as four 8-byte stores when the row is 8-byte aligned (b0 and 2t are even)
  // and the block lies below scores_end: one base address, no test per token (eight tested stores
  // took ~40 instructions a block).
  const bool scores_pairs = scores_out != nullptr && (reinterpret_cast<uintptr_t>(scores_out) & 7) == 0;

  float m = -INFINITY, l = 0.0f;  // query g's
  // m log2(e) - kLeanPLog2 (0 while m is -inf): ExpFrom's offset for the running max, kept with m.
  float m_log2e = 0.0f;
  float acc[MT][4], zv[4];         // out^T: rows 16 mt + g (+8), queries 2t, 2t + 1; zv: row g = channel group g
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    zv[i] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][i] = 0.0f;
  }
  int stage = 0;
  for (int32_t b0 = t0; b0 < t1; b0 += 32, stage ^= 1) {
    if (b0 + 32 < t1) walk.IssueGroup<D>(ws + (stage ^ 1) * SW, lane, b0 + 64 < t1, evict_first);
    if (b0 + 32 >= t1) unit_subs.Prefetch<D>(r, t0, t1, lane);  // the first rows of the pass after the blocks
    CpAsyncCommit();
    CpAsyncWaitButOne();
    __syncwarp();
    const uint32_t* kc = ws + stage * SW;
    const uint32_t* kscale = kc + D;  // mma-layout pairs (mma_codes.h): this lane's at t 2KS
    const uint32_t* kzero = kscale + D / 2;
    const uint32_t* vcodes = kzero + D / 2;
    const uint32_t* vscale = vcodes + D;  // this lane's at t 4 NGV
    const uint32_t* vzero = vscale + 16 * NGV;  // row g's (g < NGV) at (g 4 + t) 4
    // The block's substituted tokens (their mask), found before its scores: its branches (rarely
    // taken) then stand before the scores' mma, not between the scores and the softmax.
    const uint32_t sub_mask = subs.MaskBlock(r, b0, lane);

    // ---- scores: c[nt] = C of the block's tokens 8 nt + .. (weight MmaBitWeight(nt)), rows g the
    // products' hi parts and rows g + 8 their rest (A's rows g + 8 hold the rest); zc = q . z.
    uint32_t kw[W];
    LaneWords<W>(kc, lane, kw);
    float c[4][4], zc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[nt][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KS / 2; ++kk) {
      const uint4 quad = qquads[kk * 32 + lane];
      // The zeros' term of k-steps 2kk and 2kk + 1 in one mma (ZeroTermOfPair).
      const uint2 zp = reinterpret_cast<const uint2*>(kzero + t * 2 * KS)[2 * kk + (g & 1)];
      Mma(zc, quad.x, quad.y, quad.z, quad.w, zp.x, zp.y);
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        const int ks = 2 * kk + kh;
        const uint32_t q01 = kh == 0 ? quad.x : quad.y, q89 = kh == 0 ? quad.z : quad.w;
        // Pairs (ks, kh = 0, 1): two k-steps' in one 16-byte load (the compiler merges them).
        const uint2 sp = reinterpret_cast<const uint2*>(kscale + t * 2 * KS)[ks];
        const uint32_t s01 = sp.x, s89 = sp.y;
        const uint32_t h0 = Mul2(q01, s01), h2 = Mul2(q89, s89);
        const uint32_t r0 = Rest2(q01, s01, h0), r2 = Rest2(q89, s89, h2);
        const uint32_t x0 = GroupAt10(kw[(2 * ks) / 4], (2 * ks) % 4), x1 = GroupAt10(kw[(2 * ks + 1) / 4], (2 * ks + 1) % 4);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) Mma(c[nt], h0, r0, h2, r2, BitOperand(x0, nt), BitOperand(x1, nt));
      }
    }
    float sc[4][2];  // query g, tokens b0 + 8 nt + 2t + j
    const float zs = ZeroTermOfPair(zc) * unscale;
    // C of n-tile nt to scores: times its power of two (a constant) and unscale, as one factor
    // MmaBitUnweight(nt) * unscale a block (exact: a power of two times unscale; the FFMA's exact
    // product is the same real number, so the same bits). Computed in the loop by an opaque
    // multiply: hoisted out of it, the four factors held four registers through the loop, which
    // left the mma's B operands one register pair.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float u;
      asm volatile("mul.rn.f32 %0, %1, %2;" : "=f"(u) : "f"(unscale), "f"(MmaBitUnweight(nt)));
#pragma unroll
      for (int j = 0; j < 2; ++j) sc[nt][j] = fmaf(c[nt][j] + c[nt][j + 2], u, zs);
    }
    // The values' codes and scales from shared memory now, before the softmax, so that the loads'
    // latency overlaps its vote and exponentials instead of standing before the values' first mma
    // (the vote orders shared memory accesses: loads written after it stay after it).
    uint32_t vw[W];
    LaneWords<W>(vcodes, lane, vw);
    uint32_t vs[2][2][NGV];  // [ks][kh][cg]: the scale pairs of the k-halves, per channel group
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) LaneWords<NGV>(vscale + (t * 4 + 2 * ks + kh) * NGV, 0, vs[ks][kh]);
    // Substituted tokens: out of this block's softmax (their rows are attended after the blocks).
    if (sub_mask != 0) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if ((sub_mask >> (8 * nt + 2 * t + j)) & 1u) sc[nt][j] = -INFINITY;
    }
    // ---- online softmax of query g (its 32 scores are in the quad).
    float bm = fmaxf(fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1])),
                     fmaxf(fmaxf(sc[2][0], sc[2][1]), fmaxf(sc[3][0], sc[3][1])));  // exact in any order
    // Whether some query's max grows, voted on the lanes' own maxima (the quad's max exceeds m iff
    // one of its lanes' does). p kLeanP (the values' B operands' scale, whose fp16 rounding it
    // precedes) straight from the exponent, first against the running max m: when no max grew
    // (after the first blocks, nearly always) the quad's max is <= m, the new max is m and these
    // are the block's p, found without waiting for the vote or the quad's shuffles. Only when
    // some max grew, the quad's max, the rescale and p again from the new max. l sums p and is
    // divided by kLeanP at the end.
    const bool grew = __any_sync(kAll, bm > m);
    float p[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) p[nt][j] = ExpFrom(sc[nt][j], m_log2e);
    if (grew) {
      bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, 1));
      bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, 2));
      const float mn = fmaxf(m, bm);
      RaiseRunningMax(m, mn, l, acc, zv, t, true);
      m_log2e = mn == -INFINITY ? 0.0f : fmaf(mn, kLog2e, -kLeanPLog2);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) p[nt][j] = ExpFrom(sc[nt][j], m_log2e);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) l += p[nt][j];
    // The raw scores for the top-k, stored after the softmax's vote and exponentials (which no
    // longer wait behind the stores' branches).
    if (scores_pairs && b0 + 32 <= scores_end) {  // tokens 2t, 2t + 1 of each n-tile: adjacent
      float* const at = scores_out + b0 + 2 * t;
      if (evict_first) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) StoreGlobalOutputPair<true>(at + 8 * nt, sc[nt][0], sc[nt][1]);
      } else {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) StoreGlobalOutputPair(at + 8 * nt, sc[nt][0], sc[nt][1]);
      }
    } else if (scores_out) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int32_t tok = b0 + 8 * nt + 2 * t + j;
          if (tok < scores_end) StoreGlobalOutput(scores_out + tok, sc[nt][j]);
        }
    }
    // ---- values. pb[ks][kh]: p kLeanP of tokens 16 ks + 8 kh + 2t, +1 (S's n-tile 2 ks + kh), query g.
    uint32_t pb[2][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) pb[nt / 2][nt % 2] = HalfPairOf(p[nt][0], p[nt][1]);
    const uint4 vz = g < NGV ? reinterpret_cast<const uint4*>(vzero)[g * 4 + t] : make_uint4(0u, 0u, 0u, 0u);
    const uint32_t vzp[4] = {vz.x, vz.y, vz.z, vz.w};  // [2 ks + kh]
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      Mma(zv, vzp[2 * ks], 0u, vzp[2 * ks + 1], 0u, pb[ks][0], pb[ks][1]);
#pragma unroll
      for (int cg = 0; cg < NGV; ++cg) {
        const uint32_t b0 = Mul2(pb[ks][0], vs[ks][0][cg]);
        const uint32_t b1 = Mul2(pb[ks][1], vs[ks][1][cg]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int mt = 2 * cg + h;
          uint32_t a[4];
#pragma unroll
          for (int rr = 0; rr < 4; ++rr) {
            const int cc = (2 * rr + ks) * (D / 64) + mt / 4;
            a[rr] = BitOperand(GroupAt10(vw[cc / 4], cc % 4), mt % 4);
          }
          Mma(acc[mt], a[0], a[1], a[2], a[3], b0, b1);
        }
      }
    }
    __syncwarp();  // this stage is rewritten by the next blocks' copies
  }

  // ---- the unit's substituted rows, up to 32 at a time: their scores as one mma chain per eight
  // rows over the fetched keys (B: column g = the group's row g, k = channels, as in the key
  // codes' mma; A = the query operands, rows g + 8 zero), exact fp16 products summed in fp32; the
  // running max raised by them (the accumulators rescaled as for a block), then their values added
  // as mma over the fetched values (AddSubstitutedValues). Their exact scores replace the -inf the
  // blocks stored for the top-k.
  for (;;) {
    const int n = unit_subs.ListBefore<D>(r, t1, lane, sub_list, sub_tokens);
    if (n == 0) break;
    __syncwarp();  // sub_list and sub_tokens written
    for (int s0 = 0; s0 < n; s0 += 8) {
      const int in_group = min(8, n - s0);
      // Row g's channel pairs 8 ks + t (channels 16 ks + 2t, +1) and 8 ks + t + 4 (+ 8, + 9).
      const uint32_t* kt = GroupRowWords<D>(r, sub_list, s0, in_group, g, 0, t);
      float cs[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // query g's scores of the group's rows 2t, 2t + 1 (cs[0], cs[1])
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t k01 = kt ? __ldg(kt + 8 * ks) : 0u, k89 = kt ? __ldg(kt + 8 * ks + 4) : 0u;
        const uint4 quad = qquads[(ks / 2) * 32 + lane];
        Mma(cs, ks % 2 == 0 ? quad.x : quad.y, 0u, ks % 2 == 0 ? quad.z : quad.w, 0u, k01, k89);
      }
      if (s0 + 2 * t < n) sub_scores[(s0 + 2 * t) * kLeanMaxQueries + g] = cs[0] * unscale;
      if (s0 + 2 * t + 1 < n) sub_scores[(s0 + 2 * t + 1) * kLeanMaxQueries + g] = cs[1] * unscale;
    }
    __syncwarp();  // sub_scores written by the quads that scored the rows
    // Query g's largest of the rows (the quad's lanes take every fourth row).
    float bm = -INFINITY;
    for (int k = t; k < n; k += 4) bm = fmaxf(bm, sub_scores[k * kLeanMaxQueries + g]);
    bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, 1));
    bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, 2));
    const float mn = fmaxf(m, bm);
    RaiseRunningMax(m, mn, l, acc, zv, t);
    const float mn_log2e = fmaf(mn, kLog2e, -kLeanPLog2);  // mn is a row's score: finite
    for (int k = t; k < n; k += 4) l += ExpFrom(sub_scores[k * kLeanMaxQueries + g], mn_log2e);
    // p kLeanP from the rows' scores (sub_scores [row][query]); acc in its units:
    // MmaBitWeight(mt % 4) * kLeanP.
    AddSubstitutedValues<D, 1>(
        r, sub_list, n, lane, [&](int row, int) { return ExpFrom(sub_scores[row * kLeanMaxQueries + g], mn_log2e); },
        [&](int mt, int, const float (&c)[4]) {
          const float w = MmaBitWeight(mt % 4);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][e] = fmaf(c[e], w, acc[mt][e]);
        });
    if (scores_out) {  // after the blocks' stores of the same tokens (other lanes: ordered by the __syncwarp above)
      for (int k = t; k < n; k += 4) {
        const int32_t tok = sub_tokens[k];
        if (tok < scores_end) StoreGlobalOutput(scores_out + tok, sub_scores[k * kLeanMaxQueries + g]);
      }
    }
    __syncwarp();  // sub_list, sub_tokens and sub_scores are rewritten by the next rows
  }

  // ---- the unit's partial result: per query max, sum, and out + the zeros' term. out goes through
  // the stages (free now: no copy is in flight after the last block) as rows [query][D + 4] (the
  // pad spreads a store's lanes over all 32 banks), then to global memory a 16-byte store per lane
  // and row piece: written straight from the accumulators it took 32 tested scalar stores a lane
  // and ~440 instructions a unit (ncu, 32 x 8K: 6.6% of the kernel's stall samples).
  l += __shfl_xor_sync(kAll, l, 1);
  l += __shfl_xor_sync(kAll, l, 2);
  constexpr int kOutRow = D + 4;
  static_assert(kLeanMaxQueries * kOutRow <= StagesWords<1, 1, D, 1>(), "the staged output fits the stages");
  float* staged = reinterpret_cast<float*>(ws);
  __syncwarp();  // every lane is done with the stages
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int cg = mt / 2;
    const float z0 = __shfl_sync(kAll, zv[0], 4 * cg + t), z1 = __shfl_sync(kAll, zv[1], 4 * cg + t);
    const float w = MmaBitUnweight(mt % 4) * (1.0f / kLeanP);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int q = 2 * t + (e & 1), ch = 16 * mt + g + 8 * (e >> 1);  // q < kLeanMaxQueries: rows past `queries` unused
      staged[q * kOutRow + ch] = acc[mt][e] * w + ((e & 1) ? z1 : z0) * (1.0f / kLeanP);
    }
  }
  __syncwarp();
  float* partial = r.scratch + static_cast<size_t>(u) * queries * D;
  float* stats = r.scratch + static_cast<size_t>(units) * queries * D + static_cast<size_t>(u) * queries * 2;
  constexpr int kPieces = D / 4;  // 16-byte pieces a row
  if ((reinterpret_cast<uintptr_t>(partial) & 15) == 0) {
    for (int i = lane; i < queries * kPieces; i += 32) {
      const int q = i / kPieces, c = 4 * (i % kPieces);
      reinterpret_cast<float4*>(partial)[i] = *reinterpret_cast<const float4*>(staged + q * kOutRow + c);
    }
  } else {  // scratch not 16-byte aligned: a lane per channel
    for (int q = 0; q < queries; ++q)
      for (int c = lane; c < D; c += 32) partial[q * D + c] = staged[q * kOutRow + c];
  }
  if (t == 0 && g < queries) stats[g * 2] = m, stats[g * 2 + 1] = l * (1.0f / kLeanP);  // l summed p kLeanP
}

// Asks L1 for the 128-byte lines that hold the D halves at `row` (null: nothing).
template <int D>
__device__ __forceinline__ void PrefetchRowL1(const Half* row) {
  if (row == nullptr) return;
  const char* at = reinterpret_cast<const char*>(row);
  const char* const end = at + D * sizeof(Half);
  for (at = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(at) & ~uintptr_t{127}); at < end; at += 128)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(at));
}

// Where the fp16 row of `token`'s key is (residual, the step's new rows, a substituted row), or
// null for a quantized key.
__device__ __forceinline__ const Half* KeyRow(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t token,
                                              int sub) {
  const int d = v.head_dim;
  if (token >= v.length) return r.new_keys + (token - v.length) * r.kv_stride;
  if (token >= v.quantized_keys) return v.residual_keys + static_cast<size_t>(token - v.quantized_keys) * d;
  if (sub >= 0) return SubstitutedRow(r, sub, d);
  return nullptr;
}

// Where the fp16 row of `token`'s value is (a substituted row, the step's new rows, the value
// window), or null for a quantized value.
template <int D>
__device__ __forceinline__ const Half* ValueRow(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t token,
                                                int sub) {
  if (sub >= 0) return SubstitutedRow(r, sub, D) + D;
  if (token >= v.length) return r.new_values + (token - v.length) * r.kv_stride;
  if (token >= v.quantized_values) return v.window_values + static_cast<size_t>(token - v.quantized_values) * D;
  return nullptr;
}

// A tail block's start for lane's token (`valid`: before the unit's end): its value row into
// value_rows[lane], both its fp16 rows asked of L1 (the key row's loads follow at once, the value
// rows' after the block's scores; on the H200 16 x 8K ran 6% faster with the CUDA-core tail, whose
// units end the kernel there), its key row returned (null: a quantized key, or none).
template <int D>
__device__ __forceinline__ const Half* StartTailBlock(const DeviceReplicaView& v, const DeviceDecodeRows& r,
                                                      int32_t token, bool valid, const Half** value_rows, int lane) {
  const int sub = valid ? FindSubstitute(v, r, token) : -1;
  const Half* const value_row = valid ? ValueRow<D>(v, r, token, sub) : nullptr;
  const Half* const key_row = valid ? KeyRow(v, r, token, sub) : nullptr;
  value_rows[lane] = value_row;
  PrefetchRowL1<D>(key_row);
  PrefetchRowL1<D>(value_row);
  return key_row;
}

// Whether a kernel's tail units run on the tensor cores (TailUnitMma): 1-bit keys and values (the
// tail's quantized groups keep the plain layout, a code word per channel or per 32-channel
// group), one query tile.
template <int KB, int VB, int D, int NT>
constexpr bool kTailMma = KB == 1 && VB == 1 && NT == 1 && (D == 64 || D == 128);

// The tail's query operands for TailScoresMma, in the first D * 4 words of `quads` (shared
// memory): quad [kk][lane] holds query g's (g = lane / 4, t = lane % 4) channels 32 kk + 8 t .. +7
// as fp16 pairs, its QueryOperand (cpu_attention.h) times 2^e, the query's own exponent; zeros for
// the padding queries. Returns 2^-e * scale of queries 2t and 2t + 1 (unscale[2]: C to scores).
// Each lane writes the channels it holds, lane + 32 i, as halves.
template <int D>
__device__ __forceinline__ void StoreTailQueryOperands(const DeviceDecodeRows& r, int queries, uint32_t* quads, int lane,
                                                       float (&unscale)[2]) {
  constexpr int Q = 8;
  unsigned short* halves = reinterpret_cast<unsigned short*>(quads);
  const int t = lane & 3;
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    const float* row = q < queries ? r.q + QueryAt(r, q, D) : nullptr;
    const int e = row ? decode::WarpQueryOperandExponent(row, D, lane) : 0;
#pragma unroll
    for (int c = lane; c < D; c += 32) {
      const __half h = __float2half_rn(row ? row[c] * decode::Pow2(e) : 0.0f);
      // Channel c is half c % 8 of the quad of lane 4 q + (c % 32) / 8, k-step pair c / 32.
      halves[((c / 32) * 32 + 4 * q + (c % 32) / 8) * 8 + c % 8] = __half_as_ushort(h);
    }
    if (q == 2 * t) unscale[0] = decode::Pow2(-e) * r.scale;
    if (q == 2 * t + 1) unscale[1] = decode::Pow2(-e) * r.scale;
  }
  __syncwarp();
}

// A tail block's scores on the tensor cores, into sc[mt][e] (token 16 mt + g + 8 (e >> 1) of the
// block, query 2t + (e & 1), times the query's unscale: raw scores, unmasked): S^T = K Q^T over 16 tokens an m-tile (A = the keys: rows tokens, k = channels; B = the query
// operands, StoreTailQueryOperands), two m-tiles, D / 16 k-steps. The k index is permuted the same
// way in A and B (k-steps 2 kk + h take channels 32 kk + 8 t + 4 h + {0, 1} as k = 2t, 2t + 1 and
// + {2, 3} as 2t + 8, 2t + 9), so that a lane's operands of two k-steps are one 16-byte load of
// eight channels. A key row (fp16: residual, new or substituted) is loaded as it is; a quantized
// key (the block's group in the plain layout, 1-bit) is its scale or 0 (exact in fp16), its
// zeros' term q . z added in fp32 from an mma whose A rows are all the zeros. The products are
// exact; the tensor cores sum them in fp32. key_row: the fp16 key row of token b0 + lane (null
// for a quantized key or a token past the tail's end, whose score the caller masks).
template <int D>
__device__ __forceinline__ void TailScoresMma(const DeviceReplicaView& v, int32_t b0, const Half* key_row,
                                              const uint32_t* quads, const float (&unscale)[2], float (&sc)[2][4],
                                              int lane) {
  const int g = lane >> 2, t = lane & 3;
  // The block's keys are all quantized (whole groups: quantized_keys is a multiple of 32), but for
  // the substituted ones, or none is.
  const bool quantized_block = b0 < v.quantized_keys;
  const int32_t group = b0 / kGroup;
  const uint32_t* codes = quantized_block ? KeyCodes(v, group) : nullptr;
  const Half* scales = quantized_block ? KeyScales(v, group) : nullptr;
  const Half* zeros = quantized_block ? KeyZeros(v, group) : nullptr;
  // Rows of tokens 16 mt + 8 hr + g, this lane's rows of A.
  const Half* rows[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      rows[mt][hr] = reinterpret_cast<const Half*>(
          __shfl_sync(kAll, reinterpret_cast<unsigned long long>(key_row), 16 * mt + 8 * hr + g));
  float c[2][4] = {}, zc[4] = {};  // S^T's m-tiles; the zeros' term (every row the same)
#pragma unroll
  for (int kk = 0; kk < D / 32; ++kk) {
    const uint4 qw = reinterpret_cast<const uint4*>(quads)[kk * 32 + lane];
    const uint32_t b[4] = {qw.x, qw.y, qw.z, qw.w};  // [2 h]: b0 of k-step 2 kk + h, [2 h + 1]: its b1
    uint32_t a[2][2][4] = {};                        // [mt][h][A register]
    const int c0 = 32 * kk + 8 * t;                  // the lane's eight channels
    if (quantized_block) {
      // Token 16 mt + g's code bit of a channel word shifted to the msb of byte 2 mt (+ 8: 2 mt + 1).
      const uint4 w0 = __ldg(reinterpret_cast<const uint4*>(codes + c0));
      const uint4 w1 = __ldg(reinterpret_cast<const uint4*>(codes + c0 + 4));
      const uint4 sp = __ldg(reinterpret_cast<const uint4*>(scales + c0));
      const uint4 zp = __ldg(reinterpret_cast<const uint4*>(zeros + c0));
      const uint32_t x[8] = {w0.x << (7 - g), w0.y << (7 - g), w0.z << (7 - g), w0.w << (7 - g),
                             w1.x << (7 - g), w1.y << (7 - g), w1.z << (7 - g), w1.w << (7 - g)};
      const uint32_t s[4] = {sp.x, sp.y, sp.z, sp.w}, z[4] = {zp.x, zp.y, zp.z, zp.w};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          a[mt][h][0] = MaskPair(x[4 * h], x[4 * h + 1], 2 * mt) & s[2 * h];
          a[mt][h][1] = MaskPair(x[4 * h], x[4 * h + 1], 2 * mt + 1) & s[2 * h];
          a[mt][h][2] = MaskPair(x[4 * h + 2], x[4 * h + 3], 2 * mt) & s[2 * h + 1];
          a[mt][h][3] = MaskPair(x[4 * h + 2], x[4 * h + 3], 2 * mt + 1) & s[2 * h + 1];
        }
        Mma(zc, z[2 * h], z[2 * h], z[2 * h + 1], z[2 * h + 1], b[2 * h], b[2 * h + 1]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        if (rows[mt][hr] == nullptr) continue;
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(rows[mt][hr] + c0));
        a[mt][0][hr] = w.x, a[mt][0][2 + hr] = w.y, a[mt][1][hr] = w.z, a[mt][1][2 + hr] = w.w;
      }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) Mma(c[mt], a[mt][h][0], a[mt][h][1], a[mt][h][2], a[mt][h][3], b[2 * h], b[2 * h + 1]);
  }
  // C: tokens 16 mt + g (+ 8 for e >= 2), queries 2t + (e & 1).
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool quantized = quantized_block && rows[mt][e >> 1] == nullptr;
      sc[mt][e] = (c[mt][e] + (quantized ? zc[e & 1] : 0.0f)) * unscale[e & 1];
    }
}

// p times this before its split into fp16 parts (p <= 1): the lo part keeps p's bits down to
// ~2^-34 instead of fp16's subnormal floor 2^-24.
constexpr float kTailP = 1024.0f;

// A tail block's values weighted by p, added to out^T's accumulators (acc[mt]: rows = channels,
// TailValueChannel; cols = queries 2t, 2t + 1): out^T = V^T P^T, two k-steps of 16 tokens, m-tiles
// of 16 channels. B = p of tokens 16 ks + 2t, +1 (+ 8), query g, from p_rows[token][q] (row stride
// PS) times kTailP as fp16 hi + lo parts. A = the values transposed: lane (g, t) loads eight
// channels 32 j + 8 t .. +7 of tokens 16 ks + g and 16 ks + 8 + g (one 16-byte load each) and
// movmatrix turns each of the four channel pairs into A's registers, so that m-tile 2 j + p holds
// the channels of pairs 2p and 2p + 1 (TailValueChannel). A value row (fp16: window, new or
// substituted; value_rows[token in block], null for none) is loaded as it is; a quantized value
// (1-bit, plain layout: a code word per 32-channel group, bit = channel) is its scale or 0, and
// its zero enters through a second A whose rows are the tokens' zeros. Fresh accumulators per
// block, added in fp32 (the tensor cores truncate). Tokens past the tail's end have p = 0 and no row.
template <int D, int PS>
__device__ __forceinline__ void TailValuesMma(const DeviceReplicaView& v, int32_t b0, const Half* const* value_rows,
                                              const float* p_rows, float (&acc)[D / 16][4], int lane) {
  const int g = lane >> 2, t = lane & 3;
  // Tokens below quantized_values have quantized values (but for substituted ones): with the
  // HeadReplica's rule (quantized keys >= quantized values) only in the tail's first block, where
  // BulkEnd cut the value window's group; any block is handled, token by token.
  const bool quantized_block = b0 < v.quantized_values;
  // Their replica block (the 32 tokens lie in one) and the block's token b0: a quantized value's
  // parts at offsets, as ValueCodes and the others find them, without a division per token.
  const uint8_t* const block = quantized_block ? ReplicaBlock(v, b0) : nullptr;
  const int32_t in0 = b0 % v.layout.block_tokens;
  auto value_part = [&](int32_t part, int in_block, int64_t token_bytes) {
    return block + ValuePartOffset(v.layout, part, in0 + in_block, token_bytes);
  };
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    uint32_t bh[2], bl[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tok = 16 * ks + 2 * t + 8 * i;
      Split(p_rows[tok * PS + g] * kTailP, p_rows[(tok + 1) * PS + g] * kTailP, bh[i], bl[i]);
    }
    // This lane's rows before the transpose: tokens 16 ks + g (r = 0) and 16 ks + 8 + g (r = 1).
    // A quantized one's code words and scales (codes[r] null for a row or a token past the end).
    const Half* rows[2];
    const uint32_t* codes[2] = {nullptr, nullptr};
    const Half* scales[2] = {nullptr, nullptr};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int in = 16 * ks + 8 * r + g;
      rows[r] = value_rows[in];
      if (quantized_block && rows[r] == nullptr && b0 + in < v.quantized_values) {
        codes[r] = reinterpret_cast<const uint32_t*>(value_part(v.layout.value_codes, in, D / 8));
        scales[r] = reinterpret_cast<const Half*>(value_part(v.layout.value_scale, in, D / 32 * 2));
      }
    }
    // The zeros' A: tokens 16 ks + 2t + {0, 1, 8, 9} (quantized ones; null for rows).
    const Half* zeros[4] = {nullptr, nullptr, nullptr, nullptr};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int in = 16 * ks + 2 * t + (i & 1) + 8 * (i >> 1);
      if (quantized_block && b0 + in < v.quantized_values && value_rows[in] == nullptr) {
        zeros[i] = reinterpret_cast<const Half*>(value_part(v.layout.value_zero, in, D / 32 * 2));
      }
    }
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      uint32_t w[2][4];  // [r][word]: channels 32 j + 8 t + 2 word, + 1 of row r's token
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (rows[r] != nullptr) {
          const uint4 x = __ldg(reinterpret_cast<const uint4*>(rows[r] + 32 * j + 8 * t));
          w[r][0] = x.x, w[r][1] = x.y, w[r][2] = x.z, w[r][3] = x.w;
        } else if (codes[r] != nullptr) {
          const uint32_t code = codes[r][j] >> (8 * t);
          const uint32_t scale = scales[r][j];
          const uint32_t pair = scale | (scale << 16);
#pragma unroll
          for (int word = 0; word < 4; ++word) {
            const uint32_t bits = code >> (2 * word);
            w[r][word] = (((bits & 1u) ? 0x0000FFFFu : 0u) | ((bits & 2u) ? 0xFFFF0000u : 0u)) & pair;
          }
        } else {
#pragma unroll
          for (int word = 0; word < 4; ++word) w[r][word] = 0u;
        }
      }
      uint32_t az01 = 0u, az89 = 0u;  // zeros of tokens 2t, 2t + 1 and 2t + 8, 2t + 9
      if (quantized_block) {
        Half z[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) z[i] = zeros[i] != nullptr ? zeros[i][j] : Half{0};
        az01 = static_cast<uint32_t>(z[0]) | (static_cast<uint32_t>(z[1]) << 16);
        az89 = static_cast<uint32_t>(z[2]) | (static_cast<uint32_t>(z[3]) << 16);
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const uint32_t a0 = mma::Transposed8x8(w[0][2 * p]), a1 = mma::Transposed8x8(w[0][2 * p + 1]);
        const uint32_t a2 = mma::Transposed8x8(w[1][2 * p]), a3 = mma::Transposed8x8(w[1][2 * p + 1]);
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        Mma(c, a0, a1, a2, a3, bh[0], bh[1]);
        Mma(c, a0, a1, a2, a3, bl[0], bl[1]);
        if (quantized_block) {  // warp-uniform
          Mma(c, az01, az01, az89, az89, bh[0], bh[1]);
          Mma(c, az01, az01, az89, az89, bl[0], bl[1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[2 * j + p][e] = fmaf(c[e], 1.0f / kTailP, acc[2 * j + p][e]);
      }
    }
  }
}
// The channel of TailValuesMma's accumulator acc[mt][e] in lane group g (its query: 2t + (e & 1)).
__device__ __forceinline__ int TailValueChannel(int mt, int e, int g) {
  return 32 * (mt / 2) + 8 * (g >> 1) + 4 * (mt % 2) + 2 * (e >> 1) + (g & 1);
}

// One tail unit on the tensor cores (kTailMma: 1-bit keys and values, one query tile): tokens
// [from, to) as TailUnit takes them, 32 at a time. The scores (TailScoresMma) stay in the mma's
// registers for the online softmax: a lane holds queries 2t and 2t + 1 (their running max m and
// its part of the sum l) for tokens 16 mt + g (+ 8), the max over a query's tokens three shuffles
// across the lane groups; p goes to shared memory ([token][query]) for the values' B
// (TailValuesMma). On the CUDA cores a tail block ran ~10x a bulk block's instructions; with the
// scores and values as mma (the softmax then a lane per token and query, the scores through shared
// memory) the attention took, on the H200 a layer: 32 x 8K 0.1180 -> 0.1054 ms, 16 x 8K 0.0892 ->
// 0.0652 (there the tails end the kernel), 99 x 8K 0.2870 -> 0.2690, 8 x 32K 0.1058 -> 0.0976;
// with the softmax in the registers 32 x 8K 0.1062 -> 0.1028, 16 x 8K 0.0658 -> 0.0617, the other
// shapes within 0.7%.
template <int D>
__device__ void TailUnitMma(const DeviceDecodeItem& it, int u, int units, int32_t from, int32_t to, uint32_t* ws,
                            int stages_words, int lane) {
  constexpr int Q = 8, PS = Q + 4;
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int queries = r.n_rows * r.n_heads;
  const int g = lane >> 2, t = lane & 3;
  // Per warp: the query operands (D * 4 words), the block's value rows [32] at word 8 D (where
  // TailUnit keeps them, after its [Q][D] queries), p [32 tokens][PS] after the stages.
  const Half** value_rows = reinterpret_cast<const Half**>(ws + Q * D);
  float* psm = reinterpret_cast<float*>(ws + stages_words);
  float unscale[2];  // queries 2t, 2t + 1: C to scores
  StoreTailQueryOperands<D>(r, queries, ws, lane, unscale);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // queries 2t, 2t + 1 (l: this lane's tokens)
  float acc[D / 16][4] = {};  // out^T (TailValuesMma: channel TailValueChannel(mt, e, g), query 2t + (e & 1))
  for (int32_t b0 = from; b0 < to; b0 += 32) {
    const int32_t token = b0 + lane;
    const bool valid = token < to;
    const Half* const key_row = StartTailBlock<D>(v, r, token, valid, value_rows, lane);
    float sc[2][4];
    TailScoresMma<D>(v, b0, key_row, ws, unscale, sc, lane);
    // Masks: tokens past the end, the step's new rows causal among themselves (query row q / n_heads
    // sees new rows up to its own), padding queries. The candidates' scores go out for the top-k.
    float bm[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t tok = b0 + 16 * mt + g + 8 * (e >> 1);
        const int q = 2 * t + (e & 1);
        const bool in = tok < to && q < queries;
        if (!in || (tok >= v.length && tok - v.length > q / r.n_heads)) sc[mt][e] = -INFINITY;
        float* const scores = in && tok < r.n_candidates ? decode::ScoresOfRow(r, q / r.n_heads) : nullptr;
        if (scores) scores[static_cast<size_t>(q % r.n_heads) * r.n_candidates + tok] = sc[mt][e];
        bm[e & 1] = fmaxf(bm[e & 1], sc[mt][e]);
      }
    float alpha[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      for (int o = 4; o < 32; o <<= 1) bm[j] = fmaxf(bm[j], __shfl_xor_sync(kAll, bm[j], o));
      const float mn = fmaxf(m[j], bm[j]);
      alpha[j] = mn == -INFINITY ? 1.0f : __expf(m[j] - mn);
      l[j] *= alpha[j];
      m[j] = mn;
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e & 1;
        const float p = m[j] == -INFINITY ? 0.0f : __expf(sc[mt][e] - m[j]);
        l[j] += p;
        psm[(16 * mt + g + 8 * (e >> 1)) * PS + 2 * t + j] = p;
      }
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) acc[mt][0] *= alpha[0], acc[mt][2] *= alpha[0], acc[mt][1] *= alpha[1], acc[mt][3] *= alpha[1];
    __syncwarp();  // p and value_rows written
    TailValuesMma<D, PS>(v, b0, value_rows, psm, acc, lane);
    __syncwarp();  // psm and value_rows are rewritten by the next block
  }
  float* partial = r.scratch + static_cast<size_t>(u) * queries * D;
  float* stats = r.scratch + static_cast<size_t>(units) * queries * D + static_cast<size_t>(u) * queries * 2;
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int q = 2 * t + (e & 1);
      if (q < queries) partial[q * D + TailValueChannel(mt, e, g)] = acc[mt][e];
    }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    for (int o = 4; o < 32; o <<= 1) l[j] += __shfl_xor_sync(kAll, l[j], o);
    const int q = 2 * t + j;
    if (g == 0 && q < queries) stats[q * 2] = m[j], stats[q * 2 + 1] = l[j];
  }
}

// One tail unit: tokens [from, to) of whatever kind (residual keys, value window, the step's new
// rows, causal among themselves), 32 at a time with an online softmax: a lane per token for the
// scores (queries from shared memory, fp16 key rows read 8 channels at a time) and a lane per
// channel for the values, on the CUDA cores.
template <int KB, int VB, int D, int NT>
__device__ void TailUnit(const DeviceDecodeItem& it, int u, int units, int32_t from, int32_t to, uint32_t* ws,
                         int lane) {
  constexpr int Q = 8 * NT, PS = Q + 4, CPL = D / 32;
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int queries = r.n_rows * r.n_heads;
  float* qsm = reinterpret_cast<float*>(ws);  // [Q][D]: QueryOperand(q) * scale
  float* psm = reinterpret_cast<float*>(ws + StagesWords<KB, VB, D, NT>());
  // The fp16 value rows of the block's tokens (null: a quantized value), after the queries.
  const Half** value_rows = reinterpret_cast<const Half**>(qsm + Q * D);
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    const float* row = q < queries ? r.q + QueryAt(r, q, D) : nullptr;
    const int e = row ? decode::WarpQueryOperandExponent(row, D, lane) : 0;
#pragma unroll
    for (int c = lane; c < D; c += 32) qsm[q * D + c] = row ? decode::QueryOperandChannel(row[c], e) * r.scale : 0.0f;
  }
  __syncwarp();
  float m[Q], l[Q], acc[Q][CPL];
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    m[q] = -INFINITY;
    l[q] = 0.0f;
#pragma unroll
    for (int k = 0; k < CPL; ++k) acc[q][k] = 0.0f;
  }
  for (int32_t b0 = from; b0 < to; b0 += 32) {
    const int32_t token = b0 + lane;
    const bool valid = token < to;
    const Half* const key_row = StartTailBlock<D>(v, r, token, valid, value_rows, lane);
    float s[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) s[q] = 0.0f;
    if (valid) {
      const Half* row = key_row;
      if (row != nullptr) {
        for (int c = 0; c < D; c += 8) {
          const uint4 x = *reinterpret_cast<const uint4*>(row + c);
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const uint32_t w = h == 0 ? x.x : h == 1 ? x.y : h == 2 ? x.z : x.w;
            const float2 k2 = make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu))),
                                          __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))));
#pragma unroll
            for (int q = 0; q < Q; ++q) s[q] += qsm[q * D + c + 2 * h] * k2.x + qsm[q * D + c + 2 * h + 1] * k2.y;
          }
        }
      } else {  // a quantized key: its group's codes, scales and zeros found once, not per channel
        const int32_t g = token / kGroup, t = token % kGroup;
        const uint32_t* codes = KeyCodes(v, g);
        const Half* scales = KeyScales(v, g);
        const Half* zeros = KeyZeros(v, g);
        for (int c = 0; c < D; ++c) {
          const float k = static_cast<float>(decode::Code(codes + c * KB, t, KB)) * H2F(scales[c]) + H2F(zeros[c]);
#pragma unroll
          for (int q = 0; q < Q; ++q) s[q] += qsm[q * D + c] * k;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      float score = -INFINITY;
      if (q < queries && valid && !(token >= v.length && token - v.length > q / r.n_heads)) score = s[q];
      float* const scores = q < queries && valid && token < r.n_candidates ? decode::ScoresOfRow(r, q / r.n_heads) : nullptr;
      if (scores) scores[static_cast<size_t>(q % r.n_heads) * r.n_candidates + token] = score;
      float bm = score;
      for (int o = 16; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(kAll, bm, o));
      const float mn = fmaxf(m[q], bm);
      const float alpha = mn == -INFINITY ? 1.0f : __expf(m[q] - mn);
      const float p = mn == -INFINITY ? 0.0f : __expf(score - mn);
      float sum = p;
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kAll, sum, o);
      m[q] = mn;
      l[q] = l[q] * alpha + sum;
#pragma unroll
      for (int k = 0; k < CPL; ++k) acc[q][k] *= alpha;
      psm[lane * PS + q] = p;
    }
    __syncwarp();
    const int32_t n = min(32, to - b0);
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const Half* row = value_rows[j];
      // No row: a quantized value (lane's channel in group k is lane), its parts found once.
      const uint32_t* codes = row != nullptr ? nullptr : ValueCodes(v, b0 + j);
      const Half* scales = row != nullptr ? nullptr : ValueScales(v, b0 + j);
      const Half* zeros = row != nullptr ? nullptr : ValueZeros(v, b0 + j);
#pragma unroll
      for (int k = 0; k < CPL; ++k) {
        const float val = row != nullptr ? H2F(row[lane + 32 * k])
                                         : static_cast<float>(decode::Code(codes + k * VB, lane, VB)) * H2F(scales[k]) +
                                               H2F(zeros[k]);
#pragma unroll
        for (int q = 0; q < Q; ++q) acc[q][k] += psm[j * PS + q] * val;
      }
    }
    __syncwarp();
  }
  float* partial = r.scratch + static_cast<size_t>(u) * queries * D;
  float* stats = r.scratch + static_cast<size_t>(units) * queries * D + static_cast<size_t>(u) * queries * 2;
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    if (q >= queries) break;
#pragma unroll
    for (int k = 0; k < CPL; ++k) partial[q * D + lane + 32 * k] = acc[q][k];
    if (lane == 0) stats[q * 2] = m[q], stats[q * 2 + 1] = l[q];
  }
}

// One n-tile: registers capped for kMinCtasOneTile CTAs per SM (see there). kLean: the items'
// replicas are in the mma layout (KB = VB = 1, NT = 1): LeanBulkUnit for their bulk.
template <int KB, int VB, int D, int NT, bool kLean = false>
__global__ void __launch_bounds__(kWarps * 32, NT == 1 ? kMinCtasOneTile : 1) LowBitDecodeKernel(const DeviceItemSet* set) {
  static_assert(!kLean || (KB == 1 && VB == 1 && NT == 1), "the lean path: 1-bit keys and values, one query tile");
  static_assert(WarpWords<KB, VB, D, NT>() % 4 == 0 && StageWords<KB, VB, D>() % 4 == 0, "16-byte aligned stages");
  extern __shared__ uint32_t smem[];
  // The merge's CTAs may be placed once every CTA here has started: in the slots the last wave
  // frees, and in any slot left free meanwhile (also those left for the fetch).
  AllowDependentLaunch();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int w = blockIdx.x * kWarps + warp;
  const int32_t* unit_begin = UnitBegin(set);
  const int32_t* tail_begin = TailBegin(set);
  const int count = set->count;
  // The warp's item and unit in the set's order (UnitOfWarp); past the units or padding: none.
  int item = 0, u = 0;
  if (!UnitOfWarp(unit_begin, tail_begin, count, set->tail_order, w, &item, &u)) return;
  uint32_t* ws = smem + warp * WarpWords<KB, VB, D, NT>();
  static_assert(sizeof(DeviceDecodeItem) % 8 == 0, "the item is copied in 8-byte words");
  uint64_t* item_words = reinterpret_cast<uint64_t*>(ws + ItemOffsetWords<KB, VB, D, NT>());
  const uint64_t* from = reinterpret_cast<const uint64_t*>(SetItems(set) + item);
  for (int i = lane; i < static_cast<int>(sizeof(DeviceDecodeItem) / 8); i += 32) item_words[i] = from[i];
  __syncwarp();
  const DeviceDecodeItem& it = *reinterpret_cast<const DeviceDecodeItem*>(item_words);
  const int units = unit_begin[item + 1] - unit_begin[item];
  const int chunk_blocks = set->chunk_blocks;
  const int bulk_units = BulkUnits(it.replica, chunk_blocks);
  const int32_t bulk_end = BulkEnd(it.replica);
  if (u < bulk_units) {
    const int32_t t0 = u * chunk_blocks * 32;
    if constexpr (kLean) {
      LeanBulkUnit<D>(it, u, units, t0, min(bulk_end, t0 + chunk_blocks * 32), ws, lane, set->codes_evict_first != 0);
    } else {
      BulkUnit<KB, VB, D, NT>(it, u, units, t0, min(bulk_end, t0 + chunk_blocks * 32), ws, lane);
    }
  } else {
    const int32_t per = TailUnitTokens(it, set->tail_units), from_token = bulk_end + (u - bulk_units) * per;
    const int32_t to_token = min(it.replica.length + it.rows.n_rows, from_token + per);
    if constexpr (kTailMma<KB, VB, D, NT>) {
      TailUnitMma<D>(it, u, units, from_token, to_token, ws, StagesWords<KB, VB, D, NT>(), lane);
    } else {
      TailUnit<KB, VB, D, NT>(it, u, units, from_token, to_token, ws, lane);
    }
  }
}

// A merge's statistics of query q (its max mx and sum of exponentials over the item): the real
// row's statistics, or the probabilities row's (or its probabilities themselves, in place, the
// merge's threads `first`, `first + step`, ... striding over them; `first` 0 writes the pair).
__device__ void MergedRowStatistics(const DeviceDecodeRows& r, int q, float mx, float sum, int first, int step) {
  float* pair = nullptr;
  if (float* real_stats = decode::RealRowStats(r, q / r.n_heads)) {
    pair = real_stats + (q % r.n_heads) * 2;
  } else if (r.probs && q / r.n_heads == r.probs_row) {
    const int h = q % r.n_heads;
    if (r.probs_stats) {
      pair = r.probs_stats + h * 2;
    } else {
      const float inv_sum = 1.0f / sum;
      float* row = r.probs + static_cast<size_t>(h) * r.n_candidates;
      for (int32_t j = first; j < r.n_candidates; j += step) row[j] = expf(row[j] - mx) * inv_sum;
    }
  }
  if (pair != nullptr && first == 0) pair[0] = mx, pair[1] = sum;
}

// Units whose partial results a merge lane loads before the units' statistics (MergeKernel).
constexpr int kMergeHeldUnits = 8;
// Most units an item of a set may have for MergeKernel (at most a warp's lanes: a lane holds a
// unit's statistics); sets of longer items take MergeKernelPerChannel.
constexpr int kMergeWarpUnits = 16;
static_assert(kMergeWarpUnits <= 32, "a unit's statistics a lane");

// Block (item), warp q (query q), lane l (channels l + 32 i), for sets whose items have at most
// kMergeWarpUnits units: the item's units' partial results for the query combined in unit order
// (deterministic), the probabilities row's statistics (or the probabilities themselves, in
// place). Each lane loads its channels of the first kMergeHeldUnits units before the statistics,
// the rest eight or four units at a time; the units' weights are shuffled from the lane that
// computed them. Under ncu on the H200: 19.3 us a layer at 99 x 8K and 10.5 at 32 x 8K, against
// MergeKernelPerChannel's 27.1 and 12.6 (a thread per channel waits for each group of four loads
// in turn, and a thread per output took three waves at 99 x 8K). Bounded for kMaxQ queries (512
// threads): without the bound it took 126 registers, a hair under what 512 threads may use.
__global__ void __launch_bounds__(kMaxQ * 32) MergeKernel(const DeviceItemSet* set) {
  WaitForPrerequisite();  // the decode kernel's partial results (LaunchAfter)
  AllowDependentLaunch();
  const DeviceDecodeItem& it = SetItems(set)[blockIdx.x];
  const DeviceDecodeRows& r = it.rows;
  const int d = it.replica.head_dim, queries = r.n_rows * r.n_heads;
  const int q = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x & 31);
  if (q >= queries) return;  // whole warps
  const int units = UnitBegin(set)[blockIdx.x + 1] - UnitBegin(set)[blockIdx.x];
  const int cpl = d / 32;  // channels per lane: 2 or 4
  const size_t stride = static_cast<size_t>(queries) * d;
  const float* at = r.scratch + static_cast<size_t>(q) * d + lane;
  const float* stats = r.scratch + static_cast<size_t>(units) * stride;
  float held[kMergeHeldUnits][4];
#pragma unroll
  for (int u = 0; u < kMergeHeldUnits; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) held[u][i] = u < units && i < cpl ? at[u * stride + 32 * i] : 0.0f;
  // Lane u < units holds unit u's statistics and, after the max over units, its weight
  // exp(m_u - max) (0 for an empty unit); the sum of l_u * weight is lane 0's tree.
  const float mu = lane < units ? stats[(lane * queries + q) * 2] : -INFINITY;
  float mx = mu;
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, o));
  const float w_lane = mu == -INFINITY ? 0.0f : __expf(mu - mx);
  float sum = lane < units ? stats[(lane * queries + q) * 2 + 1] * w_lane : 0.0f;
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(kAll, sum, o);
  sum = __shfl_sync(kAll, sum, 0);  // the same bits in every lane
  const float inv_sum = 1.0f / sum;
  // Four independent sums (unit u into o[u % 4] while a group of four is whole, the rest into
  // o[0]), combined in a fixed order.
  const int whole = units / 4 * 4;
  float o[4][4] = {};  // [u % 4][channel i]
#pragma unroll
  for (int u = 0; u < kMergeHeldUnits; ++u) {
    const float w = __shfl_sync(kAll, w_lane, u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (u < whole) o[u % 4][i] += held[u][i] * w;
    }
  }
  // The rest of the whole groups eight units at a time (their loads in flight together), then
  // four.
  auto add_units = [&](int u0, auto batch) {
    constexpr int kBatch = decltype(batch)::value;
    float x[kBatch][4];
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
#pragma unroll
      for (int i = 0; i < 4; ++i) x[k][i] = i < cpl ? at[(u0 + k) * stride + 32 * i] : 0.0f;
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const float w = __shfl_sync(kAll, w_lane, u0 + k);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[k % 4][i] += x[k][i] * w;
    }
  };
  int u0 = kMergeHeldUnits;
  for (; u0 + 8 <= whole; u0 += 8) add_units(u0, std::integral_constant<int, 8>{});
  for (; u0 < whole; u0 += 4) add_units(u0, std::integral_constant<int, 4>{});
  for (int u = whole; u < units; ++u) {  // at most three
    const float w = __shfl_sync(kAll, w_lane, u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (i < cpl) {
        float v = 0.0f;
#pragma unroll
        for (int h = 0; h < kMergeHeldUnits; ++h) v = h == u ? held[h][i] : v;
        if (u >= kMergeHeldUnits) v = at[u * stride + 32 * i];
        o[0][i] += v * w;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i < cpl) r.out[QueryAt(r, q, d) + lane + 32 * i] = ((o[0][i] + o[1][i]) + (o[2][i] + o[3][i])) * inv_sum;
  }
  MergedRowStatistics(r, q, mx, sum, lane, 32);
}

// MergeKernel's work for sets whose items have more than kMergeWarpUnits units: block (item,
// query), a thread per channel, the units' weights in shared memory (one per unit); the threads'
// sums four units at a time. (MergeKernel's warps, with their fewer and longer chains, took
// 13.6 us against this kernel's 10.3 at 8 x 32K, 31 units an item, and 8% longer a layer at 1 x 32K.)
__global__ void MergeKernelPerChannel(const DeviceItemSet* set) {
  extern __shared__ float weight[];  // [units, rounded up to 4]
  __shared__ float reduce[32];
  WaitForPrerequisite();  // the decode kernel's partial results (LaunchAfter)
  AllowDependentLaunch();
  const DeviceDecodeItem& it = SetItems(set)[blockIdx.x];
  const DeviceDecodeRows& r = it.rows;
  const int d = it.replica.head_dim, queries = r.n_rows * r.n_heads, q = blockIdx.y;
  if (q >= queries) return;
  const int units = UnitBegin(set)[blockIdx.x + 1] - UnitBegin(set)[blockIdx.x];
  const float* partial = r.scratch;
  const float* stats = r.scratch + static_cast<size_t>(units) * queries * d;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  // The max over units, then each unit's weight exp(m_u - max) and the sum of l_u * weight.
  float mx = -INFINITY;
  for (int u = threadIdx.x; u < units; u += blockDim.x) mx = fmaxf(mx, stats[(u * queries + q) * 2]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, o));
  if (lane == 0) reduce[warp] = mx;
  __syncthreads();
  mx = reduce[0];
  for (int w = 1; w < warps; ++w) mx = fmaxf(mx, reduce[w]);
  __syncthreads();
  float sum = 0.0f;
  for (int u = units + threadIdx.x; u < (units + 3) / 4 * 4; u += blockDim.x) weight[u] = 0.0f;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const float mu = stats[(u * queries + q) * 2];
    const float w = mu == -INFINITY ? 0.0f : __expf(mu - mx);
    weight[u] = w;
    sum += stats[(u * queries + q) * 2 + 1] * w;
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kAll, sum, o);
  if (lane == 0) reduce[warp] = sum;
  __syncthreads();
  sum = 0.0f;
  for (int w = 0; w < warps; ++w) sum += reduce[w];  // in warp order: deterministic
  const float inv_sum = 1.0f / sum;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    // Four independent sums (loads in flight), combined in a fixed order.
    const float* at = partial + static_cast<size_t>(q) * d + c;
    const size_t stride = static_cast<size_t>(queries) * d;
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int u = 0;
    for (; u + 4 <= units; u += 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] += at[(u + i) * stride] * weight[u + i];
    }
    for (; u < units; ++u) o[0] += at[u * stride] * weight[u];
    r.out[QueryAt(r, q, d) + c] = ((o[0] + o[1]) + (o[2] + o[3])) * inv_sum;
  }
  MergedRowStatistics(r, q, mx, sum, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

struct KernelInfo {
  void (*fn)(const DeviceItemSet*);
  int warp_words;  // shared memory per warp
  size_t shared_bytes() const { return size_t{kWarps} * warp_words * sizeof(uint32_t); }  // per CTA
};

template <int KB, int VB, int D>
std::array<KernelInfo, 2> Tiles() {
  return {KernelInfo{LowBitDecodeKernel<KB, VB, D, 1>, WarpWords<KB, VB, D, 1>()},
          KernelInfo{LowBitDecodeKernel<KB, VB, D, 2>, WarpWords<KB, VB, D, 2>()}};
}

int QueryTiles(const DeviceDecodeItem& it) { return it.rows.n_rows * it.rows.n_heads <= 8 ? 1 : 2; }

// The (key bits, value bits, head_dim, n-tiles) class of an eligible item, 0..15; 16 and 17 the
// lean path's (mma-layout replicas, head_dim 64 and 128).
constexpr int kClasses = 18;
int ClassOf(const DeviceDecodeItem& it) {
  if (it.replica.mma_codes) return kFirstLeanClass + (it.replica.head_dim == 128);
  return (((it.replica.key_bits - 1) * 2 + (it.replica.value_bits - 1)) * 2 + (it.replica.head_dim == 128)) * 2 +
         QueryTiles(it) - 1;
}

// The kernel of a class (ClassOf's order).
KernelInfo KernelFor(int cls) {
  static const std::array<std::array<KernelInfo, 2>, 8> table = {
      Tiles<1, 1, 64>(), Tiles<1, 1, 128>(), Tiles<1, 2, 64>(), Tiles<1, 2, 128>(),
      Tiles<2, 1, 64>(), Tiles<2, 1, 128>(), Tiles<2, 2, 64>(), Tiles<2, 2, 128>()};
  static const std::array<KernelInfo, 2> lean = {
      KernelInfo{LowBitDecodeKernel<1, 1, 64, 1, true>, WarpWords<1, 1, 64, 1>()},
      KernelInfo{LowBitDecodeKernel<1, 1, 128, 1, true>, WarpWords<1, 1, 128, 1>()}};
  return cls >= kFirstLeanClass ? lean[cls - kFirstLeanClass] : table[cls / 2][cls % 2];
}

// Allows the class's kernel its shared memory on the current device (two query tiles at head_dim
// 128 take ~62 KB per CTA, over the 48 KB a launch gets without opting in): before its occupancy
// is asked and before each launch (the attribute is set once per kernel and device).
cudaError_t AllowSharedMemoryOf(int cls) {
  static std::atomic<bool> allowed[kClasses][kMaxOptInDevices] = {};
  const KernelInfo kernel = KernelFor(cls);
  return AllowDynamicSharedMemory(kernel.fn, kernel.shared_bytes(), allowed[cls]);
}

// Whether the current device runs mma.m16n8k16 with fp16 operands (sm_80+), asked once per device.
bool DeviceHasMma() {
  static std::atomic<int> known[kMaxKnownDevices] = {};
  return CurrentDeviceAtLeast(known, 8);
}

// The chunk and the unit table of one class's items: one wave of the GPU less `free_slots` CTAs.
Status PlanSet(int cls, std::vector<DeviceDecodeItem> items, const LowBitPlanArgs& args,
               LowBitSet* set) {
  // The class's CTAs per SM (its shared memory is fixed): asked once per device, not per plan.
  static std::atomic<int> known_ctas[kClasses][kMaxKnownDevices] = {};
  const int ctas_per_sm = KnownForCurrentDevice(known_ctas[cls], 1, [cls](int) {
    const KernelInfo kernel = KernelFor(cls);
    int ctas = 0;
    return AllowSharedMemoryOf(cls) == cudaSuccess &&
                   cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel.fn, kWarps * 32, kernel.shared_bytes()) ==
                       cudaSuccess &&
                   ctas >= 1
               ? ctas : 1;
  });
  const int64_t ctas = std::max<int64_t>(int64_t{MultiprocessorCount()} * ctas_per_sm - args.free_slots, 1);
  const int64_t wave = ctas * kWarps;
  // Tail units take at most an eighth of the wave (a tail of a few blocks is cheap next to a bulk
  // unit of many; at 256 items x 3 tail units they took a third of the slots).
  const int most_tail = static_cast<int>(std::clamp<int64_t>(wave / (8 * int64_t(items.size())), 1, kMaxTailUnits));
  int64_t blocks = 0, tail_units = 0, most_blocks = 2;
  // The longest tail unit's 32-token blocks (TailUnitTokens is whole blocks).
  int64_t tail_blocks = 0;
  // How many items have each bulk length ({blocks, items}): the searches below count units over
  // these, not over the items (a batch has few lengths; walking 792 items of 256 bytes for each
  // candidate chunk cost ~150 us of host time per layer at 99 x 8K).
  std::vector<std::pair<int64_t, int64_t>> lengths;
  lengths.reserve(items.size());
  for (const DeviceDecodeItem& it : items) {
    const int64_t b = BulkEnd(it.replica) / 32;
    blocks += b;
    most_blocks = std::max(most_blocks, b);
    lengths.push_back({b, 1});
    const int tails = TailUnits(it, most_tail);
    tail_units += tails;
    if (tails > 0) tail_blocks = std::max<int64_t>(tail_blocks, TailUnitTokens(it, most_tail) / 32);
  }
  std::sort(lengths.begin(), lengths.end());
  size_t distinct = 0;
  for (const auto& [b, n] : lengths) {
    if (distinct > 0 && lengths[distinct - 1].first == b) {
      lengths[distinct - 1].second += n;
    } else {
      lengths[distinct++] = {b, n};
    }
  }
  lengths.resize(distinct);
  // The bulk units of `chunk` blocks each, over all items.
  auto bulk_units_with = [&](int64_t chunk) {
    int64_t n = 0;
    for (const auto& [b, count] : lengths) n += (b + chunk - 1) / chunk * count;
    return n;
  };
  // The smallest chunk whose bulk units, with `beside` other units, fit one wave: units are
  // equal, so units left over would run as a second wave after the first and double the time.
  // Each item rounds its units up, so the chunk that divides the blocks evenly can still overflow
  // and is grown until the units fit (units fall as it grows), or one unit per item. At least 2
  // blocks per unit, which keeps the partial results within DecodeScratchFloats.
  auto fitting_chunk = [&](int64_t beside) {
    const int64_t slots = std::max<int64_t>(wave - beside, 1);
    int64_t chunk = std::clamp<int64_t>((blocks + slots - 1) / slots, 2, 1 << 20);
    if (beside + bulk_units_with(chunk) > wave) {
      int64_t lo = chunk + 1, hi = std::max(most_blocks, chunk + 1);
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (beside + bulk_units_with(mid) > wave) lo = mid + 1; else hi = mid;
      }
      chunk = lo;
    }
    return chunk;
  };
  int64_t chunk = 0;
  TailOrder order = kTailsShared;
  if (cls >= kFirstLeanClass) {
    // The lean path: the tails last (their CTAs take the slots the bulk leaves empty or frees
    // first), and the chunk of least estimated cost over the chunks of at least 16 blocks:
    //   c (m + 2) + 4 U / SMs + (30 tail blocks' time when the bulk and tail CTAs overflow the slots),
    // U the bulk units, m = ceil(U / 4 / SMs) the most bulk CTAs an SM gets (a unit's time falls as
    // its SM holds fewer: throughput ~ m / (m + 2)), 4 blocks of a unit's own cost (its start,
    // partial result and share of the merge). Fitted by least squares to an H200 sweep of 16 shapes
    // x 13 chunks x both orders (tail_mma_plans_h200_r29.txt, call c5; leave-one-shape-out regret
    // 1.022-1.028 against the previous plan's 1.064). Tails first had cost 10-20% wherever the
    // tails' CTAs gave the busiest SM one bulk CTA more. Against that previous plan on the H200
    // (plan_dealer_h200_r30.txt: two rounds each, 16 shapes): 0.96x its time over all (geometric
    // mean), 0.85-0.89x at 48 and 64 x 8K, 0.92x at 32 x 8K, but 1.05x at 12 x 8K and 1.08x at
    // 16 x 8K, where it puts the tails last at a chunk (16, 22) that one wave holds with its
    // tails: there tails first won (an order effect of the CTAs' placement that the cost leaves
    // out).
    // The overflow test counts every CTA slot of the GPU, the ones left free for the fetch too:
    // the sweep it was fitted to planned with 32 slots free but ran no fetch beside; the step at
    // 32 x 8K with the fetch (which holds them) ran 18.7 ms against the previous plan's 19.1.
    const int64_t sm_count = MultiprocessorCount(), all_ctas = sm_count * ctas_per_sm;
    const double sms = static_cast<double>(sm_count);
    const int64_t tail_ctas = (tail_units + kWarps - 1) / kWarps;
    double best = -1.0;
    for (int64_t n = 1; n <= 64; ++n) {
      const int64_t c = std::max<int64_t>((most_blocks + n - 1) / n, 16), units = bulk_units_with(c);
      const int64_t bulk_ctas = (units + kWarps - 1) / kWarps;
      const double m = std::ceil(static_cast<double>(bulk_ctas) / sms);
      const double cost = static_cast<double>(c) * (m + 2.0) + 4.0 * static_cast<double>(units) / sms +
                          (bulk_ctas + tail_ctas > all_ctas ? 30.0 * static_cast<double>(tail_blocks) : 0.0);
      if (best < 0.0 || cost < best || (cost == best && c > chunk)) best = cost, chunk = c;
      if (c == 16) break;
    }
    if (tail_units > 0) order = kTailsLast;
  } else {
    // The tails in the wave, or first (their slots then taken by bulk units): by the longest chain
    // of work a slot runs, in blocks (a bulk unit holds at most the longest item's blocks). The
    // longest tail unit costs 3 bulk blocks a tail block, as estimated from instruction counts for
    // the CUDA-core tail; not measured again since the 1-bit tails went to the tensor cores.
    const int64_t tail_cost = 3 * tail_blocks;
    const int64_t chunk_sharing = fitting_chunk(tail_units);
    const int64_t chunk_after_tails = fitting_chunk(0);
    const bool tails_first =
        tail_units > 0 && std::min(chunk_after_tails, most_blocks) + tail_cost < std::min(chunk_sharing, most_blocks);
    chunk = tails_first ? chunk_after_tails : chunk_sharing;
    order = tails_first ? kTailsFirst : kTailsShared;
  }
  // Forced (DecodePlan::force_units): benchmarks and tests of the other splits and orders.
  // A chunk past the longest item's blocks is one unit an item, as that item's blocks (no larger:
  // t0 + chunk * 32 must stay within int).
  if (args.forced_chunk_blocks > 0) {
    chunk = std::clamp<int64_t>(args.forced_chunk_blocks, 2, std::max<int64_t>(most_blocks, 2));
  }
  switch (args.forced_order) {
    case DecodePlan::UnitOrder::kChosen: break;
    case DecodePlan::UnitOrder::kTailsShared: order = kTailsShared; break;
    case DecodePlan::UnitOrder::kTailsFirst: order = kTailsFirst; break;
    case DecodePlan::UnitOrder::kTailsLast: order = kTailsLast; break;
  }
  set->kernel_class = cls;
  set->chunk_blocks = static_cast<int>(chunk);
  set->tail_units = most_tail;
  set->tail_order = order;
  // The lean path's L2 policy: the bytes its units copy are the bulk blocks' groups, one size in
  // a class (LowBitDecodeEligible: an mma-layout replica's group_bytes is MmaGroupBytes(D)).
  using CodesL2 = DecodePlan::CodesL2;
  set->codes_evict_first =
      cls >= kFirstLeanClass &&
      (args.forced_codes_l2 == CodesL2::kEvictFirst ||
       (args.forced_codes_l2 == CodesL2::kChosen &&
        CodesEvictFirst(blocks * int64_t{items.front().replica.layout.group_bytes}, args.l2_bytes)));
  set->unit_begin.assign(1, 0);
  set->tail_begin.assign(1, 0);
  int64_t units = 0, tails = 0;
  for (const DeviceDecodeItem& it : items) {
    const int item_tails = TailUnits(it, most_tail);
    const int item_units = BulkUnits(it.replica, set->chunk_blocks) + item_tails;
    if (item_units > (48 << 10) / static_cast<int>(sizeof(float))) {  // MergeKernelPerChannel's weights
      return Status::InvalidArgument("low-bit decode: more than 12288 units for one item");
    }
    units += item_units;
    tails += item_tails;
    if (units > (int64_t{1} << 30)) return Status::InvalidArgument("low-bit decode: too many units");
    set->unit_begin.push_back(static_cast<int32_t>(units));
    set->tail_begin.push_back(static_cast<int32_t>(tails));
  }
  set->items = std::move(items);
  return Status::Ok();
}

}  // namespace

LowBitPlanArgs PlanArgsOf(const DecodePlan& plan) {
  LowBitPlanArgs args;
  args.free_slots = plan.free_slots();
  args.l2_bytes = CurrentDeviceL2Bytes();
  args.forced_chunk_blocks = plan.forced_chunk_blocks();
  args.forced_order = plan.forced_order();
  args.forced_codes_l2 = plan.forced_codes_l2();
  return args;
}

Status PlanLowBitDecode(std::vector<DeviceDecodeItem> items, const LowBitPlanArgs& args, std::vector<LowBitSet>* sets) {
  std::vector<DeviceDecodeItem> by_class[kClasses];
  const int first = items.empty() ? 0 : ClassOf(items[0]);
  if (std::all_of(items.begin(), items.end(), [&](const DeviceDecodeItem& it) { return ClassOf(it) == first; })) {
    by_class[first] = std::move(items);  // the usual call: one class, no copy
  } else {
    for (const DeviceDecodeItem& it : items) by_class[ClassOf(it)].push_back(it);
  }
  sets->clear();
  for (int cls = 0; cls < kClasses; ++cls) {
    if (by_class[cls].empty()) continue;
    sets->emplace_back();
    SPECACHE_RETURN_IF_ERROR(PlanSet(cls, std::move(by_class[cls]), args, &sets->back()));
  }
  return Status::Ok();
}

Status LaunchLowBitSet(const LowBitSet& set, const DeviceItemSet* device, cudaStream_t stream) {
  const KernelInfo kernel = KernelFor(set.kernel_class);
  const size_t smem = kernel.shared_bytes();
  if (const cudaError_t err = AllowSharedMemoryOf(set.kernel_class); err != cudaSuccess) {
    return Status::Unavailable(std::string("low-bit decode: shared memory opt-in: ") + cudaGetErrorString(err));
  }
  const int warps = LaunchWarps(set.unit_begin.back(), set.tail_begin.back(), set.tail_order);
  int most_units = 1, most_queries = 1;  // most_queries <= kMaxQ (LowBitDecodeEligible)
  for (size_t i = 0; i < set.items.size(); ++i) {
    most_units = std::max(most_units, set.unit_begin[i + 1] - set.unit_begin[i]);
    most_queries = std::max(most_queries, set.items[i].rows.n_rows * set.items[i].rows.n_heads);
  }
  kernel.fn<<<(warps + kWarps - 1) / kWarps, kWarps * 32, smem, stream>>>(device);
  SPECACHE_RETURN_IF_ERROR(LaunchStatus("low-bit decode kernel"));
  // The merge as the decode kernel's programmatic dependent (dependent_launch.cuh).
  const unsigned items = static_cast<unsigned>(set.items.size());
  cudaError_t err = cudaSuccess;
  if (most_units <= kMergeWarpUnits) {
    err = LaunchAfter<MergeKernel>(dim3(items), dim3(most_queries * 32), 0, stream, device);  // a warp per query
  } else {
    // The weights' memory is padded to whole groups of four (the summing loop's loads may be
    // widened by the compiler), the padding zeroed by the kernel.
    const size_t weight_bytes = size_t((most_units + 3) / 4 * 4) * sizeof(float);
    err = LaunchAfter<MergeKernelPerChannel>(dim3(items, most_queries), dim3(set.items[0].replica.head_dim),
                      weight_bytes, stream, device);
  }
  if (err != cudaSuccess) (void)cudaGetLastError();  // returned here, not left for the next check
  return CudaStatus(err, "low-bit decode merge");
}

bool LowBitDecodeAvailable() { return DeviceHasMma(); }

bool LowBitDecodeEligible(const DeviceDecodeItem& item, bool available) {
  const DeviceReplicaView& v = item.replica;
  const int queries = item.rows.n_rows * item.rows.n_heads;
  if (v.mma_codes && (queries > kLeanMaxQueries || v.layout.group_bytes != MmaGroupBytes(v.head_dim))) return false;
  return (v.key_bits == 1 || v.key_bits == 2) && (v.value_bits == 1 || v.value_bits == 2) &&
         (v.head_dim == 64 || v.head_dim == 128) && v.group_size == kGroup && queries >= 1 && queries <= kMaxQ &&
         available;
}

}  // namespace specache::cuda
