// The host half of the CUDA agent's copy-engine fetch (cuda/copy_engine_fetch.h): the rows the
// device asked for, read in place from a zero-copy source's host pages (full_precision_source.h)
// by several threads into one buffer, which a single host-to-device copy then moves. Nothing here
// touches a device, so it is tested without one.
#pragma once

#include <cstdint>
#include <span>

namespace specache {

class SpinningPool;  // spinning_pool.h

// One (sequence, layer, KV head) of a gather.
struct PageGatherTask {
  const uint8_t* const* pages = nullptr;  // host addresses of the (sequence, layer)'s pages, by page index
  int kv_head = 0;
  const int32_t* wanted = nullptr;        // [n] per slot: a token whose row is wanted, `skip`, or a code < 0
  int32_t n = 0;
  int32_t* rank = nullptr;                // [n] out: the slot's row's index in `rows`, -1, or the code
};

// How GatherPageRows copies.
struct GatherOptions {
  int threads = 1;  // ParallelFor's threads
  // Rows a thread asks for ahead of its copy (their cache lines prefetched): several rows in
  // flight per thread. `specache-bench host-gather --gather-ahead` compares depths.
  int prefetch_rows = 4;
  // false: plain stores, which leave the output in the CPU's caches, where the copy engine's
  // reads find it while the last-level cache holds it. true (x86-64, where `rows` and row_bytes
  // allow 16-byte vectors): non-temporal stores, which write the output to DRAM past the caches
  // (no read for ownership, nothing dirty left for the DMA to snoop). CudaAgentOptions::
  // fetch_streaming_stores says which paid where.
  bool streaming_stores = false;
  // The threads that copy: null, OpenMP's (ParallelFor, `threads` of them), which follow the
  // process's OMP_WAIT_POLICY between two gathers; else this pool's (its own thread count), which
  // spin a while before they sleep (spinning_pool.h; CudaAgentOptions::fetch_gather_spin_us).
  SpinningPool* pool = nullptr;
};

// The gather's threads for `requested` (CudaAgentOptions::fetch_threads) on a host of `cores`
// logical cores the process may use (UsableCores, usable_cores.h; 0: not known, then
// `requested`): at most cores - 2, at least 1. The gather runs while the agent's own thread
// queues the step and the CUDA driver's threads serve it; given every core, it starves them: on
// a 16-core H100 host at 176 x 8K with int8 rows (specache-bench step, three rounds alternated)
// 16 threads gathered at 18-26 GB/s and the step with the fetch took 34.8-47.7 ms, against
// 31.4-31.6 ms with 12 or 14 threads (8: 31.6-37.0).
int GatherThreadsFor(int requested, int cores);

// Numbers the wanted rows 0 .. n - 1 (rank), each task's consecutively in slot order but the
// tasks' blocks in whichever order the threads took them, and copies each into rows[rank]
// ([..][row_bytes]), the tasks spread over options.threads threads (ParallelFor) or the pool's,
// fenced before it returns. Tokens equal to `skip` get rank -1 and no row; a negative entry is
// the caller's code for a row it has elsewhere (the device's row cache: ListMissedRows,
// cuda_fetch.h) and is its slot's rank as it is, with no row. The caller checked that every
// wanted token lies in a page of its task. Returns the number of rows.
int64_t GatherPageRows(std::span<const PageGatherTask> tasks, int32_t page_tokens, int64_t row_bytes, int32_t skip,
                       uint8_t* rows, const GatherOptions& options);

}  // namespace specache
