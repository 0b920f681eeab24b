// GpuEngine's steps queued a step ahead (QueueStep, QueueGreedyStep, FinishStep) against the same
// steps run one at a time (Step fed its own output): the same greedy tokens, the same rows in the
// agent; and the queue's rules. Random weights of SmolLM2-135M's shapes, the CUDA agent on the
// model's stream; needs a device (label gpu).
#include <cuda_runtime.h>

#include <memory>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "forwarding_agent.h"
#include "specache/agent.h"
#include "specache/gpu_engine.h"
#include "specache/gpu_llama.h"
#include "specache/in_memory_source.h"
#include "testing/cuda_device.h"

namespace specache::gpu {
namespace {

// A ragged batch of random prompts, the same for every run.
std::vector<std::vector<int32_t>> Prompts(int vocab) {
  std::mt19937 rng(29);
  std::vector<std::vector<int32_t>> prompts;
  for (int length : {90, 203, 147}) {
    std::vector<int32_t> p(static_cast<size_t>(length));
    for (int32_t& t : p) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    prompts.push_back(std::move(p));
  }
  return prompts;
}

// An agent and an engine over the shared model, the prompts prefilled and decoding started.
struct Run {
  InMemorySource source;
  std::unique_ptr<Agent> agent;
  std::unique_ptr<GpuEngine> engine;
  std::vector<SequenceId> ids;
  std::vector<int32_t> first;  // the first generated tokens (Start's)
};

std::unique_ptr<Run> Begin(GpuLlama* model, KvMode mode) {
  auto r = std::make_unique<Run>();
  KvConfig c;
  c.mode = mode;
  c.top_k = 16;
  CudaAgentOptions options;
  options.capacity_tokens = 1024;
  options.stream = model->stream();
  auto agent = CreateCudaAgent(model->shape(), c, &r->source, options);
  EXPECT_TRUE(agent.ok()) << agent.status().ToString();
  if (!agent.ok()) return nullptr;
  r->agent = std::move(*agent);
  r->engine = std::make_unique<GpuEngine>(model, r->agent.get());
  const auto prompts = Prompts(model->config().vocab);
  std::vector<int32_t> lengths;
  for (size_t i = 0; i < prompts.size(); ++i) {
    r->ids.push_back(static_cast<SequenceId>(i + 1));
    lengths.push_back(static_cast<int32_t>(prompts[i].size()));
  }
  auto first = r->engine->Prefill(r->ids, prompts);
  EXPECT_TRUE(first.ok()) << first.status().ToString();
  if (!first.ok()) return nullptr;
  r->first = *first;
  const Status started = r->engine->Start(r->ids, lengths, r->first);
  EXPECT_TRUE(started.ok()) << started.ToString();
  return started.ok() ? std::move(r) : nullptr;
}

class GpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SPECACHE_REQUIRE_CUDA_DEVICE();
    // An untied head: a tied one, over random layers, tends to predict the token it was fed.
    auto m = GpuLlama::Random(SmolLm2Config(), 11, /*tied_head=*/false);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
  }
  std::unique_ptr<GpuLlama> model_;
};

