// CUDA errors as Status, for every part of the CUDA agent.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "specache/status.h"

namespace specache::cuda {

// OK, or `what` with the CUDA error: RESOURCE_EXHAUSTED when device memory ran out, else
// UNAVAILABLE. Clears the error so that the next call does not see it again.
inline Status CudaStatus(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  if (err == cudaErrorMemoryAllocation) return Status::ResourceExhausted(what + ": out of device memory");
  return Status::Unavailable(what + ": " + cudaGetErrorString(err));
}

// Whether the kernel launches just queued were accepted (cudaGetLastError), as CudaStatus.
inline Status LaunchStatus(const std::string& what) { return CudaStatus(cudaGetLastError(), what); }

}  // namespace specache::cuda
