#include "commit_queue.h"

#include <utility>

#include "device_buffer.h"

namespace specache::cuda {

CommitQueue::~CommitQueue() {
  for (const CommitBatch& b : in_flight_) cudaEventDestroy(b.landed);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
}

Status CommitQueue::Record(cudaStream_t stream) {
  if (pending_.empty()) return Status::Ok();
  CommitBatch batch;
  if (free_events_.empty()) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&batch.landed, cudaEventDisableTiming), "event"));
  } else {
    batch.landed = free_events_.back();
    free_events_.pop_back();
  }
  const Status recorded = CudaStatus(cudaEventRecord(batch.landed, stream), "page writes");
  if (!recorded.ok()) {
    free_events_.push_back(batch.landed);
    return recorded;
  }
  batch.commits.swap(pending_);
  in_flight_.push_back(std::move(batch));
  return Status::Ok();
}

Status CommitQueue::CommitLanded(bool wait) {
  while (!in_flight_.empty()) {
    CommitBatch& b = in_flight_.front();
    if (wait) {
      SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(b.landed), "page writes"));
    } else {
      const cudaError_t e = cudaEventQuery(b.landed);
      if (e == cudaErrorNotReady) return Status::Ok();
      SPECACHE_RETURN_IF_ERROR(CudaStatus(e, "page writes"));
    }
    for (const PendingCommit& c : b.commits) {
      const Status s = source_->CommitLayerRows(c.id, c.layer, n_kv_heads_, c.first, c.n);
      if (s.ok()) continue;
      ++failed_;
      if (unreported_.ok()) {
        unreported_ = s.WithContext("source: rows " + std::to_string(c.first) + ".." + std::to_string(c.first + c.n) +
                                    " of sequence " + std::to_string(c.id) + " at layer " + std::to_string(c.layer) +
                                    " not committed");
      }
    }
    free_events_.push_back(b.landed);
    in_flight_.pop_front();
  }
  return Status::Ok();
}

Status CommitQueue::TakeError() { return std::exchange(unreported_, Status::Ok()); }

}  // namespace specache::cuda
