// Rows the CUDA agent wrote into the source's pages from the device, on their way to being
// committed to the source (FullPrecisionSource::CommitRows).
//
// The page writes are queued on a stream and land later; a row may be committed only once they
// have. Add() notes rows whose writes are queued; Record() closes the rows noted so far into a
// batch behind an event recorded on the stream; CommitLanded() commits the batches whose event
// completed, oldest first, either without waiting (what is still landing stays queued) or waiting
// for all of them. Nothing here waits unless asked to.
//
// Not thread-safe (the agent is used from one thread).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <vector>

#include "specache/full_precision_source.h"
#include "specache/status.h"

namespace specache::cuda {

class CommitQueue {
 public:
  // Rows are committed for every one of n_kv_heads KV heads. `source` must outlive the queue.
  CommitQueue(FullPrecisionSource* source, int n_kv_heads) : source_(source), n_kv_heads_(n_kv_heads) {}
  // Destroys the events; batches not committed are dropped (the owner commits them first).
  ~CommitQueue();
  CommitQueue(const CommitQueue&) = delete;
  CommitQueue& operator=(const CommitQueue&) = delete;

  // Tokens [first, first + n) of the (sequence, layer), whose page writes are queued.
  void Add(SequenceId id, int layer, int32_t first, int32_t n) { pending_.push_back({id, layer, first, n}); }
  // Closes the rows added since the last call into a batch that commits once an event recorded
  // now on `stream` has completed. The CUDA error when the event cannot be made or recorded (the
  // rows stay pending).
  Status Record(cudaStream_t stream);
  // Commits the batches whose writes landed, in order; with `wait`, all of them. CUDA's errors
  // stop at the batch that had them (it stays queued). Every commit of a landed batch is tried
  // once: one the source refuses is counted (failed()) and its error kept, with context "source",
  // until TakeError, so that one failed commit neither blocks the others nor is retried forever.
  Status CommitLanded(bool wait);
  // The first source error since the last call (OK if none), forgotten once returned.
  Status TakeError();
  // Commits the source refused so far.
  int64_t failed() const { return failed_; }

 private:
  struct PendingCommit {
    SequenceId id;
    int layer;
    int32_t first, n;
  };
  // Rows whose page writes were queued before `landed` was recorded.
  struct CommitBatch {
    cudaEvent_t landed = nullptr;
    std::vector<PendingCommit> commits;
  };

  FullPrecisionSource* source_;
  int n_kv_heads_;
  std::vector<PendingCommit> pending_;  // added since the last Record
  std::deque<CommitBatch> in_flight_;   // oldest first
  std::vector<cudaEvent_t> free_events_;
  Status unreported_;  // TakeError's
  int64_t failed_ = 0;
};

}  // namespace specache::cuda
