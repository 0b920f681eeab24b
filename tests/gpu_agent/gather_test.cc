// Label `gpu`: the zero-copy gather kernel against a CPU gather of the same rows (bytes must be
// identical). Skips without a device.
#include "specache/cuda_gather.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/device_probe.h"
#include "testing/cuda_device.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace specache {
namespace {

TEST(CudaGatherTest, RowsFromRegisteredHostMemoryEqualACpuGather) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const size_t host_bytes = size_t{64} << 20;
  std::vector<uint8_t> host(host_bytes + 4096);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(host.data()) + 4095) & ~uintptr_t{4095});
  std::mt19937_64 rng(5);
  for (size_t i = 0; i < host_bytes; i += 8) {
    const uint64_t r = rng();
    std::memcpy(base + i, &r, 8);
  }
  auto device_base = cuda::RegisterHostMemory(base, host_bytes);
  ASSERT_TRUE(device_base.ok()) << device_base.status().ToString();
  for (int row_bytes : {16, 256, 512, 1040}) {
    for (int64_t n_rows : {int64_t{1}, int64_t{37}, int64_t{4096}, int64_t{40000}}) {
      std::vector<uint64_t> offsets(n_rows), addresses(n_rows);
      for (auto& o : offsets) o = (rng() % (host_bytes / row_bytes)) * row_bytes;
      std::sort(offsets.begin(), offsets.end());
      for (int64_t i = 0; i < n_rows; ++i) addresses[i] = *device_base + offsets[i];
      uint64_t* d_addresses = nullptr;
      uint8_t* d_rows = nullptr;
      ASSERT_EQ(cudaMalloc(&d_addresses, n_rows * sizeof(uint64_t)), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_rows, n_rows * row_bytes), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_addresses, addresses.data(), n_rows * sizeof(uint64_t), cudaMemcpyHostToDevice),
                cudaSuccess);
      // Few blocks: every thread loops over many pieces.
      for (int blocks : {3, 264}) {
        ASSERT_EQ(cudaMemset(d_rows, 0, n_rows * row_bytes), cudaSuccess);
        ASSERT_TRUE(cuda::LaunchGatherRows(d_addresses, d_rows, n_rows, row_bytes, blocks, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<uint8_t> got(n_rows * row_bytes);
        ASSERT_EQ(cudaMemcpy(got.data(), d_rows, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        for (int64_t i = 0; i < n_rows; ++i) {
          ASSERT_EQ(std::memcmp(got.data() + i * row_bytes, base + offsets[i], row_bytes), 0)
              << "row " << i << " of " << n_rows << ", " << row_bytes << " bytes, " << blocks << " blocks";
        }
      }
      // Sources in reverse order with a destination permutation: the same rows land in place.
      std::vector<uint64_t> reversed(addresses.rbegin(), addresses.rend());
      std::vector<uint32_t> dst_rows(n_rows);
      for (int64_t i = 0; i < n_rows; ++i) dst_rows[i] = static_cast<uint32_t>(n_rows - 1 - i);
      uint32_t* d_dst_rows = nullptr;
      ASSERT_EQ(cudaMalloc(&d_dst_rows, n_rows * sizeof(uint32_t)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_addresses, reversed.data(), n_rows * sizeof(uint64_t), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_dst_rows, dst_rows.data(), n_rows * sizeof(uint32_t), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_rows, 0, n_rows * row_bytes), cudaSuccess);
      ASSERT_TRUE(cuda::LaunchGatherRows(d_addresses, d_rows, n_rows, row_bytes, 64, nullptr, d_dst_rows).ok());
      std::vector<uint8_t> permuted(n_rows * row_bytes);
      ASSERT_EQ(cudaMemcpy(permuted.data(), d_rows, permuted.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      for (int64_t i = 0; i < n_rows; ++i) {
        ASSERT_EQ(std::memcmp(permuted.data() + i * row_bytes, base + offsets[i], row_bytes), 0) << "permuted row " << i;
      }
      cudaFree(d_dst_rows);
      cudaFree(d_addresses);
      cudaFree(d_rows);
    }
  }
  EXPECT_EQ(cuda::LaunchGatherRows(nullptr, nullptr, 4, 24, 8, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda::LaunchGatherRows(nullptr, nullptr, 0, 512, 8, nullptr).ok());
  EXPECT_TRUE(cuda::UnregisterHostMemory(base).ok());
#endif
}

}  // namespace
}  // namespace specache
