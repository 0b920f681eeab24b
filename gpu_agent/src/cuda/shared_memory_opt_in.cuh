// The opt-in a kernel needs before a launch with more than 48 KiB of dynamic shared memory, made
// once per (kernel, device).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>

namespace specache::cuda {

constexpr int kMaxOptInDevices = 64;

// Allows `kernel` up to `bytes` of dynamic shared memory on the current device. `allowed` is the
// kernel's own flag array (a function-local static); setting the attribute twice from two threads
// is harmless, so the flag is only a shortcut. `bytes` must be the same on every call for a kernel.
template <typename Kernel>
cudaError_t AllowDynamicSharedMemory(Kernel kernel, size_t bytes, std::atomic<bool> (&allowed)[kMaxOptInDevices]) {
  if (bytes <= (size_t{48} << 10)) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxOptInDevices) return cudaErrorInvalidDevice;
  if (allowed[device].load(std::memory_order_acquire)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess) allowed[device].store(true, std::memory_order_release);
  return err;
}

}  // namespace specache::cuda
