// The row-selection rule (selection.h) and the agent's selection options: union, the adaptive
// budget, attend-resident and the oracle mode.
#include "specache/selection.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "specache/agent.h"
#include "specache/cpu_attention.h"
#include "specache/in_memory_source.h"
#include "testing/tiny_model.h"

namespace specache {
namespace {

KvConfig Config(KvMode mode, int k) {
  KvConfig c;
  c.mode = mode;
  c.top_k = k;
  return c;
}

std::vector<float> RandomProbs(int heads, int32_t n, std::mt19937& rng) {
  std::vector<float> p(size_t(heads) * n);
  for (auto& x : p) x = static_cast<float>(rng() % 1000) / 1000.0f;  // ties on purpose
  return p;
}

TEST(SelectionTest, SpeculativeTopKIsThePlainTopK) {
  std::mt19937 rng(3);
  for (GroupReduction red : {GroupReduction::kMean, GroupReduction::kMax}) {
    KvConfig c = Config(KvMode::kSpeCache, 24);
    c.reduction = red;
    const std::vector<float> probs = RandomProbs(3, 500, rng);
    std::vector<int32_t> want, got;
    std::vector<float> scratch;
    cpu::SelectionScratch s;
    cpu::SelectTopK(probs.data(), 3, 500, 24, red, &want, &scratch);
    cpu::SelectRows(c, probs.data(), probs.data(), 3, 500, &got, &s);
    EXPECT_EQ(got, want);
  }
}

TEST(SelectionTest, UnionAddsTheRealRowsBestOthers) {
  std::mt19937 rng(4);
  KvConfig c = Config(KvMode::kSpeCache, 16);
  c.select = SelectFrom::kUnion;
  c.top_k_real = 8;
  const int heads = 2;
  const int32_t n = 300;
  const std::vector<float> spec = RandomProbs(heads, n, rng), real = RandomProbs(heads, n, rng);
  std::vector<int32_t> got, primary, real_ranked;
  std::vector<float> scratch;
  cpu::SelectionScratch s;
  cpu::SelectRows(c, spec.data(), real.data(), heads, n, &got, &s);
  cpu::SelectTopK(spec.data(), heads, n, 16, c.reduction, &primary, &scratch);
  ASSERT_EQ(got.size(), 24u);
  EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
  EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end());
  EXPECT_TRUE(std::includes(got.begin(), got.end(), primary.begin(), primary.end()));
  // The extra rows are the real row's best among the non-primary ones.
  cpu::SelectTopK(real.data(), heads, n, n, c.reduction, &real_ranked, &scratch);
  std::vector<float> score;
  cpu::ReduceGroupScores(real.data(), heads, n, c.reduction, &score);
  std::vector<int32_t> others;
  for (int32_t t = 0; t < n; ++t) {
    if (!std::binary_search(primary.begin(), primary.end(), t)) others.push_back(t);
  }
  std::stable_sort(others.begin(), others.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
  others.resize(8);
  std::sort(others.begin(), others.end());
  std::vector<int32_t> want;
  std::merge(primary.begin(), primary.end(), others.begin(), others.end(), std::back_inserter(want));
  EXPECT_EQ(got, want);
  // Fewer candidates than both together: all of them.
  cpu::SelectRows(c, spec.data(), real.data(), heads, 20, &got, &s);
  EXPECT_EQ(got.size(), 20u);
}

// A real row of NaN (a model that overflowed) ranks every token -inf, tied with the primary ones:
// of its best extra_rows() (the lowest tokens) the primary ones are dropped, not replaced by the
// next lowest (the CUDA merge's rule); with no more candidates than both together, all of them.
TEST(SelectionTest, ARealRowOfNanAddsOnlyItsBestThatAreNotPrimary) {
  KvConfig c = Config(KvMode::kSpeCache, 3);
  c.select = SelectFrom::kUnion;
  c.top_k_real = 3;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float spec[] = {0.0f, 0.4f, 0.0f, 0.0f, 0.0f, 0.3f, 0.0f, 0.2f, 0.0f, 0.1f};
  const std::vector<float> real(10, nan);
  std::vector<int32_t> got;
  cpu::SelectionScratch s;
  cpu::SelectRows(c, spec, real.data(), 1, 10, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 5, 7}));  // {1, 5, 7} and {0, 1, 2} less 1
  c.real_next = true;  // NaN stays NaN under the predecessor's credit
  cpu::SelectRows(c, spec, real.data(), 1, 10, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 5, 7}));
  cpu::SelectRows(c, spec, real.data(), 1, 6, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  // With the adaptive budget (k_min 1, the mass 0.6: tokens 1 and 5) every candidate count
  // goes through the ranking.
  c.mass = 0.6, c.k_min = 1, c.k_max = 3;
  cpu::SelectRows(c, spec, real.data(), 1, 10, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 5}));
  cpu::SelectRows(c, spec, real.data(), 1, 6, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 5}));
}

