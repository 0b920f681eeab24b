// Top-k of the speculative row on the GPU, with the semantics of cpu::SelectTopK: the GQA group's
// per-head probabilities are reduced per token (mean or max; NaN counts as -inf), the k best tokens
// are chosen with ties towards the lower index, and written in ascending token order.
// Radix select on the scores' bits (digits of 10, 10, 10 and 2 bits, warp-aggregated counts), then
// one ordered pass. Device pointers.
#pragma once

#include <cstdint>

#include "specache/kv_config.h"
#include "specache/selection.h"
#include "specache/status.h"

namespace specache::cuda {

class DecodePlan;  // cuda_attention.h

// probs:  [segments][n_heads][n] (one segment per KV head or (sequence, KV head))
// tokens: [segments][min(k, n)] ascending;  scratch: [segments][n] floats.
Status SelectTopK(const float* probs, int segments, int n_heads, int32_t n, int k, GroupReduction reduction,
                  int32_t* tokens, float* scratch, void* stream);

// Segments of different lengths in one set of launches (up to kMaxTopKSegments per set, more are
// split into sets of equal size): the decode step's (sequence, KV head) pairs. Each set's segments
// reach the kernels through a slot of `plan` (cuda_attention.h: copied to device memory, or read
// in place, as the plan says; null: a plan of the call's own, which it waits for before
// returning). A long segment is cut into parts selected by blocks of their own, then merged by the
// last of them to finish (topk.cu), so small batches still fill the GPU; the parts' candidates
// live in `scratch`.
// INVALID_ARGUMENT when more than 6144 candidates would have to be merged for one segment
// (k x parts). The parts count themselves done in the slot's zeroed device bytes (each counter
// back to zero when its segment is merged): a captured graph's slot is its own, so two executable
// graphs instantiated from one capture must not run at once.
struct TopKSegment {
  const float* probs = nullptr;  // [n_heads][n]
  int32_t* tokens = nullptr;     // [min(k, n)] ascending
  float* scratch = nullptr;      // [TopKScratchFloats(n, budget)]
  int32_t n = 0;
  // [n_heads][2] or null. When set, `probs` holds raw scores and head h's probabilities are
  // exp(score - stats[2h]) / stats[2h + 1] (DeviceDecodeRows::probs_stats).
  const float* stats = nullptr;
  // With a budget: device memory that receives the rows kept, or null.
  int32_t* count = nullptr;
};
constexpr int kMaxTopKSegments = 65535;  // per set of launches: a segment is a row of the grid (CUDA's y limit)

// The adaptive budget (KvConfig::mass; cpu::BudgetRows, selection.h), applied after the top k
// (k = k_max) on the device: each segment keeps its fewest best rows whose positive reduced scores,
// summed in rank order, reach mass * cpu::CandidateMass of all its n candidates, at least k_min
// (and at most min(k, n)). `tokens` then holds the c kept rows ascending followed by kNoToken
// (cuda_fetch.h) up to min(k, n): the fetch, the row cache update and the attention skip those, so
// the host never needs c. One more launch for the whole batch; the candidates' mass is summed by
// the top-k's first launch while it holds the scores. k at most kMaxBudgetRows.
struct TopKBudget {
  float mass = 0;  // in (0, 1]: static_cast<float>(KvConfig::mass), as the CPU rule multiplies
  int k_min = 1;
  unsigned long long* rows = nullptr;  // device memory, or null: every segment's c is added to it
};
constexpr int kMaxBudgetRows = 4096;

// Scratch floats a segment of n candidates needs: n, and one per kMassRunTokens with a budget.
inline int64_t TopKScratchFloats(int32_t n, bool budget) {
  return int64_t{n} + (budget ? (int64_t{n} + cpu::kMassRunTokens - 1) / cpu::kMassRunTokens : 0);
}

// The parts a segment may be cut into when forced (DecodePlan::force_topk_part_tokens): whole
// 256-token steps from 512 to 8192 tokens (phase one holds at most 8192 scores in shared memory).
constexpr int kTopKMinPartTokens = 512, kTopKMaxPartTokens = 8192;
constexpr bool TopKPartTokensValid(int tokens) {
  return tokens % 256 == 0 && tokens >= kTopKMinPartTokens && tokens <= kTopKMaxPartTokens;
}

// budget: null for the plain top-k.
Status SelectTopKBatch(const TopKSegment* segments, int count, int n_heads, int k, GroupReduction reduction,
                       void* stream, const TopKBudget* budget = nullptr, DecodePlan* plan = nullptr);

}  // namespace specache::cuda
