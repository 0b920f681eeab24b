// KvConfig::seed_rows on the device: at prefill, one (sequence, layer)'s row cache starts with the
// quantized tokens the prompt's last token attends most, their rows copied from the prompt's own
// fp16 K/V. The rule is the CPU backend's cpu::SeedTokens (selection.h), its float operations in
// the CPU's order (each dot product summed channel by channel, no fused multiply-add; the group
// reduced head by head), the softmax's exponentials and sum in double (the sum a tree here, a
// loop there; the device's exp within an ulp of the CPU's), so that each float probability is the
// CPU's but for a rounding in ~1e-9 of cases, where a near-tie may then rank otherwise; on a CPU
// that fuses multiply-adds (aarch64 compilers by default) the dot products differ in their last
// bits. The H200 test compares seeds and ranks with the CPU's exactly on random prompts.
//
// Written as the row cache's list (row_fetch.h, CacheList; CacheUpdateTask's layout): the seeds
// ascending, each in the slot of its place (slot i for the i-th), its use mark -rank (rank 0 the
// best: every fetch's mark is above all of them, so the seeds leave before any fetched row, the
// least attended first); the list's other entries kNoToken with the free slots in order.
// Internal to the agent.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "specache/cuda_attention.h"  // DecodePlan
#include "specache/half.h"
#include "specache/selection.h"  // GroupReduction
#include "specache/status.h"

namespace specache::cuda {

// One KV head's seeding (device memory throughout).
struct SeedTask {
  const float* q = nullptr;      // [group][head_dim]: the query heads of the KV head, at the prompt's last token
  const Half* keys = nullptr;    // [n][head_dim]: the prompt's keys of the KV head
  const Half* values = nullptr;  // [n][head_dim]
  float* logits = nullptr;       // [group][n] scratch (SeedScratchFloats), one per task
  int32_t n = 0;                 // the prompt's tokens: the softmax runs over all of them
  int32_t candidates = 0;        // <= n: the seeds come from tokens [0, candidates), the quantized ones
  int32_t take = 0;              // <= candidates and <= capacity: the seeds (SeedCount)
  // The row cache's list and rows (row_fetch.h), written whole.
  int32_t* tokens = nullptr;       // [capacity]
  int32_t* used = nullptr;         // [capacity]
  int32_t* slots = nullptr;        // [capacity]
  int32_t* list_count = nullptr;   // [1]
  Half* rows = nullptr;            // [capacity][2][head_dim] by slot
  int32_t capacity = 0;            // >= count
};

// The seeds of a cache of `capacity` rows that wants `wanted` of `candidates` tokens.
inline int32_t SeedCount(int32_t wanted, int32_t candidates, int32_t capacity) {
  return wanted <= 0 || candidates <= 0 ? 0 : std::min({wanted, candidates, capacity});
}

// Scratch floats of one task over a prompt of n tokens.
inline int64_t SeedScratchFloats(int group, int32_t n) { return int64_t{group} * n; }

// Queues the tasks' seeding on `stream` (two launches), their list through a slot of `plan`.
// head_dim a multiple of 8 up to 256; every task's capacity within kMaxCacheRows (cuda_fetch.h) and
// its counts within their bounds; INVALID_ARGUMENT otherwise, nothing queued.
Status SeedRowCaches(const SeedTask* tasks, int n_tasks, int group, int head_dim, float scale, GroupReduction reduction,
                     cudaStream_t stream, DecodePlan* plan);

}  // namespace specache::cuda
