// Label `gpu`: DeviceHeadReplica holds byte-for-byte what HeadReplica holds after the same appends
// (every bit width, uneven append sizes crossing flushes and window compactions), and decode
// attention over it equals the CPU's over the CPU replica.
#include "specache/cuda_replica.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
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

#include "mma_codes.h"
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

// Every array of the device replica equals the CPU replica's, byte for byte; with mma codes, the
// groups whose keys and values are both quantized hold the same codes in the mma layout, and the
// key scale bound is the largest key scale of those groups.
void ExpectSameBytes(const HeadReplica& cpu, const cuda::DeviceHeadReplica& gpu, int G, int bits, bool mma = false) {
  ASSERT_EQ(gpu.length(), cpu.length());
  ASSERT_EQ(gpu.quantized_keys(), cpu.quantized_keys());
  ASSERT_EQ(gpu.quantized_values(), cpu.quantized_values());
  EXPECT_EQ(gpu.device_bytes(), cpu.device_bytes());
  EXPECT_GE(gpu.reserved_bytes(), gpu.device_bytes());
  // Every block read back whole; the view's table pointed at the host copies, so that the
  // accessors the kernels use find each group's and token's parts in them.
  cuda::DeviceReplicaView view = gpu.view();
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<const uint8_t*> table;
  for (const uint8_t* block : gpu.block_addresses()) {
    blocks.push_back(Download(block, static_cast<size_t>(view.layout.bytes)));
    table.push_back(blocks.back().data());
  }
  view.blocks = table.data();
  const size_t d = view.head_dim, groups = cpu.quantized_keys() / G, nqv = cpu.quantized_values(), vg = d / G;
  const std::string where = "d=" + std::to_string(d) + " bits=" + std::to_string(bits) + " G=" + std::to_string(G) +
                            " length=" + std::to_string(cpu.length());
  if (bits == 16) {
    for (size_t t = 0; t < groups * G; ++t) {
      ASSERT_EQ(Host(cuda::KeyHalf(view, int32_t(t)), d), Host(cpu.KeyGroupHalf(0) + t * d, d)) << where << " key " << t;
    }
    for (size_t t = 0; t < nqv; ++t) {
      ASSERT_EQ(Host(cuda::ValueHalf(view, int32_t(t)), d), Host(cpu.ValueHalf(int32_t(t)), d)) << where << " value " << t;
    }
  } else {
    const size_t kw = d * WordsPerGroup(G, bits), vw = vg * WordsPerGroup(G, bits);
    const size_t whole = mma ? std::min<size_t>(groups * G, nqv) / 32 : 0;  // groups in the mma layout
    ASSERT_EQ(view.mma_codes != 0, mma) << where;
    float bound = 0.0f;
    for (size_t g = 0; g < whole; ++g) {
      const int32_t gi = static_cast<int32_t>(g);
      const cuda::NaturalGroupArrays n = cuda::UnpackMmaGroup(
          {cuda::KeyCodes(view, gi), cuda::KeyScales(view, gi), cuda::KeyZeros(view, gi), cuda::ValueCodes(view, gi * 32),
           cuda::ValueScales(view, gi * 32), cuda::ValueZeros(view, gi * 32)},
          static_cast<int>(d));
      ASSERT_EQ(n.key_codes, Host(cpu.KeyGroupCodes(gi), d)) << where << " mma group " << g;
      ASSERT_EQ(n.key_scale, Host(cpu.KeyGroupScale(gi), d)) << where << " mma group " << g;
      ASSERT_EQ(n.key_zero, Host(cpu.KeyGroupZero(gi), d)) << where << " mma group " << g;
      for (int t = 0; t < 32; ++t) {
        ASSERT_EQ(Host(n.value_codes.data() + t * vw, vw), Host(cpu.ValueCodes(gi * 32 + t), vw)) << where << " mma group " << g;
        ASSERT_EQ(Host(n.value_scale.data() + t * vg, vg), Host(cpu.ValueScale(gi * 32 + t), vg)) << where << " mma group " << g;
        ASSERT_EQ(Host(n.value_zero.data() + t * vg, vg), Host(cpu.ValueZero(gi * 32 + t), vg)) << where << " mma group " << g;
      }
      for (size_t c = 0; c < d; ++c) bound = std::max(bound, HalfToFloat(cpu.KeyGroupScale(gi)[c]));
    }
    if (mma) {
      EXPECT_EQ(Download(view.key_scale_bound, 1)[0], bound) << where;
    }
    for (size_t g = 0; g < groups; ++g) {
      const int32_t gi = static_cast<int32_t>(g);
      if (g >= whole) {
        ASSERT_EQ(Host(cuda::KeyCodes(view, gi), kw), Host(cpu.KeyGroupCodes(gi), kw)) << where << " group " << g;
        ASSERT_EQ(Host(cuda::KeyScales(view, gi), d), Host(cpu.KeyGroupScale(gi), d)) << where << " group " << g;
        ASSERT_EQ(Host(cuda::KeyZeros(view, gi), d), Host(cpu.KeyGroupZero(gi), d)) << where << " group " << g;
      }
    }
    for (size_t t = 0; t < nqv; ++t) {
      const int32_t ti = static_cast<int32_t>(t);
      if (t / 32 >= whole) {
        ASSERT_EQ(Host(cuda::ValueCodes(view, ti), vw), Host(cpu.ValueCodes(ti), vw)) << where << " value " << t;
        ASSERT_EQ(Host(cuda::ValueScales(view, ti), vg), Host(cpu.ValueScale(ti), vg)) << where << " value " << t;
        ASSERT_EQ(Host(cuda::ValueZeros(view, ti), vg), Host(cpu.ValueZero(ti), vg)) << where << " value " << t;
      }
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
    Half* d_k = buf.Allocate<Half>(1300 * sh.d);
    Half* d_v = buf.Allocate<Half>(1300 * sh.d);
    ASSERT_TRUE(d_k && d_v);
    // The last append (a prompt's worth) tops up the residual, stores runs of R tokens straight
    // from the input across several replica blocks, and leaves a partial residual.
    for (int n : {1, 3, 64, 200, 1, 1, 90, 500, 63, 2, 700, 1299}) {
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

// A replica made with mma codes: after prompts and batched one-token appends (groups becoming
// whole through either), the whole groups hold the CPU replica's codes in the mma layout, the
// others as they are, the bound is the largest key scale of the whole groups; the attention over
// it (the lean path) is the reference's. Parameters the layout does not cover are refused.
TEST(CudaReplicaTest, MmaCodesHoldTheCpuReplicasCodes) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  EXPECT_EQ(cuda::DeviceHeadReplica::Create({128, 2, 2, 32, 64}, 100, nullptr, nullptr, true).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::DeviceHeadReplica::Create({96, 1, 1, 32, 64}, 100, nullptr, nullptr, true).status().code(),
            StatusCode::kInvalidArgument);
  for (int d : {64, 128}) {
    const ReplicaParams p{d, 1, 1, 32, 64};
    HeadReplica cpu(p);
    auto gpu = cuda::DeviceHeadReplica::Create(p, 4000, nullptr, nullptr, true);
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    testing::DeviceBuffers buf;
    Half* d_k = buf.Allocate<Half>(1300 * d);
    Half* d_v = buf.Allocate<Half>(1300 * d);
    for (int n : {1, 40, 200, 1, 700, 63}) {
      const auto k = testing::RandomHalves(size_t(n) * d, rng), v = testing::RandomHalves(size_t(n) * d, rng);
      cpu.Append(k.data(), v.data(), n);
      ASSERT_EQ(cudaMemcpy(d_k, k.data(), k.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_v, v.data(), v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE((*gpu)->Append(d_k, d_v, n).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ExpectSameBytes(cpu, **gpu, 32, 1, true);
    }
    for (int step = 0; step < 70; ++step) {  // the decode step's path: AppendTokens
      const auto k = testing::RandomHalves(d, rng), v = testing::RandomHalves(d, rng);
      cpu.Append(k.data(), v.data(), 1);
      ASSERT_EQ(cudaMemcpy(d_k, k.data(), k.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_v, v.data(), v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE(cuda::DeviceHeadReplica::AppendTokens({gpu->get()}, {d_k}, {d_v}).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      if (step % 10 == 9) ExpectSameBytes(cpu, **gpu, 32, 1, true);
    }
    // Attention over both: two rows, GQA 4 (8 queries), no substitution; the lean path's values
    // are fp16 products (outputs within ~1e-4, probabilities as the reference's).
    const int heads = 4, rows = 2;
    const auto q = testing::RandomFloats(size_t(rows) * heads * d, rng, 0.5f);
    const auto nk = testing::RandomHalves(size_t(rows) * d, rng), nv = testing::RandomHalves(size_t(rows) * d, rng);
    const int32_t n_candidates = cpu.quantized_keys();
    std::vector<float> want(size_t(rows) * heads * d), want_probs(size_t(heads) * n_candidates);
    cpu::AttentionWorkspace ws;
    cpu::AttendDecodeRows(cpu, {}, q.data(), nk.data(), nv.data(), rows, heads, 1.0f / std::sqrt(float(d)), want.data(), 1,
                          n_candidates, want_probs.data(), &ws);
    cuda::DeviceDecodeRows r;
    r.q = buf.Copy(q);
    r.new_keys = buf.Copy(nk);
    r.new_values = buf.Copy(nv);
    r.n_rows = rows;
    r.n_heads = heads;
    r.scale = 1.0f / std::sqrt(float(d));
    r.out = buf.Allocate<float>(want.size());
    r.probs_row = 1;
    r.n_candidates = n_candidates;
    r.probs = buf.Allocate<float>(want_probs.size());
    r.scratch = buf.Allocate<float>(static_cast<size_t>(cuda::DecodeScratchFloats(cpu.length(), rows, heads, d)));
    ASSERT_TRUE(cuda::AttendDecodeRows((*gpu)->view(), r, nullptr).ok());
    const std::vector<float> got = Download(r.out, want.size()), got_probs = Download(r.probs, want_probs.size());
    const double error = testing::RelativeError(got, std::vector<double>(want.begin(), want.end()));
    std::printf("d=%d: the lean path's outputs' relative error %.3g\n", d, error);
    EXPECT_LT(error, 1e-3) << "d=" << d;
    EXPECT_LT(testing::RelativeError(got_probs, std::vector<double>(want_probs.begin(), want_probs.end())), 1e-5)
        << "d=" << d;
  }
#endif
}

// The decode step's batched one-token appends leave each replica as a plain Append would (and as
// the CPU replica): replicas at different lengths, so flushes and compactions fall on different
// steps; 1, 2 and 4 bits at head_dim 64, G = 32, and 2 bits at head_dim 128, G = 64 (the values
// leaving the windows are quantized into blocks the kernel finds from the device block tables).
// The last cases have 300 and 600 replicas in the lean path's mma layout, the groups they
// make whole packed after their keys are quantized; their task lists go through one in-place
// plan, as the agent's (600: more row copies and value tasks a step than one launch took when they
// were its parameters, 1024 and 512). The 600 start at lengths equal modulo R, as a decode batch's
// replicas of one sequence and layer are, so their residuals flush in the same steps: 1200 key
// groups in one launch (runs by value took 256 a launch).
TEST(CudaReplicaTest, BatchedTokenAppendsEqualSingleAppends) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(37);
  struct Case {
    int bits, n;
    bool mma, same_phase;
    int d = 64, G = 32;
  };
  for (const Case c : {Case{1, 37, false, false}, Case{2, 37, false, false}, Case{4, 37, false, false},
                       Case{2, 37, false, false, 128, 64}, Case{16, 37, false, false}, Case{1, 300, true, false},
                       Case{1, 600, true, true}}) {
    const int bits = c.bits, n = c.n;
    cuda::DecodePlan plan(cuda::DecodePlan::SlotReads::kInPlace);  // outlives the replicas, which use it
    const int d = c.d, G = c.G, R = 64, steps = 150;
    const ReplicaParams p{d, bits, bits, G, R};
    std::vector<HeadReplica> cpu(n, HeadReplica(p));
    // One pool for all, as in the agent: the replicas' blocks interleave in memory.
    auto pool = cuda::DeviceBlockPool::Create(p, 0);
    ASSERT_TRUE(pool.ok());
    std::vector<std::unique_ptr<cuda::DeviceHeadReplica>> gpu;
    Half* rows = nullptr;
    ASSERT_EQ(cudaMalloc(&rows, size_t(2) * 300 * d * sizeof(Half)), cudaSuccess);
    for (int i = 0; i < n; ++i) {
      auto r = cuda::DeviceHeadReplica::Create(p, 1000, nullptr, pool->get(), c.mma, c.mma ? &plan : nullptr);
      ASSERT_TRUE(r.ok());
      gpu.push_back(std::move(r).value());
      const int first = c.same_phase ? static_cast<int>(rng() % 4) * R + 7 : static_cast<int>(rng() % 300);
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
    for (int i = 0; i < n; ++i) ExpectSameBytes(cpu[i], *gpu[i], G, bits, c.mma);
    gpu.clear();
    EXPECT_EQ((*pool)->used_bytes(), 0) << "every block back in the pool";
    cudaFree(rows);
    cudaFree(step_rows);
  }
#endif
}

// A fixed pool hands out blocks all or nothing: a replica that cannot have its blocks is refused
// with RESOURCE_EXHAUSTED and keeps its state, the pool keeps its free blocks, and every block comes
// back when its replica goes. A growing pool takes slabs as replicas grow.
TEST(CudaReplicaTest, PoolBlocksAreTakenAllOrNothingAndGivenBack) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(41);
  const ReplicaParams p{64, 1, 1, 32, 64};
  const cuda::ReplicaBlockLayout layout = cuda::MakeReplicaBlockLayout(p);
  EXPECT_EQ(layout.block_tokens, 128);
  EXPECT_EQ(layout.bytes % 256, 0);
  auto pool = cuda::DeviceBlockPool::Create(p, 5 * layout.bytes + 100);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  cuda::DeviceBlockPool& blocks = **pool;
  EXPECT_EQ(blocks.reserved_bytes(), 5 * layout.bytes);
  auto a = cuda::DeviceHeadReplica::Create(p, 4096, nullptr, &blocks);
  auto b = cuda::DeviceHeadReplica::Create(p, 4096, nullptr, &blocks);
  ASSERT_TRUE(a.ok() && b.ok());
  testing::DeviceBuffers buf;
  const auto k = testing::RandomHalves(size_t(600) * 64, rng), v = testing::RandomHalves(size_t(600) * 64, rng);
  const Half* dk = buf.Copy(k);
  const Half* dv = buf.Copy(v);
  ASSERT_TRUE((*a)->Append(dk, dv, 300).ok());  // 3 blocks
  EXPECT_EQ(blocks.free_blocks(), 2);
  EXPECT_EQ(blocks.used_bytes(), 3 * layout.bytes);
  const Status refused = (*b)->Append(dk, dv, 300);  // needs 3, 2 are free
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_EQ((*b)->length(), 0);
  EXPECT_EQ(blocks.free_blocks(), 2);
  EXPECT_EQ(cuda::DeviceHeadReplica::Reserve({a->get(), b->get()}, 200).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(blocks.free_blocks(), 2) << "a refused reservation takes nothing";
  ASSERT_TRUE(cuda::DeviceHeadReplica::Reserve({b->get()}, 256).ok());
  EXPECT_EQ(blocks.free_blocks(), 0);
  (*b)->ReleaseUnused();
  EXPECT_EQ(blocks.free_blocks(), 2);
  ASSERT_TRUE((*b)->Append(dk, dv, 200).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  HeadReplica cpu(p);
  cpu.Append(k.data(), v.data(), 200);
  ExpectSameBytes(cpu, **b, 32, 1);
  a->reset();
  EXPECT_EQ(blocks.free_blocks(), 3);
  b->reset();
  EXPECT_EQ(blocks.used_bytes(), 0);
  EXPECT_EQ(blocks.free_blocks(), 5);

  auto growing = cuda::DeviceBlockPool::Create(p, 0);
  ASSERT_TRUE(growing.ok());
  EXPECT_EQ((*growing)->reserved_bytes(), 0);
  auto c = cuda::DeviceHeadReplica::Create(p, 4096, nullptr, growing->get());
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Append(dk, dv, 600).ok());
  EXPECT_EQ((*growing)->used_bytes(), 5 * layout.bytes);
  EXPECT_EQ((*growing)->reserved_bytes(), cuda::DeviceBlockPool::kSlabBytes / layout.bytes * layout.bytes);
  EXPECT_EQ((*c)->reserved_bytes(), (*c)->fixed_bytes() + 5 * layout.bytes);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cuda::DeviceBlockPool::Create(p, 100).status().code(), StatusCode::kInvalidArgument);
#endif
}

}  // namespace
}  // namespace specache
