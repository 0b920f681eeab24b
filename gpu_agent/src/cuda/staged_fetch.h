// The CUDA agent's fetch from a source without zero-copy pages (full_precision_source.h; e.g.
// client_lib's RemoteSource, whose rows are on another host): what the fetch kernel would read
// from mapped host pages comes through pinned host memory instead. Stage() runs between the
// fetch's bookkeeping (RowFetcher) and the fetch kernel, on the stream the kernel then runs on:
//
//   1. device->host (pinned): each task's selection and the tokens its row cache holds; the calling
//      thread then waits for that copy (the selection lives on the device only);
//   2. the rows the cache does not hold are read from the source into a pinned buffer shaped like
//      the selection: StartReadRows for every task, then FinishReadRows for each (staged_rows.h);
//   3. host->device: that buffer into each task's out_rows.
//
// The FetchRows that follows on the stream (the tasks have null pages) copies the hits from the
// row cache over their slots and counts hits and misses as on the local path; the cache update
// after it is the local path's. So the selection, the two generations of rows and the cache stay
// RowFetcher's one logic; only where a missed row comes from differs.
//
// Step 1 blocks the calling thread until the stream reached the selection, and step 2 until the
// source answered: the agent calls Stage for the overlapped fetch on its SourceWorker, never on the
// thread that enqueues the engine's layers (nonspec and oracle fetch for the step itself, so they
// call it inline).
//
// Not thread-safe, and one StagedFetch per stream: a call reuses the pinned buffers of its copies
// once it has waited for its stream, which orders it after the previous call's copies only when
// both ran on the same stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "device_buffer.h"
#include "specache/cuda_fetch.h"
#include "specache/full_precision_source.h"
#include "specache/status.h"

namespace specache::cuda {

class StagedFetch {
 public:
  // `source` must outlive this.
  StagedFetch(FullPrecisionSource* source, int head_dim) : source_(source), head_dim_(head_dim) {}
  // Waits for the last host->device copy out of the pinned buffers before freeing them.
  ~StagedFetch();
  StagedFetch(const StagedFetch&) = delete;
  StagedFetch& operator=(const StagedFetch&) = delete;

  // Brings the rows of the tasks' selected tokens that their resident lists lack into their
  // out_rows (steps 1-3 above), queued on `stream`. tasks[i] is KV head tasks[i].kv_head of
  // (sequences[i], layer). A task's resident list, when given, has `resident_capacity` entries
  // ascending and padded with kNoToken (the row cache; its count lives on the device); its
  // selection may end in kNoToken padding too. Consecutive tasks of the same sequence keep their
  // selections, resident lists and out_rows in the same allocations (RowFetcher's buffers of a
  // (sequence, layer)): their copies merge; no copy spans two sequences. Work queued on `stream`
  // after this sees the rows.
  // Returns how many rows were read from the source.
  //
  // Errors: CUDA's (UNAVAILABLE, RESOURCE_EXHAUSTED for pinned memory) and the source's, with the
  // sequence as context. Nothing queued reads the pinned buffers once this returned an error
  // (it waits for the stream first), so the caller may go on or destroy this.
  Result<int64_t> Stage(int layer, std::span<const FetchTask> tasks, std::span<const SequenceId> sequences,
                        int32_t resident_capacity, cudaStream_t stream);

 private:
  FullPrecisionSource* source_;
  int head_dim_;
  // Pinned: the selections and resident lists copied down, and the rows going up. A call reuses
  // them only after the host waited for the stream, which orders them after the previous call's
  // host->device copies.
  Buffer<int32_t, true> selected_, resident_;
  Buffer<Half, true> rows_;
  cudaEvent_t copied_ = nullptr;  // recorded after the last host->device copy
};

}  // namespace specache::cuda
