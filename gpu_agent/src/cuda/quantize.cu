#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "specache/cuda_attention.h"
#include "specache/cuda_quantize.h"
#include "specache/cuda_tensors.h"
#include "block_task.cuh"
#include "decode_plan_slots.h"
#include "row_copy.cuh"

namespace specache::cuda {
namespace {

// Every float operation is rounded on its own (no FMA contraction), exactly as the CPU reference
// computes, so codes and (s, z) are bit-identical.
__device__ void ScaleZeroOf(float lo, float hi, int bits, float* scale, float* zero, uint16_t* scale_bits,
                            uint16_t* zero_bits) {
  const float range = __fsub_rn(hi, lo);
  float s, z;
  if (bits == 1) {
    z = __fmul_rn(__fadd_rn(__fmul_rn(3.0f, lo), hi), 0.25f);
    s = __fmul_rn(range, 0.5f);
  } else {
    z = lo;
    s = __fdiv_rn(range, static_cast<float>((1u << bits) - 1u));
  }
  const __half hs = __float2half_rn(s), hz = __float2half_rn(z);
  *scale = __half2float(hs);
  *zero = __half2float(hz);
  *scale_bits = __half_as_ushort(hs);
  *zero_bits = __half_as_ushort(hz);
}

__device__ uint32_t CodeOf(float x, float scale, float zero, int bits) {
  if (!(scale > 0.0f)) return 0;
  const float level = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(x, zero), scale), 0.5f));
  const float top = static_cast<float>((1u << bits) - 1u);
  if (!(level > 0.0f)) return 0;
  return static_cast<uint32_t>(level < top ? level : top);
}

