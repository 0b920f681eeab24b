// Label `gpu`: the agent's small tensor kernels (cuda_tensors.h) against CPU references on random
// inputs: the float-to-fp16 rows (one tensor, and a layer's keys and values in one launch, bit for
// bit with FloatToHalf), the batched row copies and the K/V interleave. Skips without a device.
#include "specache/cuda_tensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/half.h"
#include "testing/cuda_device.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace specache {
namespace {

#ifdef SPECACHE_TEST_HAVE_CUDA
template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(host.size(), 1) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}
template <typename T>
std::vector<T> ToHost(const T* p, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}
// Random floats over fp16's range and beyond (overflow to infinity, subnormals, ties).
std::vector<float> RandomFloats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> exponent(-26.0f, 17.0f);
  std::vector<float> v(n);
  for (float& x : v) x = (rng() & 1 ? -1.0f : 1.0f) * std::exp2(exponent(rng));
  return v;
}
#endif

TEST(CudaTensorsTest, FloatRowsToHalfOneTensorAndAKeyValuePairEqualFloatToHalf) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  for (int d : {64, 128}) {
    for (int32_t n : {1, 3, 257, 5000}) {  // 5000 x 128: more than the grid's 1024 blocks cover at once
      const int64_t stride = int64_t{d} * 3 + 8;  // rows inside a wider tensor
      const size_t src_floats = static_cast<size_t>((n - 1) * stride + d);
      const std::vector<float> k = RandomFloats(src_floats, 11 + n), v = RandomFloats(src_floats, 97 + n);
      float* dk = ToDevice(k);
      float* dv = ToDevice(v);
      Half *hk = nullptr, *hv = nullptr, *one = nullptr;
      const size_t out = size_t(n) * d;
      ASSERT_EQ(cudaMalloc(&hk, out * sizeof(Half)), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&hv, out * sizeof(Half)), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&one, out * sizeof(Half)), cudaSuccess);
      ASSERT_TRUE(cuda::FloatKeyValueRowsToHalf(dk, dv, n, d, stride, hk, hv, nullptr).ok());
      ASSERT_TRUE(cuda::FloatRowsToHalf(dv, n, d, stride, one, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<Half> got_k = ToHost(hk, out), got_v = ToHost(hv, out), got_one = ToHost(one, out);
      for (int32_t i = 0; i < n; ++i) {
        for (int c = 0; c < d; ++c) {
          const size_t at = size_t(i) * d + c, from = size_t(i) * stride + c;
          ASSERT_EQ(got_k[at], FloatToHalf(k[from])) << "key row " << i << " col " << c << " d " << d;
          ASSERT_EQ(got_v[at], FloatToHalf(v[from])) << "value row " << i << " col " << c << " d " << d;
          ASSERT_EQ(got_one[at], got_v[at]) << "row " << i << " col " << c;
        }
      }
      for (void* p : {static_cast<void*>(dk), static_cast<void*>(dv), static_cast<void*>(hk), static_cast<void*>(hv),
                      static_cast<void*>(one)}) {
        cudaFree(p);
      }
    }
  }
  // Nothing to convert: nothing launched, no error.
  EXPECT_TRUE(cuda::FloatKeyValueRowsToHalf(nullptr, nullptr, 0, 64, 64, nullptr, nullptr, nullptr).ok());
#endif
}

TEST(CudaTensorsTest, CopyRowsAndInterleaveKvEqualACpuCopy) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937_64 rng(3);
  const int d = 64, n = 300;
  std::vector<Half> k(size_t(n) * d), v(size_t(n) * d);
  for (Half& h : k) h = static_cast<Half>(rng());
  for (Half& h : v) h = static_cast<Half>(rng());
  Half* dk = ToDevice(k);
  Half* dv = ToDevice(v);
  Half *rows = nullptr, *copied = nullptr;
  ASSERT_EQ(cudaMalloc(&rows, size_t(n) * 2 * d * sizeof(Half)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&copied, size_t(n) * d * sizeof(Half)), cudaSuccess);
  ASSERT_TRUE(cuda::InterleaveKv(dk, dv, n, d, rows, nullptr).ok());
  // Every key row to a shuffled place (many small copies, one launch).
  std::vector<int> place(n);
  for (int i = 0; i < n; ++i) place[i] = i;
  std::shuffle(place.begin(), place.end(), rng);
  std::vector<cuda::RowCopy> copies(n);
  for (int i = 0; i < n; ++i) copies[i] = {dk + size_t(i) * d, copied + size_t(place[i]) * d};
  ASSERT_TRUE(cuda::CopyRows(copies.data(), n, d * static_cast<int>(sizeof(Half)), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<Half> got_rows = ToHost(rows, size_t(n) * 2 * d), got_copied = ToHost(copied, size_t(n) * d);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(std::memcmp(&got_rows[size_t(i) * 2 * d], &k[size_t(i) * d], d * sizeof(Half)), 0) << "row " << i;
    ASSERT_EQ(std::memcmp(&got_rows[(size_t(i) * 2 + 1) * d], &v[size_t(i) * d], d * sizeof(Half)), 0) << "row " << i;
    ASSERT_EQ(std::memcmp(&got_copied[size_t(place[i]) * d], &k[size_t(i) * d], d * sizeof(Half)), 0) << "row " << i;
  }
  for (Half* p : {dk, dv, rows, copied}) cudaFree(p);
#endif
}

}  // namespace
}  // namespace specache
