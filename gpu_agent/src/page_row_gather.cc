#include "page_row_gather.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define SPECACHE_STREAMING_STORES 1
#endif

#include "parallel_for.h"
#include "spinning_pool.h"
#include "specache/full_precision_source.h"

namespace specache {
namespace {

// Copies one row into the gather's output: with `streaming`, by non-temporal stores where the
// machine has them and the output allows 16-byte vectors (the output's cache lines are neither
// read first, a plain store's read for ownership, nor left dirty in the CPU's caches for the DMA
// to snoop); otherwise by memcpy, whose plain stores leave the rows in the caches, where the copy
// engine can read them (GatherOptions::streaming_stores, the agent's fetch_streaming_stores says
// which paid where). The caller fences (StoreFence) before anyone else reads the output.
inline void CopyRow(uint8_t* dst, const uint8_t* src, size_t bytes, bool streaming) {
#ifdef SPECACHE_STREAMING_STORES
  if (streaming && bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    for (size_t at = 0; at < bytes; at += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at), v);
    }
    return;
  }
#else
  (void)streaming;
#endif
  std::memcpy(dst, src, bytes);
}

inline void StoreFence() {
#ifdef SPECACHE_STREAMING_STORES
  _mm_sfence();
#endif
}

}  // namespace

int GatherThreadsFor(int requested, int cores) {
  const int most = cores > 0 ? std::max(cores - 2, 1) : requested;
  return std::clamp(requested, 1, std::max(most, 1));
}

int64_t GatherPageRows(std::span<const PageGatherTask> tasks, int32_t page_tokens, int64_t row_bytes, int32_t skip,
                       uint8_t* rows, const GatherOptions& options) {
  // Each row is a random DRAM access (and, at 4 KB pages, a TLB miss): its cache lines are
  // prefetched options.prefetch_rows rows before the copy, so that a thread has several rows in
  // flight (H200 host, 32 x 8K rows of 512 bytes, 4 rows ahead: 25 -> 39 GB/s at 12 threads; H100
  // host, `host-gather` over 32 x 8K rows of 512 bytes, 12 and 16 threads: 2 to 16 rows ahead
  // within 0.81-1.08x of 4). Capped so that j + ahead_rows cannot overflow.
  const int32_t ahead_rows = std::clamp(options.prefetch_rows, 0, 1 << 16);
  auto is_row = [skip](int32_t w) { return w != skip && w >= 0; };
  auto row_address = [&](const PageGatherTask& t, int32_t token) {
    const int32_t page = token / page_tokens;
    return t.pages[page] + PageRowOffset(t.kv_head, token - page * page_tokens, page_tokens, row_bytes);
  };
  auto prefetch = [&](const uint8_t* p) {
    for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(p + line, 0, 0);
  };
  // Each task numbers its own rows, from a block of ranks it takes with one atomic add: the pass
  // over the slots runs on every thread (on one thread it was ~0.1 ms a layer at 176 sequences x 8
  // heads x 64 slots, while the other threads waited), and a task's rows stay together.
  std::atomic<int64_t> taken{0};
  auto gather_task = [&](int i) {
    const PageGatherTask& t = tasks[static_cast<size_t>(i)];
    int32_t count = 0;
    for (int32_t j = 0; j < t.n; ++j) count += is_row(t.wanted[j]) ? 1 : 0;
    int64_t next = count > 0 ? taken.fetch_add(count, std::memory_order_relaxed) : 0;
    int32_t ahead = 0;  // the next slot to prefetch
    auto prefetch_until = [&](int32_t end) {
      for (; ahead < end && ahead < t.n; ++ahead) {
        if (is_row(t.wanted[ahead])) prefetch(row_address(t, t.wanted[ahead]));
      }
    };
    for (int32_t j = 0; j < t.n; ++j) {
      prefetch_until(j + ahead_rows + 1);
      const int32_t w = t.wanted[j];
      if (!is_row(w)) {
        t.rank[j] = w == skip ? -1 : w;
        continue;
      }
      t.rank[j] = static_cast<int32_t>(next);
      CopyRow(rows + next * row_bytes, row_address(t, w), static_cast<size_t>(row_bytes), options.streaming_stores);
      ++next;
    }
    StoreFence();  // before the copy engine (or the caller) reads the rows
  };
  if (options.pool != nullptr) {
    options.pool->Run(static_cast<int>(tasks.size()), gather_task);
  } else {
    ParallelFor(static_cast<int>(tasks.size()), options.threads, [&](int i, int) { gather_task(i); });
  }
  return taken.load(std::memory_order_relaxed);  // the loops joined their threads
}

}  // namespace specache
