#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "specache/cuda_fetch.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct TaskBatch {  // passed by value: 256 tasks fit the 32 KB parameter space of sm_70+
  T tasks[kMaxTasks];
  int count;
};

__device__ const uint4* HostRow(const uint64_t* pages, int page_tokens, int kv_head, int32_t token, int row_pieces) {
  const int32_t page = token / page_tokens, in_page = token - page * page_tokens;
  return reinterpret_cast<const uint4*>(pages[page]) + (static_cast<int64_t>(kv_head) * page_tokens + in_page) * row_pieces;
}

// Index of `token` in the ascending list, or -1.
__device__ int Find(const int32_t* list, int n, int32_t token) {
  int lo = 0, hi = n - 1;
  while (lo <= hi) {
    const int mid = (lo + hi) >> 1;
    if (list[mid] == token) return mid;
    if (list[mid] < token) lo = mid + 1; else hi = mid - 1;
  }
  return -1;
}

// A group of row_pieces threads per row; rows of all tasks are spread over the grid.
__global__ void FetchKernel(TaskBatch<FetchTask> batch, int32_t max_selected, int row_pieces, int page_tokens,
                            FetchCounters* counters) {
  __shared__ unsigned long long fetched, reused;
  if (threadIdx.x == 0) fetched = reused = 0;
  __syncthreads();
  const int rows_per_block = blockDim.x / row_pieces;
  const int slot = threadIdx.x / row_pieces, piece = threadIdx.x % row_pieces;
  const int64_t total = static_cast<int64_t>(batch.count) * max_selected;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * rows_per_block + slot; r < total;
       r += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    if (slot >= rows_per_block) break;
    const FetchTask& t = batch.tasks[r / max_selected];
    const int i = static_cast<int>(r % max_selected);
    if (i >= t.n_selected) continue;
    const int32_t token = t.selected[i];
    const int at = Find(t.resident, t.n_resident, token);
    const uint4* src = at >= 0 ? reinterpret_cast<const uint4*>(t.resident_rows) + static_cast<int64_t>(at) * row_pieces
                               : HostRow(t.pages, page_tokens, t.kv_head, token, row_pieces);
    reinterpret_cast<uint4*>(t.out_rows)[static_cast<int64_t>(i) * row_pieces + piece] = src[piece];
    if (piece == 0) atomicAdd(at >= 0 ? &reused : &fetched, 1ull);
  }
  __syncthreads();
  if (threadIdx.x == 0 && counters) {
    if (fetched) atomicAdd(&counters->fetched, fetched);
    if (reused) atomicAdd(&counters->reused, reused);
  }
}

// One thread per 16-byte piece of a row: K pieces first, then V.
__global__ void WriteKernel(TaskBatch<WriteTask> batch, int32_t max_rows, int half_pieces, int page_tokens) {
  const int row_pieces = 2 * half_pieces;
  const int64_t total = static_cast<int64_t>(batch.count) * max_rows * row_pieces;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < total;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = p / row_pieces;
    const int piece = static_cast<int>(p - row * row_pieces);
    const WriteTask& t = batch.tasks[row / max_rows];
    const int32_t i = static_cast<int32_t>(row % max_rows);
    if (i >= t.n) continue;
    const bool value = piece >= half_pieces;
    const uint4* src = reinterpret_cast<const uint4*>((value ? t.values : t.keys) + static_cast<int64_t>(i) * t.stride);
    uint4* dst = const_cast<uint4*>(HostRow(t.pages, page_tokens, t.kv_head, t.first_token + i, row_pieces));
    dst[piece] = src[piece - (value ? half_pieces : 0)];
  }
}

Status LaunchError(const char* what) {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : Status::Unavailable(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

Status FetchRows(const FetchTask* tasks, int n_tasks, int head_dim, int page_tokens, int max_blocks,
                 FetchCounters* counters, void* stream) {
  if (head_dim <= 0 || head_dim % 8 != 0 || page_tokens <= 0 || max_blocks <= 0 || n_tasks < 0) {
    return Status::InvalidArgument("fetch: head_dim must be a positive multiple of 8, page_tokens and blocks positive");
  }
  const int row_pieces = 2 * head_dim * static_cast<int>(sizeof(Half)) / 16;
  if (row_pieces > kThreads) return Status::InvalidArgument("fetch: rows wider than a block");
  for (int first = 0; first < n_tasks; first += kMaxTasks) {
    TaskBatch<FetchTask> batch;
    batch.count = std::min(kMaxTasks, n_tasks - first);
    int32_t max_selected = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.tasks[i] = tasks[first + i];
      max_selected = std::max(max_selected, batch.tasks[i].n_selected);
    }
    if (max_selected == 0) continue;
    const int rows_per_block = kThreads / row_pieces;
    const int64_t rows = int64_t{batch.count} * max_selected;
    const int blocks = static_cast<int>(std::min<int64_t>(max_blocks, (rows + rows_per_block - 1) / rows_per_block));
    FetchKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(batch, max_selected, row_pieces, page_tokens,
                                                                            counters);
    SPECACHE_RETURN_IF_ERROR(LaunchError("fetch kernel"));
  }
  return Status::Ok();
}

Status WriteRows(const WriteTask* tasks, int n_tasks, int head_dim, int page_tokens, void* stream) {
  if (head_dim <= 0 || head_dim % 8 != 0 || page_tokens <= 0 || n_tasks < 0) {
    return Status::InvalidArgument("write: head_dim must be a positive multiple of 8, page_tokens positive");
  }
  const int half_pieces = head_dim * static_cast<int>(sizeof(Half)) / 16;
  for (int first = 0; first < n_tasks; first += kMaxTasks) {
    TaskBatch<WriteTask> batch;
    batch.count = std::min(kMaxTasks, n_tasks - first);
    int32_t max_rows = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.tasks[i] = tasks[first + i];
      if (batch.tasks[i].stride % 8 != 0) return Status::InvalidArgument("write: row stride must keep 16-byte alignment");
      max_rows = std::max(max_rows, batch.tasks[i].n);
    }
    if (max_rows == 0) continue;
    const int64_t pieces = int64_t{batch.count} * max_rows * 2 * half_pieces;
    const int blocks = static_cast<int>(std::min<int64_t>(1024, (pieces + kThreads - 1) / kThreads));
    WriteKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(batch, max_rows, half_pieces, page_tokens);
    SPECACHE_RETURN_IF_ERROR(LaunchError("write kernel"));
  }
  return Status::Ok();
}

}  // namespace specache::cuda
