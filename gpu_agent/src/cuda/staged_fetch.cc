#include "staged_fetch.h"

#include <algorithm>
#include <vector>

#include "../staged_rows.h"

namespace specache::cuda {

StagedFetch::~StagedFetch() {
  if (copied_) {
    cudaEventSynchronize(copied_);
    cudaEventDestroy(copied_);
  }
}

Result<int64_t> StagedFetch::Stage(int layer, std::span<const FetchTask> tasks, std::span<const SequenceId> sequences,
                                   int32_t resident_capacity, cudaStream_t stream) {
  const size_t row = 2 * static_cast<size_t>(head_dim_);
  size_t n_selected = 0;
  for (const FetchTask& t : tasks) n_selected += static_cast<size_t>(t.n_selected);
  if (n_selected == 0) return int64_t{0};
  if (!copied_) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming), "event"));
  // The lists' last readers were copies the previous call waited for; the rows' last reader may
  // still be in flight, so rows_ is grown only after the wait below.
  SPECACHE_RETURN_IF_ERROR(selected_.Reserve(n_selected));
  SPECACHE_RETURN_IF_ERROR(resident_.Reserve(std::max<size_t>(1, tasks.size() * static_cast<size_t>(resident_capacity))));

  // 1. The selections and resident lists down. Tasks of one (sequence, layer) lie back to back on
  //    both sides, so a layer's lists go in one copy per sequence (never across sequences: their
  //    buffers are separate allocations).
  std::vector<CopyRun> down, down_resident;
  std::vector<StagedHeadRows> heads(tasks.size());
  size_t at = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const FetchTask& t = tasks[i];
    const bool same_sequence = i > 0 && sequences[i] == sequences[i - 1];
    StagedHeadRows& h = heads[i];
    h.sequence = sequences[i];
    h.layer = layer;
    h.kv_head = t.kv_head;
    h.selected = selected_.get() + at;
    h.n_selected = t.n_selected;
    AddCopy(&down, selected_.get() + at, t.selected, static_cast<size_t>(t.n_selected) * sizeof(int32_t), same_sequence);
    if (t.resident && resident_capacity > 0) {
      int32_t* resident = resident_.get() + i * static_cast<size_t>(resident_capacity);
      h.resident = resident;
      h.n_resident = resident_capacity;
      AddCopy(&down_resident, resident, t.resident, static_cast<size_t>(resident_capacity) * sizeof(int32_t),
              same_sequence);
    }
    at += static_cast<size_t>(t.n_selected);
  }
  down.insert(down.end(), down_resident.begin(), down_resident.end());
  Status queued;
  for (const CopyRun& c : down) {
    queued = CudaStatus(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToHost, stream), "selection to the host");
    if (!queued.ok()) break;
  }
  // Waited for even after an error, so that no queued copy writes into the lists later.
  const Status waited = CudaStatus(cudaStreamSynchronize(stream), "selection to the host");
  SPECACHE_RETURN_IF_ERROR(queued);
  SPECACHE_RETURN_IF_ERROR(waited);

  // 2. The missed rows from the source, into a pinned buffer laid out like the selections.
  SPECACHE_RETURN_IF_ERROR(rows_.Reserve(n_selected * row));
  at = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    heads[i].rows = rows_.get() + at * row;
    at += static_cast<size_t>(tasks[i].n_selected);
  }
  SPECACHE_ASSIGN_OR_RETURN(const int64_t read, ReadMissingRows(source_, heads, head_dim_));

  // 3. Up into out_rows (the slots of hits carry stale bytes: the fetch kernel overwrites them).
  std::vector<CopyRun> up;
  for (size_t i = 0; i < tasks.size(); ++i) {
    AddCopy(&up, tasks[i].out_rows, heads[i].rows, static_cast<size_t>(tasks[i].n_selected) * row * sizeof(Half),
            i > 0 && sequences[i] == sequences[i - 1]);
  }
  for (const CopyRun& c : up) {
    queued = CudaStatus(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyHostToDevice, stream), "rows to the device");
    if (!queued.ok()) break;
  }
  // Recorded after an error too: whatever was queued is what the destructor waits for.
  const Status recorded = CudaStatus(cudaEventRecord(copied_, stream), "rows to the device");
  SPECACHE_RETURN_IF_ERROR(queued);
  SPECACHE_RETURN_IF_ERROR(recorded);
  return read;
}

}  // namespace specache::cuda
