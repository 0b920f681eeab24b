// The growing device buffer the CUDA agent's scratch and per-sequence rows live in (and, through
// cuda_status.h, CUDA errors as Status).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "cuda_status.h"
#include "specache/status.h"

namespace specache::cuda {

// A device (or pinned host) array that only grows, by half again at least (a reallocation waits
// for the device); growing drops the contents. Moving or swapping hands over the allocation
// without touching the device: a move-assigned buffer frees what it held (waiting for the device).
template <typename T, bool kPinned = false>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept {
    Buffer(std::move(o)).swap(*this);
    return *this;
  }
  ~Buffer() { Free(); }
  void swap(Buffer& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
  }
  friend void swap(Buffer& a, Buffer& b) noexcept { a.swap(b); }
  Status Reserve(size_t n) {
    if (n <= n_) return Status::Ok();
    if (n_ > 0) n = std::max(n, n_ + n_ / 2);
    Free();
    void* p = nullptr;
    SPECACHE_RETURN_IF_ERROR(CudaStatus(kPinned ? cudaMallocHost(&p, n * sizeof(T)) : cudaMalloc(&p, n * sizeof(T)),
                                        kPinned ? "pinned buffer" : "device buffer"));
    p_ = static_cast<T*>(p);
    n_ = n;
    return Status::Ok();
  }
  T* get() const { return p_; }
  int64_t bytes() const { return static_cast<int64_t>(n_ * sizeof(T)); }

 private:
  void Free() {
    if (p_) kPinned ? cudaFreeHost(p_) : cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace specache::cuda
