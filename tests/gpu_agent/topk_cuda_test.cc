// Label `gpu`: the CUDA top-k equals cpu::SelectTopK exactly (ties towards the lower index, NaN
// lowest, mean and max reductions, k below, at and above n).
#include "specache/cuda_topk.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cpu_attention.h"
#include "specache/device_probe.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace specache {
namespace {

TEST(CudaTopKTest, EqualsTheCpuSelectionExactly) {
  auto info = ProbeCudaDevice();
  if (!info.ok()) GTEST_SKIP() << "no usable CUDA device: " << info.status().ToString();
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

}  // namespace
}  // namespace specache
