// Label `gpu`: the row cache's seeding at prefill on the device (seed_rows.h) against the CPU
// backend's rule (cpu::SeedTokens) on random prompts: the same seeds, the same ranks (their use
// marks), the list written whole (the slots in order, kNoToken past the seeds) and each seed's
// K/V row in its slot, byte for byte. Ragged tasks in one launch; head_dim 64 and 128; GQA groups
// 1 to 8; both group reductions; fewer, as many and more seeds than candidates; exact ties.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cuda_fetch.h"
#include "specache/selection.h"
#include "testing/cuda_device.h"
#include "testing/reference.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "seed_rows.h"
#include "specache/cuda_attention.h"
#include "testing/device_buffers.h"
#endif

namespace specache {
namespace {

TEST(CudaSeedRowsTest, SeedsRanksAndRowsEqualTheCpuRule) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  using testing::Download;
  std::mt19937 rng(53);
  struct Prompt {
    int32_t n, candidates, count, capacity;
  };
  // Shorter and longer than a logits block (256 tokens), candidates at and below n, no seed, one,
  // some, all candidates and more than there are.
  const Prompt prompts[] = {{1, 0, 8, 8},      {70, 64, 8, 16},      {300, 256, 24, 48}, {300, 256, 256, 256},
                            {513, 448, 1000, 1024}, {2100, 2048, 64, 130}, {4100, 4096, 1024, 1024}, {200, 192, 0, 4},
                            {9000, 8960, 5000, 5000}};  // more seeds than the ranking keeps in shared memory
  for (int d : {64, 128}) {
    for (int group : {1, 3, 4, 8}) {
      for (GroupReduction reduction : {GroupReduction::kMean, GroupReduction::kMax}) {
        const std::string name = "d " + std::to_string(d) + " group " + std::to_string(group) + " " +
                                 std::string(GroupReductionName(reduction));
        testing::DeviceBuffers dev;
        std::vector<cuda::SeedTask> tasks;
        struct Host {
          std::vector<float> q;
          std::vector<Half> keys, values;
        };
        std::vector<Host> hosts;
        for (const Prompt& p : prompts) {
          Host h;
          h.q = testing::RandomFloats(size_t(group) * d, rng, 0.3f);
          h.keys = testing::RandomHalves(size_t(p.n) * d, rng);
          h.values = testing::RandomHalves(size_t(p.n) * d, rng);
          // Exact ties: some keys repeated, so their scores are equal and the lower token ranks first.
          for (int32_t j = 5; j + 1 < p.n; j += 37) {
            std::copy_n(h.keys.begin() + size_t(j) * d, d, h.keys.begin() + size_t(j + 1) * d);
          }
          cuda::SeedTask t;
          t.q = dev.Copy(h.q);
          t.keys = dev.Copy(h.keys);
          t.values = dev.Copy(h.values);
          t.logits = dev.Allocate<float>(size_t(cuda::SeedScratchFloats(group, p.n)));
          t.n = p.n;
          t.candidates = p.candidates;
          t.take = cuda::SeedCount(p.count, p.candidates, p.capacity);
          t.capacity = p.capacity;
          t.tokens = dev.Allocate<int32_t>(size_t(p.capacity));
          t.used = dev.Allocate<int32_t>(size_t(p.capacity));
          t.slots = dev.Allocate<int32_t>(size_t(p.capacity));
          t.list_count = dev.Allocate<int32_t>(1);
          t.rows = dev.Allocate<Half>(size_t(p.capacity) * 2 * d);
          tasks.push_back(t);
          hosts.push_back(std::move(h));
        }
        const float scale = 1.0f / std::sqrt(float(d));
        cuda::DecodePlan plan(cuda::DecodePlan::SlotReads::kInPlace);
        const Status s = cuda::SeedRowCaches(tasks.data(), int(tasks.size()), group, d, scale, reduction, nullptr, &plan);
        ASSERT_TRUE(s.ok()) << s.ToString();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
        for (size_t i = 0; i < tasks.size(); ++i) {
          const Prompt& p = prompts[i];
          const cuda::SeedTask& t = tasks[i];
          std::vector<int32_t> want, rank;
          cpu::SeedTokens(hosts[i].q.data(), hosts[i].keys.data(), group, p.n, d, scale, p.candidates, p.count,
                          reduction, &want, &rank);
          const std::string where = name + " prompt " + std::to_string(i);
          const int32_t take = int32_t(want.size());
          ASSERT_EQ(take, std::max(0, std::min(p.count, p.candidates))) << where;
          EXPECT_EQ(Download(t.list_count, 1)[0], take) << where;
          const std::vector<int32_t> tokens = Download(t.tokens, size_t(p.capacity));
          const std::vector<int32_t> used = Download(t.used, size_t(p.capacity));
          const std::vector<int32_t> slots = Download(t.slots, size_t(p.capacity));
          EXPECT_EQ(std::vector<int32_t>(tokens.begin(), tokens.begin() + take), want) << where;
          for (int32_t j = 0; j < take; ++j) EXPECT_EQ(used[size_t(j)], -rank[size_t(j)]) << where << " seed " << j;
          for (int32_t j = take; j < p.capacity; ++j) EXPECT_EQ(tokens[size_t(j)], cuda::kNoToken) << where;
          for (int32_t j = 0; j < p.capacity; ++j) EXPECT_EQ(slots[size_t(j)], j) << where;
          const std::vector<Half> rows = Download(t.rows, size_t(take) * 2 * d);
          for (int32_t j = 0; j < take; ++j) {
            const size_t token = size_t(want[size_t(j)]);
            EXPECT_TRUE(std::equal(rows.begin() + size_t(j) * 2 * d, rows.begin() + size_t(j) * 2 * d + d,
                                   hosts[i].keys.begin() + token * d))
                << where << " key row of seed " << j;
            EXPECT_TRUE(std::equal(rows.begin() + size_t(j) * 2 * d + d, rows.begin() + size_t(j + 1) * 2 * d,
                                   hosts[i].values.begin() + token * d))
                << where << " value row of seed " << j;
          }
        }
      }
    }
  }
  // Refused before anything is queued: a cache above kMaxCacheRows, more seeds than it holds or
  // than there are candidates, candidates beyond the prompt, a head_dim the kernels do not take.
  auto refused = [](int32_t n, int32_t candidates, int32_t take, int32_t capacity, int head_dim = 64) {
    cuda::SeedTask t;
    t.n = n;
    t.candidates = candidates;
    t.take = take;
    t.capacity = capacity;
    return cuda::SeedRowCaches(&t, 1, 4, head_dim, 1.0f, GroupReduction::kMean, nullptr, nullptr).code() ==
           StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(refused(10, 10, 8, cuda::kMaxCacheRows + 1));
  EXPECT_TRUE(refused(10, 10, 9, 8));   // more seeds than the cache holds
  EXPECT_TRUE(refused(10, 4, 5, 8));    // more seeds than candidates
  EXPECT_TRUE(refused(10, 11, 4, 8));   // candidates beyond the prompt
  EXPECT_TRUE(refused(10, 10, 4, 8, 60));
#endif
}

}  // namespace
}  // namespace specache
