#include "seed_rows.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "specache/cuda_fetch.h"  // kNoToken, kMaxCacheRows
#include "block_select.cuh"
#include "block_task.cuh"
#include "decode_plan_slots.h"

namespace specache::cuda {
namespace {

constexpr int kMaxHeadDim = 256;
// Seeds whose keys the ranking reads from shared memory (32 KiB); more read them from the scores.
constexpr int32_t kSharedRankKeys = 4096;

// Block (x, task): the logits scale * q_g.k_j of tokens j in [x * kListThreads, +kListThreads) for
// every query head g of the task, a thread per token, summed channel by channel as
// cpu::SeedTokens sums them (products and sums rounded one by one: no fused multiply-add).
__global__ void SeedLogitsKernel(const SeedTask* __restrict__ tasks, int group, int head_dim, float scale) {
  const SeedTask& t = TaskOfBlock(tasks, blockIdx.y);
  extern __shared__ float q[];  // [group][head_dim]
  for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) q[i] = t.q[i];
  __syncthreads();
  const int32_t j = static_cast<int32_t>(blockIdx.x) * kListThreads + static_cast<int32_t>(threadIdx.x);
  if (j >= t.n) return;
  const uint4* key = reinterpret_cast<const uint4*>(t.keys + static_cast<int64_t>(j) * head_dim);
  float dots[8];  // the group's sums, eight heads at a time
  for (int g0 = 0; g0 < group; g0 += 8) {
    const int heads = min(8, group - g0);
#pragma unroll
    for (int g = 0; g < 8; ++g) dots[g] = 0.0f;
    for (int c0 = 0; c0 < head_dim; c0 += 8) {
      const uint4 piece = key[c0 / 8];
      const __half* k = reinterpret_cast<const __half*>(&piece);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float kc = __half2float(k[c]);
#pragma unroll
        for (int g = 0; g < 8; ++g) {
          if (g < heads) dots[g] = __fadd_rn(dots[g], __fmul_rn(q[(g0 + g) * head_dim + c0 + c], kc));
        }
      }
    }
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      if (g < heads) t.logits[static_cast<int64_t>(g0 + g) * t.n + j] = __fmul_rn(dots[g], scale);
    }
  }
}

// A score's 64-bit key: higher scores larger, then (ties) lower tokens larger: cpu::SeedTokens'
// order (RankBest). Distinct for distinct tokens.
__device__ uint64_t SeedKey(float score, int32_t token) {
  const uint32_t bits = __float_as_uint(score);
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return uint64_t{ordered} << 32 | ~uint32_t(token);
}

