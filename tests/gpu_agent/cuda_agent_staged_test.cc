// Label `gpu`: the CUDA agent over a source without zero-copy pages (the staged path: rows through
// pinned host memory, reads and appends on the agent's worker thread) against the CUDA agent over
// the same kind of source with pages: same outputs, selections, counts and rows in the source, for
// a ragged batch in every fetching mode; and errors of the source come back as a Status from the
// next call that waits for them, the agent usable after.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "specache/agent.h"
#include "specache/host_tensor_agent.h"
#include "specache/in_memory_source.h"
#include "testing/cuda_device.h"
#include "testing/drive_batch.h"
#include "testing/pageless_source.h"

namespace specache {
namespace {

const ModelShape kShape{3, 8, 2, 64};

Result<std::unique_ptr<Agent>> HostTensorCudaAgent(const KvConfig& c, FullPrecisionSource* source) {
  SPECACHE_ASSIGN_OR_RETURN(auto agent, CreateCudaAgent(kShape, c, source, {1024}));
  return WrapHostTensors(std::move(agent));
}

TEST(CudaAgentStagedTest, ASourceWithoutPagesGivesWhatTheSameSourceWithPagesGives) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  struct Case {
    const char* name;
    KvMode mode;
    SelectFrom select = SelectFrom::kSpeculative;
    bool resident = false;
    double mass = 0;  // the adaptive budget, k_min = 3, k_max = 40
    int k_real = 0;
  } cases[] = {
      {"specache", KvMode::kSpeCache},
      {"specache resident", KvMode::kSpeCache, SelectFrom::kSpeculative, true},
      {"adaptive resident", KvMode::kSpeCache, SelectFrom::kSpeculative, true, 0.5},
      {"union", KvMode::kSpeCache, SelectFrom::kUnion, false, 0, 8},
      {"nonspec", KvMode::kSpeCacheNonSpec},
      {"oracle", KvMode::kSpeCacheOracle},
      {"kivi", KvMode::kKivi},
  };
  for (const Case& cs : cases) {
    KvConfig c;
    c.mode = cs.mode;
    c.key_bits = c.value_bits = 2;
    c.top_k = cs.mode == KvMode::kKivi ? 0 : 24;
    c.select = cs.select;
    c.top_k_real = cs.k_real;
    c.attend_resident = cs.resident;
    if (cs.mass > 0) {
      c.mass = cs.mass;
      c.k_min = 3;
      c.k_max = 40;
    }
    const std::string name = cs.name;
    InMemorySource paged;
    testing::PagelessSource staged;
    auto local = HostTensorCudaAgent(c, &paged);
    auto remote = HostTensorCudaAgent(c, &staged);
    ASSERT_TRUE(local.ok()) << name << ": " << local.status().ToString();
    ASSERT_TRUE(remote.ok()) << name << ": " << remote.status().ToString();
    auto want = testing::DriveBatch(local->get(), prompts, 40, std::mt19937(77));
    auto got = testing::DriveBatch(remote->get(), prompts, 40, std::mt19937(77));
    ASSERT_TRUE(want.ok()) << name << ": " << want.status().ToString();
    ASSERT_TRUE(got.ok()) << name << ": " << got.status().ToString();
    ASSERT_EQ(got->size(), want->size());
    double worst = 0;
    for (size_t i = 0; i < want->size(); ++i) worst = std::max(worst, double(std::fabs((*got)[i] - (*want)[i])));
    // The same kernels on the same rows: only where a missed row came from differs.
    EXPECT_LE(worst, 1e-6) << name;
    const AgentStats a = (*local)->stats(), b = (*remote)->stats();
    EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
    EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
    EXPECT_EQ(b.rows_reused, a.rows_reused) << name;
    EXPECT_EQ(b.device_bytes, a.device_bytes) << name;
    EXPECT_EQ(b.full_precision_bytes, a.full_precision_bytes) << name;
    EXPECT_EQ(staged.stored_bytes(), paged.stored_bytes()) << name << ": rows appended to the source";
    for (size_t s = 0; s < prompts.size(); ++s) {
      const SequenceId id = static_cast<SequenceId>(10 + s);
      for (int l = 0; l < kShape.n_layers; ++l) {
        for (int h = 0; h < kShape.n_kv_heads; ++h) {
          EXPECT_EQ(*(*remote)->SelectedTokens(id, l, h), *(*local)->SelectedTokens(id, l, h))
              << name << ": sequence " << id << " layer " << l << " head " << h;
          // The rows the staged path appended are the rows the GPU wrote into the pages.
          const int32_t length = *paged.Length(id, l, h);
          ASSERT_EQ(*staged.Length(id, l, h), length) << name;
          std::vector<int32_t> tokens(static_cast<size_t>(length));
          for (int32_t t = 0; t < length; ++t) tokens[t] = t;
          std::vector<Half> x(tokens.size() * 2 * kShape.head_dim), y(x.size());
          ASSERT_TRUE(paged.ReadRows(id, l, h, tokens.data(), length, x.data()).ok());
          ASSERT_TRUE(staged.ReadRows(id, l, h, tokens.data(), length, y.data()).ok());
          EXPECT_TRUE(x == y) << name << ": sequence " << id << " layer " << l << " head " << h;
        }
      }
    }
    if (c.fetches_rows()) {
      EXPECT_GT(b.rows_fetched, 0) << name;
      // A layer's reads for every (sequence, KV head) are in flight together.
      EXPECT_GT(staged.max_in_flight(), kShape.n_kv_heads) << name;
    }
    EXPECT_EQ(staged.in_flight(), 0) << name;
    ASSERT_TRUE((*remote)->ReleaseSequence(11).ok());
    EXPECT_EQ(staged.Length(11, 0, 0).status().code(), StatusCode::kNotFound) << name;
    std::printf("%-18s max |out diff| %.2e, %lld rows fetched, %lld reused, %d reads in flight at most\n", cs.name,
                worst, static_cast<long long>(b.rows_fetched), static_cast<long long>(b.rows_reused),
                staged.max_in_flight());
  }
}

TEST(CudaAgentStagedTest, ASourceErrorDuringAFetchComesBackFromTheNextWaitForThatLayer) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  KvConfig c;
  c.mode = KvMode::kSpeCache;
  c.key_bits = c.value_bits = 2;
  c.top_k = 24;
  testing::PagelessSource source;
  auto agent = HostTensorCudaAgent(c, &source);
  ASSERT_TRUE(agent.ok()) << agent.status().ToString();
  const std::vector<int32_t> prompts{150, 90};
  const std::vector<SequenceId> ids{10, 11};
  ASSERT_TRUE(testing::DriveBatch(agent->get(), prompts, 3, std::mt19937(5)).ok());
  (void)(*agent)->stats();  // the worker ran every fetch handed to it: all succeeded

