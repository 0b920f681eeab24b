// CUDA errors as Status, for the GPU model, its engine's helpers and their benchmarks.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "specache/status.h"

namespace specache::gpu {

// OK, or `what` with the CUDA error: RESOURCE_EXHAUSTED when device memory ran out, else
// UNAVAILABLE.
inline Status Cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return Status::Ok();
  if (e == cudaErrorMemoryAllocation) return Status::ResourceExhausted(what + ": " + cudaGetErrorString(e));
  return Status::Unavailable(what + ": " + cudaGetErrorString(e));
}

}  // namespace specache::gpu
