#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "specache/cuda_fetch.h"
#include "block_select.cuh"
#include "block_task.cuh"
#include "decode_plan_slots.h"
#include "device_buffer.h"
#include "int8_rows.cuh"
#include "shared_memory_opt_in.cuh"

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

// A thread per count (SumCacheCounts), grid-strided; each warp adds its sum with one atomic.
__global__ void SumCountsKernel(const int32_t* const* __restrict__ counts, int n_caches, int per_cache,
                                unsigned long long* sum) {
  const int64_t total = static_cast<int64_t>(n_caches) * per_cache;
  long long local = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += counts[i / per_cache][i % per_cache];
  }
  for (int lanes = 16; lanes > 0; lanes /= 2) local += __shfl_down_sync(0xffffffffu, local, lanes);
  // Two's complement: the unsigned sum of the signed terms is their signed sum.
  if (threadIdx.x % 32 == 0 && local != 0) atomicAdd(sum, static_cast<unsigned long long>(local));
}

static_assert(kMaxCacheRows <= 0x7fff,
              "cache positions and slots are int16 in shared memory, and two counts of entries share an int");

// Dynamic shared memory of one task's update: free_slots [capacity] and below [capacity]
// (int16), then flags [capacity] (bytes): 5 bytes an entry, 80 KiB at kMaxCacheRows (under the
// 99 KiB a block may take on sm_86 and sm_89).
constexpr size_t CacheUpdateSharedBytes(int capacity) { return 2 * 2 * size_t(capacity) + size_t(capacity); }

// flags[o] of old entry o (passes 1 to 4).
constexpr uint8_t kSelectedAgain = 1, kStays = 2;

// What an old entry adds to pass 3's scan: kept | again << 16.
__device__ int ScanCount(uint8_t flag) { return flag & kStays ? 1 : flag & kSelectedAgain ? 1 << 16 : 0; }

// Entries a thread loads before it uses them: a batch's loads and binary searches are in flight
// together, not one entry's chain of dependent loads after another's.
constexpr int kBatch = 4;

// The cache update's blocks an SM holds at once (its launch bounds: 40 registers a thread, where
// it would take 80): a block is a chain of dependent steps (loads, searches, barriers), so the
// more of them an SM holds, the more of each other's latency they hide.
constexpr int kCacheUpdateBlocks = 6;
static_assert(kThreads == 256, "the cache update: a bin of KeepThreshold's, and a run, a thread");

// An entry's recency as one unsigned key: later use first, then higher token (row_cache.h).
__device__ uint64_t RecencyKey(int32_t used, int32_t token) {
  return uint64_t{uint32_t(used) ^ 0x80000000u} << 32 | (uint32_t(token) ^ 0x80000000u);
}

// Below (sorted_tokens.cuh) of kBatch tokens at once over the ascending list [0, n), without
// branches: every search takes the same probes (the powers of two from n's highest down), so the
// batch's loads of a probe are in flight together.
__device__ void BelowBatch(const int32_t* list, int32_t n, const int32_t (&token)[kBatch], int32_t (&at)[kBatch]) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) at[u] = 0;
  for (int32_t step = n > 0 ? int32_t{1} << (31 - __clz(n)) : 0; step > 0; step >>= 1) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (at[u] + step <= n && list[at[u] + step - 1] < token[u]) at[u] += step;
    }
  }
}

