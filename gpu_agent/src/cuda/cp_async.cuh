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
// The L2 policy of a copy's lines (cp.async's L2::cache_hint, sm_80+).
enum class L2Policy {
  kNormal,
  kEvictFirst,  // evict the copied lines first: bytes read once whose lines would otherwise push
                // out data that is read again soon
};
// kPieces copies of 16 bytes by one lane: piece i from gmem + i kStride to the shared-window
// address smem + i kStride (__cvta_generic_to_shared), their lines in L2 as kPolicy asks. The
// offsets are the instructions' immediates, so the lane's two addresses are all it computes.
// Traps below sm_80, as CpAsync16.
template <int kPieces, int kStride, L2Policy kPolicy = L2Policy::kNormal, int kAt = 0>
__device__ __forceinline__ void CpAsync16Pieces(unsigned smem, const void* gmem) {
  if constexpr (kAt < kPieces) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (kPolicy == L2Policy::kEvictFirst) {
      asm volatile(
          "{\n .reg .b64 policy;\n createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
          " cp.async.cg.shared.global.L2::cache_hint [%0+%2], [%1+%2], 16, policy;\n}\n" ::"r"(smem),
          "l"(gmem), "n"(kAt * kStride));
    } else {
      asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;\n" ::"r"(smem), "l"(gmem), "n"(kAt * kStride));
    }
#else
    __trap();
#endif
    CpAsync16Pieces<kPieces, kStride, kPolicy, kAt + 1>(smem, gmem);
  }
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
