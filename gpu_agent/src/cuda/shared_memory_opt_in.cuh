// The opt-in a kernel needs before a launch whose shared memory passes 48 KiB, made once per
// (kernel, device).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>

namespace specache::cuda {

constexpr int kMaxOptInDevices = 64;

// What every launch gets unasked: 48 KiB of shared memory, static and dynamic together.
constexpr size_t kUnaskedSharedBytes = size_t{48} << 10;

// Allows `kernel` up to `bytes` of dynamic shared memory on the current device. A launch gets
// kUnaskedSharedBytes for its static and dynamic shared memory together, so the kernel's static
// size (read once per device, cudaFuncGetAttributes) counts: a kernel with 1 KiB of static arrays
// needs the opt-in from 47 KiB of dynamic memory. `allowed` is the kernel's own flag array (a
// function-local static); setting the attribute twice from two threads is harmless, so the flag is
// only a shortcut. `bytes` must be the largest the kernel is ever launched with, the same on every
// call: the opt-in is made for it even where the launch at hand would fit without (a GPU that
// refuses it, one with less shared memory a block than `bytes` + the static size, refuses every
// launch of the kernel through this helper). A refusal's error is returned, and cleared from the
// runtime's last error, so that the next launch's check does not report it again.
template <typename Kernel>
cudaError_t AllowDynamicSharedMemory(Kernel kernel, size_t bytes, std::atomic<bool> (&allowed)[kMaxOptInDevices]) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxOptInDevices) return cudaErrorInvalidDevice;
  if (allowed[device].load(std::memory_order_acquire)) return cudaSuccess;
  cudaFuncAttributes attributes{};
  err = cudaFuncGetAttributes(&attributes, kernel);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return err;
  }
  if (attributes.sharedSizeBytes + bytes > kUnaskedSharedBytes) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  }
  if (err == cudaSuccess) {
    allowed[device].store(true, std::memory_order_release);
  } else {
    (void)cudaGetLastError();
  }
  return err;
}

}  // namespace specache::cuda
