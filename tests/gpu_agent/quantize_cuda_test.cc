// Label `gpu`: the CUDA quantization kernels are bit-identical to the CPU reference (codes, scale
// and zero) on random fp16 inputs, degenerate groups included, and in runs to scattered
// destinations (by value, and as a task per key group through a plan). Skips without a device
// (fails under SPECACHE_REQUIRE_GPU).
#include "specache/cuda_quantize.h"

#include <algorithm>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "specache/device_probe.h"
#include "specache/quantizer.h"
#include "testing/cuda_device.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "specache/cuda_attention.h"
#include "testing/device_buffers.h"
#endif

namespace specache {
namespace {

// Random fp16 values of mixed magnitudes; every 7th group constant (degenerate), some groups with
// a single outlier.
std::vector<Half> RandomInputs(size_t groups, size_t group_elems, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Half> x(groups * group_elems);
  for (size_t g = 0; g < groups; ++g) {
    const float scale = std::pow(10.0f, static_cast<float>(static_cast<int>(rng() % 7)) - 3.0f);
    for (size_t i = 0; i < group_elems; ++i) {
      x[g * group_elems + i] = FloatToHalf(g % 7 == 3 ? 1.25f : normal(rng) * scale);
    }
    if (g % 5 == 1) x[g * group_elems + rng() % group_elems] = FloatToHalf(300.0f);
  }
  return x;
}

TEST(CudaQuantizeTest, KeyGroupsAndValueTokensMatchTheCpuBitForBit) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(17);
  for (int head_dim : {64, 128}) {
    for (int group : {32, 64}) {
      for (int bits : {1, 2, 4}) {
        const int words = WordsPerGroup(group, bits);
        // Keys: 50 groups of [group][head_dim].
        const int n_groups = 50;
        const std::vector<Half> keys = RandomInputs(n_groups, size_t(group) * head_dim, rng);
        std::vector<uint32_t> want_codes(size_t(n_groups) * head_dim * words), got_codes(want_codes.size());
        std::vector<Half> want_s(size_t(n_groups) * head_dim), want_z(want_s.size()), got_s(want_s.size()),
            got_z(want_s.size());
        for (int g = 0; g < n_groups; ++g) {
          QuantizeKeyGroup(keys.data() + size_t(g) * group * head_dim, group, head_dim, bits,
                           want_codes.data() + size_t(g) * head_dim * words, want_s.data() + size_t(g) * head_dim,
                           want_z.data() + size_t(g) * head_dim);
        }
        Half *d_in, *d_s, *d_z;
        uint32_t* d_codes;
        ASSERT_EQ(cudaMalloc(&d_in, keys.size() * 2), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_codes, want_codes.size() * 4), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_s, want_s.size() * 2), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_z, want_s.size() * 2), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d_in, keys.data(), keys.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_TRUE(cuda::QuantizeKeyGroups(d_in, n_groups, group, head_dim, bits, d_codes, d_s, d_z, nullptr).ok());
        ASSERT_EQ(cudaMemcpy(got_codes.data(), d_codes, got_codes.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(got_s.data(), d_s, got_s.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(got_z.data(), d_z, got_z.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(got_codes, want_codes) << "keys d=" << head_dim << " G=" << group << " B=" << bits;
        EXPECT_EQ(got_s, want_s) << "key scales";
        EXPECT_EQ(got_z, want_z) << "key zeros";
        cudaFree(d_in);
        cudaFree(d_codes);
        cudaFree(d_s);
        cudaFree(d_z);

        // Values: 300 tokens of [head_dim].
        const int n_tokens = 300, groups_per_token = head_dim / group;
        const std::vector<Half> values = RandomInputs(size_t(n_tokens) * groups_per_token, group, rng);
        std::vector<uint32_t> vwant(size_t(n_tokens) * groups_per_token * words), vgot(vwant.size());
        std::vector<Half> vs(size_t(n_tokens) * groups_per_token), vz(vs.size()), gs(vs.size()), gz(vs.size());
        for (int t = 0; t < n_tokens; ++t) {
          QuantizeValueToken(values.data() + size_t(t) * head_dim, head_dim, group, bits,
                             vwant.data() + size_t(t) * groups_per_token * words, vs.data() + size_t(t) * groups_per_token,
                             vz.data() + size_t(t) * groups_per_token);
        }
        ASSERT_EQ(cudaMalloc(&d_in, values.size() * 2), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_codes, vwant.size() * 4), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_s, vs.size() * 2), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_z, vs.size() * 2), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d_in, values.data(), values.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_TRUE(cuda::QuantizeValueTokens(d_in, n_tokens, head_dim, group, bits, d_codes, d_s, d_z, nullptr).ok());
        ASSERT_EQ(cudaMemcpy(vgot.data(), d_codes, vgot.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(gs.data(), d_s, gs.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(gz.data(), d_z, gz.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(vgot, vwant) << "values d=" << head_dim << " G=" << group << " B=" << bits;
        EXPECT_EQ(gs, vs) << "value scales";
        EXPECT_EQ(gz, vz) << "value zeros";
        cudaFree(d_in);
        cudaFree(d_codes);
        cudaFree(d_s);
        cudaFree(d_z);
      }
    }
  }
  EXPECT_EQ(cuda::QuantizeKeyGroups(nullptr, 1, 48, 64, 1, nullptr, nullptr, nullptr, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeValueTokens(nullptr, 1, 64, 32, 3, nullptr, nullptr, nullptr, nullptr).code(),
            StatusCode::kInvalidArgument);
#endif
}

// Runs (a replica block each) into destinations in reverse order, of 0 to 3 groups or 0 to 5 tokens,
// more runs than one launch holds: each run equals the CPU reference of its inputs.
TEST(CudaQuantizeTest, RunsIntoScatteredDestinationsMatchTheCpuBitForBit) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(23);
  const int head_dim = 128, group = 32, n_runs = cuda::kMaxQuantizeRuns + 9;
  for (int bits : {1, 2}) {
    const int words = WordsPerGroup(group, bits), vgroups = head_dim / group;
    std::vector<int> key_groups(n_runs), value_tokens(n_runs);
    int total_groups = 0, total_tokens = 0;
    for (int i = 0; i < n_runs; ++i) total_groups += key_groups[i] = i % 4, total_tokens += value_tokens[i] = i % 6;
    const std::vector<Half> keys = RandomInputs(total_groups, size_t(group) * head_dim, rng);
    const std::vector<Half> values = RandomInputs(size_t(total_tokens) * vgroups, group, rng);
    // The CPU reference, item by item in input order.
    std::vector<uint32_t> kc(size_t(total_groups) * head_dim * words), vc(size_t(total_tokens) * vgroups * words);
    std::vector<Half> ks(size_t(total_groups) * head_dim), kz(ks.size()), vs(size_t(total_tokens) * vgroups), vz(vs.size());
    for (int g = 0; g < total_groups; ++g) {
      QuantizeKeyGroup(keys.data() + size_t(g) * group * head_dim, group, head_dim, bits,
                       kc.data() + size_t(g) * head_dim * words, ks.data() + size_t(g) * head_dim,
                       kz.data() + size_t(g) * head_dim);
    }
    for (int t = 0; t < total_tokens; ++t) {
      QuantizeValueToken(values.data() + size_t(t) * head_dim, head_dim, group, bits, vc.data() + size_t(t) * vgroups * words,
                         vs.data() + size_t(t) * vgroups, vz.data() + size_t(t) * vgroups);
    }
    testing::DeviceBuffers buf;
    const Half* d_keys = buf.Copy(keys);
    const Half* d_values = buf.Copy(values);
    uint32_t* d_kc = buf.Zeros<uint32_t>(kc.size());
    uint32_t* d_vc = buf.Zeros<uint32_t>(vc.size());
    Half *d_ks = buf.Zeros<Half>(ks.size()), *d_kz = buf.Zeros<Half>(ks.size());
    Half *d_vs = buf.Zeros<Half>(vs.size()), *d_vz = buf.Zeros<Half>(vs.size());
    // Run i's destination: after the runs i + 1 .. n - 1 (reverse order). Expected: the reference
    // rearranged the same way.
    std::vector<cuda::KeyGroupRun> kruns;
    std::vector<cuda::ValueTokenRun> vruns;
    std::vector<uint32_t> want_kc(kc.size()), want_vc(vc.size());
    std::vector<Half> want_ks(ks.size()), want_kz(ks.size()), want_vs(vs.size()), want_vz(vs.size());
    int in_g = 0, in_t = 0, out_g = total_groups, out_t = total_tokens;
    for (int i = 0; i < n_runs; ++i) {
      out_g -= key_groups[i];
      out_t -= value_tokens[i];
      kruns.push_back({d_keys + size_t(in_g) * group * head_dim, d_kc + size_t(out_g) * head_dim * words,
                       d_ks + size_t(out_g) * head_dim, d_kz + size_t(out_g) * head_dim, key_groups[i]});
      vruns.push_back({d_values + size_t(in_t) * head_dim, d_vc + size_t(out_t) * vgroups * words,
                       d_vs + size_t(out_t) * vgroups, d_vz + size_t(out_t) * vgroups, value_tokens[i]});
      const size_t kn = size_t(key_groups[i]) * head_dim, vn = size_t(value_tokens[i]) * vgroups;
      std::copy_n(kc.begin() + in_g * head_dim * words, kn * words, want_kc.begin() + out_g * head_dim * words);
      std::copy_n(ks.begin() + in_g * head_dim, kn, want_ks.begin() + out_g * head_dim);
      std::copy_n(kz.begin() + in_g * head_dim, kn, want_kz.begin() + out_g * head_dim);
      std::copy_n(vc.begin() + in_t * vgroups * words, vn * words, want_vc.begin() + out_t * vgroups * words);
      std::copy_n(vs.begin() + in_t * vgroups, vn, want_vs.begin() + out_t * vgroups);
      std::copy_n(vz.begin() + in_t * vgroups, vn, want_vz.begin() + out_t * vgroups);
      in_g += key_groups[i];
      in_t += value_tokens[i];
    }
    ASSERT_TRUE(cuda::QuantizeKeyGroupRuns(kruns.data(), n_runs, group, head_dim, bits, nullptr).ok());
    ASSERT_TRUE(cuda::QuantizeValueTokenRuns(vruns.data(), n_runs, head_dim, group, bits, nullptr).ok());
    EXPECT_EQ(testing::Download(d_kc, kc.size()), want_kc) << "key codes, bits " << bits;
    EXPECT_EQ(testing::Download(d_ks, ks.size()), want_ks) << "key scales";
    EXPECT_EQ(testing::Download(d_kz, kz.size()), want_kz) << "key zeros";
    EXPECT_EQ(testing::Download(d_vc, vc.size()), want_vc) << "value codes, bits " << bits;
    EXPECT_EQ(testing::Download(d_vs, vs.size()), want_vs) << "value scales";
    EXPECT_EQ(testing::Download(d_vz, vz.size()), want_vz) << "value zeros";
    // The same runs as one task per group (the decode step's way: hundreds of groups in one
    // launch), through an in-place plan as the replicas' appends use, then through none.
    for (bool own_plan : {false, true}) {
      ASSERT_EQ(cudaMemset(d_kc, 0, kc.size() * sizeof(uint32_t)), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_ks, 0, ks.size() * sizeof(Half)), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_kz, 0, kz.size() * sizeof(Half)), cudaSuccess);
      cuda::DecodePlan plan(cuda::DecodePlan::SlotReads::kInPlace);
      ASSERT_TRUE(cuda::QuantizeKeyGroupTasks(kruns.data(), n_runs, group, head_dim, bits, nullptr,
                                              own_plan ? nullptr : &plan)
                      .ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(testing::Download(d_kc, kc.size()), want_kc) << "key codes by task, bits " << bits << ", own plan " << own_plan;
      EXPECT_EQ(testing::Download(d_ks, ks.size()), want_ks) << "key scales by task";
      EXPECT_EQ(testing::Download(d_kz, kz.size()), want_kz) << "key zeros by task";
    }
    EXPECT_GT(total_groups, cuda::kMaxQuantizeRuns) << "more groups than one launch of runs holds";
  }
  cuda::KeyGroupRun negative{nullptr, nullptr, nullptr, nullptr, -1};
  EXPECT_EQ(cuda::QuantizeKeyGroupRuns(&negative, 1, group, head_dim, 1, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeKeyGroupTasks(&negative, 1, group, head_dim, 1, nullptr).code(), StatusCode::kInvalidArgument);
#endif
}

}  // namespace
}  // namespace specache
