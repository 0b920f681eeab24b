#include "forked_stream.h"

#include "cuda_status.h"

namespace specache::cuda {

ForkedStream::~ForkedStream() {
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (forked_) cudaEventDestroy(forked_);
  if (done_) cudaEventDestroy(done_);
}

Status ForkedStream::Fork() {
  // Each made once; one that failed is asked for again at the next call.
  if (!stream_) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "forked stream"));
  }
  if (!forked_) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming), "event"));
  if (!done_) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "event"));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(forked_, compute_), "fork event"));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream_, forked_, 0), "wait for the compute stream"));
  joined_ = false;
  return Status::Ok();
}

Status ForkedStream::Join() {
  if (joined_) return Status::Ok();
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(done_, stream_), "join event"));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(compute_, done_, 0), "wait for the forked stream"));
  joined_ = true;
  return Status::Ok();
}

Status ForkedStream::Synchronize() const {
  return stream_ ? CudaStatus(cudaStreamSynchronize(stream_), "forked stream") : Status::Ok();
}

}  // namespace specache::cuda
