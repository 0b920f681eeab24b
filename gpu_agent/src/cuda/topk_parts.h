// How the top-k (topk.cu) cuts a set of segments into parts, on the host: a segment of n
// candidates is cut into parts of P tokens, a block each, and the segment's last part to finish
// merges the parts' k candidates each. The choice needs no device (the GPU's SMs and phase one's
// blocks per SM only size the wave), so CI checks it (topk_parts_test.cc); the kernels' results
// over such cuts are the gpu-labelled CudaTopKTest.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "specache/cuda_attention.h"  // SPECACHE_HOST_DEVICE
#include "specache/cuda_topk.h"
#include "specache/status.h"

namespace specache::cuda {

constexpr int kTopKThreads = 256;          // a phase-one block's threads: a merge of at most this many candidates ranks them
constexpr int kMaxPartTokens = kTopKMaxPartTokens;  // shared memory of phase one: 32 KiB of scores, then the list's 4 KiB
constexpr int kMinPartTokens = kTopKMinPartTokens;
constexpr int kOneWavePartTokens = 4096;   // the longest part a one-wave cut may take (ChooseTopKParts)
constexpr int kMaxMergeCandidates = 6144;  // a segment's merge holds its parts' candidates in shared memory

// Parts of a segment of n candidates: several when their candidates (score + token per slot) fit
// the segment's scratch, else one.
SPECACHE_HOST_DEVICE inline int PartsOf(int32_t n, int part_tokens, int k) {
  if (n <= part_tokens) return 1;
  const int parts = (n + part_tokens - 1) / part_tokens;
  return 2 * static_cast<int64_t>(k) * parts <= n ? parts : 1;
}

// The most parts a segment of segments[0, count) has with parts of `part_tokens` (1 at least).
inline int MostPartsOf(const TopKSegment* segments, int count, int part_tokens, int k) {
  int most = 1;
  for (int i = 0; i < count; ++i) most = std::max(most, PartsOf(segments[i].n, part_tokens, k));
  return most;
}

// A set's cut: P, and the most parts a segment has (its merge's candidates: max_parts k).
struct TopKParts {
  int part_tokens = kMinPartTokens;
  int max_parts = 1;
};

// The cut of segments[0, count) for k rows on a GPU of `sms` SMs holding `blocks_per_sm` phase-one
// blocks each (k >= 1, counts >= 0). In order:
// - One wave where parts of up to 4096 tokens do it: the smallest part (whole 256-token steps)
//   whose blocks all fit the GPU at once. About 8 blocks per SM, rounded up per segment, ran
//   1.3-1.5 waves at 32 and 99 x 8K (6 fit on an H200 then; 4 now, at 64 registers): top-k 0.053 ->
//   0.044 ms at 32 x 8K, 0.163 -> 0.149 at 99. Longer parts stay at about 8 blocks per SM: 24 x 32K
//   in one wave of 8192-token parts took 0.161 ms against 0.152 in 1.45 waves of 6144.
// - Within that one wave, 4096 or else 2048 tokens where about two blocks an SM remain (below).
// - Parts long enough that a segment's merge ranks its candidates (at most kTopKThreads: one pass)
//   instead of a radix select of its own after phase one's, where parts of up to
//   kOneWavePartTokens do it with a block for every two SMs or more: at small batches the parts
//   were short (512-1792 tokens at 4-16 x 8K) and the merge of their 320-1024 candidates a second
//   select in series. On the H200 (plan_dealer_h200_r30.txt, call t1): one layer's top-k at
//   4 x 8K 0.0209 -> 0.0183 ms, 8 x 8K 0.0230 -> 0.0204, 12 x 8K 0.0268 -> 0.0233, 16 x 8K
//   0.0280 -> 0.0266. Parts of up to 8192 tokens (the 32K batches) were 5-14% slower at 4, 8 and
//   24 x 32K (one part's own work grew 2-4x) though 7% faster at 12 and 16 x 32K: longer parts
//   only where their blocks fill one wave at 2.5 an SM or more (below).
// - A merge's candidates within kMaxMergeCandidates: the parts doubled until they are (up to
//   kMaxPartTokens), else INVALID_ARGUMENT (segments of over ~786K candidates at k = 64).
inline Status ChooseTopKParts(const TopKSegment* segments, int count, int k, int sms, int blocks_per_sm,
                              TopKParts* cut) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    if (segments[i].n < 0) return Status::InvalidArgument("negative candidate count");
    total += segments[i].n;
  }
  const int64_t slots = int64_t{std::max(blocks_per_sm, 1)} * std::max(sms, 1);
  auto blocks_with = [&](int part_tokens) {
    int64_t blocks = 0;
    for (int i = 0; i < count; ++i) blocks += PartsOf(segments[i].n, part_tokens, k);
    return blocks;
  };
  auto most_parts_with = [&](int part_tokens) { return MostPartsOf(segments, count, part_tokens, k); };
  auto rounded_part = [](int64_t tokens) {
    return static_cast<int>(std::clamp<int64_t>((tokens + 255) / 256 * 256, kMinPartTokens, kMaxPartTokens));
  };
  int part = rounded_part((total + slots - 1) / slots);
  bool one_wave = blocks_with(part) <= slots;
  while (part < kOneWavePartTokens && !one_wave) {
    part += 256;
    one_wave = blocks_with(part) <= slots;
  }
  if (part > kOneWavePartTokens || !one_wave) {
    const int64_t eight_per_sm = int64_t{8} * std::max(sms, 1);
    part = rounded_part((total + eight_per_sm - 1) / eight_per_sm);
  } else {
    // Within one wave, fewer and longer parts while about two blocks an SM remain (blocks >=
    // 1.9 sms): the longest of 4096 and 2048 tokens that keeps them. A block's fixed work (its
    // histogram scans and barriers) and the merge's candidates weigh more than the wave's last
    // blocks. Measured at four blocks an SM (132 SMs, forced cuts in one call; H100 and H200):
    // 16 x 8K 2048 -> 4096 tokens 0.900x, 20 x 8K 2816 -> 4096 0.935x / 0.943x, 2 x 32K 1024 ->
    // 2048 0.829x, 4 x 32K 2048 -> 4096 0.955x, 6 x 32K 3072 -> 4096 0.987x; where fewer than 1.9
    // blocks an SM would be left the shorter cut held (8 x 8K: 4096 1.056x at 128 blocks; 12 x 8K:
    // 1.005x at 192).
    for (const int longer : {kOneWavePartTokens, kOneWavePartTokens / 2}) {
      if (longer > part && 10 * blocks_with(longer) >= 19 * int64_t{std::max(sms, 1)}) {
        part = longer;
        break;
      }
    }
  }
  // The shortest part from here (whole 256-token steps, up to kMaxPartTokens) whose merge ranks
  // (at most kTopKThreads candidates a segment); taken when up to kOneWavePartTokens long with a block for
  // every two SMs or more, or longer while its blocks fill one wave at 2.5 an SM or more: at 12
  // and 16 x 32K (384 and 512 blocks of 8192 tokens) the merges ranked ran 7% faster (call t1),
  // while at 4 and 8 x 32K (128 and 256 blocks) a part's 2-4x own work cost more than the second
  // select, and at 24 x 32K (768 blocks, over a wave) too. With the longer parts (call t2, three
  // rounds): 12 x 32K 0.0554 -> 0.0510 ms, 16 x 32K 0.0641 -> 0.0597, 20 x 32K (not measured
  // before) 0.0769 -> 0.0677; 8 and 24 x 32K keep their cuts.
  auto merge_ranks = [&](int part_tokens) { return int64_t{most_parts_with(part_tokens)} * k <= kTopKThreads; };
  if (part < kMaxPartTokens && !merge_ranks(part)) {
    int ranked = part + 256;
    bool ranks = merge_ranks(ranked);
    while (ranked < kMaxPartTokens && !ranks) {
      ranked += 256;
      ranks = merge_ranks(ranked);
    }
    if (ranks) {
      const int64_t blocks = blocks_with(ranked);
      const bool short_enough = ranked <= kOneWavePartTokens && blocks >= sms / 2;
      const bool fills_one_wave = ranked > kOneWavePartTokens && 2 * blocks >= 5 * int64_t{sms} && blocks <= slots;
      if (short_enough || fills_one_wave) part = ranked;
    }
  }
  int max_parts = most_parts_with(part);
  while (part < kMaxPartTokens && max_parts > 1 && int64_t{max_parts} * k > kMaxMergeCandidates) {
    part = std::min(2 * part, kMaxPartTokens);  // parts of 3840 tokens double past it
    max_parts = most_parts_with(part);
  }
  if (max_parts > 1 && int64_t{max_parts} * k > kMaxMergeCandidates) {
    return Status::InvalidArgument("top-k: more than " + std::to_string(kMaxMergeCandidates) +
                                   " candidates to merge (k " + std::to_string(k) + " over segments of up to " +
                                   std::to_string(int64_t{max_parts} * part) + " tokens)");
  }
  cut->part_tokens = part;
  cut->max_parts = max_parts;
  return Status::Ok();
}