// One warp quantizes one run of `n` (32 or 64, ...) values: lane l holds elements l, l+32, ...
// Writes n*bits/32 words: code i at bits (i % (32/bits))*bits of word i/(32/bits).
__device__ void QuantizeRunWarp(const float* x, int per_lane, int bits, uint32_t* words, uint16_t* scale_out,
                                uint16_t* zero_out) {
  const int lane = threadIdx.x & 31;
  float lo = x[0], hi = x[0];
  for (int j = 1; j < per_lane; ++j) {
    lo = fminf(lo, x[j]);
    hi = fmaxf(hi, x[j]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  float scale, zero;
  uint16_t sb, zb;
  ScaleZeroOf(lo, hi, bits, &scale, &zero, &sb, &zb);
  if (lane == 0) {
    *scale_out = sb;
    *zero_out = zb;
  }
  const int per_word = 32 / bits;  // lanes whose codes share a word
  for (int j = 0; j < per_lane; ++j) {
    const int i = lane + 32 * j;  // element index in the run
    uint32_t v = CodeOf(x[j], scale, zero, bits) << ((i % per_word) * bits);
    for (int o = 1; o < per_word; o <<= 1) v |= __shfl_xor_sync(0xffffffffu, v, o);
    if (i % per_word == 0) words[i / per_word] = v;
  }
}

// Runs by value (kMaxQuantizeRuns x 40 bytes): first[i] is the first group (keys) or token
// (values) of run i counted over all runs, first[count] the total.
template <typename Run>
struct RunBatch {
  Run runs[kMaxQuantizeRuns];
  int32_t first[kMaxQuantizeRuns + 1];
  int count;
};

// The run holding item `i` (a group or a token) and i's index inside it.
template <typename Run>
__device__ int RunOf(const RunBatch<Run>& b, int32_t i, int32_t* local) {
  int lo = 0, hi = b.count - 1;  // the last run with first <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.first[mid] <= i) lo = mid; else hi = mid - 1;
  }
  *local = i - b.first[lo];
  return lo;
}

// The calling warp quantizes channel d of one key group: keys [group_size][head_dim], codes
// [head_dim][group_size * bits / 32], scale and zero [head_dim].
__device__ void QuantizeKeyChannelWarp(const __half* keys, int d, int group_size, int head_dim, int bits,
                                       uint32_t* codes, uint16_t* scale, uint16_t* zero) {
  const int lane = threadIdx.x & 31, per_lane = group_size / 32;
  float x[4];
  for (int j = 0; j < per_lane; ++j) x[j] = __half2float(keys[static_cast<size_t>(lane + 32 * j) * head_dim + d]);
  const int words = group_size * bits / 32;
  QuantizeRunWarp(x, per_lane, bits, codes + static_cast<size_t>(d) * words, scale + d, zero + d);
}

// Block = one warp per channel of one key group; grid = groups of all runs x ceil(head_dim / warps).
__global__ void QuantizeKeyGroupRunsKernel(RunBatch<KeyGroupRun> batch, int group_size, int head_dim, int bits) {
  const int d = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
  if (d >= head_dim) return;  // whole warps leave together
  int32_t group = 0;
  const KeyGroupRun& r = batch.runs[RunOf(batch, static_cast<int32_t>(blockIdx.x), &group)];
  const size_t first = static_cast<size_t>(group) * head_dim;
  QuantizeKeyChannelWarp(reinterpret_cast<const __half*>(r.keys) + first * group_size, d, group_size, head_dim, bits,
                         r.codes + first * (group_size * bits / 32), r.scale + first, r.zero + first);
}

// One key group of a KeyGroupRun (QuantizeKeyGroupTasks' unit of work).
struct KeyGroupTask {
  const Half* keys;  // [group_size][head_dim]
  uint32_t* codes;   // [head_dim][group_size * bits / 32]
  Half* scale;       // [head_dim]
  Half* zero;
};

// Block = task blockIdx.x's group, its warps over the channels: the task (read in place from host
// memory) is read once per group, not once per few channels.
__global__ void QuantizeKeyGroupTasksKernel(const KeyGroupTask* __restrict__ tasks, int group_size, int head_dim,
                                            int bits) {
  const KeyGroupTask& t = TaskOfBlock(tasks, blockIdx.x);
  const int warps = blockDim.x / 32;
  for (int d = threadIdx.x / 32; d < head_dim; d += warps) {
    QuantizeKeyChannelWarp(reinterpret_cast<const __half*>(t.keys), d, group_size, head_dim, bits, t.codes, t.scale,
                           t.zero);
  }
}

// The calling warp quantizes channel group g of one value token.
__device__ void QuantizeValueGroupWarp(const __half* token, int g, int group_size, int bits, uint32_t* codes,
                                       uint16_t* scale, uint16_t* zero) {
  const int lane = threadIdx.x & 31, per_lane = group_size / 32;
  float x[4];
  const __half* v = token + static_cast<size_t>(g) * group_size;
  for (int j = 0; j < per_lane; ++j) x[j] = __half2float(v[lane + 32 * j]);
  const int words = group_size * bits / 32;
  QuantizeRunWarp(x, per_lane, bits, codes + static_cast<size_t>(g) * words, scale + g, zero + g);
}

// One warp per (token, channel group) of all runs.
__global__ void QuantizeValueTokenRunsKernel(RunBatch<ValueTokenRun> batch, int head_dim, int group_size, int bits) {
  const int groups = head_dim / group_size;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (w >= static_cast<int64_t>(batch.first[batch.count]) * groups) return;
  int32_t token = 0;
  const ValueTokenRun& r = batch.runs[RunOf(batch, static_cast<int32_t>(w / groups), &token)];
  const int g = static_cast<int>(w % groups);
  const size_t first = static_cast<size_t>(token) * groups;
  QuantizeValueGroupWarp(reinterpret_cast<const __half*>(r.values) + static_cast<size_t>(token) * head_dim, g,
                         group_size, bits, r.codes + first * (group_size * bits / 32), r.scale + first, r.zero + first);
}

// One warp per (task, channel group): the token's parts located in its replica's block, as the
// attention reads them.
// The warps of `block` (of the value tasks' blocks) each quantize one (task, channel group).
__device__ void RetireValuesOfBlock(const ValueRetireTask* __restrict__ tasks, int count, DeviceReplicaView v,
                                    int64_t block) {
  const int groups = v.head_dim / v.group_size;
  const int64_t run = block * (blockDim.x / 32) + threadIdx.x / 32;
  if (run >= static_cast<int64_t>(count) * groups) return;
  const ValueRetireTask& t = tasks[run / groups];
  v.blocks = t.blocks;
  QuantizeValueGroupWarp(reinterpret_cast<const __half*>(t.value), static_cast<int>(run % groups), v.group_size,
                         v.value_bits, const_cast<uint32_t*>(ValueCodes(v, t.token)),
                         const_cast<Half*>(ValueScales(v, t.token)), const_cast<Half*>(ValueZeros(v, t.token)));
}

__global__ void QuantizeValueTokensInBlocksKernel(const ValueRetireTask* __restrict__ tasks, int count,
                                                  DeviceReplicaView v) {
  RetireValuesOfBlock(tasks, count, v, blockIdx.x);
}

// The appends' two jobs in one grid: blocks [0, copy_blocks) copy rows (a thread a 16-byte piece,
// striding over the copy blocks), the rest quantize values as QuantizeValueTokensInBlocksKernel.
__global__ void CopyRowsAndQuantizeValuesKernel(const RowCopy* __restrict__ copies, int n_copies, int pieces_per_row,
                                                int copy_blocks, const ValueRetireTask* __restrict__ tasks, int count,
                                                DeviceReplicaView v) {
  if (static_cast<int>(blockIdx.x) < copy_blocks) {
    CopyRowPieces(copies, n_copies, pieces_per_row, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                  static_cast<int64_t>(copy_blocks) * blockDim.x);
    return;
  }
  RetireValuesOfBlock(tasks, count, v, static_cast<int64_t>(blockIdx.x) - copy_blocks);
}

Status Check(int group_size, int head_dim, int bits) {
  if (bits != 1 && bits != 2 && bits != 4) return Status::InvalidArgument("bits must be 1, 2 or 4");
  if (group_size <= 0 || group_size % 32 != 0 || group_size > 128) {
    return Status::InvalidArgument("group_size must be 32, 64, 96 or 128");
  }
  if (head_dim <= 0 || head_dim % 8 != 0) return Status::InvalidArgument("head_dim must be a positive multiple of 8");
  return Status::Ok();
}

// Launches `launch(batch, items)` for runs[0..n) in batches of kMaxQuantizeRuns; `size` is a run's
// item count (groups or tokens).
template <typename Run, typename Size, typename Launch>
Status LaunchRuns(const Run* runs, int n_runs, Size size, Launch launch) {
  if (n_runs < 0) return Status::InvalidArgument("negative run count");
  for (int at = 0; at < n_runs; at += kMaxQuantizeRuns) {
    RunBatch<Run> batch;
    batch.count = 0;
    batch.first[0] = 0;
    for (int i = at; i < std::min(n_runs, at + kMaxQuantizeRuns); ++i) {
      const int64_t n = size(runs[i]);
      if (n < 0) return Status::InvalidArgument("negative run length");
      if (n == 0) continue;
      if (batch.first[batch.count] + n > (int64_t{1} << 30)) return Status::InvalidArgument("runs too long for one launch");
      batch.runs[batch.count] = runs[i];
      batch.first[batch.count + 1] = static_cast<int32_t>(batch.first[batch.count] + n);
      ++batch.count;
    }
    if (batch.count > 0) SPECACHE_RETURN_IF_ERROR(launch(batch, batch.first[batch.count]));
  }
  return Status::Ok();
}

}  // namespace

