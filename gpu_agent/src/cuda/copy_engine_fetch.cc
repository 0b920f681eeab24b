#include "copy_engine_fetch.h"

#include <algorithm>
#include <chrono>

#include "../page_row_gather.h"

namespace specache::cuda {

CopyEngineFetch::~CopyEngineFetch() {
  for (cudaEvent_t& e : copied_) {
    if (!e) continue;
    cudaEventSynchronize(e);
    cudaEventDestroy(e);
  }
  if (listed_) cudaEventDestroy(listed_);
  if (queued_) cudaEventDestroy(queued_);
  if (lister_) {
    cudaStreamSynchronize(lister_);
    cudaStreamDestroy(lister_);
  }
}

namespace {

int64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

CopyEngineFetch::Times CopyEngineFetch::times() const {
  return {list_wait_ns_.load(), buffer_wait_ns_.load(), gather_ns_.load(), rows_gathered_.load()};
}

Result<std::vector<FetchTask>> CopyEngineFetch::Stage(std::span<const FetchTask> tasks,
                                                      std::span<const uint8_t* const* const> host_pages,
                                                      std::span<const cudaEvent_t> ready, cudaStream_t stream,
                                                      bool after_stream,
                                                      DecodePlan* plan) {
  std::vector<FetchTask> out(tasks.begin(), tasks.end());
  int32_t stride = 0;
  for (const FetchTask& t : tasks) stride = std::max(stride, t.n_selected);
  if (stride == 0) return out;
  if (host_pages.size() != tasks.size()) return Status::InvalidArgument("copy-engine fetch: a page table per task");
  // Made at the first call; each piece that failed to be made is tried again at the next.
  if (!lister_) {
    // The list is on the path of the layer's whole fetch: its kernel is scheduled first.
    int least = 0, greatest = 0;
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities"));
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithPriority(&lister_, cudaStreamNonBlocking, greatest), "stream"));
  }
  for (cudaEvent_t* e : {&listed_, &queued_, &copied_[0], &copied_[1]}) {
    if (!*e) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event"));
  }
  const size_t slots = tasks.size() * static_cast<size_t>(stride);
  const size_t row = static_cast<size_t>(HostRowBytes(page_rows_, head_dim_));  // as the pages store it
  const size_t rank_bytes = (slots * sizeof(int32_t) + 15) / 16 * 16;
  const size_t most_bytes = rank_bytes + slots * row;  // every slot a miss
  // The list's last reader was the host, in the previous call.
  SPECACHE_RETURN_IF_ERROR(missed_.Reserve(slots));

  // 1. Which rows the cache lacks, down through the mapping; the host waits for the list (for the
  //    layer's selection, then the list's kernel: list_wait_ns_).
  int32_t* missed_on_device = nullptr;
  SPECACHE_RETURN_IF_ERROR(
      CudaStatus(cudaHostGetDevicePointer(reinterpret_cast<void**>(&missed_on_device), missed_.get(), 0), "mapped list"));
  auto waited = std::chrono::steady_clock::now();
  Status queued = Status::Ok();
  for (cudaEvent_t e : ready) {
    if (e && queued.ok()) queued = CudaStatus(cudaStreamWaitEvent(lister_, e, 0), "wait for the selection");
  }
  if (queued.ok() && after_stream) {
    queued = CudaStatus(cudaEventRecord(queued_, stream), "fetch stream event");
    if (queued.ok()) queued = CudaStatus(cudaStreamWaitEvent(lister_, queued_, 0), "wait for the fetch stream");
  }
  if (queued.ok()) queued = ListMissedRows(out.data(), static_cast<int>(out.size()), stride, missed_on_device, lister_, plan);
  if (queued.ok()) queued = CudaStatus(cudaEventRecord(listed_, lister_), "list event");
  // Waited for even after an error, so that nothing queued writes the list later.
  const Status listed = CudaStatus(queued.ok() ? cudaEventSynchronize(listed_) : cudaStreamSynchronize(lister_),
                                   "missed rows to the host");
  list_wait_ns_ += NanosSince(waited);
  SPECACHE_RETURN_IF_ERROR(queued);
  SPECACHE_RETURN_IF_ERROR(listed);

  // 2. The missed rows from the pages, behind their ranks, into this call's pinned buffer once its
  //    last copy (two calls back) is done.
  const int b = next_;
  waited = std::chrono::steady_clock::now();
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(copied_[b]), "copy-engine fetch"));
  if (static_cast<size_t>(up_[b].bytes()) < most_bytes || static_cast<size_t>(device_[b].bytes()) < most_bytes) {
    // The cache update two calls back may still read device_[b].
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "copy-engine fetch"));
    SPECACHE_RETURN_IF_ERROR(up_[b].Reserve(most_bytes));
    SPECACHE_RETURN_IF_ERROR(device_[b].Reserve(most_bytes));
  }
  buffer_wait_ns_ += NanosSince(waited);
  auto* ranks = reinterpret_cast<int32_t*>(up_[b].get());
  std::vector<PageGatherTask> gather(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    gather[i] = {host_pages[i], out[i].kv_head, missed_.get() + i * stride, out[i].n_selected, ranks + i * stride};
  }
  const auto gathering = std::chrono::steady_clock::now();
  const int64_t rows = GatherPageRows(gather, page_tokens_, static_cast<int64_t>(row), kNoToken,
                                      up_[b].get() + rank_bytes, gather_);
  gather_ns_ += NanosSince(gathering);
  rows_gathered_ += rows;

  // 3. Up in pieces of piece_bytes_; the cache update reads them from device memory. Copies in
  //    one direction run one at a time on the copy engine: a piece at a time, another stream's
  //    small copy (a launch plan's upload) waits for a piece, not for the layer's whole rows.
  const size_t total = rank_bytes + static_cast<size_t>(rows) * row;
  const size_t piece = piece_bytes_ > 0 ? static_cast<size_t>(piece_bytes_) : total;
  for (size_t at = 0; at < total && queued.ok(); at += piece) {
    queued = CudaStatus(cudaMemcpyAsync(device_[b].get() + at, up_[b].get() + at, std::min(piece, total - at),
                                        cudaMemcpyHostToDevice, stream),
                        "rows to the device");
  }
  // Recorded after an error too: whatever was queued is what the next use and the destructor wait
  // for; when it cannot be, the host waits for the copies here (the buffer's next user waits for
  // the event's older record).
  const Status recorded = CudaStatus(cudaEventRecord(copied_[b], stream), "rows to the device");
  if (!recorded.ok()) cudaStreamSynchronize(stream);
  next_ = 1 - b;
  SPECACHE_RETURN_IF_ERROR(queued);
  SPECACHE_RETURN_IF_ERROR(recorded);
  const auto* staged_rows = reinterpret_cast<const Half*>(device_[b].get() + rank_bytes);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].pages = nullptr;
    out[i].staged_rank = reinterpret_cast<const int32_t*>(device_[b].get()) + i * stride;
    out[i].staged_rows = staged_rows;
  }
  return out;
}

}  // namespace specache::cuda
