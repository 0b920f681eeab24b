// The steps of the row-selection rule (selection.h) that the top-k kernels do not cover, on the
// device. The union selection (SelectFrom::kUnion): MaskTokens takes the primary rows out of the
// real row's scores (they become NaN, which every top-k ranks lowest), SelectTopKBatch then picks
// the real row's best others, and MergeSelections joins the two ascending lists into one, each
// token once. With KvConfig::real_next, WithPredecessors first credits each token with its
// predecessor's score. Device pointers; streams as void*. One launch per call, its tasks through a
// slot of `plan` (cuda_attention.h; null: a plan of the call's own, which waits for the kernel).
#pragma once

#include <cstdint>

#include "specache/status.h"

namespace specache::cuda {

class DecodePlan;  // cuda_attention.h

struct MaskTask {
  float* scores = nullptr;          // [n_heads][n]
  const int32_t* tokens = nullptr;  // [count], each < n
  int32_t n = 0;
  int32_t count = 0;
};

// Two ascending lists of distinct tokens merged into `out` [na + nb] (MergeSelections).
struct MergeTask {
  const int32_t* a = nullptr;
  const int32_t* b = nullptr;
  int32_t* out = nullptr;
  int32_t na = 0;
  int32_t nb = 0;
};

// out[h][j] = max(in[h][j], in[h][j - 1]) for j > 0, out[h][0] = in[h][0]; NaN stays NaN. On raw
// scores this is the same as on probabilities (one softmax per head is monotone).
struct ShiftTask {
  const float* in = nullptr;  // [n_heads][n]
  float* out = nullptr;       // [n_heads][n], not overlapping `in`
  int32_t n = 0;
};

// scores[h][token] = NaN for every listed token, in every head of the group (kNoToken entries,
// the adaptive budget's padding, are skipped).
Status MaskTokens(const MaskTask* tasks, int n_tasks, int n_heads, void* stream, DecodePlan* plan = nullptr);
// The union: `a` holds the primary rows (with the adaptive budget: the budget's, then kNoToken
// padding, cuda_topk.h), `b` the real row's best others ranked with a's rows masked. When fewer
// than nb others rank above the masked rows (too few candidates, or a real row of -inf and NaN
// scores), b also holds some of a's rows: they count once. `out` [na + nb] receives a's rows and
// b's others, ascending, then kNoToken; each task's count is added to *rows (device memory) when
// rows is set. na + nb at most kMaxMergedRows: the CUDA agent refuses a union that selects more
// (before, one that selected 8193-16384 rows went through a merge for disjoint lists, which a
// real row of NaN broke).
constexpr int kMaxMergedRows = 8192;
Status MergeSelections(const MergeTask* tasks, int n_tasks, unsigned long long* rows, void* stream,
                       DecodePlan* plan = nullptr);
Status WithPredecessors(const ShiftTask* tasks, int n_tasks, int n_heads, void* stream, DecodePlan* plan = nullptr);

}  // namespace specache::cuda
