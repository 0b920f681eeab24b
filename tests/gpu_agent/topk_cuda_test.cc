// Label `gpu`: the CUDA top-k equals cpu::SelectTopK exactly (ties towards the lower index, NaN
// lowest, mean and max reductions, k below, at and above n).
#include "specache/cuda_topk.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cpu_attention.h"
#include "specache/device_probe.h"
#include "testing/cuda_device.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "testing/device_buffers.h"
#endif

namespace specache {
namespace {

TEST(CudaTopKTest, EqualsTheCpuSelectionExactly) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(29);
  const int heads = 4, segments = 6;
  for (int32_t n : {1, 63, 64, 65, 1000, 8192}) {
    for (int k : {1, 64, 128, 100000}) {
      for (GroupReduction red : {GroupReduction::kMean, GroupReduction::kMax}) {
        // Probabilities with many exact ties (a few distinct values), some NaN, some zeros.
        std::vector<float> probs(size_t(segments) * heads * n);
        for (auto& p : probs) {
          const uint32_t r = rng() % 100;
          p = r < 3 ? std::numeric_limits<float>::quiet_NaN() : r < 40 ? static_cast<float>(rng() % 4) * 0.125f
                                                                       : static_cast<float>(rng() % 100000) / 1e5f;
        }
        const int out_k = std::min(k, n);
        float* d_probs = nullptr;
        float* d_scratch = nullptr;
        int32_t* d_tokens = nullptr;
        ASSERT_EQ(cudaMalloc(&d_probs, probs.size() * 4), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_scratch, size_t(segments) * n * 4), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_tokens, size_t(segments) * out_k * 4), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d_probs, probs.data(), probs.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_TRUE(cuda::SelectTopK(d_probs, segments, heads, n, k, red, d_tokens, d_scratch, nullptr).ok());
        std::vector<int32_t> got(size_t(segments) * out_k);
        ASSERT_EQ(cudaMemcpy(got.data(), d_tokens, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        for (int s = 0; s < segments; ++s) {
          std::vector<int32_t> want;
          std::vector<float> scratch;
          cpu::SelectTopK(probs.data() + size_t(s) * heads * n, heads, n, k, red, &want, &scratch);
          const std::vector<int32_t> mine(got.begin() + size_t(s) * out_k, got.begin() + size_t(s + 1) * out_k);
          ASSERT_EQ(mine, want) << "n=" << n << " k=" << k << " reduction=" << static_cast<int>(red) << " segment " << s;
        }
        cudaFree(d_probs);
        cudaFree(d_scratch);
        cudaFree(d_tokens);
      }
    }
  }
#endif
}

// Segments of different lengths in one batched call (more than one launch's worth): each equals
// the CPU's selection of its own probabilities.
TEST(CudaTopKTest, RaggedBatchEqualsTheCpuSelection) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(31);
  const int heads = 4, k = 64, count = cuda::kMaxTopKSegments + 9;
  std::vector<std::vector<float>> probs(count);
  testing::DeviceBuffers buf;
  std::vector<cuda::TopKSegment> segments(count);
  for (int i = 0; i < count; ++i) {
    const int32_t n = static_cast<int32_t>(rng() % (i % 5 == 0 ? 9000 : 300));
    probs[i].resize(size_t(heads) * n);
    for (auto& p : probs[i]) p = rng() % 7 == 0 ? 0.25f : static_cast<float>(rng() % 100000) / 1e5f;
    segments[i] = {buf.Copy(probs[i]), buf.Allocate<int32_t>(k), buf.Allocate<float>(n), n};
    ASSERT_TRUE(segments[i].probs && segments[i].tokens && segments[i].scratch);
  }
  ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), count, heads, k, GroupReduction::kMean, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < count; ++i) {
    const int32_t n = segments[i].n;
    std::vector<int32_t> want;
    std::vector<float> scratch;
    if (n > 0) cpu::SelectTopK(probs[i].data(), heads, n, k, GroupReduction::kMean, &want, &scratch);
    ASSERT_EQ(testing::Download(segments[i].tokens, std::min<int32_t>(k, n)), want) << "segment " << i << " n=" << n;
  }
#endif
}

}  // namespace
}  // namespace specache
