// Facts about the current CUDA device that launch planning needs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace specache::cuda {

constexpr int kMaxKnownDevices = 64;

// What `ask(device)` (nonzero) says of the current device, asked once per device and kept in
// `known`, the caller's function-local static (0: not asked yet); `fallback` when the device cannot
// be named. Two threads asking at once both ask and keep the same answer.
template <typename Ask>
int KnownForCurrentDevice(std::atomic<int> (&known)[kMaxKnownDevices], int fallback, Ask ask) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxKnownDevices) return fallback;
  int value = known[device].load(std::memory_order_acquire);
  if (value == 0) {
    value = ask(device);
    known[device].store(value, std::memory_order_release);
  }
  return value;
}

// The current device's L2 bytes, asked once per device; 0 when they cannot be asked.
inline int64_t CurrentDeviceL2Bytes() {
  static std::atomic<int> known_kib[kMaxKnownDevices] = {};  // KiB: a KnownForCurrentDevice value is an int
  const int kib = KnownForCurrentDevice(known_kib, -1, [](int device) {
    int bytes = 0;
    return cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, device) == cudaSuccess && bytes >= 1024 ? bytes / 1024
                                                                                                           : -1;
  });
  return kib > 0 ? int64_t{kib} * 1024 : 0;
}

// Multiprocessors of the current device, asked once per device (a launch plans with it every
// layer: asking the driver each time cost ~2 us of a host-bound layer); 100 when it cannot be
// asked (launch sizing only).
inline int MultiprocessorCount() {
  static std::atomic<int> known[kMaxKnownDevices] = {};
  return KnownForCurrentDevice(known, 100, [](int device) {
    int n = 0;
    return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess && n > 0 ? n : 100;
  });
}

// Whether the current device's compute capability is at least `major`.0, asked once per device
// and kept in `known` (the caller's function-local static); false when it cannot be asked.
inline bool CurrentDeviceAtLeast(std::atomic<int> (&known)[kMaxKnownDevices], int major) {
  return KnownForCurrentDevice(known, 2, [major](int device) {
           int have = 0;
           return cudaDeviceGetAttribute(&have, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && have >= major
                      ? 1 : 2;
         }) == 1;
}

}  // namespace specache::cuda
