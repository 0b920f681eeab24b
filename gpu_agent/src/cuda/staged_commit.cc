#include "staged_commit.h"

#include <utility>

#include "../staged_rows.h"

namespace specache::cuda {

StagedCommit::~StagedCommit() {
  if (pending_.landed) cudaEventDestroy(pending_.landed);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
}

std::unique_ptr<StagedCommit::Block> StagedCommit::TakeBlock(size_t rows) {
  std::lock_guard<std::mutex> lock(free_mu_);
  for (auto it = free_blocks_.begin(); it != free_blocks_.end(); ++it) {
    if ((*it)->rows >= rows) {
      std::unique_ptr<Block> b = std::move(*it);
      free_blocks_.erase(it);
      return b;
    }
  }
  return nullptr;
}

Status StagedCommit::Stage(int layer, std::span<const WriteTask> writes, std::span<const SequenceId> sequences,
                           cudaStream_t stream) {
  const size_t d = static_cast<size_t>(head_dim_);
  size_t rows = 0;
  for (const WriteTask& w : writes) rows += static_cast<size_t>(w.n);
  if (rows == 0) return Status::Ok();
  std::unique_ptr<Block> block = TakeBlock(rows);
  if (!block) {  // a block serves any later Stage of as many rows: decode steps reuse the same few
    block = std::make_unique<Block>();
    SPECACHE_RETURN_IF_ERROR(block->planes.Reserve(2 * rows * d));
    block->rows = rows;
  }
  Half* keys = block->planes.get();
  Half* values = keys + block->rows * d;
  // Rows of consecutive tasks usually lie back to back on the device (a decode layer's new rows
  // are [sequence][KV head][head_dim]): AddCopy makes them one copy per plane. Every write's keys
  // lie in one allocation and its values in one (Stage's contract), and the block is one.
  std::vector<CopyRun> k_runs, v_runs;
  std::vector<Append> appends;
  size_t at = 0;
  for (size_t i = 0; i < writes.size(); ++i) {
    const WriteTask& w = writes[i];
    appends.push_back({sequences[i], layer, w.kv_head, w.first_token, w.n, keys + at * d, values + at * d});
    for (int32_t r = 0; r < w.n; ++r, ++at) {
      AddCopy(&k_runs, keys + at * d, w.keys + r * w.stride, d * sizeof(Half), true);
      AddCopy(&v_runs, values + at * d, w.values + r * w.stride, d * sizeof(Half), true);
    }
  }
  Status queued;
  for (const auto* runs : {&k_runs, &v_runs}) {
    for (const CopyRun& c : *runs) {
      if (queued.ok()) queued = CudaStatus(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToHost, stream), "new rows to the host");
    }
  }
  if (!queued.ok()) {
    // Copies already queued may still write into the block: it is freed only once they are done.
    (void)cudaStreamSynchronize(stream);
    return queued;
  }
  pending_.blocks.push_back(std::move(block));
  pending_.appends.insert(pending_.appends.end(), appends.begin(), appends.end());
  return Status::Ok();
}

Status StagedCommit::Record(cudaStream_t stream) {
  if (pending_.appends.empty()) return Status::Ok();
  if (!pending_.landed) {
    std::lock_guard<std::mutex> lock(free_mu_);
    if (!free_events_.empty()) {
      pending_.landed = free_events_.back();
      free_events_.pop_back();
    }
  }
  if (!pending_.landed) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&pending_.landed, cudaEventDisableTiming), "event"));
  }
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(pending_.landed, stream), "new rows to the host"));
  // std::function copies its callable: the batch travels behind a shared pointer.
  auto batch = std::make_shared<Batch>(std::move(pending_));
  pending_ = Batch{};
  worker_->Submit(SourceWorker::kCommitKey, [this, batch] { return Commit(batch.get()); });
  return Status::Ok();
}

Status StagedCommit::Commit(Batch* batch) {
  const size_t d = static_cast<size_t>(head_dim_);
  Status first = CudaStatus(cudaEventSynchronize(batch->landed), "new rows to the host");
  if (first.ok()) {
    std::vector<Half> rows;
    for (const Append& a : batch->appends) {
      rows.resize(static_cast<size_t>(a.n) * 2 * d);
      InterleaveRows(a.keys, a.values, a.n, head_dim_, rows.data());
      const Status s = source_->AppendRows(a.id, a.layer, a.kv_head, a.first, rows.data(), a.n).WithContext("source");
      if (!s.ok() && first.ok()) first = s;
    }
  }
  std::lock_guard<std::mutex> lock(free_mu_);
  for (auto& b : batch->blocks) free_blocks_.push_back(std::move(b));
  free_events_.push_back(batch->landed);
  batch->landed = nullptr;
  return first;
}

Status StagedCommit::CommitLanded(bool wait) {
  return wait ? worker_->Wait(SourceWorker::kCommitKey) : worker_->TakeError(SourceWorker::kCommitKey);
}

}  // namespace specache::cuda
