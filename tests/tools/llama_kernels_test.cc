// The GPU model's small kernels (llama_kernels.h) against CPU references on random inputs:
// RMSNorm to fp16 (rows of a width divisible by 4, read as float4, and of another width), SwiGLU
// from fp32 and from fp16 halves, the Q/K/V split with RoPE, and the argmax of logits rows (ties
// to the lowest index). Needs a device (label gpu).
#include <cmath>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "llama_kernels.h"
#include "specache/half.h"
#include "testing/cuda_device.h"
#include "testing/device_buffers.h"
#include "testing/reference.h"

namespace specache::gpu {
namespace {

// n normal draws of standard deviation `scale` from a generator seeded with `seed`.
std::vector<float> Random(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  return testing::RandomFloats(n, rng, scale);
}

// The kernels' results, once every queued kernel finished without an error.
template <typename T>
std::vector<T> Finished(const T* device, size_t n) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return testing::Download(device, n);
}

// Whether fp16 `got` is within one unit in the last place of fp16 `want` (below 2^-14, the
// subnormals' fixed spacing 2^-24).
bool WithinOneUlp(float got, float want) {
  const float ulp = std::ldexp(1.0f, std::ilogb(std::max(std::fabs(want), 0x1p-14f)) - 10);
  return std::fabs(got - want) <= ulp * 1.01f;
}

class LlamaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override { SPECACHE_REQUIRE_CUDA_DEVICE(); }
};

TEST_F(LlamaKernelsTest, RmsNormMatchesTheCpu) {
  for (int d : {4096, 576, 102}) {  // 102: not a multiple of 4 (no float4 reads)
    for (int rows : {1, 3, 198}) {
      const auto x = Random(size_t(rows) * d, 1.5f, d + rows), w = Random(d, 1.0f, 7);
      testing::DeviceBuffers buf;
      Half* out = buf.Allocate<Half>(x.size());
      RmsNormToHalf(buf.Copy(x), rows, d, buf.Copy(w), 1e-5f, out, nullptr);
      const std::vector<Half> got = Finished(out, x.size());
      for (int r = 0; r < rows; ++r) {
        double ss = 0;
        for (int c = 0; c < d; ++c) ss += double(x[size_t(r) * d + c]) * x[size_t(r) * d + c];
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / d + 1e-5));
        for (int c = 0; c < d; ++c) {
          const size_t i = size_t(r) * d + c;
          const float want = RoundToHalf(x[i] * inv * w[c]);
          if (!WithinOneUlp(HalfToFloat(got[i]), want)) {
            ADD_FAILURE() << "width " << d << ", row " << r << ", column " << c << ": " << HalfToFloat(got[i])
                          << " against " << want;
            return;
          }
        }
      }
    }
  }
}

TEST_F(LlamaKernelsTest, SiluMulMatchesTheCpuFromFloatAndHalf) {
  for (int ffn : {1536, 14336, 37, 1538, 4}) {  // by fours, and not (37, 1538)
    for (int rows : {1, 198}) {
      const auto gu = Random(size_t(rows) * 2 * ffn, 2.0f, ffn + rows);
      std::vector<Half> gu_half(gu.size());
      for (size_t i = 0; i < gu.size(); ++i) gu_half[i] = ::specache::FloatToHalf(gu[i]);
      testing::DeviceBuffers buf;
      const size_t n = size_t(rows) * ffn;
      Half *out = buf.Allocate<Half>(n), *out_half = buf.Allocate<Half>(n);
      SiluMul(buf.Copy(gu), out, rows, ffn, nullptr);
      SiluMul(buf.Copy(gu_half), out_half, rows, ffn, nullptr);
      const std::vector<Half> got = Finished(out, n), got_half = Finished(out_half, n);
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < ffn; ++c) {
          const size_t i = size_t(r) * ffn + c, g = size_t(r) * 2 * ffn + c;
          auto silu_mul = [](float a, float b) { return a / (1.0f + std::exp(-a)) * b; };
          const float want = RoundToHalf(silu_mul(gu[g], gu[g + ffn]));
          const float want_half = RoundToHalf(silu_mul(HalfToFloat(gu_half[g]), HalfToFloat(gu_half[g + ffn])));
          if (!WithinOneUlp(HalfToFloat(got[i]), want) || !WithinOneUlp(HalfToFloat(got_half[i]), want_half)) {
            ADD_FAILURE() << "ffn " << ffn << ", row " << r << ", column " << c << ": " << HalfToFloat(got[i]) << " / "
                          << HalfToFloat(got_half[i]) << " against " << want << " / " << want_half;
            return;
          }
        }
      }
    }
  }
}

