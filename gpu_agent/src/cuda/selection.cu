#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "specache/cuda_selection.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Batch {  // by value: 256 tasks of at most 32 bytes
  T tasks[kMaxSelectionTasks];
  int count;
};

__global__ void MaskKernel(Batch<MaskTask> batch, int n_heads) {
  const MaskTask& t = batch.tasks[blockIdx.x];
  for (int64_t i = threadIdx.x; i < int64_t{t.count} * n_heads; i += blockDim.x) {
    const int h = static_cast<int>(i / t.count);
    t.scores[static_cast<int64_t>(h) * t.n + t.tokens[i % t.count]] = __int_as_float(0x7fc00000);  // quiet NaN
  }
}

__global__ void ShiftKernel(Batch<ShiftTask> batch, int n_heads) {
  const ShiftTask& t = batch.tasks[blockIdx.x];
  for (int64_t i = threadIdx.x; i < int64_t{t.n} * n_heads; i += blockDim.x) {
    const int32_t j = static_cast<int32_t>(i % t.n);
    const float own = t.in[i];
    t.out[i] = j > 0 && !isnan(own) && t.in[i - 1] > own ? t.in[i - 1] : own;
  }
}

// Tokens of `list` [0, n) below `token`.
__device__ int32_t Below(const int32_t* list, int32_t n, int32_t token) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    if (list[mid] < token) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Each token's place in the merged list is its index plus the other list's tokens below it.
__global__ void MergeKernel(Batch<MergeTask> batch) {
  const MergeTask& t = batch.tasks[blockIdx.x];
  for (int32_t i = threadIdx.x; i < t.na; i += blockDim.x) t.out[i + Below(t.b, t.nb, t.a[i])] = t.a[i];
  for (int32_t j = threadIdx.x; j < t.nb; j += blockDim.x) t.out[j + Below(t.a, t.na, t.b[j])] = t.b[j];
}

template <typename T, typename Launch>
Status InBatches(const T* tasks, int n_tasks, const char* what, Launch launch) {
  if (n_tasks < 0) return Status::InvalidArgument(std::string(what) + ": negative task count");
  for (int first = 0; first < n_tasks; first += kMaxSelectionTasks) {
    Batch<T> batch;
    batch.count = std::min(kMaxSelectionTasks, n_tasks - first);
    std::copy_n(tasks + first, batch.count, batch.tasks);
    launch(batch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return Status::Unavailable(std::string(what) + ": " + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace

Status MaskTokens(const MaskTask* tasks, int n_tasks, int n_heads, void* stream) {
  if (n_heads <= 0) return Status::InvalidArgument("mask: n_heads must be positive");
  return InBatches(tasks, n_tasks, "mask kernel", [&](const Batch<MaskTask>& b) {
    MaskKernel<<<b.count, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b, n_heads);
  });
}

Status MergeSelections(const MergeTask* tasks, int n_tasks, void* stream) {
  return InBatches(tasks, n_tasks, "merge kernel", [&](const Batch<MergeTask>& b) {
    MergeKernel<<<b.count, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
  });
}

Status WithPredecessors(const ShiftTask* tasks, int n_tasks, int n_heads, void* stream) {
  if (n_heads <= 0) return Status::InvalidArgument("shift: n_heads must be positive");
  return InBatches(tasks, n_tasks, "shift kernel", [&](const Batch<ShiftTask>& b) {
    ShiftKernel<<<b.count, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b, n_heads);
  });
}

}  // namespace specache::cuda
