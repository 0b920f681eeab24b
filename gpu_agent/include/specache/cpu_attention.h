// CPU attention for one (sequence, layer, KV head): the reference the CUDA kernels are tested
// against, and the compute of the CPU backend. float32 arithmetic over fp16-stored K/V.
#pragma once

#include <cstdint>
#include <vector>

#include "specache/head_replica.h"
#include "specache/kv_config.h"

namespace specache::cpu {

// Full-precision rows standing in for their quantized counterparts (both the key in the scores
// and the value in the output).
struct SubstitutedRows {
  const int32_t* tokens = nullptr;  // [n], strictly ascending; tokens >= replica.quantized_keys()
                                    // are already full precision and are ignored
  const Half* rows = nullptr;       // [n][2][head_dim]: K then V, as fetched from the source
  int32_t n = 0;
};

// Reused scratch buffers; one per thread.
struct AttentionWorkspace {
  std::vector<float> scores;
  std::vector<float> tile;
  std::vector<int32_t> substitute_of;
};

// The query a decode attention scores with, on the CPU and the GPU alike: q rounded to fp16 at the
// power of two that puts its largest channel in [2^13, 2^14), as fp16 attention kernels take their
// queries (~11 significant bits per channel, relative to that channel):
//   e = clamp(13 - floor(log2(max_c |q_c|)), -126, 126), or 0 when that max is 0 or not finite
//   out_c = fp16_round_to_nearest_even(q_c * 2^e) * 2^-e
// The GPU's tensor cores then take q * 2^e as exact fp16 operands and sum in fp32, so the CPU's
// scores equal theirs up to the order of fp32 sums, and so do the selections made from them.
// out may be q.
void QueryOperand(const float* q, int d, float* out);

// One decode step of `n_rows` query rows against the replica of one KV head.
//
// The step's new tokens are causal among themselves: row r sees the cache plus new tokens 0..r
// (row 0 = the real token sees its own K/V only; row 1 = the speculative token also sees the
// real token's). Each row has the GQA group's `n_heads` query heads.
//   q          [n_rows][n_heads][head_dim] float
//   new_keys   [n_rows][head_dim] fp16,  new_values likewise
//   out        [n_rows][n_heads][head_dim] float
//   probs      if not null: [n_heads][n_candidates] receives row `probs_row`'s softmax
//              probabilities of the first n_candidates tokens (cache tokens in order, then the new
//              tokens): the top-k candidates. n_candidates <= length + probs_row + 1.
//   row0_probs if not null: row 0's probabilities of the same candidates, same layout (the real
//              row's, for selections that use both rows).
// `scale` multiplies q.k (1/sqrt(head_dim) for Llama); each query is taken as QueryOperand(q).
void AttendDecodeRows(const HeadReplica& replica, const SubstitutedRows& substituted, const float* q,
                      const Half* new_keys, const Half* new_values, int n_rows, int n_heads, float scale, float* out,
                      int probs_row, int32_t n_candidates, float* probs, AttentionWorkspace* ws,
                      float* row0_probs = nullptr);

// Exact causal attention over a prompt of n tokens (prefill): token i sees tokens 0..i.
//   q [n][n_heads][head_dim] float, keys/values [n][head_dim] fp16, out [n][n_heads][head_dim].
void AttendPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_heads, int head_dim,
                   float scale, float* out, AttentionWorkspace* ws);

// Top-k tokens of one KV head: the group's per-head probabilities ([n_heads][n]) are reduced to
// one score per token (mean or max), and the k best tokens are returned in ascending token order.
// Ties are broken towards the lower token index; NaN ranks lowest; k >= n returns every token.
void SelectTopK(const float* probs, int n_heads, int32_t n, int k, GroupReduction reduction,
                std::vector<int32_t>* tokens, std::vector<float>* scratch);

}  // namespace specache::cpu