// The kernel of four columns a thread (16-byte aligned tensors, ffn a multiple of 4) and the one of
// a column a thread (the same tensors one element past 16-byte alignment) give the same bits.
TEST_F(LlamaKernelsTest, SiluMulByFoursEqualsTheOneColumnKernelBitForBit) {
  for (int ffn : {1536, 1538, 4}) {
    const int rows = 67;
    const auto gu = Random(size_t(rows) * 2 * ffn, 4.0f, ffn);
    std::vector<Half> gu_half(gu.size());
    for (size_t i = 0; i < gu.size(); ++i) gu_half[i] = ::specache::FloatToHalf(gu[i]);
    testing::DeviceBuffers buf;
    const size_t n = size_t(rows) * ffn;
    // Each input in two buffers: at offset 0 (aligned: cudaMalloc's 256 bytes) and at offset 1.
    const float* f = buf.Copy(gu);
    const Half* h = buf.Copy(gu_half);
    float* f_off = buf.Allocate<float>(gu.size() + 1);
    Half* h_off = buf.Allocate<Half>(gu.size() + 1);
    ASSERT_EQ(cudaMemcpy(f_off + 1, gu.data(), gu.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(h_off + 1, gu_half.data(), gu.size() * sizeof(Half), cudaMemcpyHostToDevice), cudaSuccess);
    Half* by_fours = buf.Allocate<Half>(n);
    Half* by_ones = buf.Allocate<Half>(n + 1);
    for (const bool half_input : {false, true}) {
      if (half_input) {
        SiluMul(h, by_fours, rows, ffn, nullptr);
        SiluMul(h_off + 1, by_ones + 1, rows, ffn, nullptr);
      } else {
        SiluMul(f, by_fours, rows, ffn, nullptr);
        SiluMul(f_off + 1, by_ones + 1, rows, ffn, nullptr);
      }
      const std::vector<Half> a = Finished(by_fours, n), b = Finished(by_ones + 1, n);
      for (size_t i = 0; i < n; ++i) {
        if (a[i] != b[i]) {
          ADD_FAILURE() << "ffn " << ffn << (half_input ? ", half" : ", float") << " input, element " << i << ": "
                        << HalfToFloat(a[i]) << " by fours, " << HalfToFloat(b[i]) << " a column a thread";
          break;
        }
      }
    }
  }
}

TEST_F(LlamaKernelsTest, SplitQkvRopeMatchesTheCpu) {
  const int n = 5, n_heads = 4, n_kv = 2, hd = 64, width = (n_heads + 2 * n_kv) * hd;
  const auto qkv = Random(size_t(n) * width, 1.0f, 3);
  std::vector<float> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / hd));
  const std::vector<int32_t> positions{0, 1, 17, 4095, 131071};
  testing::DeviceBuffers buf;
  const size_t nq = size_t(n) * n_heads * hd, nkv = size_t(n) * n_kv * hd;
  float *q = buf.Allocate<float>(nq), *k = buf.Allocate<float>(nkv), *v = buf.Allocate<float>(nkv);
  SplitQkvRope(buf.Copy(qkv), n, n_heads, n_kv, hd, buf.Copy(positions), buf.Copy(inv_freq), q, k, v, nullptr);
  const auto gq = Finished(q, nq), gk = Finished(k, nkv), gv = Finished(v, nkv);
  for (int r = 0; r < n; ++r) {
    for (int head = 0; head < n_heads + 2 * n_kv; ++head) {
      for (int p = 0; p < hd / 2; ++p) {
        const float a = qkv[size_t(r) * width + head * hd + 2 * p], b = qkv[size_t(r) * width + head * hd + 2 * p + 1];
        float ra = a, rb = b;
        if (head < n_heads + n_kv) {
          const double angle = double(inv_freq[p]) * positions[r];
          const float cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
          ra = a * cs - b * sn;
          rb = a * sn + b * cs;
        }
        const float* got = head < n_heads          ? &gq[(size_t(r) * n_heads + head) * hd]
                           : head < n_heads + n_kv ? &gk[(size_t(r) * n_kv + head - n_heads) * hd]
                                                   : &gv[(size_t(r) * n_kv + head - n_heads - n_kv) * hd];
        ASSERT_NEAR(got[2 * p], ra, 1e-5f * (std::fabs(a) + std::fabs(b))) << "row " << r << " head " << head;
        ASSERT_NEAR(got[2 * p + 1], rb, 1e-5f * (std::fabs(a) + std::fabs(b))) << "row " << r << " head " << head;
      }
    }
  }
}

TEST_F(LlamaKernelsTest, ArgmaxTakesTheLowestIndexAmongEquals) {
  const int rows = 4, vocab = 49152;
  auto logits = Random(size_t(rows) * vocab, 3.0f, 11);
  logits[size_t(1) * vocab + 300] = logits[size_t(1) * vocab + 40000] = 100.0f;  // a tie
  logits[size_t(2) * vocab + vocab - 1] = 50.0f;                                    // the last column
  testing::DeviceBuffers buf;
  int32_t* out = buf.Allocate<int32_t>(rows);
  ArgmaxRows(buf.Copy(logits), rows, vocab, out, nullptr);
  const auto got = Finished(out, rows);
  for (int r = 0; r < rows; ++r) {
    int32_t best = 0;
    for (int c = 1; c < vocab; ++c) {
      if (logits[size_t(r) * vocab + c] > logits[size_t(r) * vocab + best]) best = c;
    }
    EXPECT_EQ(got[r], best) << "row " << r;
  }
  EXPECT_EQ(got[1], 300);
  EXPECT_EQ(got[2], vocab - 1);
}

}  // namespace
}  // namespace specache::gpu
