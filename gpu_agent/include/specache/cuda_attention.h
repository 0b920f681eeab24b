// Decode attention of one step on the GPU, with the semantics of cpu::AttendDecodeRows (the
// reference it is tested against): rows of a step over the low-bit replica of one (sequence,
// layer, KV head), fetched full-precision rows substituted for their quantized counterparts (key
// and value), the residual key window and value window in fp16, and the step's new tokens causal
// among themselves. Optionally writes one row's softmax probabilities over the first
// n_candidates tokens (the top-k candidates).
//
// Items whose replica is 1 or 2 bits for keys and values, head_dim 64 or 128, at most 16 queries
// (rows x GQA heads) and group size a multiple of 32 go through the tensor-core path
// (lowbit_decode.cu): one pass over the packed codes per split of the context, every query of the
// item served by the same pass, partial results merged per item. The others take the CUDA-core
// path below.
// The work of many (sequence, KV head) items goes into one set of launches (ragged lengths are
// fine), flash-decoding style: scores by blocks of tokens (a thread per token, all queries at
// once) with each block's softmax statistics; the weighted values by blocks of tokens (threads
// over channels, each value decoded once for all queries), normalised with the statistics of all
// blocks, into per-block partial sums (the probabilities row is written here too); then one
// ordered reduction (deterministic).
// Device pointers; streams as void*. UNAVAILABLE without CUDA.
#pragma once

#include <cstdint>

#include "specache/half.h"
#include "specache/status.h"

namespace specache::cuda {

// The device copy of one HeadReplica (see head_replica.h for the layouts).
struct DeviceReplicaView {
  int head_dim = 0, group_size = 0, key_bits = 1, value_bits = 1;
  int32_t length = 0, quantized_keys = 0, quantized_values = 0;
  const uint32_t* key_codes = nullptr;  // [groups][head_dim][G*B/32]     (packed key bits)
  const Half* key_scale = nullptr;      // [groups][head_dim]
  const Half* key_zero = nullptr;
  const Half* key_half = nullptr;       // [quantized_keys][head_dim]      (16-bit keys)
  const Half* residual_keys = nullptr;  // [length - quantized_keys][head_dim]
  const uint32_t* value_codes = nullptr;  // [quantized_values][head_dim/G][G*B/32]
  const Half* value_scale = nullptr;      // [quantized_values][head_dim/G]
  const Half* value_zero = nullptr;
  const Half* value_half = nullptr;       // [quantized_values][head_dim]  (16-bit values)
  const Half* window_values = nullptr;    // [length - quantized_values][head_dim]
};

struct DeviceDecodeRows {
  const int32_t* sub_tokens = nullptr;  // [n_sub] ascending
  const Half* sub_rows = nullptr;       // [n_sub][2][head_dim]
  int32_t n_sub = 0;
  const float* q = nullptr;             // [n_rows][n_heads][head_dim], rows q_stride apart
  const Half* new_keys = nullptr;       // [n_rows][head_dim], rows kv_stride apart
  const Half* new_values = nullptr;
  int n_rows = 1, n_heads = 1;
  int64_t q_stride = 0;                 // elements between rows of q and out; 0: n_heads * head_dim
  int64_t kv_stride = 0;                // elements between rows of new keys/values; 0: head_dim
  float scale = 1.0f;
  float* out = nullptr;                 // [n_rows][n_heads][head_dim], rows q_stride apart
  int probs_row = 0;
  int32_t n_candidates = 0;
  float* probs = nullptr;               // [n_heads][n_candidates] or null
  // [n_heads][2] or null. When set, `probs` receives the probabilities row's raw (scaled) scores
  // and this its softmax statistics per head (max, sum of exp(score - max)), so that a consumer
  // (SelectTopKBatch) normalises while it reads: p = exp(score - max) / sum. Saves a pass over
  // the scores. When null, `probs` receives the probabilities themselves.
  float* probs_stats = nullptr;
  float* scratch = nullptr;             // DecodeScratchFloats(length, n_rows, n_heads, head_dim) floats
};

// Tokens per block of the scores and of the partial value sums.
constexpr int kDecodeBlockTokens = 128;
// Most rows x GQA heads of one item.
constexpr int kMaxDecodeQueries = 32;

// Floats of scratch one item needs. The CUDA-core path: its raw scores, each score block's
// softmax statistics (max and sum of exponentials per query) and the partial sums of its value
// blocks. The tensor-core path: a partial result (outputs, max, sum per query) per unit of at
// least 64 tokens, plus up to 4 tail units.
inline int64_t DecodeScratchFloats(int32_t length, int n_rows, int n_heads, int head_dim) {
  const int64_t width = int64_t{length} + n_rows, queries = int64_t{n_rows} * n_heads;
  const int64_t blocks = (width + kDecodeBlockTokens - 1) / kDecodeBlockTokens;
  const int64_t cuda_cores = queries * width + queries * blocks * 2 + blocks * queries * head_dim;
  const int64_t tensor_cores = queries * (head_dim + 2) * ((width + 63) / 64 + 4);
  return cuda_cores > tensor_cores ? cuda_cores : tensor_cores;
}

struct DeviceDecodeItem {
  DeviceReplicaView replica;
  DeviceDecodeRows rows;
};

// Items per launch set; more are split.
constexpr int kMaxDecodeItems = 128;

Status AttendDecodeBatch(const DeviceDecodeItem* items, int n_items, void* stream);
// One item.
Status AttendDecodeRows(const DeviceReplicaView& replica, const DeviceDecodeRows& rows, void* stream);

// Exact causal attention over a prompt for one KV head (semantics of cpu::AttendPrefill):
//   q [n][n_heads][head_dim] float, keys/values [n][head_dim] fp16, out [n][n_heads][head_dim];
//   scratch: [min(n * n_heads, 1024)][n] floats.
Status AttendPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_heads, int head_dim,
                     float scale, float* out, float* scratch, void* stream);
// Scratch floats AttendPrefill needs.
inline int64_t PrefillScratchFloats(int32_t n, int n_heads) {
  const int64_t pairs = int64_t{n} * n_heads;
  return (pairs < 1024 ? pairs : 1024) * n;
}

}  // namespace specache::cuda