// Pass 1's sums over the block: `counts` added (two 16-bit counts, neither passing 0x7fff in all),
// the keys and-ed and or-ed (warp reductions, sm_80+). kThreads threads, all calling, once.
struct OldEntrySums {
  int counts;
  uint64_t key_and, key_or;
};
__device__ OldEntrySums SumOldEntries(OldEntrySums s) {
  __shared__ OldEntrySums warp_sums[kThreads / 32];
  const auto low = [](uint64_t x) { return static_cast<unsigned>(x); };
  const auto high = [](uint64_t x) { return static_cast<unsigned>(x >> 32); };
  s.counts = __reduce_add_sync(0xffffffffu, s.counts);
  s.key_and = uint64_t{__reduce_and_sync(0xffffffffu, high(s.key_and))} << 32 |
              __reduce_and_sync(0xffffffffu, low(s.key_and));
  s.key_or = uint64_t{__reduce_or_sync(0xffffffffu, high(s.key_or))} << 32 |
             __reduce_or_sync(0xffffffffu, low(s.key_or));
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
  __syncthreads();
  s = warp_sums[0];
  for (int w = 1; w < kThreads / 32; ++w) {
    s.counts += warp_sums[w].counts;
    s.key_and &= warp_sums[w].key_and;
    s.key_or |= warp_sums[w].key_or;
  }
  return s;
}

// The keep-th largest recency key among the old entries not selected again (those of this
// thread: [first, last)), of which there are more than keep > 0; key_and and key_or: all their
// keys and-ed and or-ed. Keys are distinct, as tokens are, so exactly the `keep` most recent of
// those entries have a key at or above it. A radix select over the key's bytes, most significant
// first (block_select.cuh's KthLargestKey), but only over the bytes in which the keys differ (a
// byte they share is the threshold's: use marks a few fetches apart and tokens below 64K differ in
// three of eight), with one __syncthreads a pass: the passes count into bins[0], [1], [2] in turn
// (bins[0] and [1] zeroed before the caller's last __syncthreads; a pass zeroes the bins of the
// pass after next once every warp has read those), and every warp reads the whole bins to find
// the byte, no thread for all. kThreads threads, all calling.
__device__ uint64_t KeepThreshold(const CacheUpdateTask& t, int32_t first, int32_t last, const uint8_t* flags,
                                  int32_t keep, uint64_t key_and, uint64_t key_or, int (*bins)[256]) {
  const uint64_t differ = key_and ^ key_or;
  uint64_t differ_bytes = 0;
  for (int shift = 0; shift < 64; shift += 8) {
    if ((differ >> shift) & 0xff) differ_bytes |= uint64_t{0xff} << shift;
  }
  uint64_t prefix = key_and & ~differ_bytes;  // the shared bytes; the others found pass by pass
  int32_t want = keep;  // the sought key is the want-th largest of the keys matching prefix's bytes above shift
  const int lane = threadIdx.x & 31;
  int pass = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    if (!((differ_bytes >> shift) & 0xff)) continue;  // uniform
    int* bin = bins[pass % 3];
    const uint64_t above = shift == 56 ? 0 : ~uint64_t{0} << (shift + 8);
    for (int32_t base = first; base < last; base += kBatch) {
      int32_t token[kBatch], used[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int32_t o = base + u;
        if (o < last) token[u] = t.old_tokens[o], used[u] = t.old_used[o];
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int32_t o = base + u;
        if (o >= last || (flags[o] & kSelectedAgain)) continue;
        const uint64_t key = RecencyKey(used[u], token[u]);
        if ((key & above) == (prefix & above)) atomicAdd(&bin[(key >> shift) & 0xff], 1);
      }
    }
    __syncthreads();
    bins[(pass + 2) % 3][threadIdx.x] = 0;
    // Lane l sums bytes 255 - 8l down to 248 - 8l; the lane where the larger keys reach `want`
    // walks its eight.
    const int4 low = reinterpret_cast<const int4*>(bin)[62 - 2 * lane];
    const int4 high = reinterpret_cast<const int4*>(bin)[63 - 2 * lane];
    const int count[8] = {high.w, high.z, high.y, high.x, low.w, low.z, low.y, low.x};
    int sum = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) sum += count[b];
    int inclusive = sum;
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    int larger = inclusive - sum, byte = 0, byte_larger = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      if (larger < want && want <= larger + count[b]) byte = 255 - 8 * lane - b, byte_larger = larger;
      larger += count[b];
    }
    const int owner = __ffs(__ballot_sync(0xffffffffu, inclusive - sum < want && want <= inclusive)) - 1;
    byte = __shfl_sync(0xffffffffu, byte, owner);
    byte_larger = __shfl_sync(0xffffffffu, byte_larger, owner);
    prefix |= uint64_t(byte) << shift;
    want -= byte_larger;
    ++pass;
  }
  return prefix;
}

