#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "specache/cpu_attention.h"
#include "specache/selection.h"

namespace specache {
namespace {

std::vector<int32_t> TopK(const std::vector<float>& probs, int heads, int k, GroupReduction r) {
  std::vector<int32_t> out;
  std::vector<float> scratch;
  cpu::SelectTopK(probs.data(), heads, static_cast<int32_t>(probs.size() / heads), k, r, &out, &scratch);
  return out;
}

TEST(TopKTest, MeanAndMaxReductionsDiffer) {
  // Token 0: one head very sure (max 0.9, mean 0.45). Token 1: both heads fairly sure (0.5, 0.5).
  const std::vector<float> probs = {0.9f, 0.5f, 0.1f, 0.0f,   // head 0
                                    0.0f, 0.5f, 0.1f, 0.05f};  // head 1
  EXPECT_EQ(TopK(probs, 2, 1, GroupReduction::kMax), std::vector<int32_t>{0});
  EXPECT_EQ(TopK(probs, 2, 1, GroupReduction::kMean), std::vector<int32_t>{1});
  EXPECT_EQ(TopK(probs, 2, 3, GroupReduction::kMean), (std::vector<int32_t>{0, 1, 2}));
}

TEST(TopKTest, TiesGoToTheLowerTokenAndOutputIsAscending) {
  const std::vector<float> probs = {0.1f, 0.3f, 0.3f, 0.3f, 0.0f, 0.3f};
  EXPECT_EQ(TopK(probs, 1, 2, GroupReduction::kMean), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(TopK(probs, 1, 4, GroupReduction::kMax), (std::vector<int32_t>{1, 2, 3, 5}));
}

TEST(TopKTest, KLargerThanCandidatesReturnsAllAndZeroReturnsNone) {
  const std::vector<float> probs = {0.2f, 0.1f, 0.7f};
  EXPECT_EQ(TopK(probs, 1, 3, GroupReduction::kMean), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(TopK(probs, 1, 64, GroupReduction::kMean), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_TRUE(TopK(probs, 1, 0, GroupReduction::kMean).empty());
  EXPECT_TRUE(TopK({}, 1, 5, GroupReduction::kMean).empty());
}

TEST(TopKTest, NanRanksLowest) {
  const std::vector<float> probs = {std::nanf(""), 0.1f, 0.2f};
  EXPECT_EQ(TopK(probs, 1, 2, GroupReduction::kMax), (std::vector<int32_t>{1, 2}));
}

// A mean of +inf and NaN (the NaN counts as -inf) or of +inf and -inf is NaN: it ranks lowest
// too, not first and not out of the ranking's order (a NaN score broke the sort's comparison).
TEST(TopKTest, AMeanThatComesOutNanRanksLowest) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> probs = {inf, inf, 0.2f, 0.1f, 0.3f,             // head 0
                                    std::nanf(""), -inf, 0.2f, 0.1f, 0.0f};  // head 1
  EXPECT_EQ(TopK(probs, 2, 2, GroupReduction::kMean), (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(TopK(probs, 2, 3, GroupReduction::kMean), (std::vector<int32_t>{2, 3, 4}));
  std::vector<float> score;
  cpu::ReduceGroupScores(probs.data(), 2, 5, GroupReduction::kMean, &score);
  EXPECT_EQ(score[0], -inf);
  EXPECT_EQ(score[1], -inf);
  cpu::ReduceGroupScores(probs.data(), 2, 5, GroupReduction::kMax, &score);
  EXPECT_EQ(score[0], inf) << "the max of +inf and a NaN head is +inf";
}

// Random inputs against a brute-force float64 reference (full sort by score, then index).
TEST(TopKTest, MatchesBruteForceOnRandomInputs) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 50; ++trial) {
    const int heads = 1 + trial % 4, n = 50 + trial * 13, k = 1 + trial * 3 % 70;
    std::vector<float> probs(heads * n);
    std::uniform_int_distribution<int> coarse(0, 20);  // coarse values force many ties
    for (auto& p : probs) p = coarse(rng) / 20.0f;
    for (GroupReduction r : {GroupReduction::kMean, GroupReduction::kMax}) {
      std::vector<double> score(n, r == GroupReduction::kMax ? -1.0 : 0.0);
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < n; ++j) {
          score[j] = r == GroupReduction::kMax ? std::max(score[j], double(probs[h * n + j])) : score[j] + probs[h * n + j];
        }
      }
      // Mean is computed in float by the agent; compare rankings on the float-rounded mean.
      if (r == GroupReduction::kMean) {
        for (int j = 0; j < n; ++j) {
          float s = 0;
          for (int h = 0; h < heads; ++h) s += probs[h * n + j];
          score[j] = s / heads;
        }
      }
      std::vector<int32_t> order(n);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return score[a] > score[b]; });
      order.resize(std::min(k, n));
      std::sort(order.begin(), order.end());
      EXPECT_EQ(TopK(probs, heads, k, r), order) << "trial " << trial;
    }
  }
}

}  // namespace
}  // namespace specache