Status QuantizeKeyGroupRuns(const KeyGroupRun* runs, int n_runs, int group_size, int head_dim, int bits, void* stream) {
  SPECACHE_RETURN_IF_ERROR(Check(group_size, head_dim, bits));
  return LaunchRuns(runs, n_runs, [](const KeyGroupRun& r) { return int64_t{r.n_groups}; },
                    [&](const RunBatch<KeyGroupRun>& batch, int32_t groups) {
                      constexpr int kWarps = 4;
                      const dim3 grid(groups, (head_dim + kWarps - 1) / kWarps);
                      QuantizeKeyGroupRunsKernel<<<grid, kWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
                          batch, group_size, head_dim, bits);
                      return LaunchStatus("key quantization kernel");
                    });
}

Status QuantizeKeyGroupTasks(const KeyGroupRun* runs, int n_runs, int group_size, int head_dim, int bits, void* stream,
                             DecodePlan* plan) {
  SPECACHE_RETURN_IF_ERROR(Check(group_size, head_dim, bits));
  if (n_runs < 0) return Status::InvalidArgument("negative run count");
  const int words = group_size * bits / 32;
  // The runs checked and their groups counted first, so that nothing is allocated for a bad call.
  int64_t groups = 0;
  for (int i = 0; i < n_runs; ++i) {
    if (runs[i].n_groups < 0) return Status::InvalidArgument("negative run length");
    groups += runs[i].n_groups;
  }
  if (groups > int64_t{std::numeric_limits<int>::max()}) {
    return Status::InvalidArgument("too many key groups for one launch");
  }
  std::vector<KeyGroupTask> tasks;
  tasks.reserve(static_cast<size_t>(groups));
  for (int i = 0; i < n_runs; ++i) {
    const KeyGroupRun& r = runs[i];
    for (int32_t g = 0; g < r.n_groups; ++g) {
      const size_t first = static_cast<size_t>(g) * head_dim;
      tasks.push_back({r.keys + first * group_size, r.codes + first * words, r.scale + first, r.zero + first});
    }
  }
  if (tasks.empty()) return Status::Ok();
  constexpr int kWarps = 8;
  const int n = static_cast<int>(tasks.size());
  auto* s = static_cast<cudaStream_t>(stream);
  const char* what = "key quantization kernel (tasks)";
  return WithDeviceTasks(plan, tasks.data(), n, s, what, [&](const KeyGroupTask* on_device) {
    QuantizeKeyGroupTasksKernel<<<static_cast<unsigned>(n), kWarps * 32, 0, s>>>(on_device, group_size, head_dim, bits);
  });
}

