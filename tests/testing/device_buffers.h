// Device memory for the CUDA tests (builds with SPECACHE_TEST_HAVE_CUDA): uploads and zeroed
// buffers that one DeviceBuffers owns and frees with itself, and downloads. Every CUDA call's
// result is checked.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace specache::testing {

class DeviceBuffers {
 public:
  DeviceBuffers() = default;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    for (void* p : owned_) cudaFree(p);
  }

  // n elements, not initialised. At least one element is allocated, so an empty buffer is still
  // a valid address; null only if the allocation failed (and the test with it).
  template <typename T>
  T* Allocate(size_t n) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    if (d) owned_.push_back(d);
    return static_cast<T*>(d);
  }
  // A device copy of host[0, n).
  template <typename T>
  T* Copy(const T* host, size_t n) {
    T* d = Allocate<T>(n);
    if (d && n) {
      EXPECT_EQ(cudaMemcpy(d, host, n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
    return d;
  }
  template <typename T>
  T* Copy(const std::vector<T>& host) {
    return Copy(host.data(), host.size());
  }
  // n elements of zero bytes.
  template <typename T>
  T* Zeros(size_t n) {
    T* d = Allocate<T>(n);
    if (d) {
      EXPECT_EQ(cudaMemset(d, 0, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    }
    return d;
  }

 private:
  std::vector<void*> owned_;
};

// A host copy of device[0, n).
template <typename T>
std::vector<T> Download(const T* device, size_t n) {
  std::vector<T> host(n);
  if (n) {
    EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return host;
}

}  // namespace specache::testing
