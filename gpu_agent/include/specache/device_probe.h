// Is there a usable CUDA device? The CPU backend is chosen whenever the answer is no, whatever the
// reason (no toolkit at build time, no driver, no device, a device that fails to initialise).
#pragma once

#include <cstdint>
#include <string>

#include "specache/status.h"

namespace specache {

struct CudaDeviceInfo {
  int device_count = 0;
  std::string name;             // device 0
  int compute_major = 0;
  int compute_minor = 0;
  int64_t total_memory_bytes = 0;
  int multiprocessors = 0;
};

// True when this build contains the CUDA code (configured with nvcc).
bool BuiltWithCuda();

// Device 0's properties after a real context creation (cudaFree(0)), or UNAVAILABLE with the
// CUDA error text ("built without CUDA", "CUDA driver version is insufficient..." = error 35, ...).
Result<CudaDeviceInfo> ProbeCudaDevice();

}  // namespace specache