Status QuantizeValueTokenRuns(const ValueTokenRun* runs, int n_runs, int head_dim, int group_size, int bits,
                              void* stream) {
  SPECACHE_RETURN_IF_ERROR(Check(group_size, head_dim, bits));
  if (head_dim % group_size != 0) return Status::InvalidArgument("group_size must divide head_dim");
  return LaunchRuns(runs, n_runs, [](const ValueTokenRun& r) { return int64_t{r.n_tokens}; },
                    [&](const RunBatch<ValueTokenRun>& batch, int32_t tokens) {
                      constexpr int kWarps = 8;
                      const int64_t warps = int64_t{tokens} * (head_dim / group_size);
                      QuantizeValueTokenRunsKernel<<<static_cast<unsigned>((warps + kWarps - 1) / kWarps), kWarps * 32,
                                                     0, static_cast<cudaStream_t>(stream)>>>(batch, head_dim, group_size,
                                                                                             bits);
                      return LaunchStatus("value quantization kernel");
                    });
}

Status QuantizeKeyGroups(const Half* keys, int n_groups, int group_size, int head_dim, int bits, uint32_t* codes,
                         Half* scale, Half* zero, void* stream) {
  const KeyGroupRun run{keys, codes, scale, zero, n_groups};
  return QuantizeKeyGroupRuns(&run, 1, group_size, head_dim, bits, stream);
}

Status QuantizeValueTokens(const Half* values, int n_tokens, int head_dim, int group_size, int bits,
                           uint32_t* codes, Half* scale, Half* zero, void* stream) {
  const ValueTokenRun run{values, codes, scale, zero, n_tokens};
  return QuantizeValueTokenRuns(&run, 1, head_dim, group_size, bits, stream);
}

namespace {

Status CheckRetire(int n_tasks, const DeviceReplicaView& geometry) {
  const int head_dim = geometry.head_dim, group_size = geometry.group_size, bits = geometry.value_bits;
  SPECACHE_RETURN_IF_ERROR(Check(group_size, head_dim, bits));
  if (head_dim % group_size != 0) return Status::InvalidArgument("group_size must divide head_dim");
  if (geometry.layout.block_tokens <= 0) return Status::InvalidArgument("value quantization: no block layout");
  if (n_tasks < 0) return Status::InvalidArgument("negative task count");
  return Status::Ok();
}

}  // namespace