TEST(SelectionTest, RealNextCreditsTheRowAfterEachAttendedRow) {
  KvConfig c = Config(KvMode::kSpeCache, 1);
  c.select = SelectFrom::kUnion;
  c.top_k_real = 2;
  const float spec[] = {1.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const float real[] = {0.0f, 0.9f, 0.0f, 0.05f, 0.05f};
  std::vector<int32_t> got;
  cpu::SelectionScratch s;
  cpu::SelectRows(c, spec, real, 1, 5, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 3}));
  c.real_next = true;
  cpu::SelectRows(c, spec, real, 1, 5, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2}));  // token 2 follows the real row's best
  // The same credit on the primary ranking when the real row alone selects.
  c.select = SelectFrom::kReal;
  c.top_k = 2;
  cpu::SelectRows(c, real, real, 1, 5, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2}));
  std::vector<float> shifted;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float probs[] = {0.5f, nan, 0.1f, 0.2f};
  cpu::WithPredecessors(probs, 1, 4, &shifted);
  EXPECT_EQ(shifted[0], 0.5f);
  EXPECT_TRUE(std::isnan(shifted[1]));
  EXPECT_EQ(shifted[2], 0.1f);  // a NaN predecessor credits nothing
  EXPECT_EQ(shifted[3], 0.2f);
}

TEST(SelectionTest, AdaptiveBudgetTakesRowsUntilTheMassIsReached) {
  KvConfig c = Config(KvMode::kSpeCache, 64);
  c.mass = 0.8;
  c.k_min = 1;
  c.k_max = 5;
  const float probs[] = {0.05f, 0.5f, 0.1f, 0.3f, 0.05f};  // one head
  std::vector<int32_t> got;
  cpu::SelectionScratch s;
  cpu::SelectRows(c, probs, probs, 1, 5, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 3}));  // 0.5 + 0.3 reach 0.8
  c.k_min = 3;
  cpu::SelectRows(c, probs, probs, 1, 5, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2, 3}));
  c.k_min = 1;
  c.k_max = 1;
  cpu::SelectRows(c, probs, probs, 1, 5, &got, &s);
  EXPECT_EQ(got, (std::vector<int32_t>{1}));
  c.k_max = 5;
  c.mass = 1.0;
  cpu::SelectRows(c, probs, probs, 1, 5, &got, &s);
  EXPECT_EQ(got.size(), 5u);
}

// x[i] + ... summed as the halving tree of CandidateMass: level h adds x[i + h] to x[i], so the
// value at (i, h) is the sum of (i, 2h) and (i + h, 2h), with (i, kMassRunTokens) = x[i].
float RunTree(const float* x, int32_t i, int32_t h) {
  if (h == cpu::kMassRunTokens) return x[i];
  return RunTree(x, i, 2 * h) + RunTree(x, i + h, 2 * h);
}