// Where free slot f goes (pass 3, in order: the slots of the old entries that neither stay nor
// are selected again, then those past the old count): the f-th miss's, through free_slots, or,
// past the misses, the new list's slot new_count + f - misses, stored at once. Slots pass
// through int16, as free_slots holds them.
__device__ void PlaceFreeSlot(const CacheUpdateTask& t, int32_t f, int16_t slot, int32_t misses, int32_t new_count,
                              int16_t* free_slots) {
  if (f < misses) free_slots[f] = slot;
  else t.new_slots[new_count + f - misses] = slot;
}

// Asks for the lines of [p, p + bytes), wanted in a later pass (a hint, no load): into L2, or
// into L1 (and L2) with `l1`.
__device__ void Prefetch(const void* p, int64_t bytes, bool l1) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = at & ~uintptr_t{127}; line < at + bytes; line += 128) {
    if (l1) asm volatile("prefetch.global.L1 [%0];" ::"l"(line));
    else asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
  }
}

// Block b updates task b's cache (CacheUpdateTask) in five passes. In passes 1-3 each thread takes
// one run of consecutive slots of the list, [first, end) of [0, capacity) (so that the loads of
// the first pass need not wait for the old count), its old entries [first, last), kBatch entries'
// loads at a time:
//   1. which old entries are selected again (they keep their slots), with each entry's place in
//      the selection (below); summed over the block (one __syncthreads): the entries not selected
//      again, the selection without the budget's padding, and those entries' keys and-ed and or-ed
//      (the run's slots are asked of L1 for pass 3);
//   2. which others stay: all if they fit in `keep`, else the `keep` most recent (KeepThreshold:
//      a pass, one __syncthreads, for each byte the keys differ in);
//   3. one scan of two counts: the staying and the selected-again entries before each old entry
//      (packed kept | again << 16, ScanCount; each run's first in run_before). With it each old
//      entry takes its place in the merged ascending order: a staying one its kept entries before
//      plus the selected tokens below it, with its use mark and slot; a selected-again one (a hit)
//      its selection index plus the kept entries before, with `now` and its old slot (also
//      selected_slots); any other one's slot is free slot f = its index less both counts before
//      it, as are the slots past the old count (PlaceFreeSlot: the f-th miss's, or, past the
//      misses, at once the new list's after the new count). The new count, the kNoToken past it
//      and the padding's -1 slots too;
//   4. each missed selected token takes its place (its index plus the kept entries below it) and
//      the m-th miss the m-th free slot, m its index less the hits below it (both counts before its
//      place in the old list: its run's run_before and the flags of the run up to there); its row
//      is asked of L2 for pass 5;
//   5. the missed rows are copied into their slots, 16-byte pieces, consecutive threads
//      consecutive pieces of the misses in order, kBatch loads in flight a thread. Nothing else
//      moves.
// `staged_head_dim` > 0: ranked (staged) rows are stored int8 rows of that head_dim (int8_rows.cuh),
// decoded into the cache's fp16 rows in pass 5; 0: they are fp16 rows, copied.
// The old list ascends without repeats to its count, and so does the selection to its padding
// (CacheUpdateTask): a selected token found in the old list is the same pair from either side.
__global__ void __launch_bounds__(kThreads, kCacheUpdateBlocks)
    UpdateCacheKernel(const CacheUpdateTask* __restrict__ tasks, int row_pieces, int staged_head_dim,
                      FetchCounters* counters) {
  // The block's task in shared memory: read through a reference to global memory, its fields
  // would be loaded again after the block's global stores.
  const CacheUpdateTask& t = TaskOfBlock(tasks, blockIdx.x);
  const int32_t capacity = t.capacity;
  extern __shared__ int16_t shared[];
  int16_t* free_slots = shared;  // [capacity], pass 3 on
  // [capacity]: old entry o's place in the selection (Below) in passes 1-3; in passes 4-5 the
  // selection index of miss m.
  int16_t* below = free_slots + capacity;
  uint8_t* flags = reinterpret_cast<uint8_t*>(below + capacity);  // [capacity] kSelectedAgain | kStays
  __shared__ __align__(16) int bins[3][256];                      // KeepThreshold's
  __shared__ int run_before[kThreads];                            // pass 3's scan at each run's start
  const int32_t n_old = min(*t.old_count, capacity);
  const int32_t run = (capacity + kThreads - 1) / kThreads;
  const int32_t first = min(capacity, static_cast<int32_t>(threadIdx.x) * run), end = min(capacity, first + run);
  OldEntrySums sums{0, ~uint64_t{0}, 0};  // counts: not selected again | selection's tokens << 16
  if (first < end) Prefetch(t.old_slots + first, int64_t{end - first} * 4, true);  // pass 3's
  for (int32_t base = first; base < end; base += kBatch) {  // 1.
    int32_t token[kBatch], used[kBatch], at[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t o = min(base + u, end - 1);
      token[u] = t.old_tokens[o], used[u] = t.old_used[o];
    }
    // Over the padded selection: its padding (kNoToken) lies above every token.
    BelowBatch(t.selected, t.n_selected, token, at);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t o = base + u;
      if (o >= end || o >= n_old) continue;
      const bool again = token[u] < kNoToken && at[u] < t.n_selected && t.selected[at[u]] == token[u];
      flags[o] = again ? kSelectedAgain : 0;
      below[o] = static_cast<int16_t>(at[u]);
      if (again) continue;
      const uint64_t key = RecencyKey(used[u], token[u]);
      sums.counts += 1, sums.key_and &= key, sums.key_or |= key;
    }
  }
  for (int32_t i = threadIdx.x; i < t.n_selected; i += kThreads) sums.counts += t.selected[i] < kNoToken ? 1 << 16 : 0;
  bins[0][threadIdx.x] = bins[1][threadIdx.x] = 0;
  sums = SumOldEntries(sums);
  const int32_t last = max(first, min(end, n_old));
  const int32_t unselected = sums.counts & 0xffff;
  // Without the budget's padding (Below(selected, n_selected, kNoToken): the selection ascends).
  const int32_t n_selected = sums.counts >> 16;
  const int32_t keep = max(0, capacity - n_selected);
  const bool all_stay = unselected <= keep;  // uniform
  const bool ranked = keep > 0 && !all_stay;
  const uint64_t threshold = ranked ? KeepThreshold(t, first, last, flags, keep, sums.key_and, sums.key_or, bins) : 0;
  int counts = 0;  // 3. kept | again << 16 in this thread's run
  for (int32_t base = first; base < last; base += kBatch) {
    int32_t token[kBatch], used[kBatch];
    if (ranked) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int32_t o = min(base + u, last - 1);
        token[u] = t.old_tokens[o], used[u] = t.old_used[o];
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t o = base + u;
      if (o >= last) continue;
      uint8_t flag = flags[o];
      if (keep > 0 && !(flag & kSelectedAgain) && (all_stay || RecencyKey(used[u], token[u]) >= threshold)) {
        flags[o] = flag |= kStays;
      }
      counts += ScanCount(flag);
    }
  }
  int total = 0;
  int running = BlockExclusiveSum(counts, &total);
  run_before[threadIdx.x] = running;
  const int32_t new_count = (total & 0xffff) + n_selected, misses = n_selected - (total >> 16);
  for (int32_t base = first; base < end; base += kBatch) {
    int32_t token[kBatch], used[kBatch], slot[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t o = min(base + u, end - 1);
      token[u] = t.old_tokens[o], used[u] = t.old_used[o], slot[u] = t.old_slots[o];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t o = base + u;
      if (o >= end) continue;
      const int32_t kept_before = running & 0xffff, again_before = running >> 16;
      // Past the old count every slot is free (a fresh cache's in order); the counts before are the totals.
      const uint8_t flag = o < n_old ? flags[o] : 0;
      if (flag & kStays) {
        const int32_t pos = kept_before + min(static_cast<int32_t>(below[o]), n_selected);
        t.new_tokens[pos] = token[u];
        t.new_used[pos] = used[u];
        t.new_slots[pos] = slot[u];
        running += 1;
      } else if (flag & kSelectedAgain) {
        const int32_t i = below[o], pos = i + kept_before;
        t.new_tokens[pos] = token[u];
        t.new_used[pos] = t.now;
        t.new_slots[pos] = slot[u];
        t.selected_slots[i] = slot[u];
        running += 1 << 16;
      } else {
        const auto free_slot = static_cast<int16_t>(n_old == 0 ? o : slot[u]);
        PlaceFreeSlot(t, o - kept_before - again_before, free_slot, misses, new_count, free_slots);
      }
    }
  }
  for (int32_t j = new_count + threadIdx.x; j < capacity; j += kThreads) t.new_tokens[j] = kNoToken;
  for (int32_t i = n_selected + threadIdx.x; i < t.n_selected; i += kThreads) t.selected_slots[i] = -1;
  if (threadIdx.x == 0) {
    *t.new_count = new_count;
    if (counters && t.staged_rank) {
      const int32_t hits = total >> 16;
      if (hits) atomicAdd(&counters->reused, static_cast<unsigned long long>(hits));
      if (misses > 0) atomicAdd(&counters->fetched, static_cast<unsigned long long>(misses));
    }
  }
  __syncthreads();  // run_before and free_slots; below's old entries are read
  const int32_t* rank = t.staged_rank;  // a missed row's place among the staged rows, or null
  const bool decode = rank && staged_head_dim > 0;  // stored int8 rows, else fp16 rows
  const int64_t source_bytes = decode ? int8_rows::StoredRowBytes(staged_head_dim) : int64_t{16} * row_pieces;
  const auto* sources = reinterpret_cast<const uint8_t*>(t.selected_rows);
  int16_t* miss_selected = below;  // [misses]
  for (int32_t base = threadIdx.x; base < n_selected; base += kBatch * kThreads) {  // 4.
    int32_t token[kBatch], source[kBatch], at[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t i = min(base + u * kThreads, n_selected - 1);
      token[u] = t.selected[i];
      source[u] = rank ? rank[i] : i;
    }
    BelowBatch(t.old_tokens, n_old, token, at);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t i = base + u * kThreads, o = at[u];
      if (i >= n_selected || (o < n_old && t.old_tokens[o] == token[u])) continue;  // a hit: placed in pass 3
      int packed = total;  // kept | again << 16 before old entry o
      if (o < n_old) {
        const int32_t from = o / run * run;
        packed = run_before[o / run];
        for (int32_t q = from; q < o; ++q) packed += ScanCount(flags[q]);
      }
      const int32_t m = i - (packed >> 16), pos = i + (packed & 0xffff);
      const int32_t slot = free_slots[m];
      t.new_tokens[pos] = token[u];
      t.new_used[pos] = t.now;
      t.new_slots[pos] = slot;
      t.selected_slots[i] = slot;
      miss_selected[m] = static_cast<int16_t>(i);
      Prefetch(sources + source[u] * source_bytes, source_bytes, false);
    }
  }
  __syncthreads();  // the misses' selection indices
  uint4* rows = reinterpret_cast<uint4*>(t.rows);
  if (decode) {  // 5. stored int8 rows: a thread per 16 codes, decoded
    const int parts = 2 * int8_rows::HalfPieces(staged_head_dim), half_parts = parts / 2;
    const int32_t pieces = misses * parts;
    for (int32_t base = threadIdx.x; base < pieces; base += kBatch * kThreads) {
      uint4 codes[kBatch];
      unsigned short scale[kBatch];
      int32_t to[kBatch];  // the piece's first vector in rows, or -1
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int32_t p = base + u * kThreads, m = p / parts, part = p - m * parts;
        to[u] = -1;
        if (p >= pieces) continue;
        const uint8_t* stored = sources + int64_t{rank[miss_selected[m]]} * source_bytes;
        scale[u] = *reinterpret_cast<const unsigned short*>(stored + 2 * staged_head_dim + (part < half_parts ? 0 : 2));
        codes[u] = reinterpret_cast<const uint4*>(stored)[part];
        to[u] = free_slots[m] * row_pieces + 2 * part;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (to[u] < 0) continue;
        uint4 first_half, second_half;
        int8_rows::DecodePiece(codes[u], scale[u], &first_half, &second_half);
        rows[to[u]] = first_half;
        rows[to[u] + 1] = second_half;
      }
    }
    return;
  }
  const uint4* sel_rows = reinterpret_cast<const uint4*>(t.selected_rows);
  const int32_t pieces = misses * row_pieces;
  for (int32_t base = threadIdx.x; base < pieces; base += kBatch * kThreads) {
    uint4 piece[kBatch];
    int32_t to[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int32_t p = base + u * kThreads, m = p / row_pieces, in_row = p - m * row_pieces;
      to[u] = -1;
      if (p >= pieces) continue;
      const int32_t i = miss_selected[m];
      to[u] = free_slots[m] * row_pieces + in_row;
      piece[u] = sel_rows[int64_t{rank ? rank[i] : i} * row_pieces + in_row];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
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

Status SumCacheCounts(const int32_t* const* counts, int n_caches, int per_cache, int64_t* sum,
                      CountSumScratch scratch) {
  if (sum == nullptr) return Status::InvalidArgument("sum of cache counts: no output");
  *sum = 0;
  if (n_caches < 0 || per_cache < 0) return Status::InvalidArgument("sum of cache counts: negative counts");
  if (n_caches == 0 || per_cache == 0) return Status::Ok();
  if ((scratch.lists == nullptr) != (scratch.total == nullptr)) {
    return Status::InvalidArgument("sum of cache counts: scratch needs both its lists and its total");
  }
  Buffer<const int32_t*> own_lists;
  Buffer<unsigned long long> own_total;
  if (scratch.lists == nullptr) {
    SPECACHE_RETURN_IF_ERROR(own_lists.Reserve(static_cast<size_t>(n_caches)));
    SPECACHE_RETURN_IF_ERROR(own_total.Reserve(1));
    scratch = {own_lists.get(), own_total.get()};
  }
  SPECACHE_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(scratch.lists, counts, static_cast<size_t>(n_caches) * sizeof(counts[0]), cudaMemcpyHostToDevice),
      "sum of cache counts: the lists"));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemset(scratch.total, 0, sizeof(unsigned long long)), "sum of cache counts"));
  const int64_t n = int64_t{n_caches} * per_cache;
  const int blocks = static_cast<int>(std::min<int64_t>(1024, (n + kThreads - 1) / kThreads));
  SumCountsKernel<<<blocks, kThreads>>>(scratch.lists, n_caches, per_cache, scratch.total);
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "sum of cache counts kernel"));
  unsigned long long got = 0;
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(&got, scratch.total, sizeof(got), cudaMemcpyDeviceToHost),
                                      "sum of cache counts: the result"));
  *sum = static_cast<int64_t>(got);
  return Status::Ok();
}

}  // namespace specache::cuda