Status QuantizeValueTokensInBlocks(const ValueRetireTask* tasks, int n_tasks, const DeviceReplicaView& geometry,
                                   void* stream, DecodePlan* plan) {
  const int head_dim = geometry.head_dim, group_size = geometry.group_size;
  SPECACHE_RETURN_IF_ERROR(CheckRetire(n_tasks, geometry));
  if (n_tasks == 0) return Status::Ok();
  constexpr int kWarps = 8;
  const int64_t runs = int64_t{n_tasks} * (head_dim / group_size);
  auto* s = static_cast<cudaStream_t>(stream);
  const char* what = "value quantization kernel (in blocks)";
  return WithDeviceTasks(plan, tasks, n_tasks, s, what, [&](const ValueRetireTask* on_device) {
    QuantizeValueTokensInBlocksKernel<<<static_cast<unsigned>((runs + kWarps - 1) / kWarps), kWarps * 32, 0, s>>>(
        on_device, n_tasks, geometry);
  });
}

Status CopyRowsAndQuantizeValueTokensInBlocks(const RowCopy* copies, int n_copies, int row_bytes,
                                              const ValueRetireTask* tasks, int n_tasks,
                                              const DeviceReplicaView& geometry, void* stream, DecodePlan* plan) {
  if (n_tasks == 0) return CopyRows(copies, n_copies, row_bytes, stream, plan);
  SPECACHE_RETURN_IF_ERROR(CheckRetire(n_tasks, geometry));
  if (n_copies == 0) return QuantizeValueTokensInBlocks(tasks, n_tasks, geometry, stream, plan);
  if (row_bytes <= 0 || row_bytes % 16 != 0) return Status::InvalidArgument("row_bytes must be a positive multiple of 16");
  if (n_copies < 0) return Status::InvalidArgument("negative row copy count");
  if (plan == nullptr) {
    return WithOwnPlan(static_cast<cudaStream_t>(stream), DecodePlan::SlotReads::kInPlace, [&](DecodePlan* own) {
      return CopyRowsAndQuantizeValueTokensInBlocks(copies, n_copies, row_bytes, tasks, n_tasks, geometry, stream, own);
    });
  }
  // Both lists in one slot: the copies, then the tasks (RowCopy's 16 bytes keep them aligned).
  static_assert(sizeof(RowCopy) % alignof(ValueRetireTask) == 0);
  const size_t copy_bytes = static_cast<size_t>(n_copies) * sizeof(RowCopy);
  const size_t bytes = copy_bytes + static_cast<size_t>(n_tasks) * sizeof(ValueRetireTask);
  auto* s = static_cast<cudaStream_t>(stream);
  SPECACHE_ASSIGN_OR_RETURN(const DecodePlan::Impl::Upload up, plan->impl()->Begin(bytes, s));
  std::memcpy(up.host, copies, copy_bytes);
  std::memcpy(static_cast<char*>(up.host) + copy_bytes, tasks, bytes - copy_bytes);
  SPECACHE_RETURN_IF_ERROR(plan->impl()->Send(up, bytes, s));
  constexpr int kThreads = 256, kWarps = kThreads / 32;  // GridStrideBlocks' blocks
  const int pieces_per_row = row_bytes / 16;
  const int copy_blocks = GridStrideBlocks(int64_t{n_copies} * pieces_per_row);
  const int64_t runs = int64_t{n_tasks} * (geometry.head_dim / geometry.group_size);
  const auto* device = static_cast<const char*>(up.device);
  CopyRowsAndQuantizeValuesKernel<<<static_cast<unsigned>(copy_blocks + (runs + kWarps - 1) / kWarps), kThreads, 0, s>>>(
      reinterpret_cast<const RowCopy*>(device), n_copies, pieces_per_row, copy_blocks,
      reinterpret_cast<const ValueRetireTask*>(device + copy_bytes), n_tasks, geometry);
  const Status launched = LaunchStatus("row copy and value quantization kernel");
  SPECACHE_RETURN_IF_ERROR(plan->impl()->Finish(up, s));  // also after a failed launch
  return launched;
}

}  // namespace specache::cuda