TEST(SelectionTest, CandidateMassSumsEachRunAsATreeAndTheRunsInOrder) {
  std::mt19937 rng(5);
  for (int32_t n : {1, 255, 256, 257, 1000, 4099}) {
    std::vector<float> score(static_cast<size_t>(n));
    for (auto& x : score) {
      const uint32_t r = rng() % 10;
      // Magnitudes far apart, so that a different order would round differently.
      x = r == 0 ? -std::numeric_limits<float>::infinity() : r == 1 ? -0.5f : std::ldexp(float(rng() % 1000), -int(rng() % 30));
    }
    float want = 0.0f;
    for (int32_t first = 0; first < n; first += cpu::kMassRunTokens) {
      std::vector<float> run(cpu::kMassRunTokens, 0.0f);
      for (int32_t i = 0; i < cpu::kMassRunTokens && first + i < n; ++i) run[i] = std::max(score[first + i], 0.0f);
      want += RunTree(run.data(), 0, 1);
    }
    EXPECT_EQ(cpu::CandidateMass(score.data(), n), want) << "n=" << n;
  }
  EXPECT_EQ(cpu::CandidateMass(nullptr, 0), 0.0f);
}

TEST(SelectionTest, ConfigChecksTheNewOptions) {
  const ModelShape shape{2, 4, 2, 64};
  KvConfig c = Config(KvMode::kSpeCache, 16);
  c.mass = 1.5;
  EXPECT_NE(ValidateKvConfig(c, shape).message().find("mass"), std::string::npos);
  c.mass = 0.9;
  c.k_min = 0;
  c.k_max = 8;
  EXPECT_NE(ValidateKvConfig(c, shape).message().find("k_min"), std::string::npos);
  c.k_min = 9;
  EXPECT_FALSE(ValidateKvConfig(c, shape).ok());
  c = Config(KvMode::kSpeCache, 16);
  c.select = SelectFrom::kUnion;
  c.top_k_real = 8;
  EXPECT_EQ(c.max_selected(), 24);
  EXPECT_EQ(c.cache_rows(), 48);
  c.cached_rows = 20;
  EXPECT_NE(ValidateKvConfig(c, shape).message().find("cached_rows"), std::string::npos);
  EXPECT_EQ(*ParseKvMode("specache-oracle"), KvMode::kSpeCacheOracle);
  EXPECT_EQ(*ParseSelectFrom("union"), SelectFrom::kUnion);
  EXPECT_FALSE(ParseSelectFrom("both").ok());
}

