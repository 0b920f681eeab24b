// Builds without CUDA: the gather path reports that there is no GPU.
#include "specache/cuda_gather.h"

namespace specache::cuda {

Result<uint64_t> RegisterHostMemory(void*, size_t) { return Status::Unavailable("built without CUDA"); }
Status UnregisterHostMemory(void*) { return Status::Unavailable("built without CUDA"); }
Status LaunchGatherRows(const uint64_t*, void*, int64_t, int, int, void*, const uint32_t*) {
  return Status::Unavailable("built without CUDA");
}

}  // namespace specache::cuda