// A cut of parts of `part_tokens` (DecodePlan::force_topk_part_tokens), for benchmarks and tests:
// INVALID_ARGUMENT unless a multiple of 256 in [kMinPartTokens, kMaxPartTokens] whose merges fit
// kMaxMergeCandidates.
inline Status ForcedTopKParts(const TopKSegment* segments, int count, int k, int part_tokens, TopKParts* cut) {
  if (!TopKPartTokensValid(part_tokens)) {
    return Status::InvalidArgument("top-k: forced parts of " + std::to_string(part_tokens) +
                                   " tokens (a multiple of 256 in [" + std::to_string(kMinPartTokens) + ", " +
                                   std::to_string(kMaxPartTokens) + "])");
  }
  for (int i = 0; i < count; ++i) {
    if (segments[i].n < 0) return Status::InvalidArgument("negative candidate count");
  }
  const int max_parts = MostPartsOf(segments, count, part_tokens, k);
  if (max_parts > 1 && int64_t{max_parts} * k > kMaxMergeCandidates) {
    return Status::InvalidArgument("top-k: forced parts of " + std::to_string(part_tokens) + " tokens leave " +
                                   std::to_string(int64_t{max_parts} * k) + " candidates to merge (at most " +
                                   std::to_string(kMaxMergeCandidates) + ")");
  }
  cut->part_tokens = part_tokens;
  cut->max_parts = max_parts;
  return Status::Ok();
}

}  // namespace specache::cuda