  // A step whose fetches (started at each layer, for the next step) all fail in the source.
  std::mt19937 rng(6);
  const int64_t reads_before = source.reads_started();
  source.FailReadsAfter(0);
  ASSERT_TRUE(testing::DecodeStepWithRandomRows(agent->get(), ids, &rng).ok()) << "the fetches fail on the worker, later";
  (void)(*agent)->stats();  // they ran
  source.FailReadsAfter(-1);
  ASSERT_GT(source.reads_started(), reads_before) << "the step's fetches read nothing";
  EXPECT_EQ(source.in_flight(), 0) << "every started read was finished";

  // Each layer whose fetch read (and so failed) says so once, at its WaitPrefetch; its sequences
  // then hold no rows there. A failed call between steps leaves no step to abandon, so the
  // sequences decode on.
  int failures = 0;
  for (int l = 0; l < kShape.n_layers; ++l) {
    const Status s = (*agent)->WaitPrefetch(l);
    if (s.ok()) continue;
    ++failures;
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
    EXPECT_NE(s.message().find("fetching rows of sequence"), std::string::npos) << s.ToString();
    EXPECT_TRUE((*agent)->SelectedTokens(10, l, 0)->empty()) << "layer " << l;
  }
  EXPECT_GE(failures, 1);
  for (int l = 0; l < kShape.n_layers; ++l) EXPECT_TRUE((*agent)->WaitPrefetch(l).ok()) << "reported once";
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(testing::DecodeStepWithRandomRows(agent->get(), ids, &rng).ok());

  // An append the source refuses comes back from the next BeginStep; the source then lacks the
  // step's rows, so the sequences are released.
  source.FailAppendsAfter(0);
  ASSERT_TRUE(testing::DecodeStepWithRandomRows(agent->get(), ids, &rng).ok()) << "the appends run on the worker, later";
  (void)(*agent)->stats();  // they ran
  source.FailAppendsAfter(-1);
  const Status refused = (*agent)->BeginStep(StepKind::kDecode, ids);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_NE(refused.message().find("source"), std::string::npos) << refused.ToString();
  if (refused.ok()) (*agent)->AbortStep();

  for (SequenceId id : ids) EXPECT_TRUE((*agent)->ReleaseSequence(id).ok());
  EXPECT_EQ(source.stored_bytes(), 0);
  EXPECT_EQ(source.in_flight(), 0);
}

}  // namespace
}  // namespace specache
