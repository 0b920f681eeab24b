#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "specache/cuda_fetch.h"
#include "block_select.cuh"
#include "block_task.cuh"
#include "decode_plan_slots.h"
#include "int8_rows.cuh"
#include "shared_memory_opt_in.cuh"
#include "sorted_tokens.cuh"

namespace specache::cuda {
namespace {

constexpr int kThreads = kListThreads;  // the cache update calls block_select.cuh

__device__ const uint4* HostRow(const uint64_t* pages, int page_tokens, int kv_head, int32_t token, int row_pieces) {
  const int32_t page = token / page_tokens, in_page = token - page * page_tokens;
  return reinterpret_cast<const uint4*>(pages[page]) + (static_cast<int64_t>(kv_head) * page_tokens + in_page) * row_pieces;
}

// Where a stored row of `row_bytes` bytes starts in its host page (any row format).
__device__ uint8_t* StoredHostRow(const uint64_t* pages, int page_tokens, int kv_head, int32_t token, int64_t row_bytes) {
  const int32_t page = token / page_tokens, in_page = token - page * page_tokens;
  return reinterpret_cast<uint8_t*>(pages[page]) + (static_cast<int64_t>(kv_head) * page_tokens + in_page) * row_bytes;
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

// Rows a thread group has in flight: each host row read over PCIe waits ~1-2 us plus an address
// translation (4 KiB pages over a span of GiBs), so one row at a time leaves the link idle. A
// group resolves kRowsInFlight rows (task, token, resident search), issues their loads, then their
// stores (gather bench, 32 blocks, 32 GiB of pages: 15.6 GB/s with one row in flight).
constexpr int kRowsInFlight = 4;

// A group of row_pieces threads per row; rows of all tasks are spread over the grid, each block
// taking rows_per_block * kRowsInFlight consecutive rows a round (a task's rows ascend by token,
// so a round's rows lie near one another in a page). Tasks with pages (SM loads from the host) or
// staged inline (no pages, no ranks).
__global__ void FetchKernel(const FetchTask* __restrict__ tasks, int count, int32_t max_selected, int row_pieces,
                            int page_tokens, FetchCounters* counters) {
  __shared__ unsigned long long fetched, reused;
  if (threadIdx.x == 0) fetched = reused = 0;
  __syncthreads();
  const int rows_per_block = blockDim.x / row_pieces;
  const int slot = threadIdx.x / row_pieces, piece = threadIdx.x % row_pieces;
  const int64_t total = static_cast<int64_t>(count) * max_selected;
  const int64_t round = static_cast<int64_t>(rows_per_block) * kRowsInFlight;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * round + slot; first < total;
       first += static_cast<int64_t>(gridDim.x) * round) {
    if (slot >= rows_per_block) break;
    const uint4* src[kRowsInFlight];
    uint4* dst[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      src[u] = nullptr;
      const int64_t r = first + static_cast<int64_t>(u) * rows_per_block;
      if (r >= total) continue;
      const FetchTask& t = tasks[r / max_selected];
      const int i = static_cast<int>(r % max_selected);
      if (i >= t.n_selected) continue;
      const int32_t token = t.selected[i];
      if (token == kNoToken) continue;  // the adaptive budget's padding: no row
      const int at = Find(t.resident, t.resident_count ? *t.resident_count : t.n_resident, token);
      if (at < 0 && t.pages == nullptr) {  // the staged fetch put this row into out_rows already
        if (piece == 0) atomicAdd(&fetched, 1ull);
        continue;
      }
      const int32_t resident_row = at >= 0 && t.resident_slots ? t.resident_slots[at] : at;
      src[u] = at >= 0 ? reinterpret_cast<const uint4*>(t.resident_rows) + static_cast<int64_t>(resident_row) * row_pieces
                       : HostRow(t.pages, page_tokens, t.kv_head, token, row_pieces);
      dst[u] = reinterpret_cast<uint4*>(t.out_rows) + static_cast<int64_t>(i) * row_pieces;
      if (piece == 0) atomicAdd(at >= 0 ? &reused : &fetched, 1ull);
    }
    uint4 value[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (src[u]) value[u] = src[u][piece];
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (src[u]) dst[u][piece] = value[u];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && counters) {
    if (fetched) atomicAdd(&counters->fetched, fetched);
    if (reused) atomicAdd(&counters->reused, reused);
  }
}

// FetchKernel for pages of int8 rows (int8_rows.cuh): a group of `width` lanes per row (a power of
// two >= head_dim / 8, a lane per 16 codes), 32 / width rows a warp, kRowsInFlight rows a group at
// once. A miss reads its lane's 16 codes from the host page (the group's lane 0 also the scales)
// and writes 16 fp16 values; a hit copies the same 32 bytes of the resident fp16 row. Loops are
// uniform over the warp (the scales are shuffled within the group).
__global__ void FetchInt8Kernel(const FetchTask* __restrict__ tasks, int count, int32_t max_selected, int head_dim,
                                int width, int page_tokens, FetchCounters* counters) {
  __shared__ unsigned long long fetched, reused;
  if (threadIdx.x == 0) fetched = reused = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32, group = lane / width, part = lane % width;
  const int rows_per_warp = 32 / width, parts = head_dim / int8_rows::kValuesPerPiece * 2;  // code pieces a row
  const int half_parts = parts / 2;
  const int64_t row_bytes = int8_rows::StoredRowBytes(head_dim);
  const int64_t total = static_cast<int64_t>(count) * max_selected;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t round = static_cast<int64_t>(rows_per_warp) * kRowsInFlight;
  for (int64_t base = warp * round; base < total; base += warps * round) {
    const uint8_t* host[kRowsInFlight];   // a miss: the stored row
    const uint4* device[kRowsInFlight];   // a hit: the resident fp16 row
    uint4* dst[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      host[u] = nullptr, device[u] = nullptr;
      const int64_t r = base + static_cast<int64_t>(u) * rows_per_warp + group;
      if (r >= total) continue;
      const FetchTask& t = tasks[r / max_selected];
      const int i = static_cast<int>(r % max_selected);
      if (i >= t.n_selected) continue;
      const int32_t token = t.selected[i];
      if (token == kNoToken) continue;
      const int at = Find(t.resident, t.resident_count ? *t.resident_count : t.n_resident, token);
      if (at < 0 && t.pages == nullptr) {  // the staged fetch put this (fp16) row into out_rows already
        if (part == 0) atomicAdd(&fetched, 1ull);
        continue;
      }
      if (at >= 0) {
        const int32_t resident_row = t.resident_slots ? t.resident_slots[at] : at;
        device[u] = reinterpret_cast<const uint4*>(t.resident_rows) + static_cast<int64_t>(resident_row) * 2 * parts;
      } else {
        host[u] = StoredHostRow(t.pages, page_tokens, t.kv_head, token, row_bytes);
      }
      dst[u] = reinterpret_cast<uint4*>(t.out_rows) + static_cast<int64_t>(i) * 2 * parts;
      if (part == 0) atomicAdd(at >= 0 ? &reused : &fetched, 1ull);
    }
    uint4 first[kRowsInFlight], second[kRowsInFlight];
    uint32_t scales[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      scales[u] = 0;
      if (part >= parts) continue;
      if (device[u]) {
        first[u] = device[u][2 * part];
        second[u] = device[u][2 * part + 1];
      } else if (host[u]) {
        first[u] = reinterpret_cast<const uint4*>(host[u])[part];
        if (part == 0) scales[u] = *reinterpret_cast<const uint32_t*>(host[u] + 2 * head_dim);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const uint32_t both = __shfl_sync(0xffffffffu, scales[u], group * width);  // K scale low, V scale high
      if (part >= parts || !(device[u] || host[u])) continue;
      if (host[u]) {
        const auto scale = static_cast<unsigned short>(part < half_parts ? both & 0xffffu : both >> 16);
        int8_rows::DecodePiece(first[u], scale, &first[u], &second[u]);
      }
      dst[u][2 * part] = first[u];
      dst[u][2 * part + 1] = second[u];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && counters) {
    if (fetched) atomicAdd(&counters->fetched, fetched);
    if (reused) atomicAdd(&counters->reused, reused);
  }
}

// A thread per slot of every task (ListMissedRows).
__global__ void ListMissedKernel(const FetchTask* __restrict__ tasks, int count, int32_t stride, int32_t* missed) {
  const int64_t total = static_cast<int64_t>(count) * stride;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < total;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const FetchTask& t = tasks[s / stride];
    const int i = static_cast<int>(s % stride);
    if (i >= t.n_selected) continue;
    const int32_t token = t.selected[i];
    const int at = token == kNoToken ? -1 : Find(t.resident, t.resident_count ? *t.resident_count : t.n_resident, token);
    missed[s] = token == kNoToken ? kNoToken : at >= 0 ? -2 - at : token;
  }
}

// One thread per 16-byte piece of a row: K pieces first, then V.
__global__ void WriteKernel(const WriteTask* __restrict__ tasks, int count, int32_t max_rows, int half_pieces,
                            int page_tokens) {
  const int row_pieces = 2 * half_pieces;
  const int64_t total = static_cast<int64_t>(count) * max_rows * row_pieces;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < total;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = p / row_pieces;
    const int piece = static_cast<int>(p - row * row_pieces);
    const WriteTask& t = tasks[row / max_rows];
    const int32_t i = static_cast<int32_t>(row % max_rows);
    if (i >= t.n) continue;
    const bool value = piece >= half_pieces;
    const uint4* src = reinterpret_cast<const uint4*>((value ? t.values : t.keys) + static_cast<int64_t>(i) * t.stride);
    uint4* dst = const_cast<uint4*>(HostRow(t.pages, page_tokens, t.kv_head, t.first_token + i, row_pieces));
    dst[piece] = src[piece - (value ? half_pieces : 0)];
  }
}

// WriteKernel for pages of int8 rows (int8_rows.cuh): a group of 2 x half_width lanes per row, the
// K lanes then the V lanes (half_width a power of two >= head_dim / 16, a lane per 16 values), 32
// / (2 x half_width) rows a warp. Each half's lanes agree on its scale by shuffles; each lane
// stores its 16 codes, and the K half's lane 0 the row's tail (both scales, then zeros). Loops are
// uniform over the warp.
__global__ void WriteInt8Kernel(const WriteTask* __restrict__ tasks, int count, int32_t max_rows, int head_dim,
                                int half_width, int page_tokens) {
  const int lane = threadIdx.x % 32, row_width = 2 * half_width, rows_per_warp = 32 / row_width;
  const int in_row = lane % row_width, part = in_row % half_width;
  const bool value = in_row >= half_width;
  const int half_parts = int8_rows::HalfPieces(head_dim);
  const int64_t row_bytes = int8_rows::StoredRowBytes(head_dim);
  const int64_t total = static_cast<int64_t>(count) * max_rows;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t base = warp * rows_per_warp; base < total; base += warps * rows_per_warp) {
    const int64_t row = base + lane / row_width;
    const WriteTask* t = nullptr;
    int32_t i = 0;
    if (row < total) {
      t = &tasks[row / max_rows];
      i = static_cast<int32_t>(row % max_rows);
      if (i >= t->n) t = nullptr;
    }
    const bool has = t != nullptr && part < half_parts;
    uint4 first = make_uint4(0, 0, 0, 0), second = first;
    if (has) {
      const uint4* src =
          reinterpret_cast<const uint4*>((value ? t->values : t->keys) + static_cast<int64_t>(i) * t->stride) + 2 * part;
      first = src[0];
      second = src[1];
    }
    uint4 codes;
    const uint32_t scale = int8_rows::EncodePiece(first, second, has, half_width, &codes);
    const uint32_t value_scale = __shfl_sync(0xffffffffu, scale, (lane / row_width) * row_width + half_width);
    if (t == nullptr) continue;
    uint8_t* dst = StoredHostRow(t->pages, page_tokens, t->kv_head, t->first_token + i, row_bytes);
    if (has) reinterpret_cast<uint4*>(dst + (value ? head_dim : 0))[part] = codes;
    if (in_row == 0) *reinterpret_cast<uint4*>(dst + 2 * head_dim) = make_uint4(scale | value_scale << 16, 0, 0, 0);
  }
}

static_assert(kMaxCacheRows <= 0x7fff, "cache positions, slots and their scans are int16 in shared memory");

// Dynamic shared memory of one task's update: kept_before [capacity + 1] and free_slots
// [capacity] (int16), then flags [capacity] (bytes).
constexpr size_t CacheUpdateSharedBytes(int capacity) { return 2 * (size_t(capacity) + 1) + 3 * size_t(capacity); }

// flags[o] of old entry o (passes 1 to 4).
constexpr uint8_t kSelectedAgain = 1, kStays = 2;

// An entry's recency as one unsigned key: later use first, then higher token (row_cache.h).
__device__ uint64_t RecencyKey(int32_t used, int32_t token) {
  return uint64_t{uint32_t(used) ^ 0x80000000u} << 32 | (uint32_t(token) ^ 0x80000000u);
}

// The keep-th largest recency key among the old entries not selected again, of which there are
// more than keep > 0 (KthLargestKey: keys are distinct, as tokens are, so exactly the `keep` most
// recent of those entries have a key at or above it). All kThreads threads call it.
__device__ uint64_t KeepThreshold(const CacheUpdateTask& t, int32_t n_old, const uint8_t* flags, int32_t keep) {
  return KthLargestKey(n_old, keep, [&](int32_t o, uint64_t* key) {
    if (flags[o] & kSelectedAgain) return false;
    *key = RecencyKey(t.old_used[o], t.old_tokens[o]);
    return true;
  });
}

// Block b updates task b's cache (CacheUpdateTask) in six passes:
//   1. which old entries are selected again (they keep their slots);
//   2. which others stay: all if they fit in `keep`, else the `keep` most recent (KeepThreshold);
//   3. scans: the staying entries before each old entry (kept_before), and the free slots in
//      order: those of the entries that neither stay nor are selected, then those past the old
//      count (free_slots);
//   4. each staying entry takes its place in the merged ascending order (staying entries before
//      it plus selected tokens below it), with its use mark and slot;
//   5. each selected token takes its place (its index plus the staying entries below it): a hit
//      keeps its old slot, the m-th miss takes the m-th free slot; the slots left over follow the
//      new count;
//   6. the missed rows are copied into their slots, 16-byte pieces, consecutive threads
//      consecutive pieces. Nothing else moves.
// `staged_head_dim` > 0: ranked (staged) rows are stored int8 rows of that head_dim (int8_rows.cuh),
// decoded into the cache's fp16 rows in pass 6; 0: they are fp16 rows, copied.
__global__ void UpdateCacheKernel(const CacheUpdateTask* __restrict__ tasks, int row_pieces, int staged_head_dim,
                                  FetchCounters* counters) {
  // The block's task in shared memory: read through a reference to global memory, its fields
  // would be loaded again after the block's global stores.
  const CacheUpdateTask& t = TaskOfBlock(tasks, blockIdx.x);
  const int32_t capacity = t.capacity;
  extern __shared__ int16_t shared[];
  int16_t* kept_before = shared;                      // [capacity + 1]
  int16_t* free_slots = kept_before + capacity + 1;   // [capacity]
  // [capacity]: old entry o's kSelectedAgain | kStays in passes 1-4; from pass 5, whether
  // selected token i is a miss.
  uint8_t* flags = reinterpret_cast<uint8_t*>(free_slots + capacity);
  __shared__ int unselected;
  const int32_t n_old = min(*t.old_count, capacity);
  const int32_t n_selected = Below(t.selected, t.n_selected, kNoToken);  // without the budget's padding
  const int32_t keep = max(0, capacity - n_selected);
  if (threadIdx.x == 0) unselected = 0;
  __syncthreads();
  int others = 0;
  for (int32_t o = threadIdx.x; o < n_old; o += blockDim.x) {
    const bool again = Find(t.selected, n_selected, t.old_tokens[o]) >= 0;
    flags[o] = again ? kSelectedAgain : 0;
    others += again ? 0 : 1;
  }
  if (others) atomicAdd(&unselected, others);
  __syncthreads();
  const bool all_stay = unselected <= keep;  // uniform
  const uint64_t threshold = keep == 0 || all_stay ? 0 : KeepThreshold(t, n_old, flags, keep);
  for (int32_t o = threadIdx.x; o < n_old; o += blockDim.x) {
    if (keep > 0 && !(flags[o] & kSelectedAgain) && (all_stay || RecencyKey(t.old_used[o], t.old_tokens[o]) >= threshold)) {
      flags[o] |= kStays;
    }
  }
  __syncthreads();
  {  // 3. Thread i scans its run of consecutive entries; the last thread's run ends the total.
    const int32_t run = (n_old + kThreads - 1) / kThreads;
    const int32_t first = min(n_old, static_cast<int32_t>(threadIdx.x) * run), last = min(n_old, first + run);
    int count = 0;
    for (int32_t o = first; o < last; ++o) count += flags[o] & kStays ? 1 : 0;
    int before = BlockExclusiveSum(count);
    for (int32_t o = first; o < last; ++o) {
      kept_before[o] = static_cast<int16_t>(before);
      before += flags[o] & kStays ? 1 : 0;
    }
    if (threadIdx.x == kThreads - 1) kept_before[n_old] = static_cast<int16_t>(before);
  }
  __syncthreads();
  {  // A fresh cache (no old entries) has every slot free, in order.
    const int32_t run = (capacity + kThreads - 1) / kThreads;
    const int32_t first = min(capacity, static_cast<int32_t>(threadIdx.x) * run), last = min(capacity, first + run);
    auto is_free = [&](int32_t c) { return c >= n_old || !(flags[c] & (kStays | kSelectedAgain)); };
    int count = 0;
    for (int32_t c = first; c < last; ++c) count += is_free(c) ? 1 : 0;
    int before = BlockExclusiveSum(count);
    for (int32_t c = first; c < last; ++c) {
      if (is_free(c)) free_slots[before++] = static_cast<int16_t>(n_old == 0 ? c : t.old_slots[c]);
    }
  }
  for (int32_t o = threadIdx.x; o < n_old; o += blockDim.x) {
    if (!(flags[o] & kStays)) continue;
    const int32_t token = t.old_tokens[o];
    const int32_t pos = kept_before[o] + Below(t.selected, n_selected, token);
    t.new_tokens[pos] = token;
    t.new_used[pos] = t.old_used[o];
    t.new_slots[pos] = t.old_slots[o];
  }
  __syncthreads();  // flags now name the selection's misses; the scan's sums are written again
  int hits = 0;
  {
    const int32_t run = (n_selected + kThreads - 1) / kThreads;
    const int32_t first = min(n_selected, static_cast<int32_t>(threadIdx.x) * run), last = min(n_selected, first + run);
    auto old_index = [&](int32_t i) { return Below(t.old_tokens, n_old, t.selected[i]); };
    auto is_hit = [&](int32_t i, int32_t o) { return o < n_old && t.old_tokens[o] == t.selected[i]; };
    int misses = 0;
    for (int32_t i = first; i < last; ++i) misses += is_hit(i, old_index(i)) ? 0 : 1;
    int all_misses = 0;
    int miss = BlockExclusiveSum(misses, &all_misses);  // this run's first miss's free slot
    for (int32_t i = first; i < last; ++i) {
      const int32_t o = old_index(i), pos = i + kept_before[o];
      const bool hit = is_hit(i, o);
      const int32_t slot = hit ? t.old_slots[o] : free_slots[miss++];
      t.new_tokens[pos] = t.selected[i];
      t.new_used[pos] = t.now;
      t.new_slots[pos] = slot;
      t.selected_slots[i] = slot;
      flags[i] = hit ? 0 : 1;
      hits += hit ? 1 : 0;
    }
    for (int32_t i = n_selected + threadIdx.x; i < t.n_selected; i += blockDim.x) t.selected_slots[i] = -1;
    const int32_t new_count = kept_before[n_old] + n_selected;
    if (threadIdx.x == 0) *t.new_count = new_count;
    for (int32_t j = new_count + threadIdx.x; j < capacity; j += blockDim.x) {
      t.new_tokens[j] = kNoToken;
      t.new_slots[j] = free_slots[all_misses + j - new_count];
    }
  }
  if (counters && t.staged_rank) {
    __shared__ int block_hits;
    if (threadIdx.x == 0) block_hits = 0;
    __syncthreads();
    if (hits) atomicAdd(&block_hits, hits);
    __syncthreads();
    if (threadIdx.x == 0) {
      if (block_hits) atomicAdd(&counters->reused, static_cast<unsigned long long>(block_hits));
      if (n_selected > block_hits) atomicAdd(&counters->fetched, static_cast<unsigned long long>(n_selected - block_hits));
    }
  }
  __syncthreads();  // the misses' flags and slots
  const uint4* sel_rows = reinterpret_cast<const uint4*>(t.selected_rows);
  const int32_t* rank = t.staged_rank;  // a missed row's place among the staged rows, or null
  uint4* rows = reinterpret_cast<uint4*>(t.rows);
  if (rank && staged_head_dim > 0) {  // stored int8 rows: a thread per 16 codes, decoded
    const int parts = 2 * int8_rows::HalfPieces(staged_head_dim), half_parts = parts / 2;
    const int64_t row_bytes = int8_rows::StoredRowBytes(staged_head_dim);
    const auto* staged = reinterpret_cast<const uint8_t*>(t.selected_rows);
    for (int32_t p = threadIdx.x; p < n_selected * parts; p += kThreads) {
      const int32_t i = p / parts, part = p - i * parts;
      if (!flags[i]) continue;
      const uint8_t* stored = staged + int64_t{rank[i]} * row_bytes;
      const auto scale = *reinterpret_cast<const unsigned short*>(stored + 2 * staged_head_dim + (part < half_parts ? 0 : 2));
      uint4 first, second;
      int8_rows::DecodePiece(reinterpret_cast<const uint4*>(stored)[part], scale, &first, &second);
      uint4* to = rows + int64_t{t.selected_slots[i]} * row_pieces + 2 * part;
      to[0] = first;
      to[1] = second;
    }
    return;
  }
  const int32_t pieces = n_selected * row_pieces;
  constexpr int kInFlight = 4;  // loads per thread before its stores
  for (int32_t base = threadIdx.x; base < pieces; base += kInFlight * kThreads) {
    uint4 piece[kInFlight];
    int64_t to[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int32_t p = base + u * kThreads, i = p / row_pieces, in_row = p - i * row_pieces;
      to[u] = -1;
      if (p >= pieces || !flags[i]) continue;
      to[u] = int64_t{t.selected_slots[i]} * row_pieces + in_row;
      piece[u] = sel_rows[int64_t{rank ? rank[i] : i} * row_pieces + in_row];
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (to[u] >= 0) rows[to[u]] = piece[u];
    }
  }
}

}  // namespace

Status FetchRows(const FetchTask* tasks, int n_tasks, int head_dim, HostRowFormat page_rows, int page_tokens,
                 int max_blocks, FetchCounters* counters, void* stream, DecodePlan* plan) {
  if (head_dim <= 0 || head_dim % 8 != 0 || max_blocks <= 0 || n_tasks < 0) {
    return Status::InvalidArgument("fetch: head_dim must be a positive multiple of 8, blocks positive");
  }
  SPECACHE_RETURN_IF_ERROR(CheckKernelRows(page_rows, head_dim).WithContext("fetch"));
  const bool int8 = page_rows == HostRowFormat::kInt8;
  if (page_tokens <= 0 && std::any_of(tasks, tasks + n_tasks, [](const FetchTask& t) { return t.pages != nullptr; })) {
    return Status::InvalidArgument("fetch: page_tokens must be positive to read pages");
  }
  const int row_pieces = 2 * head_dim * static_cast<int>(sizeof(Half)) / 16;
  if (row_pieces > kThreads) return Status::InvalidArgument("fetch: rows wider than a block");
  // The copy-engine route's ranked rows are placed by the cache update (UpdateRowCaches).
  if (std::any_of(tasks, tasks + n_tasks, [](const FetchTask& t) { return t.staged_rank != nullptr; })) {
    return Status::InvalidArgument("fetch: tasks with staged ranks go to the cache update, not FetchRows");
  }
  int32_t max_selected = 0;
  for (int i = 0; i < n_tasks; ++i) max_selected = std::max(max_selected, tasks[i].n_selected);
  if (max_selected == 0) return Status::Ok();
  const int64_t rows = int64_t{n_tasks} * max_selected;
  const int width = int8_rows::GroupWidth(2 * int8_rows::HalfPieces(head_dim));  // int8: lanes a row
  const int64_t rows_per_round = int64_t{int8 ? (kThreads / 32) * (32 / width) : kThreads / row_pieces} * kRowsInFlight;
  const int blocks = static_cast<int>(std::min<int64_t>(max_blocks, (rows + rows_per_round - 1) / rows_per_round));
  auto* s = static_cast<cudaStream_t>(stream);
  return WithDeviceTasks(plan, tasks, n_tasks, s, "fetch kernel", [&](const FetchTask* on_device) {
    if (int8) {
      FetchInt8Kernel<<<blocks, kThreads, 0, s>>>(on_device, n_tasks, max_selected, head_dim, width, page_tokens, counters);
    } else {
      FetchKernel<<<blocks, kThreads, 0, s>>>(on_device, n_tasks, max_selected, row_pieces, page_tokens, counters);
    }
  });
}

Status ListMissedRows(const FetchTask* tasks, int n_tasks, int32_t stride, int32_t* missed, void* stream,
                      DecodePlan* plan) {
  if (n_tasks < 0 || stride < 0) return Status::InvalidArgument("list missed rows: negative count");
  for (int i = 0; i < n_tasks; ++i) {
    if (tasks[i].n_selected > stride) return Status::InvalidArgument("list missed rows: stride below a selection");
  }
  const int64_t slots = int64_t{n_tasks} * stride;
  if (slots == 0) return Status::Ok();
  const int blocks = static_cast<int>(std::min<int64_t>(1024, (slots + kThreads - 1) / kThreads));
  auto* s = static_cast<cudaStream_t>(stream);
  return WithDeviceTasks(plan, tasks, n_tasks, s, "list missed rows", [&](const FetchTask* on_device) {
    ListMissedKernel<<<blocks, kThreads, 0, s>>>(on_device, n_tasks, stride, missed);
  });
}

Status WriteRows(const WriteTask* tasks, int n_tasks, int head_dim, HostRowFormat page_rows, int page_tokens,
                 void* stream, DecodePlan* plan) {
  if (head_dim <= 0 || head_dim % 8 != 0 || page_tokens <= 0 || n_tasks < 0) {
    return Status::InvalidArgument("write: head_dim must be a positive multiple of 8, page_tokens positive");
  }
  SPECACHE_RETURN_IF_ERROR(CheckKernelRows(page_rows, head_dim).WithContext("write"));
  const bool int8 = page_rows == HostRowFormat::kInt8;
  const int half_pieces = head_dim * static_cast<int>(sizeof(Half)) / 16;
  int32_t max_rows = 0;
  for (int i = 0; i < n_tasks; ++i) {
    if (tasks[i].stride % 8 != 0) return Status::InvalidArgument("write: row stride must keep 16-byte alignment");
    max_rows = std::max(max_rows, tasks[i].n);
  }
  if (max_rows == 0) return Status::Ok();
  auto* s = static_cast<cudaStream_t>(stream);
  if (int8) {
    const int half_width = int8_rows::GroupWidth(int8_rows::HalfPieces(head_dim));
    const int64_t rows = int64_t{n_tasks} * max_rows, rows_per_block = (kThreads / 32) * (32 / (2 * half_width));
    const int blocks = static_cast<int>(std::min<int64_t>(1024, (rows + rows_per_block - 1) / rows_per_block));
    return WithDeviceTasks(plan, tasks, n_tasks, s, "write kernel", [&](const WriteTask* on_device) {
      WriteInt8Kernel<<<blocks, kThreads, 0, s>>>(on_device, n_tasks, max_rows, head_dim, half_width, page_tokens);
    });
  }
  const int64_t pieces = int64_t{n_tasks} * max_rows * 2 * half_pieces;
  const int blocks = static_cast<int>(std::min<int64_t>(1024, (pieces + kThreads - 1) / kThreads));
  return WithDeviceTasks(plan, tasks, n_tasks, s, "write kernel", [&](const WriteTask* on_device) {
    WriteKernel<<<blocks, kThreads, 0, s>>>(on_device, n_tasks, max_rows, half_pieces, page_tokens);
  });
}

Status UpdateRowCaches(const CacheUpdateTask* tasks, int n_tasks, int head_dim, HostRowFormat staged_rows,
                       FetchCounters* counters, void* stream, DecodePlan* plan) {
  if (head_dim <= 0 || head_dim % 8 != 0 || n_tasks < 0) return Status::InvalidArgument("cache update: bad head_dim");
  SPECACHE_RETURN_IF_ERROR(CheckKernelRows(staged_rows, head_dim).WithContext("cache update"));
  const bool int8 = staged_rows == HostRowFormat::kInt8;
  const int row_pieces = 2 * head_dim * static_cast<int>(sizeof(Half)) / 16;
  int32_t largest = 0;  // capacity
  for (int i = 0; i < n_tasks; ++i) {
    if (tasks[i].capacity < tasks[i].n_selected || tasks[i].capacity > kMaxCacheRows) {
      return Status::InvalidArgument("cache update: capacity below the selection or above kMaxCacheRows");
    }
    if (tasks[i].n_selected > 0 && tasks[i].selected_slots == nullptr) {
      return Status::InvalidArgument("cache update: selected_slots is required (the missed rows' slots)");
    }
    largest = std::max(largest, tasks[i].capacity);
  }
  if (n_tasks == 0) return Status::Ok();
  // The largest cache (kMaxCacheRows: ~80 KB of dynamic memory, sm_80+) with the kernel's static
  // arrays passes the 48 KB a launch gets unasked: the opt-in, once per device. Older GPUs refuse
  // it, with this error.
  static std::atomic<bool> allowed[kMaxOptInDevices] = {};
  const cudaError_t err = AllowDynamicSharedMemory(UpdateCacheKernel, CacheUpdateSharedBytes(kMaxCacheRows), allowed);
  if (err != cudaSuccess) {
    return Status::Unavailable("cache update: the shared memory of a cache of " + std::to_string(kMaxCacheRows) +
                               " rows (kMaxCacheRows, the opt-in's size): " + cudaGetErrorString(err));
  }
  auto* s = static_cast<cudaStream_t>(stream);
  return WithDeviceTasks(plan, tasks, n_tasks, s, "cache update kernel", [&](const CacheUpdateTask* on_device) {
    UpdateCacheKernel<<<n_tasks, kThreads, CacheUpdateSharedBytes(largest), s>>>(on_device, row_pieces, int8 ? head_dim : 0,
                                                                                  counters);
  });
}

}  // namespace specache::cuda
