// Label `gpu`: DeviceHeadReplica holds byte-for-byte what HeadReplica holds after the same appends
// (every bit width, uneven append sizes crossing flushes and window compactions), and decode
// attention over it equals the CPU's over the CPU replica.
#include "specache/cuda_replica.h"

#include <cmath>
#include <memory>
#include <string>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cpu_attention.h"
#include "specache/device_probe.h"
#include "specache/quantizer.h"
#include "testing/cuda_device.h"
#include "testing/reference.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "testing/device_buffers.h"
#endif

namespace specache {
namespace {

#ifdef SPECACHE_TEST_HAVE_CUDA
using testing::Download;

template <typename T>
std::vector<T> Host(const T* host, size_t n) {
  return std::vector<T>(host, host + n);
}

// Every array of the device replica equals the CPU replica's, byte for byte.
void ExpectSameBytes(const HeadReplica& cpu, const cuda::DeviceHeadReplica& gpu, int G, int bits) {
  ASSERT_EQ(gpu.length(), cpu.length());
  ASSERT_EQ(gpu.quantized_keys(), cpu.quantized_keys());
  ASSERT_EQ(gpu.quantized_values(), cpu.quantized_values());
  EXPECT_EQ(gpu.device_bytes(), cpu.device_bytes());
  EXPECT_GE(gpu.reserved_bytes(), gpu.device_bytes());
  const cuda::DeviceReplicaView view = gpu.view();
  const size_t d = view.head_dim, groups = cpu.quantized_keys() / G, nqv = cpu.quantized_values(), vg = d / G;
  const std::string where = "d=" + std::to_string(d) + " bits=" + std::to_string(bits) + " G=" + std::to_string(G) +
                            " length=" + std::to_string(cpu.length());
  if (bits == 16) {
    if (groups) {
      EXPECT_EQ(Download(view.key_half, groups * G * d), Host(cpu.KeyGroupHalf(0), groups * G * d)) << where;
    }
    if (nqv) {
      EXPECT_EQ(Download(view.value_half, nqv * d), Host(cpu.ValueHalf(0), nqv * d)) << where;
    }
  } else {
    const size_t kw = d * WordsPerGroup(G, bits), vw = vg * WordsPerGroup(G, bits);
    if (groups) {
      EXPECT_EQ(Download(view.key_codes, groups * kw), Host(cpu.KeyGroupCodes(0), groups * kw)) << where;
      EXPECT_EQ(Download(view.key_scale, groups * d), Host(cpu.KeyGroupScale(0), groups * d)) << where;
      EXPECT_EQ(Download(view.key_zero, groups * d), Host(cpu.KeyGroupZero(0), groups * d)) << where;
    }
    if (nqv) {
      EXPECT_EQ(Download(view.value_codes, nqv * vw), Host(cpu.ValueCodes(0), nqv * vw)) << where;
      EXPECT_EQ(Download(view.value_scale, nqv * vg), Host(cpu.ValueScale(0), nqv * vg)) << where;
      EXPECT_EQ(Download(view.value_zero, nqv * vg), Host(cpu.ValueZero(0), nqv * vg)) << where;
    }
  }
  const size_t residual = cpu.length() - cpu.quantized_keys(), window = cpu.length() - nqv;
  EXPECT_EQ(Download(view.residual_keys, residual * d), Host(cpu.ResidualKeys(), residual * d)) << where;
  EXPECT_EQ(Download(view.window_values, window * d), Host(cpu.WindowValues(), window * d)) << where;
}
#endif

TEST(CudaReplicaTest, SameBytesAsTheCpuReplicaAndTheSameAttention) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(31);
  struct Shape {
    int d, bits, G, R;
  } shapes[] = {{64, 1, 32, 64}, {128, 1, 32, 64}, {128, 2, 32, 64}, {64, 4, 32, 64}, {128, 16, 32, 64}, {128, 1, 64, 128}};
  for (const Shape& sh : shapes) {
    const ReplicaParams p{sh.d, sh.bits, sh.bits, sh.G, sh.R};
    HeadReplica cpu(p);
    auto gpu = cuda::DeviceHeadReplica::Create(p, 3000, nullptr);
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    testing::DeviceBuffers buf;
    Half* d_k = buf.Allocate<Half>(1000 * sh.d);
    Half* d_v = buf.Allocate<Half>(1000 * sh.d);
    ASSERT_TRUE(d_k && d_v);
    for (int n : {1, 3, 64, 200, 1, 1, 90, 500, 63, 2, 700}) {
      const auto k = testing::RandomHalves(size_t(n) * sh.d, rng), v = testing::RandomHalves(size_t(n) * sh.d, rng);
      cpu.Append(k.data(), v.data(), n);
      ASSERT_EQ(cudaMemcpy(d_k, k.data(), k.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_v, v.data(), v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE((*gpu)->Append(d_k, d_v, n).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ExpectSameBytes(cpu, **gpu, sh.G, sh.bits);
    }
    // Attention over both replicas: one row, GQA 4, no substitution.
    const int heads = 4, d = sh.d;
    const auto q = testing::RandomFloats(size_t(heads) * d, rng, 0.5f);
    const auto nk = testing::RandomHalves(d, rng), nv = testing::RandomHalves(d, rng);
    std::vector<float> want(size_t(heads) * d);
    cpu::AttentionWorkspace ws;
    cpu::AttendDecodeRows(cpu, {}, q.data(), nk.data(), nv.data(), 1, heads, 1.0f / std::sqrt(float(d)), want.data(), 0, 0,
                          nullptr, &ws);
    cuda::DeviceDecodeRows r;
    r.q = buf.Copy(q);
    r.new_keys = buf.Copy(nk);
    r.new_values = buf.Copy(nv);
    r.n_rows = 1;
    r.n_heads = heads;
    r.scale = 1.0f / std::sqrt(float(d));
    r.out = buf.Allocate<float>(want.size());
    r.scratch = buf.Allocate<float>(static_cast<size_t>(cuda::DecodeScratchFloats(cpu.length(), 1, heads, d)));
    ASSERT_TRUE(cuda::AttendDecodeRows((*gpu)->view(), r, nullptr).ok());
    const std::vector<float> got = Download(r.out, want.size());
    EXPECT_LT(testing::RelativeError(got, std::vector<double>(want.begin(), want.end())), 1e-5);
  }
  // Capacity is enforced.
  auto small = cuda::DeviceHeadReplica::Create({64, 1, 1, 32, 64}, 10, nullptr);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ((*small)->Append(nullptr, nullptr, 11).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cuda::DeviceHeadReplica::Create({64, 3, 1, 32, 64}, 10, nullptr).status().code(), StatusCode::kInvalidArgument);
#endif
}

// The decode step's batched one-token appends leave each replica as a plain Append would (and as
// the CPU replica): replicas at different lengths, so flushes and compactions fall on different
// steps.
TEST(CudaReplicaTest, BatchedTokenAppendsEqualSingleAppends) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(37);
  for (int bits : {1, 2, 16}) {
    const int d = 64, G = 32, R = 64, n = 37, steps = 150;
    const ReplicaParams p{d, bits, bits, G, R};
    std::vector<HeadReplica> cpu(n, HeadReplica(p));
    std::vector<std::unique_ptr<cuda::DeviceHeadReplica>> gpu;
    Half* rows = nullptr;
    ASSERT_EQ(cudaMalloc(&rows, size_t(2) * 300 * d * sizeof(Half)), cudaSuccess);
    for (int i = 0; i < n; ++i) {
      auto r = cuda::DeviceHeadReplica::Create(p, 1000, nullptr);
      ASSERT_TRUE(r.ok());
      gpu.push_back(std::move(r).value());
      const int first = static_cast<int>(rng() % 300);
      const auto k = testing::RandomHalves(size_t(first) * d, rng), v = testing::RandomHalves(size_t(first) * d, rng);
      cpu[i].Append(k.data(), v.data(), first);
      cudaMemcpy(rows, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(rows + 300 * d, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
      ASSERT_TRUE(gpu[i]->Append(rows, rows + 300 * d, first).ok());
    }
    Half* step_rows = nullptr;
    ASSERT_EQ(cudaMalloc(&step_rows, size_t(2) * n * d * sizeof(Half)), cudaSuccess);
    std::vector<cuda::DeviceHeadReplica*> replicas;
    for (auto& r : gpu) replicas.push_back(r.get());
    for (int step = 0; step < steps; ++step) {
      const auto k = testing::RandomHalves(size_t(n) * d, rng), v = testing::RandomHalves(size_t(n) * d, rng);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the previous step's rows were read
      cudaMemcpy(step_rows, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(step_rows + n * d, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
      std::vector<const Half*> keys, values;
      for (int i = 0; i < n; ++i) {
        cpu[i].Append(&k[size_t(i) * d], &v[size_t(i) * d], 1);
        keys.push_back(step_rows + size_t(i) * d);
        values.push_back(step_rows + size_t(n + i) * d);
      }
      ASSERT_TRUE(cuda::DeviceHeadReplica::AppendTokens(replicas, keys, values).ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int i = 0; i < n; ++i) ExpectSameBytes(cpu[i], *gpu[i], G, bits);
    cudaFree(rows);
    cudaFree(step_rows);
  }
#endif
}

}  // namespace
}  // namespace specache
