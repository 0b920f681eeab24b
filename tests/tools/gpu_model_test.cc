// The whole model on the GPU (GpuLlama + CUDA agent + GpuEngine) against the CPU reference engine
// on the real model (SmolLM2-135M): greedy tokens in `full` for three prompts of 40 to 2000
// tokens; where they part, the logits at that position must differ by < 0.05 (fp16 weights and
// cuBLAS sums against float32 weights and OpenBLAS). SpeCache with k >= n equals full on the GPU;
// specache-run's own 1-bit SpeCache (seeded at prefill) gives the CPU engine's tokens; and a ragged
// batch decodes as each sequence alone (same rule at a first divergence). Needs a device (label
// gpu) and the model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "run_support.h"
#include "specache/gpu_engine.h"
#include "specache/gpu_llama.h"
#include "testing/cuda_device.h"
#include "testing/model_file.h"

namespace specache {
namespace {

constexpr int kDecodeTokens = 24;

struct Decoded {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // per token: the logits it was chosen from
};

class GpuModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(testing::ModelPath()) || !ProbeCudaDevice().ok()) return;
    auto m = run::LoadModel(testing::ModelPath());
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = new run::LoadedModel(std::move(m).value());
    auto g = gpu::GpuLlama::FromModel(*model_->model);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    gpu_ = g->release();
    std::ifstream in(testing::SourcePath("tools/data/gpl-3.0.txt"));
    std::stringstream text;
    text << in.rdbuf();
    const std::vector<int32_t> all = model_->tokenizer->Encode(text.str(), false);
    for (size_t n : {40, 700, 2000}) {  // three prompts from different places of the text
      const size_t at = n * 3 % (all.size() - n);
      prompts_.emplace_back(all.begin() + at, all.begin() + at + n);
    }
  }
  static void TearDownTestSuite() {
    delete gpu_;
    delete model_;
    gpu_ = nullptr;
    model_ = nullptr;
  }
  void SetUp() override {
    SPECACHE_REQUIRE_CUDA_DEVICE();
    SPECACHE_REQUIRE_MODEL_FILE();
    ASSERT_NE(gpu_, nullptr);
  }


  // The CPU engine with the CPU agent in `config`.
  static Decoded Cpu(const std::vector<int32_t>& prompt, const KvConfig& config = KvConfig{KvMode::kFull}) {
    Decoded d;
    auto run = run::MakeModeRun(*model_->model, config);
    EXPECT_TRUE(run.ok());
    Agent* agents[] = {(*run)->agent.get()};
    auto pre = Prefill(*model_->model, agents, 1, prompt);
    EXPECT_TRUE(pre.ok()) << pre.status().ToString();
    Decoder decoder(*model_->model, (*run)->agent.get(), 1, static_cast<int32_t>(prompt.size()));
    d.logits.push_back(pre->logits);
    d.tokens.push_back(Argmax(pre->logits));
    EXPECT_TRUE(decoder.Start(d.tokens[0]).ok());
    while (static_cast<int>(d.tokens.size()) < kDecodeTokens) {
      auto logits = decoder.Step(d.tokens.back());
      EXPECT_TRUE(logits.ok()) << logits.status().ToString();
      d.logits.emplace_back(logits->begin(), logits->end());
      d.tokens.push_back(Argmax(*logits));
    }
    return d;
  }

  // The GPU model and the CUDA agent in `config`, all prompts as one ragged batch.
  static std::vector<Decoded> Gpu(const KvConfig& config, const std::vector<std::vector<int32_t>>& prompts) {
    InMemorySource source;
    CudaAgentOptions options;
    options.capacity_tokens = 4096;
    options.stream = gpu_->stream();
    auto agent = CreateCudaAgent(gpu_->shape(), config, &source, options);
    EXPECT_TRUE(agent.ok()) << agent.status().ToString();
    gpu::GpuEngine engine(gpu_, agent->get());
    std::vector<SequenceId> ids;
    std::vector<int32_t> lengths;
    for (size_t i = 0; i < prompts.size(); ++i) {
      ids.push_back(i + 1);
      lengths.push_back(static_cast<int32_t>(prompts[i].size()));
    }
    const int vocab = gpu_->config().vocab;
    std::vector<Decoded> out(prompts.size());
    std::vector<float> logits;
    auto first = engine.Prefill(ids, prompts, &logits);
    EXPECT_TRUE(first.ok()) << first.status().ToString();
    auto keep = [&](const std::vector<int32_t>& tokens) {
      for (size_t i = 0; i < prompts.size(); ++i) {
        out[i].tokens.push_back(tokens[i]);
        out[i].logits.emplace_back(logits.begin() + i * vocab, logits.begin() + (i + 1) * vocab);
      }
    };
    keep(*first);
    EXPECT_TRUE(engine.Start(ids, lengths, *first).ok());
    std::vector<int32_t> tokens = *first;
    while (static_cast<int>(out[0].tokens.size()) < kDecodeTokens) {
      auto next = engine.Step(tokens, &logits);
      EXPECT_TRUE(next.ok()) << next.status().ToString();
      if (!next.ok()) break;
      tokens = *next;
      keep(tokens);
    }
    return out;
  }

  static run::LoadedModel* model_;
  static gpu::GpuLlama* gpu_;
  static std::vector<std::vector<int32_t>> prompts_;
};
run::LoadedModel* GpuModelTest::model_ = nullptr;
gpu::GpuLlama* GpuModelTest::gpu_ = nullptr;
std::vector<std::vector<int32_t>> GpuModelTest::prompts_;

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

