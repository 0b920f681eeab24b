// Used when the build has no CUDA compiler: there is never a device.
#include "specache/device_probe.h"

namespace specache {

bool BuiltWithCuda() { return false; }

Result<CudaDeviceInfo> ProbeCudaDevice() {
  return Status::Unavailable("built without CUDA (no nvcc at configure time)");
}

}  // namespace specache
