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
#include <vector>

#include "specache/half.h"
#include "specache/status.h"

namespace specache::cuda {

#if defined(__CUDACC__)
#define SPECACHE_HOST_DEVICE __host__ __device__
#else
#define SPECACHE_HOST_DEVICE
#endif

// Where a replica's quantized tokens live (cuda_replica.h makes it): fixed-size blocks, block b
// holding tokens [b * block_tokens, (b + 1) * block_tokens) -- their key groups' codes, scales
// and zeros (or fp16 keys) and their values' codes, scales and zeros (or fp16 values) -- at these
// byte offsets from the block's start (each 16-byte aligned: the kernels copy 16-byte pieces).
// 32-bit fields: the layout travels in every kernel's parameters.
//
// Interleaved by group (group_bytes != 0; replicas in the mma layout: packed keys and values,
// G = 32): the six parts of each 32-token group lie together, group j of a block (its tokens
// 32j..32j+31) at j * group_bytes, each part at its offset below from there, with the shapes
// below for block_tokens = 32. The lean decode path copies a group's bytes as one piece. The
// accessors below (KeyPartOffset, ValuePartOffset) place every part in either layout.
struct ReplicaBlockLayout {
  int32_t block_tokens = 0;  // a multiple of the group size and of 32
  int32_t key_codes = 0;     // [block_tokens / G][head_dim][G * key_bits / 32] words
  int32_t key_scale = 0;     // [block_tokens / G][head_dim] fp16
  int32_t key_zero = 0;
  int32_t key_half = 0;      // [block_tokens][head_dim] fp16 (16-bit keys, instead of the three above)
  int32_t value_codes = 0;   // [block_tokens][head_dim / G][G * value_bits / 32] words
  int32_t value_scale = 0;   // [block_tokens][head_dim / G] fp16
  int32_t value_zero = 0;
  int32_t value_half = 0;    // [block_tokens][head_dim] fp16 (16-bit values)
  int32_t bytes = 0;         // of one block
  int32_t group_bytes = 0;   // nonzero: the parts interleaved per 32-token group (above)
};

// Byte offset in its block of part `part` (a layout offset) of the key group `group` of the
// block, whose bytes per group are `natural_bytes` in the layout that is not interleaved.
SPECACHE_HOST_DEVICE inline int64_t KeyPartOffset(const ReplicaBlockLayout& l, int32_t part, int32_t group,
                                                  int64_t natural_bytes) {
  return part + static_cast<int64_t>(group) * (l.group_bytes ? l.group_bytes : natural_bytes);
}
// Byte offset in its block of part `part` of token `in` of the block, `token_bytes` per token.
SPECACHE_HOST_DEVICE inline int64_t ValuePartOffset(const ReplicaBlockLayout& l, int32_t part, int32_t in,
                                                    int64_t token_bytes) {
  return l.group_bytes ? part + static_cast<int64_t>(in / 32) * l.group_bytes + static_cast<int64_t>(in % 32) * token_bytes
                       : part + static_cast<int64_t>(in) * token_bytes;
}

// One replica as the kernels see it (see head_replica.h for the quantized formats).
struct DeviceReplicaView {
  int head_dim = 0, group_size = 0, key_bits = 1, value_bits = 1;
  int32_t length = 0, quantized_keys = 0, quantized_values = 0;
  ReplicaBlockLayout layout;
  // [ceil(max(quantized_keys, quantized_values) / block_tokens)] block addresses. In device
  // memory for the kernels; a host copy makes the accessors below usable on the host.
  const uint8_t* const* blocks = nullptr;
  const Half* residual_keys = nullptr;  // [length - quantized_keys][head_dim]
  const Half* window_values = nullptr;  // [length - quantized_values][head_dim]
  // Nonzero: the 32-token groups below min(quantized_keys, quantized_values) hold their key and
  // value code words in the mma layout of the low-bit decode's lean path (mma_codes.h), not the
  // layout above; only that path reads them, and only with the layout interleaved by group
  // (group_bytes = 16 head_dim). key_scale_bound (device memory) is then at least every key
  // scale of those groups.
  int32_t mma_codes = 0;
  const float* key_scale_bound = nullptr;
};

// The block holding `token`.
SPECACHE_HOST_DEVICE inline const uint8_t* ReplicaBlock(const DeviceReplicaView& v, int32_t token) {
  return v.blocks[token / v.layout.block_tokens];
}
// Key group g's codes [head_dim][G * key_bits / 32].
SPECACHE_HOST_DEVICE inline const uint32_t* KeyCodes(const DeviceReplicaView& v, int32_t g) {
  const int32_t token = g * v.group_size, in = (token % v.layout.block_tokens) / v.group_size;
  return reinterpret_cast<const uint32_t*>(
      ReplicaBlock(v, token) + KeyPartOffset(v.layout, v.layout.key_codes, in, int64_t{v.head_dim} * v.group_size * v.key_bits / 8));
}
// Key group g's scales and zeros [head_dim].
SPECACHE_HOST_DEVICE inline const Half* KeyScales(const DeviceReplicaView& v, int32_t g) {
  const int32_t token = g * v.group_size, in = (token % v.layout.block_tokens) / v.group_size;
  return reinterpret_cast<const Half*>(ReplicaBlock(v, token) + KeyPartOffset(v.layout, v.layout.key_scale, in, v.head_dim * 2));
}
SPECACHE_HOST_DEVICE inline const Half* KeyZeros(const DeviceReplicaView& v, int32_t g) {
  const int32_t token = g * v.group_size, in = (token % v.layout.block_tokens) / v.group_size;
  return reinterpret_cast<const Half*>(ReplicaBlock(v, token) + KeyPartOffset(v.layout, v.layout.key_zero, in, v.head_dim * 2));
}
// A 16-bit key's row [head_dim].
SPECACHE_HOST_DEVICE inline const Half* KeyHalf(const DeviceReplicaView& v, int32_t token) {
  return reinterpret_cast<const Half*>(ReplicaBlock(v, token) + v.layout.key_half) +
         static_cast<int64_t>(token % v.layout.block_tokens) * v.head_dim;
}
// A value token's codes [head_dim / G][G * value_bits / 32], scales and zeros [head_dim / G].
SPECACHE_HOST_DEVICE inline const uint32_t* ValueCodes(const DeviceReplicaView& v, int32_t token) {
  return reinterpret_cast<const uint32_t*>(ReplicaBlock(v, token) +
                                           ValuePartOffset(v.layout, v.layout.value_codes, token % v.layout.block_tokens,
                                                           int64_t{v.head_dim} * v.value_bits / 8));
}
SPECACHE_HOST_DEVICE inline const Half* ValueScales(const DeviceReplicaView& v, int32_t token) {
  return reinterpret_cast<const Half*>(ReplicaBlock(v, token) + ValuePartOffset(v.layout, v.layout.value_scale,
                                                                                 token % v.layout.block_tokens,
                                                                                 v.head_dim / v.group_size * 2));
}
SPECACHE_HOST_DEVICE inline const Half* ValueZeros(const DeviceReplicaView& v, int32_t token) {
  return reinterpret_cast<const Half*>(ReplicaBlock(v, token) + ValuePartOffset(v.layout, v.layout.value_zero,
                                                                                 token % v.layout.block_tokens,
                                                                                 v.head_dim / v.group_size * 2));
}
// A 16-bit value's row [head_dim].
SPECACHE_HOST_DEVICE inline const Half* ValueHalf(const DeviceReplicaView& v, int32_t token) {
  return reinterpret_cast<const Half*>(ReplicaBlock(v, token) + v.layout.value_half) +
         static_cast<int64_t>(token % v.layout.block_tokens) * v.head_dim;
}

// The fp16 rows handed to the kernels (residual keys, the value window, the step's new rows, the
// substituted rows) must start 16-byte aligned, kv_stride a multiple of 8 elements: the kernels
// read them 16 bytes at a time. AttendDecodeBatch refuses others (INVALID_ARGUMENT).
struct DeviceDecodeRows {
  // [n_sub] ascending, each token of the context at most once (the kernels list a block's rows by
  // rank); padding past the context (kNoToken, a row cache's empty entries) may repeat.
  const int32_t* sub_tokens = nullptr;
  const Half* sub_rows = nullptr;       // [rows][2][head_dim]: rows [n_sub], or a row cache (sub_slots)
  // [n_sub] or null. When set, substituted row i is row sub_slots[i] of sub_rows (the row cache
  // that the fetch's update left the selection in, cuda_fetch.h); else row i. SubstitutedRow.
  const int32_t* sub_slots = nullptr;
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
  // [n_heads][n_candidates] or null; device memory that overlaps no input, `out` or `scratch` (the
  // kernel writes it without reading it back).
  float* probs = nullptr;
  // [n_heads][2] or null. When set, `probs` receives the probabilities row's raw (scaled) scores
  // and this its softmax statistics per head (max, sum of exp(score - max)), so that a consumer
  // (SelectTopKBatch) normalises while it reads: p = exp(score - max) / sum. Saves a pass over
  // the scores. When null, `probs` receives the probabilities themselves.
  float* probs_stats = nullptr;
  // Both or neither, and only with probs_row != 0: row 0's (the real row's) raw scores of the same
  // candidates [n_heads][n_candidates] and their statistics [n_heads][2], from the same pass (the
  // union rule ranks the real row too, selection.h).
  float* real_probs = nullptr;
  float* real_probs_stats = nullptr;
  float* scratch = nullptr;             // DecodeScratchFloats(length, n_rows, n_heads, head_dim) floats
};

// Tokens per block of the scores and of the partial value sums.
constexpr int kDecodeBlockTokens = 128;
// Most rows x GQA heads of one item.
constexpr int kMaxDecodeQueries = 32;

// Floats of scratch one item needs. The CUDA-core path: its raw scores, each score block's
// softmax statistics (max and sum of exponentials per query) and the partial sums of its value
// blocks. The tensor-core path: a partial result (outputs, max, sum per query) per unit of at
// least 64 tokens, plus up to 4 tail units. A multiple of 4, so that items' scratch carved one
// after another from an aligned buffer stays 16-byte aligned (the partial results are written 16
// bytes at a time where they are).
inline int64_t DecodeScratchFloats(int32_t length, int n_rows, int n_heads, int head_dim) {
  const int64_t width = int64_t{length} + n_rows, queries = int64_t{n_rows} * n_heads;
  const int64_t blocks = (width + kDecodeBlockTokens - 1) / kDecodeBlockTokens;
  const int64_t cuda_cores = queries * width + queries * blocks * 2 + blocks * queries * head_dim;
  const int64_t tensor_cores = queries * (head_dim + 2) * ((width + 63) / 64 + 4);
  return ((cuda_cores > tensor_cores ? cuda_cores : tensor_cores) + 3) / 4 * 4;
}

// Substituted row i of `r` (its key, then its value at + head_dim).
SPECACHE_HOST_DEVICE inline const Half* SubstitutedRow(const DeviceDecodeRows& r, int32_t i, int head_dim) {
  return r.sub_rows + static_cast<int64_t>(r.sub_slots ? r.sub_slots[i] : i) * 2 * head_dim;
}

struct DeviceDecodeItem {
  DeviceReplicaView replica;
  DeviceDecodeRows rows;
};

// Where AttendDecodeBatch puts its launch plan: the items and the split of their work, written to
// pinned host memory and (kDeviceCopy, below) copied to device memory once per call, so a call
// takes any number of items and no kernel carries them in its parameters (SelectTopKBatch's
// segments, the fetch's and the appends' task lists go the same way). A ring of slots (grown as
// calls need); a slot is written again only after the kernels that read it have run, so the host
// can run a few calls ahead of the device and no call waits for the device unless the ring is full.
// The host learns that from one event for several calls in a row on one stream, recorded on that
// stream up to a few calls later: a stream given to a call must stay valid, and not be captured by
// anyone else, until the plan's next call on another stream has returned, or until the plan is
// destroyed (which then waits for the whole device).
//
// CUDA graphs: a call made while its stream is being captured reads a slot kept for the graph
// (never rewritten, 64 KB or more pinned each until the plan goes, and a few KB of device memory
// where the call's kernels keep counters there: the top-k's), so replaying the graph
// replays the same plan: keep the plan alive as long as the graph. A call given no plan (one of its
// own, freed on return) is refused on a capturing stream (INVALID_ARGUMENT). One plan per thread
// of calls (not thread-safe). UNAVAILABLE without CUDA.
class DecodePlan {
 public:
  // Where the kernels read a slot. kDeviceCopy: a copy in device memory, made on a side stream
  // (the attention's items, which many threads read; the top-k's segments where the selection
  // runs on the compute stream). kInPlace: the pinned host bytes themselves, over PCIe (small task
  // lists whose threads read a task each: no copy that could queue behind the fetch's large copies
  // on the copy engine; measured on the H200, task lists copied to the device made the fetch's
  // missed-row list wait for them and the step wait 14-21 ms for the fetch at 8K, 98 sequences,
  // where the attention read in place ran 35-55% slower), and the top-k's segments on the
  // selection's own stream (a block reads its segment once: no host call at all). kStreamCopy: a
  // copy in device memory made on the call's own stream, in its order (no side stream's event and
  // wait: two host calls fewer a call), for a stream off the engine's critical path, where the
  // copy's latency before the kernels costs nothing (no user in the agent now; the tests').
  enum class SlotReads { kDeviceCopy, kInPlace, kStreamCopy };
  explicit DecodePlan(SlotReads reads = SlotReads::kDeviceCopy);
  ~DecodePlan();  // waits for the device to finish reading the slots
  DecodePlan(const DecodePlan&) = delete;
  DecodePlan& operator=(const DecodePlan&) = delete;

