// DeviceBlockPool (cuda_replica.h): slabs of device memory cut into replica blocks, a free list.
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "specache/cuda_replica.h"
#include "specache/quantizer.h"
#include "cuda_status.h"

namespace specache::cuda {
namespace {

constexpr int64_t kAlign = 256;  // every block starts 256-byte aligned; parts 16-byte aligned within

int64_t Up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

}  // namespace

ReplicaBlockLayout MakeReplicaBlockLayout(const ReplicaParams& p, bool interleave_groups) {
  ReplicaBlockLayout l;
  // Whole residual flushes (R tokens) and whole 32-token blocks of the decode kernels fit in one
  // block; 128 tokens at least, so that the table stays short.
  l.block_tokens = std::lcm(std::max(p.residual_tokens, 32), 128);
  const bool interleaved = interleave_groups && p.group_size == 32 && IsPackedBitWidth(p.key_bits) &&
                           IsPackedBitWidth(p.value_bits);
  // Interleaved, the parts below are one 32-token group's; the block repeats them per group.
  const int64_t T = interleaved ? 32 : l.block_tokens, d = p.head_dim, G = p.group_size;
  int64_t at = 0;
  auto part = [&](int64_t bytes) {
    const int64_t offset = at;
    at = Up(at + bytes, 16);
    return static_cast<int32_t>(offset);
  };
  if (IsPackedBitWidth(p.key_bits)) {
    l.key_codes = part(T / G * d * WordsPerGroup(p.group_size, p.key_bits) * 4);
    l.key_scale = part(T / G * d * 2);
    l.key_zero = part(T / G * d * 2);
  } else {
    l.key_half = part(T * d * 2);
  }
  if (IsPackedBitWidth(p.value_bits)) {
    l.value_codes = part(T * (d / G) * WordsPerGroup(p.group_size, p.value_bits) * 4);
    l.value_scale = part(T * (d / G) * 2);
    l.value_zero = part(T * (d / G) * 2);
  } else {
    l.value_half = part(T * d * 2);
  }
  if (interleaved) {  // each part a multiple of 16 bytes: a block is as large as without interleaving
    l.group_bytes = static_cast<int32_t>(at);
    at *= l.block_tokens / 32;
  }
  l.bytes = static_cast<int32_t>(Up(at, kAlign));  // megabytes at most (lcm(R, 128) fp16 rows)
  return l;
}

Result<std::unique_ptr<DeviceBlockPool>> DeviceBlockPool::Create(const ReplicaParams& params, int64_t limit_bytes) {
  if (limit_bytes < 0) return Status::InvalidArgument("device pool size must be >= 0");
  std::unique_ptr<DeviceBlockPool> pool(new DeviceBlockPool());
  pool->layout_ = MakeReplicaBlockLayout(params);
  pool->fixed_ = limit_bytes > 0;
  if (pool->fixed_) {
    const int64_t blocks = limit_bytes / pool->layout_.bytes;
    if (blocks < 1) {
      return Status::InvalidArgument("device pool of " + std::to_string(limit_bytes) + " bytes holds no block of " +
                                     std::to_string(pool->layout_.bytes) + " bytes");
    }
    SPECACHE_RETURN_IF_ERROR(pool->AddSlab(blocks));
  }
  return Result<std::unique_ptr<DeviceBlockPool>>(std::move(pool));
}

DeviceBlockPool::~DeviceBlockPool() {
  for (void* slab : slabs_) cudaFree(slab);
}

Status DeviceBlockPool::AddSlab(int64_t blocks) {
  void* p = nullptr;
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, static_cast<size_t>(blocks * layout_.bytes)), "device block pool"));
  slabs_.push_back(p);
  reserved_ += blocks * layout_.bytes;
  auto* base = static_cast<uint8_t*>(p);
  for (int64_t i = blocks - 1; i >= 0; --i) free_.push_back(base + i * layout_.bytes);  // lowest address first out
  return Status::Ok();
}

Status DeviceBlockPool::Take(int n, std::vector<uint8_t*>* out) {
  if (n <= 0) return Status::Ok();
  if (static_cast<int64_t>(free_.size()) < n) {
    if (fixed_) {
      return Status::ResourceExhausted("device pool exhausted: " + std::to_string(n) + " blocks asked, " +
                                       std::to_string(free_.size()) + " free of " +
                                       std::to_string(reserved_ / layout_.bytes) + " (" + std::to_string(reserved_) +
                                       " bytes; CudaAgentOptions::device_pool_bytes)");
    }
    const int64_t missing = n - static_cast<int64_t>(free_.size());
    SPECACHE_RETURN_IF_ERROR(AddSlab(std::max(missing, std::max<int64_t>(1, kSlabBytes / layout_.bytes))));
  }
  for (int i = 0; i < n; ++i) {
    out->push_back(free_.back());
    free_.pop_back();
  }
  used_ += int64_t{n} * layout_.bytes;
  return Status::Ok();
}

void DeviceBlockPool::Give(uint8_t* block) {
  free_.push_back(block);
  used_ -= layout_.bytes;
}

}  // namespace specache::cuda
