// The copy-engine route of the CUDA agent's overlapped fetch (FetchVia::kCopyEngine, agent.h),
// for a source with zero-copy pages: no SM loads host memory, so the fetch takes no SM from the
// engine's GEMMs while it moves rows. Per layer, Stage does:
//
//   1. on a stream of its own, once `ready` (the layer's selection, the step's page writes) fired: ListMissedRows
//      (cuda_fetch.h), per selected slot the token if the row cache lacks it, else the cache's
//      index of the row, into pinned host memory the device writes through its mapping; the
//      calling thread waits for it (the selection exists on the device only);
//   2. on the host: GatherPageRows (../page_row_gather.h) numbers the missed rows and copies them
//      from the pages into a pinned buffer, on `threads` threads, the ranks in front of the rows
//      (a hit's rank names its cache row: FetchTask::staged_rank);
//   3. on `stream` (the fetch stream): one host-to-device copy of ranks and rows (a DMA engine)
//      into device memory;
//
// and returns the tasks with staged_rank / staged_rows set, for the row cache's update that follows
// on `stream` (UpdateRowCaches): it takes the missed rows from that device copy by their ranks and
// the hits from the old cache, and counts them, as FetchRows does on the other routes.
//
// Layers pipeline: step 1 runs on its own stream so that the next layer's list does not wait
// behind this layer's copy and cache update on `stream`, and steps 2-3 alternate
// between two buffers, so the host gathers layer L + 1 while layer L's copy is in flight (at 99
// sequences x 8K a layer's 25 MB take ~0.65 ms to gather and ~0.45 ms to copy). Buffer reuse:
// the list is read by the host before the next call lists into it; a pinned buffer is written
// only after the host waited for its last copy (two calls back); a device buffer's last reader,
// the cache update two calls back, precedes its next copy on `stream`. Growing a buffer waits for
// `stream` first. The list's stream reads the row caches the fetches update: the update of the
// layer's previous fetch (on `stream`, or on the SM share's stream: RowFetcher) comes before
// `ready` (the compute stream waited for that fetch before the selection), and nothing
// overwrites the cache read here before this call's own update on `stream`.
// Not thread-safe (times() aside); one instance per fetch stream (the RowFetcher's, on its worker
// thread).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "../page_row_gather.h"
#include "../spinning_pool.h"
#include "device_buffer.h"
#include "specache/cuda_fetch.h"
#include "specache/status.h"

namespace specache::cuda {

class CopyEngineFetch {
 public:
  // piece_bytes: the rows go up in copies of at most this many bytes (0: one copy a layer).
  // page_rows: the pages' row format; the rows go up as stored (int8 ones half the bytes), and the
  // cache update decodes them (UpdateRowCaches' staged_rows). streaming_stores: how the gather
  // writes the pinned buffer (GatherOptions::streaming_stores; CudaAgentOptions::fetch_streaming_stores).
  // gather_spin_us > 0: the gather's `threads` are a SpinningPool's that spin that long between
  // layers (CudaAgentOptions::fetch_gather_spin_us), else OpenMP's.
  CopyEngineFetch(int head_dim, HostRowFormat page_rows, int32_t page_tokens, int threads,
                  int64_t piece_bytes = kCopyPieceBytes, bool streaming_stores = GatherOptions{}.streaming_stores,
                  int gather_spin_us = 0)
      : head_dim_(head_dim),
        page_rows_(page_rows),
        page_tokens_(page_tokens),
        pool_(gather_spin_us > 0 ? std::make_unique<SpinningPool>(threads, std::chrono::microseconds(gather_spin_us))
                                 : nullptr),
        gather_{.threads = threads, .streaming_stores = streaming_stores, .pool = pool_.get()},
        piece_bytes_(piece_bytes) {}
  // Waits for the last copy out of the pinned buffer before freeing it.
  ~CopyEngineFetch();
  CopyEngineFetch(const CopyEngineFetch&) = delete;
  CopyEngineFetch& operator=(const CopyEngineFetch&) = delete;

  // Steps 1-3 above for one layer's tasks; host_pages[i] is the host page table of task i's
  // (sequence, layer) (DevicePageTable::HostLayer), whose entries cover every selected token;
  // once every event of `ready` fired (null ones are skipped), the tasks' selections and resident
  // lists are written, and so are the page rows they may select. With
  // `after_stream`, the list also waits for what is queued on `stream` so far: a row cache's
  // first fetch, whose count and tokens are set there just before (RowFetcher's fills), which
  // the list would otherwise race with (reading a stale count and tokens, it lists the wrong
  // rows, or searches past the list's end). The tasks' `pages` are ignored. Returns the tasks to
  // hand to the cache update (UpdateRowCaches) on `stream`. The list's tasks go through `plan`
  // (the calling thread's; null: one of its own, waited for). Errors: CUDA's (RESOURCE_EXHAUSTED
  // for memory); after one, nothing queued reads the pinned buffers later (the streams are waited
  // for), and the caller queues no cache update.
  Result<std::vector<FetchTask>> Stage(std::span<const FetchTask> tasks, std::span<const uint8_t* const* const> host_pages,
                                       std::span<const cudaEvent_t> ready, cudaStream_t stream, bool after_stream = false,
                                       DecodePlan* plan = nullptr);

  // Where the worker's time went, since creation (AgentStats' fetch_host_*); any thread may ask.
  struct Times {
    int64_t list_wait_ns = 0;    // waiting for the device's lists of missed rows
    int64_t buffer_wait_ns = 0;  // waiting for a pinned buffer's copy two layers back
    int64_t gather_ns = 0;       // gathering the missed rows from the pages
    int64_t rows_gathered = 0;   // the misses (the cache update counts them on the device too)
  };
  Times times() const;

  // The default piece (~40 us at PCIe 5's ~50 GB/s, ~100 us measured in a profiled 99 x 8K step):
  // the copy engine runs copies of one direction one at a time, so a small upload on another
  // stream waits for one piece rather than for a layer's rows (26 MB at 99 x 8K).
  static constexpr int64_t kCopyPieceBytes = int64_t{2} << 20;

 private:
  int head_dim_;
  HostRowFormat page_rows_;
  int32_t page_tokens_;
  std::unique_ptr<SpinningPool> pool_;  // the gather's threads when they are the agent's own
  GatherOptions gather_;  // the host's gather: threads, stores, pool
  int64_t piece_bytes_;
  Buffer<int32_t, true> missed_;  // [tasks][stride], written by the device through its mapping
  // Two of each, alternating by call: [tasks][stride] int32 ranks, then the rows (16-byte
  // aligned), pinned and on the device; copied_ is recorded after each one's copy.
  Buffer<uint8_t, true> up_[2];
  Buffer<uint8_t> device_[2];
  cudaEvent_t copied_[2] = {nullptr, nullptr};
  int next_ = 0;  // the buffers of the next call
  cudaStream_t lister_ = nullptr;
  cudaEvent_t listed_ = nullptr;
  cudaEvent_t queued_ = nullptr;  // recorded on `stream` for after_stream
  // Written by the worker, read by times() on the agent's thread.
  std::atomic<int64_t> list_wait_ns_{0}, buffer_wait_ns_{0}, gather_ns_{0}, rows_gathered_{0};
};

}  // namespace specache::cuda