  // CTA slots of the GPU the tensor-core attention leaves free for kernels that should run beside
  // it (the agent's fetch). Its work is one wave over the rest; when short tail units run first,
  // their CTAs come before that wave and may hold free slots too until they finish (microseconds).
  // Default 0.
  void set_free_slots(int slots) { free_slots_ = slots < 0 ? 0 : slots; }
  int free_slots() const { return free_slots_; }

  // The order of the tensor-core attention's warps: each item's tail units (its last, partly
  // quantized blocks) sharing the bulk units' wave, first (the bulk units then take their slots as
  // they finish) or last (in the slots the bulk units leave empty or free first).
  enum class UnitOrder { kChosen, kTailsShared, kTailsFirst, kTailsLast };
  // For benchmarks and tests: the tensor-core attention's work split as given instead of chosen by
  // the plan's model: bulk units of `chunk_blocks` 32-token blocks (0: chosen; below 2 taken as
  // 2) in `order` (kChosen: chosen). Default: both chosen.
  void force_units(int chunk_blocks, UnitOrder order) {
    forced_chunk_blocks_ = chunk_blocks <= 0 ? 0 : (chunk_blocks < 2 ? 2 : chunk_blocks);
    forced_order_ = order;
  }
  int forced_chunk_blocks() const { return forced_chunk_blocks_; }
  UnitOrder forced_order() const { return forced_order_; }
  // For benchmarks and tests: the top-k (cuda_topk.h) run on this plan cuts its segments into
  // parts of `tokens` instead of the cut ChooseTopKParts picks (topk_parts.h; TopKPartTokensValid,
  // cuda_topk.h, or INVALID_ARGUMENT from the top-k; 0: chosen). Default 0.
  void force_topk_part_tokens(int tokens) { forced_topk_part_tokens_ = tokens < 0 ? 0 : tokens; }
  int forced_topk_part_tokens() const { return forced_topk_part_tokens_; }
  // The L2 priority of the lean attention's copies of the replica's code groups (read once a
  // layer) and of its score stores: kChosen, evict-first copies and evict-last scores when the
  // launch's groups are at most a few times the device's L2 (CodesEvictFirst, lowbit_decode.h),
  // else both normal; kNormal and kEvictFirst force one. No result depends on it. For benchmarks
  // and tests; default kChosen.
  enum class CodesL2 { kChosen, kNormal, kEvictFirst };
  void force_codes_l2(CodesL2 policy) { forced_codes_l2_ = policy; }
  CodesL2 forced_codes_l2() const { return forced_codes_l2_; }