// SeedTokens against a reference written out here: per head the softmax of scale * q.k over all
// n keys (double), the mean (or max) over the group, the best `count` of the candidates (ties: the
// lower token), ascending; random inputs, a few keys planted along the queries.
TEST(SelectionTest, SeedTokensAreTheCandidatesTheLastQueryAttendsMost) {
  std::mt19937 rng(21);
  for (int trial = 0; trial < 40; ++trial) {
    const int heads = 1 + trial % 4, d = trial % 2 ? 64 : 32;
    const int32_t n = 20 + static_cast<int32_t>(rng() % 300), candidates = static_cast<int32_t>(rng() % (n + 8));
    const int count = 1 + static_cast<int>(rng() % 80);
    const GroupReduction reduction = trial % 3 == 0 ? GroupReduction::kMax : GroupReduction::kMean;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(heads) * d);
    for (float& x : q) x = normal(rng);
    std::vector<Half> keys(static_cast<size_t>(n) * d);
    for (Half& k : keys) k = FloatToHalf(normal(rng));
    for (int planted = 0; planted < 5; ++planted) {  // keys along head 0's query: clear winners
      const size_t j = rng() % static_cast<size_t>(n);
      for (int c = 0; c < d; ++c) keys[j * d + c] = FloatToHalf(q[static_cast<size_t>(c)] * (2.0f + planted));
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<int32_t> got, rank;
    cpu::SeedTokens(q.data(), keys.data(), heads, n, d, scale, candidates, count, reduction, &got, &rank);

    std::vector<double> score(static_cast<size_t>(std::min(candidates, n)), reduction == GroupReduction::kMax ? -1.0 : 0.0);
    for (int h = 0; h < heads; ++h) {
      std::vector<double> logit(static_cast<size_t>(n));
      double mx = -1e300, sum = 0;
      for (int32_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(q[size_t(h) * d + c]) * HalfToFloat(keys[size_t(j) * d + c]);
        logit[size_t(j)] = dot * scale;
        mx = std::max(mx, logit[size_t(j)]);
      }
      for (double l : logit) sum += std::exp(l - mx);
      for (size_t j = 0; j < score.size(); ++j) {
        const double p = std::exp(logit[j] - mx) / sum;
        score[j] = reduction == GroupReduction::kMax ? std::max(score[j], p) : score[j] + p / heads;
      }
    }
    std::vector<int32_t> want(score.size());
    for (size_t j = 0; j < want.size(); ++j) want[j] = static_cast<int32_t>(j);
    std::stable_sort(want.begin(), want.end(), [&](int32_t a, int32_t b) { return score[size_t(a)] > score[size_t(b)]; });
    want.resize(std::min(want.size(), static_cast<size_t>(count)));
    std::sort(want.begin(), want.end());
    // float against double: a token may differ only where its reference score ties (to 1e-5,
    // relative) the best score left out, at the cut.
    ASSERT_EQ(got.size(), want.size()) << "trial " << trial;
    EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
    double cut = -1.0;  // the reference's best score not taken
    for (size_t j = 0; j < score.size(); ++j) {
      if (!std::binary_search(want.begin(), want.end(), static_cast<int32_t>(j))) cut = std::max(cut, score[j]);
    }
    for (int32_t t : got) {
      ASSERT_LT(t, std::min(candidates, n)) << "trial " << trial;
      if (!std::binary_search(want.begin(), want.end(), t)) {
        EXPECT_NEAR(score[size_t(t)], cut, 1e-5 * std::max(cut, 1e-30)) << "trial " << trial << " token " << t;
      }
    }
    // The ranks: a permutation of 0..size-1, the best scored token first (to the same tolerance).
    ASSERT_EQ(rank.size(), got.size());
    std::vector<int32_t> by_rank(got.size(), -1);
    for (size_t i = 0; i < rank.size(); ++i) {
      ASSERT_GE(rank[i], 0);
      ASSERT_LT(rank[i], static_cast<int32_t>(rank.size()));
      by_rank[size_t(rank[i])] = got[i];
    }
    for (size_t r = 1; r < by_rank.size(); ++r) {
      ASSERT_GE(by_rank[r], 0);
      EXPECT_GE(score[size_t(by_rank[r - 1])] + 1e-5 * score[size_t(by_rank[r - 1])], score[size_t(by_rank[r])])
          << "trial " << trial << " rank " << r;
    }
  }
}

TEST(SelectionTest, SeedRowsOnlyInSpeCacheMode) {
  const ModelShape shape{2, 4, 2, 64};
  KvConfig c = Config(KvMode::kSpeCache, 16);
  c.seed_rows = 64;
  EXPECT_TRUE(ValidateKvConfig(c, shape).ok());
  EXPECT_NE(DescribeKvConfig(c).find("seed=64"), std::string::npos);
  c.seed_rows = -1;
  EXPECT_NE(ValidateKvConfig(c, shape).message().find("seed_rows"), std::string::npos);
  c = Config(KvMode::kKivi, 16);
  c.seed_rows = 8;
  EXPECT_NE(ValidateKvConfig(c, shape).message().find("seed_rows"), std::string::npos);
}

constexpr int kPrompt = 300;
constexpr int kSteps = 16;

std::vector<int> Prompt() {
  std::mt19937 rng(55);
  std::vector<int> p(kPrompt);
  for (auto& t : p) t = static_cast<int>(rng() % 96);
  return p;
}

struct AgentRun {
  testing::GenerationTrace trace;
  AgentStats stats;
  std::vector<int32_t> selected;  // layer 0, KV head 0 after the last step
};

AgentRun Generate(const testing::TinyModel& model, const KvConfig& config) {
  InMemorySource source;
  auto agent = CreateCpuAgent(model.shape(), config, &source);
  EXPECT_TRUE(agent.ok()) << agent.status().ToString();
  AgentRun r;
  auto trace = model.Generate(agent->get(), 1, Prompt(), kSteps);
  EXPECT_TRUE(trace.ok()) << trace.status().ToString();
  if (trace.ok()) r.trace = *trace;
  r.stats = (*agent)->stats();
  r.selected = *(*agent)->SelectedTokens(1, 0, 0);
  return r;
}