TEST_F(GpuEngineTest, StepsQueuedAheadGiveTheTokensOfStepsOneAtATime) {
  constexpr int kSteps = 12;
  for (KvMode mode : {KvMode::kSpeCache, KvMode::kFull}) {  // two rows a sequence (real, speculative), and one
    SCOPED_TRACE(mode == KvMode::kSpeCache ? "specache" : "full");
    auto one = Begin(model_.get(), mode);
    ASSERT_NE(one, nullptr);
    auto speculative = [](const GpuEngine& e) {
      return std::vector<int32_t>(e.speculative_tokens().begin(), e.speculative_tokens().end());
    };
    std::vector<std::vector<int32_t>> want, want_speculative;
    std::vector<int32_t> tokens = one->first;
    for (int i = 0; i < kSteps + 1; ++i) {
      auto next = one->engine->Step(tokens);
      ASSERT_TRUE(next.ok()) << next.status().ToString();
      tokens = *next;
      want.push_back(tokens);
      want_speculative.push_back(speculative(*one->engine));
    }
    // A run that repeated one token would not tell a step fed the wrong tokens from the right ones.
    ASSERT_GT(std::set<std::vector<int32_t>>(want.begin(), want.end()).size(), 1u) << "the random model repeats itself";

    auto ahead = Begin(model_.get(), mode);
    ASSERT_NE(ahead, nullptr);
    GpuEngine& e = *ahead->engine;
    ASSERT_EQ(ahead->first, one->first);
    EXPECT_EQ(e.QueueGreedyStep().code(), StatusCode::kFailedPrecondition) << "a greedy step with none before it";
    ASSERT_TRUE(e.QueueStep(ahead->first).ok());
    EXPECT_EQ(e.Step(ahead->first).status().code(), StatusCode::kFailedPrecondition) << "Step while one is queued";
    EXPECT_EQ(e.QueueStep(ahead->first).code(), StatusCode::kFailedPrecondition) << "tokens while one is queued";
    EXPECT_EQ(e.Prefill(ahead->ids, Prompts(model_->config().vocab)).status().code(), StatusCode::kFailedPrecondition)
        << "a prefill while a step is queued";
    std::vector<std::vector<int32_t>> got, got_speculative;
    for (int i = 0; i < kSteps; ++i) {
      ASSERT_TRUE(e.QueueGreedyStep().ok());
      ASSERT_EQ(e.queued_steps(), 2);
      if (i == 0) {
        EXPECT_EQ(e.QueueGreedyStep().code(), StatusCode::kFailedPrecondition) << "a third step queued";
      }
      auto next = e.FinishStep();
      ASSERT_TRUE(next.ok()) << next.status().ToString();
      got.push_back(*next);
      got_speculative.push_back(speculative(e));
    }
    auto last = e.FinishStep();
    ASSERT_TRUE(last.ok()) << last.status().ToString();
    got.push_back(*last);
    got_speculative.push_back(speculative(e));
    EXPECT_EQ(e.queued_steps(), 0);
    EXPECT_EQ(e.FinishStep().status().code(), StatusCode::kFailedPrecondition) << "a finish with none queued";
    EXPECT_EQ(got, want);
    EXPECT_EQ(got_speculative, want_speculative);
    EXPECT_EQ(e.steps(), one->engine->steps());
    const ModelShape shape = model_->shape();
    for (SequenceId id : one->ids) {
      EXPECT_EQ(*ahead->agent->SequenceLength(id), *one->agent->SequenceLength(id));
      if (mode != KvMode::kSpeCache) continue;
      for (int l = 0; l < shape.n_layers; ++l) {  // the rows the last steps selected: their speculative tokens'
        for (int h = 0; h < shape.n_kv_heads; ++h) {
          EXPECT_EQ(*ahead->agent->SelectedTokens(id, l, h), *one->agent->SelectedTokens(id, l, h))
              << "sequence " << id << ", layer " << l << ", head " << h;
        }
      }
    }

    // Phase timing times one step at a time; after the queue drains, Step goes on from its tokens.
    e.set_phase_timing(true);
    ASSERT_TRUE(e.QueueStep(got.back()).ok());
    EXPECT_EQ(e.QueueGreedyStep().code(), StatusCode::kFailedPrecondition) << "a greedy step under phase timing";
    auto timed = e.FinishStep();
    ASSERT_TRUE(timed.ok()) << timed.status().ToString();
    auto stepped = one->engine->Step(want.back());
    ASSERT_TRUE(stepped.ok()) << stepped.status().ToString();
    EXPECT_EQ(*timed, *stepped);
    EXPECT_EQ(e.phase_times().steps, 1);
  }
}

// An agent that forwards to another and fails one layer of one decode step, as a device or a
// source could, after the step began.
class FailingLayerAgent final : public ForwardingAgent {
 public:
  using ForwardingAgent::ForwardingAgent;
  void FailNextDecodeAt(int layer) { fail_layer_ = layer; }

  Status DecodeLayer(int layer, const DecodeRows& rows) override {
    if (layer == fail_layer_) {
      fail_layer_ = -1;
      return Status::Unavailable("injected: layer " + std::to_string(layer) + " failed");
    }
    return ForwardingAgent::DecodeLayer(layer, rows);
  }

 private:
  int fail_layer_ = -1;
};

// A step that fails after the agent began it stops the batch (its rows may be partly appended):
// every later step is refused with its error, while the step queued before it still finishes.
TEST_F(GpuEngineTest, AStepThatFailsAfterTheAgentBeganItStopsTheBatch) {
  auto r = Begin(model_.get(), KvMode::kSpeCache);
  ASSERT_NE(r, nullptr);
  FailingLayerAgent failing(r->agent.get());
  GpuEngine e(model_.get(), &failing);  // a second engine over the started batch
  std::vector<int32_t> lengths;
  for (SequenceId id : r->ids) lengths.push_back(*r->agent->SequenceLength(id));
  ASSERT_TRUE(e.Start(r->ids, lengths, r->first).ok());
  ASSERT_TRUE(e.QueueStep(r->first).ok());
  failing.FailNextDecodeAt(3);
  const Status failed = e.QueueGreedyStep();
  EXPECT_EQ(failed.code(), StatusCode::kUnavailable) << failed.ToString();
  EXPECT_EQ(e.queued_steps(), 1);
  auto first = e.FinishStep();  // queued before the failure: finished as usual
  EXPECT_TRUE(first.ok()) << first.status().ToString();
  const Status refused = e.QueueStep(r->first);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
  EXPECT_NE(refused.message().find("injected: layer 3 failed"), std::string::npos) << refused.ToString();
  EXPECT_EQ(e.Step(r->first).status().code(), StatusCode::kFailedPrecondition);
}

// An engine destroyed with a step still queued waits for it (its tokens' buffer is the engine's).
TEST_F(GpuEngineTest, AnEngineDestroyedWithAQueuedStepWaitsForIt) {
  auto r = Begin(model_.get(), KvMode::kSpeCache);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->engine->QueueStep(r->first).ok());
  ASSERT_TRUE(r->engine->QueueGreedyStep().ok());
  r->engine.reset();
  EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>(model_->stream())), cudaSuccess);
  const auto prompts = Prompts(model_->config().vocab);
  for (size_t i = 0; i < r->ids.size(); ++i) {  // both queued steps' rows appended
    EXPECT_EQ(*r->agent->SequenceLength(r->ids[i]), static_cast<int32_t>(prompts[i].size()) + 2);
  }
}

}  // namespace
}  // namespace specache::gpu
