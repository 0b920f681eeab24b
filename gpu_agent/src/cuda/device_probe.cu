#include <cuda_runtime.h>

#include "specache/device_probe.h"

namespace specache {
namespace {

Status FromCuda(cudaError_t err, const char* what) {
  return Status::Unavailable(std::string(what) + ": " + cudaGetErrorString(err) + " (cuda error " +
                             std::to_string(static_cast<int>(err)) + ")");
}

}  // namespace

bool BuiltWithCuda() { return true; }

Result<CudaDeviceInfo> ProbeCudaDevice() {
  CudaDeviceInfo info;
  cudaError_t err = cudaGetDeviceCount(&info.device_count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later probes start clean
    return FromCuda(err, "cudaGetDeviceCount");
  }
  if (info.device_count == 0) return Status::Unavailable("no CUDA device");
  cudaDeviceProp prop{};
  if ((err = cudaGetDeviceProperties(&prop, 0)) != cudaSuccess) return FromCuda(err, "cudaGetDeviceProperties");
  if ((err = cudaFree(nullptr)) != cudaSuccess) return FromCuda(err, "creating a CUDA context");
  info.name = prop.name;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.total_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info.multiprocessors = prop.multiProcessorCount;
  return info;
}

}  // namespace specache
