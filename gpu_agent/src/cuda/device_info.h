// Facts about the current CUDA device that launch planning needs.
#pragma once

#include <cuda_runtime.h>

namespace specache::cuda {

// Multiprocessors of the current device; 100 when it cannot be asked (launch sizing only).
inline int MultiprocessorCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    return 100;
  }
  return sms;
}

}  // namespace specache::cuda
