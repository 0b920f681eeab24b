#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include <cub/block/block_scan.cuh>

#include "specache/cuda_fetch.h"
#include "sorted_tokens.cuh"
#include "specache/cuda_selection.h"
#include "block_task.cuh"
#include "decode_plan_slots.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void MaskKernel(const MaskTask* __restrict__ tasks, int n_heads) {
  const MaskTask& t = TaskOfBlock(tasks, blockIdx.x);
  for (int64_t i = threadIdx.x; i < int64_t{t.count} * n_heads; i += blockDim.x) {
    const int h = static_cast<int>(i / t.count);
    const int32_t token = t.tokens[i % t.count];
    if (token != kNoToken) t.scores[static_cast<int64_t>(h) * t.n + token] = __int_as_float(0x7fc00000);  // quiet NaN
  }
}

// Block (x, y): scores [x kShiftSlice, (x + 1) kShiftSlice) of task y's n_heads x n (fewer than
// 2^31: the host checks), four per thread. (One block per task walked a task's ~32K scores with
// 256 threads: 0.29 ms a layer at 99 x 8K for ~208 MB, ~6x its bytes' time.)
constexpr int kShiftSlice = 4 * kThreads;
__global__ void ShiftKernel(const ShiftTask* __restrict__ tasks, int n_heads) {
  const ShiftTask& t = TaskOfBlock(tasks, blockIdx.y);
  const int32_t total = t.n * n_heads, end = min(total, static_cast<int32_t>(blockIdx.x + 1) * kShiftSlice);
  for (int32_t i = static_cast<int32_t>(blockIdx.x) * kShiftSlice + threadIdx.x; i < end; i += blockDim.x) {
    const int32_t j = i % t.n;
    const float own = t.in[i];
    t.out[i] = j > 0 && !isnan(own) && t.in[i - 1] > own ? t.in[i - 1] : own;
  }
}

// The union. fresh_before[j]: b's entries in [0, j) that are not in a (one block scan over
// per-thread runs). A new b entry lands at fresh_before[j] + (a's rows below it); a's row i at
// i + fresh_before[b's entries below it] (none of those equals it).
__global__ void MergeKernel(const MergeTask* __restrict__ tasks, unsigned long long* rows) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int32_t fresh_before[kMaxMergedRows + 1];
  const MergeTask& t = TaskOfBlock(tasks, blockIdx.x);
  const int32_t na = Below(t.a, t.na, kNoToken);  // the budget's rows, without its padding
  auto is_new = [&](int32_t token) {
    const int32_t at = Below(t.a, na, token);
    return !(at < na && t.a[at] == token);
  };
  const int32_t per = (t.nb + blockDim.x - 1) / blockDim.x;
  const int32_t lo = min(t.nb, static_cast<int32_t>(threadIdx.x) * per), hi = min(t.nb, lo + per);
  int fresh = 0;
  for (int32_t j = lo; j < hi; ++j) fresh += is_new(t.b[j]) ? 1 : 0;
  int before = 0, total = 0;
  Scan(scan).ExclusiveSum(fresh, before, total);
  for (int32_t j = lo; j < hi; ++j) {
    fresh_before[j] = before;
    before += is_new(t.b[j]) ? 1 : 0;
  }
  if (threadIdx.x == 0) fresh_before[t.nb] = total;
  __syncthreads();
  for (int32_t j = threadIdx.x; j < t.nb; j += blockDim.x) {
    if (is_new(t.b[j])) t.out[fresh_before[j] + Below(t.a, na, t.b[j])] = t.b[j];
  }
  for (int32_t i = threadIdx.x; i < na; i += blockDim.x) t.out[i + fresh_before[Below(t.b, t.nb, t.a[i])]] = t.a[i];
  const int32_t count = na + total;
  for (int32_t i = count + threadIdx.x; i < t.na + t.nb; i += blockDim.x) t.out[i] = kNoToken;
  if (threadIdx.x == 0 && rows) atomicAdd(rows, static_cast<unsigned long long>(count));
}

// One launch over all the tasks (`launch(device_tasks)` queues it), through `plan`.
template <typename T, typename Launch>
Status OneLaunch(DecodePlan* plan, const T* tasks, int n_tasks, const char* what, cudaStream_t stream, Launch launch) {
  if (n_tasks < 0) return Status::InvalidArgument(std::string(what) + ": negative task count");
  if (n_tasks == 0) return Status::Ok();
  return WithDeviceTasks(plan, tasks, n_tasks, stream, what, launch);
}

}  // namespace

Status MaskTokens(const MaskTask* tasks, int n_tasks, int n_heads, void* stream, DecodePlan* plan) {
  if (n_heads <= 0) return Status::InvalidArgument("mask: n_heads must be positive");
  auto* s = static_cast<cudaStream_t>(stream);
  return OneLaunch(plan, tasks, n_tasks, "mask kernel", s, [&](const MaskTask* t) {
    MaskKernel<<<n_tasks, kThreads, 0, s>>>(t, n_heads);
  });
}

Status MergeSelections(const MergeTask* tasks, int n_tasks, unsigned long long* rows, void* stream,
                       DecodePlan* plan) {
  for (int i = 0; i < n_tasks; ++i) {
    if (tasks[i].na + tasks[i].nb > kMaxMergedRows) return Status::InvalidArgument("merge: lists too long");
  }
  auto* s = static_cast<cudaStream_t>(stream);
  return OneLaunch(plan, tasks, n_tasks, "merge kernel", s, [&](const MergeTask* t) {
    MergeKernel<<<n_tasks, kThreads, 0, s>>>(t, rows);
  });
}

Status WithPredecessors(const ShiftTask* tasks, int n_tasks, int n_heads, void* stream, DecodePlan* plan) {
  if (n_heads <= 0) return Status::InvalidArgument("shift: n_heads must be positive");
  int64_t most = 0;  // the largest task's scores
  for (int i = 0; i < n_tasks; ++i) most = std::max(most, int64_t{tasks[i].n} * n_heads);
  if (most >= int64_t{1} << 31) return Status::InvalidArgument("shift: a task of 2^31 scores or more");
  const unsigned slices = static_cast<unsigned>(std::max<int64_t>(1, (most + kShiftSlice - 1) / kShiftSlice));
  auto* s = static_cast<cudaStream_t>(stream);
  return OneLaunch(plan, tasks, n_tasks, "shift kernel", s, [&](const ShiftTask* t) {
    constexpr int kMaxRows = 65535;  // a task is a row of the grid
    for (int first = 0; first < n_tasks; first += kMaxRows) {
      ShiftKernel<<<dim3(slices, static_cast<unsigned>(std::min(kMaxRows, n_tasks - first))), kThreads, 0, s>>>(
          t + first, n_heads);
    }
  });
}

}  // namespace specache::cuda
