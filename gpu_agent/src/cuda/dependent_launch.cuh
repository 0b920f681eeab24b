// Programmatic dependent launch (sm_90+): a kernel launched with LaunchAfter may be scheduled
// while the kernel before it in the stream is still running, once every CTA of that kernel has
// called AllowDependentLaunch (or exited); it must call WaitForPrerequisite before it reads
// anything the kernel before it writes, and then sees all of it. Launched plainly (older GPUs,
// code without sm_90, or a stream operation between the two kernels) the calls do nothing and
// the order is the stream's. Saves the gap between a kernel's last CTAs and the next kernel's
// start: its CTAs are placed in the slots the last wave frees and wait there (also slots left
// free for other streams' kernels, such as the agent's fetch).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "device_info.h"

namespace specache::cuda {

// Lets the next kernel in the stream, if launched with LaunchAfter, be scheduled (a CTA's first
// call counts; every thread may call it).
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the kernel before this one in the stream has finished and its writes are visible.
__device__ __forceinline__ void WaitForPrerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether kKernel, as it runs on the current device, was compiled from sm_90+ code (PTX 9.0 or
// later: only there do the two calls above exist), asked once per device. A build without sm_90
// code run on a Hopper GPU JIT-compiles its compute_80 PTX, which has neither call: launched as a
// dependent, such a kernel would not wait for its predecessor.
template <auto kKernel>
bool DependentLaunchAllowed() {
  static std::atomic<int> known[kMaxKnownDevices] = {};  // 1 yes, 2 no
  return KnownForCurrentDevice(known, 2, [](int) {
           cudaFuncAttributes attributes{};
           if (cudaFuncGetAttributes(&attributes, kKernel) != cudaSuccess) {
             (void)cudaGetLastError();
             return 2;
           }
           return attributes.ptxVersion >= 90 ? 1 : 2;
         }) == 1;
}

// kKernel<<<grid, block, shared_bytes, stream>>>(args...), as a programmatic dependent of the
// kernel before it where DependentLaunchAllowed (kKernel calls WaitForPrerequisite first).
template <auto kKernel, typename... Args>
cudaError_t LaunchAfter(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1] = {};
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (DependentLaunchAllowed<kKernel>()) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kKernel, static_cast<Args&&>(args)...);
}

}  // namespace specache::cuda