// Block b seeds task b's list, in passes:
//   1. per query head, the softmax's max and its sum of exponentials over all n logits;
//   2. each candidate's score: the heads' probabilities reduced (GroupReduction), into the logits'
//      first row (a thread reads and writes only its own tokens there);
//   3. the threshold of the `take` best (KthLargestKey), then the seeds in ascending order, each
//      in the slot of its place (a scan of per-thread runs);
//   4. each seed's rank (the seeds with a larger key, their keys kept in shared memory from pass 3
//      when they fit) as its use mark, -rank; the rest of the list;
//   5. the seeds' rows copied into their slots, 16-byte pieces.
__global__ void SeedSelectKernel(const SeedTask* __restrict__ tasks, int group, int row_pieces, bool use_max) {
  const SeedTask& t = TaskOfBlock(tasks, blockIdx.x);
  // [group] sums, [group] maxima (as doubles), then the seeds' keys when take <= kSharedRankKeys.
  extern __shared__ double stats[];
  double* sums = stats;
  double* maxima = stats + group;
  uint64_t* seed_keys = reinterpret_cast<uint64_t*>(stats + 2 * group);
  const int32_t n = t.n;
  for (int g = 0; g < group; ++g) {
    const float* l = t.logits + static_cast<int64_t>(g) * n;
    float mx = -INFINITY;
    for (int32_t j = threadIdx.x; j < n; j += kListThreads) mx = fmaxf(mx, l[j]);
    mx = BlockAllReduce(mx, [](float a, float b) { return fmaxf(a, b); });
    double sum = 0.0;
    for (int32_t j = threadIdx.x; j < n; j += kListThreads) sum += exp(static_cast<double>(__fsub_rn(l[j], mx)));
    sum = BlockAllReduce(sum, [](double a, double b) { return a + b; });
    if (threadIdx.x == 0) sums[g] = sum, maxima[g] = mx;
  }
  __syncthreads();
  const int32_t candidates = t.candidates, take = t.take;
  const bool keys_shared = take <= kSharedRankKeys;
  float* score = t.logits;  // [candidates], over head 0's logits
  for (int32_t j = threadIdx.x; j < candidates; j += kListThreads) {
    float s = use_max ? -INFINITY : 0.0f;
    for (int g = 0; g < group; ++g) {
      const float l = t.logits[static_cast<int64_t>(g) * n + j];
      const float p = static_cast<float>(exp(static_cast<double>(__fsub_rn(l, static_cast<float>(maxima[g])))) / sums[g]);
      const float v = isnan(p) ? -INFINITY : p;
      s = use_max ? fmaxf(s, v) : __fadd_rn(s, v);
    }
    score[j] = use_max ? s : __fdiv_rn(s, static_cast<float>(group));
  }
  __syncthreads();
  auto key_of = [&](int32_t j, uint64_t* key) {
    *key = SeedKey(score[j], j);
    return true;
  };
  // Every key is above 0: with all candidates taken, no select. (take and candidates come
  // clamped from the host: on the H200, built by ptxas 13.0.88, a version of this kernel that
  // clamped them itself with min and max took this test as true for 8 seeds of 64 candidates,
  // the values it printed beside it.)
  const uint64_t threshold = take > 0 && take < candidates ? KthLargestKey(candidates, take, key_of) : 0;
  {
    const int32_t run = (candidates + kListThreads - 1) / kListThreads;
    const int32_t first = min(candidates, static_cast<int32_t>(threadIdx.x) * run), last = min(candidates, first + run);
    int count = 0;
    if (take > 0) {
      for (int32_t j = first; j < last; ++j) count += SeedKey(score[j], j) >= threshold ? 1 : 0;
    }
    int pos = BlockExclusiveSum(count);
    for (int32_t j = first; j < last && count > 0; ++j) {
      const uint64_t key = SeedKey(score[j], j);
      if (key < threshold) continue;
      t.tokens[pos] = j;
      t.slots[pos] = pos;
      if (keys_shared) seed_keys[pos] = key;
      ++pos;
    }
  }
  __syncthreads();  // the seeds' tokens and keys, read by every thread below
  auto key_at = [&](int32_t i) { return keys_shared ? seed_keys[i] : SeedKey(score[t.tokens[i]], t.tokens[i]); };
  for (int32_t i = threadIdx.x; i < take; i += kListThreads) {
    const uint64_t mine = key_at(i);
    int32_t rank = 0;
    for (int32_t o = 0; o < take; ++o) rank += key_at(o) > mine ? 1 : 0;
    t.used[i] = -rank;
  }
  for (int32_t i = take + threadIdx.x; i < t.capacity; i += kListThreads) {
    t.tokens[i] = kNoToken;
    t.used[i] = 0;
    t.slots[i] = i;
  }
  if (threadIdx.x == 0) *t.list_count = take;
  const int half_pieces = row_pieces / 2;
  for (int64_t p = threadIdx.x; p < int64_t{take} * row_pieces; p += kListThreads) {
    const int32_t i = static_cast<int32_t>(p / row_pieces), piece = static_cast<int32_t>(p - int64_t{i} * row_pieces);
    const bool value = piece >= half_pieces;
    const uint4* src = reinterpret_cast<const uint4*>((value ? t.values : t.keys) + int64_t{t.tokens[i]} * half_pieces * 8);
    reinterpret_cast<uint4*>(t.rows)[p] = src[piece - (value ? half_pieces : 0)];
  }
}

}  // namespace

Status SeedRowCaches(const SeedTask* tasks, int n_tasks, int group, int head_dim, float scale, GroupReduction reduction,
                     cudaStream_t stream, DecodePlan* plan) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > kMaxHeadDim || group <= 0 || n_tasks < 0) {
    return Status::InvalidArgument("seed rows: head_dim must be a multiple of 8 up to 256, the group positive");
  }
  int32_t longest = 0, shared_keys = 0;
  for (int i = 0; i < n_tasks; ++i) {
    const SeedTask& t = tasks[i];
    if (t.capacity < 0 || t.capacity > kMaxCacheRows || t.n < 0 || t.candidates < 0 || t.candidates > t.n ||
        t.take < 0 || t.take > t.candidates || t.take > t.capacity) {
      return Status::InvalidArgument(
          "seed rows: a cache above kMaxCacheRows, candidates beyond the prompt, or more seeds than candidates or "
          "than the cache holds");
    }
    longest = std::max(longest, t.n);
    if (t.take <= kSharedRankKeys) shared_keys = std::max(shared_keys, t.take);
  }
  if (n_tasks == 0) return Status::Ok();
  const int row_pieces = 2 * head_dim * static_cast<int>(sizeof(Half)) / 16;
  const size_t q_bytes = size_t(group) * head_dim * sizeof(float);
  const size_t stats_bytes = 2 * size_t(group) * sizeof(double) + size_t(shared_keys) * sizeof(uint64_t);
  if (q_bytes > 48 * 1024 || stats_bytes > 48 * 1024) {
    return Status::InvalidArgument("seed rows: a GQA group's queries or statistics above 48 KB");
  }
  const dim3 logits_grid(static_cast<unsigned>(std::max(1, (longest + kListThreads - 1) / kListThreads)),
                         static_cast<unsigned>(n_tasks));
  const bool use_max = reduction == GroupReduction::kMax;
  return WithDeviceTasks(plan, tasks, n_tasks, stream, "seed rows kernels", [&](const SeedTask* on_device) {
    SeedLogitsKernel<<<logits_grid, kListThreads, q_bytes, stream>>>(on_device, group, head_dim, scale);
    SeedSelectKernel<<<n_tasks, kListThreads, stats_bytes, stream>>>(on_device, group, row_pieces, use_max);
  });
}

}  // namespace specache::cuda
