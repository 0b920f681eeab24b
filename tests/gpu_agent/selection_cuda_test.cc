// Label `gpu`: the union steps of the row selection on the device (cuda_selection.h) with the
// adaptive budget's padding: the mask skips it, and the merge equals the set union of the budget's
// rows and the real row's picks, counted once each, then padding.
#include "specache/cuda_selection.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cuda_fetch.h"
#include "testing/cuda_device.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>

#include "testing/device_buffers.h"
#endif

namespace specache {
namespace {

#ifdef SPECACHE_TEST_HAVE_CUDA
// A sorted random subset of [0, n) of `size` distinct tokens.
std::vector<int32_t> Subset(int32_t n, int32_t size, std::mt19937& rng) {
  std::set<int32_t> s;
  while (static_cast<int32_t>(s.size()) < std::min(size, n)) s.insert(static_cast<int32_t>(rng() % n));
  return {s.begin(), s.end()};
}
#endif

TEST(CudaSelectionTest, MergeIsTheUnionOfTheRowsThenPadding) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  std::mt19937 rng(53);
  testing::DeviceBuffers buf;
  std::vector<cuda::MergeTask> tasks;
  std::vector<std::vector<int32_t>> want;
  unsigned long long want_rows = 0;
  const int n_tasks = 286;  // more than a launch took when the tasks were its parameters (256)
  for (int i = 0; i < n_tasks; ++i) {
    const int32_t n = 1 + static_cast<int32_t>(rng() % (i % 4 == 0 ? 40 : 3000));
    const int32_t k = 1 + static_cast<int32_t>(rng() % 300), extra = 1 + static_cast<int32_t>(rng() % 100);
    const int32_t na = std::min(n, k), nb = std::min(n, extra);
    std::vector<int32_t> a = Subset(n, 1 + static_cast<int32_t>(rng() % na), rng);  // the budget's c rows
    // b: the real row's picks; when fewer than nb others exist it takes some of a's rows too.
    std::vector<int32_t> others;
    for (int32_t t = 0; t < n; ++t) {
      if (!std::binary_search(a.begin(), a.end(), t)) others.push_back(t);
    }
    std::shuffle(others.begin(), others.end(), rng);
    std::vector<int32_t> b(others.begin(), others.begin() + std::min<size_t>(others.size(), size_t(nb)));
    for (size_t j = 0; b.size() < size_t(nb); ++j) b.push_back(a[j]);
    std::sort(b.begin(), b.end());
    std::set<int32_t> u(a.begin(), a.end());
    u.insert(b.begin(), b.end());
    std::vector<int32_t> w(u.begin(), u.end());
    want_rows += w.size();
    w.resize(size_t(na + nb), cuda::kNoToken);
    want.push_back(w);
    a.resize(size_t(na), cuda::kNoToken);
    tasks.push_back({buf.Copy(a), buf.Copy(b), buf.Allocate<int32_t>(size_t(na + nb)), na, nb});
  }
  auto* rows = buf.Zeros<unsigned long long>(1);
  ASSERT_TRUE(cuda::MergeSelections(tasks.data(), n_tasks, rows, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < n_tasks; ++i) {
    ASSERT_EQ(testing::Download(tasks[i].out, want[i].size()), want[i]) << "task " << i;
  }
  EXPECT_EQ(testing::Download(rows, 1)[0], want_rows);
  // Without a count: the same lists.
  for (const cuda::MergeTask& t : tasks) ASSERT_EQ(cudaMemset(t.out, 0xff, size_t(t.na + t.nb) * 4), cudaSuccess);
  ASSERT_TRUE(cuda::MergeSelections(tasks.data(), n_tasks, nullptr, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < n_tasks; ++i) {
    ASSERT_EQ(testing::Download(tasks[i].out, want[i].size()), want[i]) << "task " << i << " without a count";
  }
#endif
}

TEST(CudaSelectionTest, MaskSkipsThePadding) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  testing::DeviceBuffers buf;
  const int heads = 2;
  const int32_t n = 10;
  std::vector<float> scores(size_t(heads) * n, 0.5f);
  const std::vector<int32_t> tokens{1, 7, cuda::kNoToken, cuda::kNoToken};
  const cuda::MaskTask task{buf.Copy(scores), buf.Copy(tokens), n, static_cast<int32_t>(tokens.size())};
  ASSERT_TRUE(cuda::MaskTokens(&task, 1, heads, nullptr).ok());
  const std::vector<float> got = testing::Download(task.scores, scores.size());
  for (int h = 0; h < heads; ++h) {
    for (int32_t j = 0; j < n; ++j) {
      EXPECT_EQ(std::isnan(got[size_t(h) * n + j]), j == 1 || j == 7) << "head " << h << " token " << j;
    }
  }
#endif
}

}  // namespace
}  // namespace specache