  struct Impl;  // the slots (decode_plan_slots.h)
  Impl* impl() const { return impl_; }  // for the agent's kernels that read a plan's slots

 private:
  friend Status AttendDecodeBatch(std::vector<DeviceDecodeItem> items, void* stream, DecodePlan* plan);
  Impl* impl_;
  int free_slots_ = 0;
  int forced_chunk_blocks_ = 0;
  UnitOrder forced_order_ = UnitOrder::kChosen;
  int forced_topk_part_tokens_ = 0;
  CodesL2 forced_codes_l2_ = CodesL2::kChosen;
};

// The decode attention of many items in one set of launches, planned in `plan`.
Status AttendDecodeBatch(const DeviceDecodeItem* items, int n_items, void* stream, DecodePlan* plan);
// The same, the items moved in: the host copies them once (into the plan's slot), not twice (a
// layer's items at 99 x 8K are ~200 KB).
Status AttendDecodeBatch(std::vector<DeviceDecodeItem> items, void* stream, DecodePlan* plan);
// The same with a plan of its own, which it waits for before returning (tests, one-off calls).
Status AttendDecodeBatch(const DeviceDecodeItem* items, int n_items, void* stream);
// One item (a plan of its own, as above).
Status AttendDecodeRows(const DeviceReplicaView& replica, const DeviceDecodeRows& rows, void* stream);

// Exact causal attention over a prompt for every KV head at once (cpu::AttendPrefill's semantics
// for each KV head and its group of query heads):
//   q, out   [n][n_kv][group][head_dim] float: the model's [n][n_kv * group] query rows, query head
//            h * group + i attending with KV head h;
//   keys, values [n_kv][n][head_dim] fp16 (head-major);
//   scratch: PrefillScratchFloats(n, group) floats (for the CUDA-core kernel; the tensor-core
//            kernel, head_dim 64 or 128 on sm_80+, needs none).
Status AttendPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_kv, int group, int head_dim,
                     float scale, float* out, float* scratch, void* stream);
// Scratch floats AttendPrefill needs.
inline int64_t PrefillScratchFloats(int32_t n, int group) {
  const int64_t pairs = int64_t{n} * group;
  return (pairs < 1024 ? pairs : 1024) * n;
}

}  // namespace specache::cuda
