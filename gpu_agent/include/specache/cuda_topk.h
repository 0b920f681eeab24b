// Top-k of the speculative row on the GPU, with the semantics of cpu::SelectTopK: the GQA group's
// per-head probabilities are reduced per token (mean or max; NaN counts as -inf), the k best tokens
// are chosen with ties towards the lower index, and written in ascending token order.
// Radix select on the scores' bits (4 passes of 8 bits, warp-aggregated histogram counts), then
// one ordered pass. Device pointers.
#pragma once

#include <cstdint>

#include "specache/kv_config.h"
#include "specache/status.h"

namespace specache::cuda {

// probs:  [segments][n_heads][n] (one segment per KV head or (sequence, KV head))
// tokens: [segments][min(k, n)] ascending;  scratch: [segments][n] floats.
Status SelectTopK(const float* probs, int segments, int n_heads, int32_t n, int k, GroupReduction reduction,
                  int32_t* tokens, float* scratch, void* stream);

// Segments of different lengths in one set of launches (up to kMaxTopKSegments per set, more are
// split): the decode step's (sequence, KV head) pairs. A long segment is cut into parts selected
// by blocks of their own, then merged (topk.cu), so small batches still fill the GPU; the parts'
// candidates live in `scratch`. INVALID_ARGUMENT when more than 6144 candidates would have to be
// merged for one segment (k x parts).
struct TopKSegment {
  const float* probs = nullptr;  // [n_heads][n]
  int32_t* tokens = nullptr;     // [min(k, n)] ascending
  float* scratch = nullptr;      // [n]
  int32_t n = 0;
  // [n_heads][2] or null. When set, `probs` holds raw scores and head h's probabilities are
  // exp(score - stats[2h]) / stats[2h + 1] (DeviceDecodeRows::probs_stats).
  const float* stats = nullptr;
};
constexpr int kMaxTopKSegments = 256;
Status SelectTopKBatch(const TopKSegment* segments, int count, int n_heads, int k, GroupReduction reduction,
                       void* stream);

}  // namespace specache::cuda
