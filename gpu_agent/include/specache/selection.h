// The rule that picks the full-precision rows of one (sequence, layer, KV head) for a fetch
// (docs/method.md, "Choosing the rows"): the CPU reference both backends follow.
//
// Scores: the GQA group's per-head probabilities over the candidates ([n_heads][n]) are reduced
// to one score per token (mean or max; NaN ranks lowest) as cpu::SelectTopK does.
//   - The primary rows are the best `top_k` of the primary row's scores or, with the adaptive
//     budget (KvConfig::mass > 0), the fewest best rows whose scores sum to at least `mass` of all
//     candidates' scores, no fewer than k_min and no more than k_max (and never more than n).
//     The primary row is the speculative row (SelectFrom::kSpeculative and kUnion), or the real
//     row (kReal, and the modes that select for their own step).
//   - kUnion adds, of the real row's best extra_rows() tokens with the primary ones ranked lowest
//     (-inf), those that are not primary (all of them, unless fewer than extra_rows() others rank
//     above -inf: a real row of NaN keeps fewer rows, as the CUDA merge does). Without the
//     adaptive budget, n <= top_k + extra_rows() candidates are all selected.
//   - With real_next (kSpeCache), the real row's ranking (kReal's primary, kUnion's extra) reads
//     per-head probabilities replaced by max(p[j], p[j - 1]).
// Ties go to the lower token. The result is ascending.
#pragma once

#include <cstdint>
#include <vector>

#include "specache/half.h"
#include "specache/kv_config.h"

namespace specache::cpu {

struct SelectionScratch {
  std::vector<float> score;
  std::vector<int32_t> order;
  std::vector<int32_t> extra;
  std::vector<float> shifted;
};

// out[h][j] = max(probs[h][j], probs[h][j - 1]) (j > 0; out[h][0] = probs[h][0]); NaN stays NaN.
void WithPredecessors(const float* probs, int n_heads, int32_t n, std::vector<float>* out);

// Reduced score per token: [n] from [n_heads][n], never NaN (a head's NaN counts as -inf, and so
// does a mean that comes out NaN, of +inf and -inf): NaN ranks lowest.
void ReduceGroupScores(const float* probs, int n_heads, int32_t n, GroupReduction reduction, std::vector<float>* score);

// Tokens per run of CandidateMass's sum (the CUDA top-k's block width).
constexpr int32_t kMassRunTokens = 256;

// The candidates' mass: the sum of the positive scores of score[0, n) (-inf, from NaN, and zeros
// add nothing), in one fixed order a GPU reproduces bit for bit: each run of kMassRunTokens
// consecutive tokens (the last one padded with zeros) is summed as a halving tree, x[i] += x[i + h]
// for h = 128, 64, ..., 1, and the runs' sums are added in token order, all in float.
float CandidateMass(const float* score, int32_t n);

// How many of the best rows the adaptive budget takes from the reduced scores `score[0, n)`: the
// smallest c in [k_min, k_max] whose c best scores (in rank order, the positive ones summed in
// float one after the other) reach mass * CandidateMass (the product in float), or min(k_max, n).
// Without a mass: min(top_k, n).
int32_t BudgetRows(const KvConfig& config, const float* score, int32_t n, std::vector<int32_t>* order);

// The rows to fetch. `real_probs` is used by kUnion only (may equal primary_probs, as in the
// pre-decode step, whose one row is both).
void SelectRows(const KvConfig& config, const float* primary_probs, const float* real_probs, int n_heads, int32_t n,
                std::vector<int32_t>* tokens, SelectionScratch* scratch);

// The rows a row cache is seeded with at prefill (KvConfig::seed_rows): the best `count` of
// tokens [0, candidates) by the exact attention of one query row of the GQA group (q: [n_heads]
// [d], the prompt's last token) over keys [0, n) ([n][d], fp16 as stored): per head the softmax
// of scale * q.k over all n keys, reduced per token as the selection reduces (SelectTopK's ties:
// the lower token). Ascending; min(count, candidates) tokens; rank[i] (when asked) is tokens[i]'s
// place in that order, 0 the best.
void SeedTokens(const float* q, const Half* keys, int n_heads, int32_t n, int d, float scale, int32_t candidates,
                int count, GroupReduction reduction, std::vector<int32_t>* tokens, std::vector<int32_t>* rank = nullptr);

}  // namespace specache::cpu
