#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>

#include "specache/cuda_gather.h"

namespace specache::cuda {
namespace {

Status FromCuda(cudaError_t err, const char* what) {
  return Status::Unavailable(std::string(what) + ": " + cudaGetErrorString(err));
}

// One thread per 16-byte piece: piece p of the batch is piece (p % per_row) of row (p / per_row).
__global__ void GatherRowsKernel(const uint64_t* __restrict__ src, uint4* __restrict__ dst,
                                 const uint32_t* __restrict__ dst_rows, int64_t pieces, int per_row) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pieces; p += stride) {
    const int64_t row = p / per_row;
    const int piece = static_cast<int>(p - row * per_row);
    const uint4* s = reinterpret_cast<const uint4*>(src[row]) + piece;
    const int64_t out_row = dst_rows ? static_cast<int64_t>(dst_rows[row]) : row;
    dst[out_row * per_row + piece] = *s;
  }
}

}  // namespace

namespace {

// Registrations are counted per base address, process-wide: several agents (or an agent and a
// benchmark) may map the same daemon chunks, and the memory stays registered until the last one
// lets go. A range registered by someone outside this file is used, never unregistered here.
struct Registration {
  int count = 0;
  uint64_t device = 0;
  bool owned = true;
};
std::mutex registrations_mu;
std::map<void*, Registration>& Registrations() {
  static auto* registrations = new std::map<void*, Registration>();
  return *registrations;
}

}  // namespace

Result<uint64_t> RegisterHostMemory(void* host, size_t bytes) {
  std::lock_guard<std::mutex> lock(registrations_mu);
  auto it = Registrations().find(host);
  if (it != Registrations().end()) {
    ++it->second.count;
    return it->second.device;
  }
  Registration r;
  cudaError_t err = cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    r.owned = false;
  } else if (err != cudaSuccess) {
    cudaGetLastError();
    return FromCuda(err, "cudaHostRegister");
  }
  void* device = nullptr;
  if ((err = cudaHostGetDevicePointer(&device, host, 0)) != cudaSuccess) {
    cudaGetLastError();
    if (r.owned) cudaHostUnregister(host);
    return FromCuda(err, "cudaHostGetDevicePointer");
  }
  r.count = 1;
  r.device = reinterpret_cast<uint64_t>(device);
  Registrations()[host] = r;
  return r.device;
}

Status UnregisterHostMemory(void* host) {
  std::lock_guard<std::mutex> lock(registrations_mu);
  auto it = Registrations().find(host);
  if (it == Registrations().end()) return Status::NotFound("host memory was not registered here");
  if (--it->second.count > 0) return Status::Ok();
  const bool owned = it->second.owned;
  Registrations().erase(it);
  if (!owned) return Status::Ok();
  const cudaError_t err = cudaHostUnregister(host);
  if (err != cudaSuccess) cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : FromCuda(err, "cudaHostUnregister");
}

Status LaunchGatherRows(const uint64_t* device_src_addresses, void* device_dst, int64_t n_rows, int row_bytes,
                        int max_blocks, void* stream, const uint32_t* device_dst_rows) {
  if (row_bytes <= 0 || row_bytes % 16 != 0) return Status::InvalidArgument("row_bytes must be a positive multiple of 16");
  if (n_rows < 0 || max_blocks <= 0) return Status::InvalidArgument("negative row count or no blocks");
  if (n_rows == 0) return Status::Ok();
  const int per_row = row_bytes / 16;
  const int64_t pieces = n_rows * per_row;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>(max_blocks, (pieces + kThreads - 1) / kThreads));
  GatherRowsKernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      device_src_addresses, static_cast<uint4*>(device_dst), device_dst_rows, pieces, per_row);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : FromCuda(err, "gather kernel launch");
}

}  // namespace specache::cuda
