// A stream of the agent's own that work forks onto from the compute stream and that the compute
// stream joins later, for work the compute stream's next kernels do not need: it then runs beside
// them instead of in front of them. Internal to the agent.
//
//   Fork(): what is queued next on stream() runs after everything queued on the compute stream so
//           far (an event recorded there, waited for here).
//   Join(): what is queued next on the compute stream runs after everything queued on stream()
//           so far; nothing when nothing was forked since the last Join.
//
// The stream and its events are made at the first Fork (non-blocking: the compute stream may be
// the legacy default stream). Not thread-safe (the agent is used from one thread).
#pragma once

#include <cuda_runtime.h>

#include "specache/status.h"

namespace specache::cuda {

class ForkedStream {
 public:
  explicit ForkedStream(cudaStream_t compute) : compute_(compute) {}
  ForkedStream(const ForkedStream&) = delete;
  ForkedStream& operator=(const ForkedStream&) = delete;
  ~ForkedStream();  // waits for the stream's work, then frees it

  Status Fork();
  Status Join();
  // The host waits for everything queued on stream() (nothing before the first Fork).
  Status Synchronize() const;
  // Null before the first Fork.
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t compute_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t forked_ = nullptr, done_ = nullptr;
  bool joined_ = true;  // nothing queued on stream_ since the last Join
};

}  // namespace specache::cuda