// Greedy tokens agree, or where they first part the two runs saw the same inputs and their logits
// differ by less than `tolerance` (a near-tie flipped by float summation order: cuBLAS picks
// other kernels for other row counts). Prints where they part.
void ExpectSameTokensOrNearTie(const std::string& what, const Decoded& want, const Decoded& got,
                               float tolerance = 0.05f) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size()) << what;
  const size_t same =
      std::mismatch(want.tokens.begin(), want.tokens.end(), got.tokens.begin()).first - want.tokens.begin();
  std::printf("%s: %zu of %zu greedy tokens equal; first logits max |diff| %.4f\n", what.c_str(), same,
              want.tokens.size(), MaxAbsDiff(want.logits[0], got.logits[0]));
  if (same == want.tokens.size()) return;
  const float diff = MaxAbsDiff(want.logits[same], got.logits[same]);
  std::printf("  first divergence at token %zu: %d vs %d; logits max |diff| %.4f\n", same, want.tokens[same],
              got.tokens[same], diff);
  EXPECT_LT(diff, tolerance) << what << " diverges at token " << same;
}

TEST_F(GpuModelTest, FullOnTheGpuGivesTheCpuEnginesTokens) {
  for (const auto& prompt : prompts_) {
    ExpectSameTokensOrNearTie("CPU engine vs GPU model, prompt of " + std::to_string(prompt.size()) + " tokens",
                              Cpu(prompt), Gpu(KvConfig{KvMode::kFull}, {prompt})[0]);
  }
}

TEST_F(GpuModelTest, SpeCacheWithTopKCoveringTheContextEqualsFull) {
  KvConfig spec;
  spec.mode = KvMode::kSpeCache;
  spec.top_k = 4096;  // >= every context here: every row is fetched in full precision
  const std::vector<std::vector<int32_t>> prompts{prompts_[0], prompts_[1]};
  const auto full = Gpu(KvConfig{KvMode::kFull}, prompts);
  const auto specache = Gpu(spec, prompts);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ExpectSameTokensOrNearTie("full vs specache k >= n, prompt " + std::to_string(i), full[i], specache[i]);
  }
}

// specache-run's own SpeCache 1-bit (its defaults: the union of both rows' rankings, every
// resident row attended, the row cache seeded at prefill from the prompt's last query) on the GPU
// against the CPU engine with the CPU agent: the same rule on both backends, so the same tokens, or
// a near-tie where they first part.
TEST_F(GpuModelTest, SpecacheRunsDefaultOneBitOnTheGpuGivesTheCpuEnginesTokens) {
  const Result<KvConfig> config = run::ToConfig(run::KvOptions{}, "specache:1");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  ASSERT_GT(config->seed_rows, 0);
  for (const auto& prompt : {prompts_[1], prompts_[2]}) {
    ExpectSameTokensOrNearTie("specache-1bit (specache-run's defaults), CPU vs GPU, prompt of " +
                                  std::to_string(prompt.size()) + " tokens",
                              Cpu(prompt, *config), Gpu(*config, {prompt})[0]);
  }
}

TEST_F(GpuModelTest, RaggedBatchDecodesAsEachSequenceAlone) {
  const auto together = Gpu(KvConfig{KvMode::kFull}, prompts_);
  for (size_t i = 0; i < prompts_.size(); ++i) {
    ExpectSameTokensOrNearTie("alone vs in a ragged batch of 3, prompt " + std::to_string(i),
                              Gpu(KvConfig{KvMode::kFull}, {prompts_[i]})[0], together[i]);
  }
}

}  // namespace
}  // namespace specache