TEST(SelectionAgentTest, OracleWithKCoveringTheContextReproducesFull) {
  const testing::TinyModel model({});
  KvConfig full = Config(KvMode::kFull, 0);
  full.key_bits = full.value_bits = 16;
  const AgentRun want = Generate(model, full);
  const AgentRun oracle = Generate(model, Config(KvMode::kSpeCacheOracle, 4096));
  EXPECT_EQ(oracle.trace.tokens, want.trace.tokens);
}

// The oracle's rows are the real row's exact top-k: they score at least as well against the exact
// attention as the replica's guess. On the tiny model (peaked attention) it tracks full at
// least as closely as the non-speculative selection at the same k.
TEST(SelectionAgentTest, OracleTracksFullAtLeastAsWellAsNonSpec) {
  const testing::TinyModel model({});
  KvConfig full = Config(KvMode::kFull, 0);
  full.key_bits = full.value_bits = 16;
  const AgentRun want = Generate(model, full);
  auto error = [&](const AgentRun& r) {
    double e = 0;
    for (size_t t = 0; t < want.trace.logits.size(); ++t) {
      for (size_t i = 0; i < want.trace.logits[t].size(); ++i) e += std::fabs(r.trace.logits[t][i] - want.trace.logits[t][i]);
    }
    return e;
  };
  const AgentRun oracle = Generate(model, Config(KvMode::kSpeCacheOracle, 8));
  const AgentRun nonspec = Generate(model, Config(KvMode::kSpeCacheNonSpec, 8));
  EXPECT_LE(error(oracle), error(nonspec));
  EXPECT_EQ(oracle.selected.size(), 8u);
  EXPECT_EQ(oracle.stats.rows_selected, nonspec.stats.rows_selected);
}

TEST(SelectionAgentTest, UnionSelectsFromBothRowsAndFetchesThem) {
  const testing::TinyModel model({});
  KvConfig c = Config(KvMode::kSpeCache, 8);
  c.select = SelectFrom::kUnion;
  c.top_k_real = 4;
  const AgentRun u = Generate(model, c);
  EXPECT_EQ(u.selected.size(), 12u);
  const int64_t head_fetches = int64_t{kSteps} * 3 * 2;  // pre-decode + kSteps - 1 decode steps, 3 layers, 2 heads
  EXPECT_EQ(u.stats.rows_selected, head_fetches * 12);
  EXPECT_EQ(u.stats.rows_fetched + u.stats.rows_reused, u.stats.rows_selected);
}

// Attending the whole row cache: with a cache that can hold every quantized token and enough
// steps, more rows are full precision, so the output moves towards full's; the fetch is the same.
TEST(SelectionAgentTest, AttendResidentUsesTheRowCacheAndFetchesNothingMore) {
  const testing::TinyModel model({});
  KvConfig plain = Config(KvMode::kSpeCache, 8);
  plain.cached_rows = 64;
  KvConfig resident = plain;
  resident.attend_resident = true;
  const AgentRun a = Generate(model, plain), b = Generate(model, resident);
  EXPECT_EQ(b.stats.rows_selected, a.stats.rows_selected);
  EXPECT_NE(b.trace.logits, a.trace.logits);  // more rows substituted
  EXPECT_EQ(b.stats.device_bytes, a.stats.device_bytes);
}

TEST(SelectionAgentTest, AdaptiveBudgetStaysWithinItsBounds) {
  const testing::TinyModel model({});
  KvConfig c = Config(KvMode::kSpeCache, 64);
  c.mass = 0.5;
  c.k_min = 2;
  c.k_max = 20;
  const AgentRun r = Generate(model, c);
  const int64_t head_fetches = int64_t{kSteps} * 3 * 2;
  EXPECT_GE(r.stats.rows_selected, head_fetches * 2);
  EXPECT_LE(r.stats.rows_selected, head_fetches * 20);
  EXPECT_GE(r.selected.size(), 2u);
  EXPECT_LE(r.selected.size(), 20u);
}

}  // namespace
}  // namespace specache
