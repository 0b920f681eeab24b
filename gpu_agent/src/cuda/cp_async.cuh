// Asynchronous 16-byte copies from global to shared memory (cp.async, sm_80+), shared by the
// attention kernels that stage their inputs a tile ahead of the compute.
#pragma once

#include <cuda_runtime.h>

namespace specache::cuda {

// Both ends 16-byte aligned. Traps below sm_80: the hosts route only sm_80+ devices here.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
#else
  __trap();
#endif
}
// The same, or 16 zero bytes when !valid (gmem is then not read, but must be a valid address).
__device__ __forceinline__ void CpAsync16OrZeros(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
#else
  __trap();
#endif
}
__device__ __forceinline__ void CpAsyncCommit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most one committed group of this thread is still in flight.
__device__ __forceinline__ void CpAsyncWaitButOne() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::);
#endif
}
// Waits for every committed group of this thread.
__device__ __forceinline__ void CpAsyncWaitAll() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::);
#endif
}

}  // namespace specache::cuda
