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

// Long segments (cut into many parts and merged) given as raw scores plus per-head softmax
// statistics: each equals the CPU's selection of the probabilities exp(score - max) / sum.
TEST(CudaTopKTest, LongSegmentsWithStatisticsEqualTheCpuSelection) {
  auto info = ProbeCudaDevice();
  if (!info.ok()) GTEST_SKIP() << "no usable CUDA device: " << info.status().ToString();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(37);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int heads = 4, k = 64;
  for (GroupReduction red : {GroupReduction::kMean, GroupReduction::kMax}) {
    testing::DeviceBuffers buf;
    std::vector<cuda::TopKSegment> segments;
    std::vector<std::vector<float>> probs;
    for (int32_t n : {32768, 100000, 5000, 700}) {
      std::vector<float> raw(size_t(heads) * n), stats(size_t(heads) * 2), p(raw.size());
      for (auto& x : raw) x = normal(rng);
      for (int h = 0; h < heads; ++h) {
        const float* row = raw.data() + size_t(h) * n;
        const float m = *std::max_element(row, row + n);
        float sum = 0.0f;
        for (int32_t j = 0; j < n; ++j) sum += std::exp(row[j] - m);
        stats[2 * h] = m;
        stats[2 * h + 1] = sum;
        for (int32_t j = 0; j < n; ++j) p[size_t(h) * n + j] = std::exp(row[j] - m) / sum;
      }
      segments.push_back({buf.Copy(raw), buf.Allocate<int32_t>(k), buf.Allocate<float>(n), n, buf.Copy(stats)});
      probs.push_back(std::move(p));
    }
    ASSERT_TRUE(cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), heads, k, red, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < segments.size(); ++i) {
      std::vector<int32_t> want;
      std::vector<float> scratch;
      cpu::SelectTopK(probs[i].data(), heads, segments[i].n, k, red, &want, &scratch);
      ASSERT_EQ(testing::Download(segments[i].tokens, k), want) << "n=" << segments[i].n;
    }
  }
#endif
}

}  // namespace
}  // namespace specache
