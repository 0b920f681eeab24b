// The CUDA agent's new rows for a source without zero-copy pages (full_precision_source.h; e.g.
// client_lib's RemoteSource). Where the local path has the GPU write the step's K/V rows into the
// source's pages (WriteRows) and commits them once they landed (CommitQueue), this copies them
// device->host into pinned staging on the compute stream, and the agent's SourceWorker appends
// them to the source (AppendRows) once the copies completed:
//
// - Stage() queues on the stream the copies of some WriteTasks' rows into a pinned block of their
//   own (a K plane and a V plane; the rows are interleaved into the source's [K|V] layout on the
//   host before the append).
// - Record() closes what was staged since the last call into a batch behind an event recorded now
//   on the stream, and hands the batch to the worker (key SourceWorker::kCommitKey): the worker
//   waits for the event, then appends the batch's rows in the order they were staged. Batches run
//   in the order recorded, so each (sequence, layer, head) receives its rows in token order.
// - CommitLanded() reports the first error of the appends that ran (with `wait`, after all ran).
//   A failed append leaves its triple short: that triple's later appends fail too (AppendRows's
//   FAILED_PRECONDITION), the other triples' go on; the first error says the cause.
//
// Nothing on the agent's thread waits for the copies or the source. Not thread-safe (the agent's
// thread calls it); the worker's jobs only touch the batch they own and the free lists (locked).
// The worker must have run every batch before this is destroyed (the agent waits for it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "device_buffer.h"
#include "specache/cuda_fetch.h"
#include "specache/full_precision_source.h"
#include "specache/status.h"
#include "../source_worker.h"

namespace specache::cuda {

class StagedCommit {
 public:
  // `source` and `worker` must outlive this.
  StagedCommit(FullPrecisionSource* source, int head_dim, SourceWorker* worker)
      : source_(source), head_dim_(head_dim), worker_(worker) {}
  ~StagedCommit();
  StagedCommit(const StagedCommit&) = delete;
  StagedCommit& operator=(const StagedCommit&) = delete;

  // Queues on `stream` the copies of writes[i]'s rows (KV head writes[i].kv_head of (sequences[i],
  // layer), tokens first_token.. first_token + n; `pages` is not used) into pinned staging. All
  // the writes' keys lie in one device allocation and all their values in one (the agent's are
  // views of the step planner's new_keys/new_values): their copies merge where rows lie back to
  // back. The CUDA error, or RESOURCE_EXHAUSTED for pinned memory, with nothing staged.
  Status Stage(int layer, std::span<const WriteTask> writes, std::span<const SequenceId> sequences, cudaStream_t stream);
  // Hands what was staged since the last call to the worker, behind an event recorded now on
  // `stream`. The CUDA error when the event cannot be made or recorded (the rows stay staged).
  Status Record(cudaStream_t stream);
  // The first error of the appends that ran since the last report (context "source"); with
  // `wait`, after every batch recorded so far ran.
  Status CommitLanded(bool wait);

 private:
  struct Block {  // pinned [2][rows][head_dim]: the K plane, then the V plane
    Buffer<Half, true> planes;
    size_t rows = 0;
  };
  struct Append {
    SequenceId id;
    int layer, kv_head;
    int32_t first, n;
    const Half* keys;  // [n][head_dim] in a block's K plane
    const Half* values;
  };
  struct Batch {
    cudaEvent_t landed = nullptr;
    std::vector<std::unique_ptr<Block>> blocks;
    std::vector<Append> appends;
  };
  // Runs on the worker: waits for the batch's copies, appends its rows, returns its block and event.
  Status Commit(Batch* batch);
  std::unique_ptr<Block> TakeBlock(size_t rows);

  FullPrecisionSource* source_;
  int head_dim_;
  SourceWorker* worker_;
  Batch pending_;  // staged since the last Record
  std::mutex free_mu_;  // the free lists, which the worker refills
  std::vector<std::unique_ptr<Block>> free_blocks_;
  std::vector<cudaEvent_t> free_events_;
};

}  // namespace specache::cuda
