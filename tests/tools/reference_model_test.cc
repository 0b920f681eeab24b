// The reference engine on the real model (SmolLM2-135M): tokenizer and logits against llama.cpp's
// golden data (tools/reference/llama_cpp_reference.py wrote it), engine vs agent prefill, and
// SpeCache with k >= context equal to full token for token, and with k = 64 close to it.
#include <algorithm>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "blas_runtime.h"
#include "niah_prompt.h"
#include "run_support.h"
#include "testing/model_file.h"

namespace specache {
namespace {

class ReferenceModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(testing::ModelPath())) return;
    auto m = run::LoadModel(testing::ModelPath());
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = new run::LoadedModel(std::move(m).value());
    std::ifstream in(testing::SourcePath("tests/data/smollm2_llama_cpp.json"));
    golden_ = new nlohmann::json(nlohmann::json::parse(in));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete golden_;
    model_ = nullptr;
    golden_ = nullptr;
  }
  void SetUp() override { SPECACHE_REQUIRE_MODEL_FILE(); }

  static std::vector<int32_t> Chat(const std::string& text) {
    const ChatMessage user[] = {{"user", text}};
    return model_->tokenizer->Encode(model_->chat.Apply(user, true), true);
  }

  // Greedy generation of n tokens in one KV mode (full precision in `memory`, or process memory).
  static std::vector<int32_t> Generate(const KvConfig& config, const std::vector<int32_t>& prompt, int n,
                                       run::KvMemory* memory = nullptr) {
    auto run = run::MakeModeRun(*model_->model, config, memory);
    EXPECT_TRUE(run.ok());
    Agent* agents[] = {(*run)->agent.get()};
    auto pre = Prefill(*model_->model, agents, 1, prompt);
    EXPECT_TRUE(pre.ok()) << pre.status().ToString();
    Decoder decoder(*model_->model, (*run)->agent.get(), 1, static_cast<int32_t>(prompt.size()));
    std::vector<int32_t> out{Argmax(pre->logits)};
    EXPECT_TRUE(decoder.Start(out[0]).ok());
    while (static_cast<int>(out.size()) < n) {
      auto logits = decoder.Step(out.back());
      EXPECT_TRUE(logits.ok()) << logits.status().ToString();
      out.push_back(Argmax(*logits));
    }
    return out;
  }

  static run::LoadedModel* model_;
  static nlohmann::json* golden_;
};
run::LoadedModel* ReferenceModelTest::model_ = nullptr;
nlohmann::json* ReferenceModelTest::golden_ = nullptr;

TEST_F(ReferenceModelTest, TokenizerMatchesLlamaCppAndDecodesBack) {
  ASSERT_GE((*golden_)["tokenizer"].size(), 10u);
  for (const auto& c : (*golden_)["tokenizer"]) {
    const std::string text = c["text"];
    const bool special = c["special"];
    const auto ids = model_->tokenizer->Encode(text, special);
    EXPECT_EQ(ids, c["tokens"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(model_->tokenizer->Decode(ids, /*render_control=*/true), text);
  }
}

// llama.cpp multiplies Q4_1 weights with activations rounded to 8 bits, so its logits differ from
// our float32 ones by a few tenths (numpy_reference.py shows ours match a float64 forward to
// ~1e-2). The bounds: llama.cpp's top-1 is within 0.25 of our best logit, and over its top-20
// tokens the logits, each relative to the top-1's, differ by at most 1.0 (mean 0.4).
TEST_F(ReferenceModelTest, LogitsAgreeWithLlamaCpp) {
  LlamaScratch scratch;
  for (const auto& c : (*golden_)["logits"]) {
    const std::vector<int32_t> tokens = model_->tokenizer->Encode(c["prompt"].get<std::string>(), true);
    ASSERT_EQ(tokens, c["tokens"].get<std::vector<int32_t>>());
    auto run = run::MakeModeRun(*model_->model, KvConfig{KvMode::kFull});
    ASSERT_TRUE(run.ok());
    Agent* agents[] = {(*run)->agent.get()};
    auto pre = Prefill(*model_->model, agents, 1, tokens);
    ASSERT_TRUE(pre.ok()) << pre.status().ToString();
    const std::vector<float>& ours = pre->logits;
    const auto& top = c["top"];
    const int ref_best = top[0][0];
    const float our_best = ours[Argmax(ours)];
    EXPECT_LE(our_best - ours[ref_best], 0.25f) << "llama.cpp's top-1 " << ref_best << " vs ours " << Argmax(ours);
    double worst = 0, mean = 0;
    for (const auto& entry : top) {
      const int id = entry[0];
      const double ref_rel = entry[1].get<double>() - top[0][1].get<double>();
      const double our_rel = double{ours[id]} - ours[ref_best];
      worst = std::max(worst, std::abs(ref_rel - our_rel));
      mean += std::abs(ref_rel - our_rel) / static_cast<double>(top.size());
    }
    EXPECT_LE(worst, 1.0) << c["prompt"];
    EXPECT_LE(mean, 0.4) << c["prompt"];
  }
}

TEST_F(ReferenceModelTest, EnginePrefillAttentionEqualsTheAgentsOwn) {
  const std::vector<int32_t> prompt = Chat("Name three colors of the rainbow and explain why the sky is blue.");
  std::vector<std::vector<float>> logits;
  for (bool agent_attention : {false, true}) {
    auto run = run::MakeModeRun(*model_->model, KvConfig{KvMode::kFull});
    ASSERT_TRUE(run.ok());
    Agent* agents[] = {(*run)->agent.get()};
    auto pre = Prefill(*model_->model, agents, 1, prompt, agent_attention);
    ASSERT_TRUE(pre.ok()) << pre.status().ToString();
    logits.push_back(pre->logits);
  }
  float worst = 0;
  for (size_t i = 0; i < logits[0].size(); ++i) worst = std::max(worst, std::abs(logits[0][i] - logits[1][i]));
  // Float32 sums in another order, over 30 layers: the float64 reference differs from either by ~1e-2.
  EXPECT_LT(worst, 2e-2f);
  EXPECT_EQ(Argmax(logits[0]), Argmax(logits[1]));
}

// Tokens at the start of `got` equal to `want`.
int LeadingAgreement(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  const auto [g, w] = std::mismatch(got.begin(), got.end(), want.begin(), want.end());
  return static_cast<int>(g - got.begin());
}

// SpeCache 1-bit with k = 64 gives the full-precision answer for at least this many tokens on the
// prompt below. Measured: 24 of 40 (KIVI 1-bit alone: 1). The bound leaves room for a near-tie
// flipping one greedy token earlier after a change of summation order, and is still far above
// what the replica alone gives; a fetch that substituted the wrong rows, or none, falls below it.
constexpr int kSpeCache64LeadingTokens = 16;

TEST_F(ReferenceModelTest, SpeCacheWithTopKCoveringTheContextReproducesFull) {
  const std::vector<int32_t> prompt = Chat(
      "A bicycle is a human-powered vehicle with two wheels, one behind the other, attached to a frame. The rider "
      "steers with handlebars and pushes pedals that turn the rear wheel through a chain. Bicycles were introduced "
      "in the nineteenth century in Europe, and by the early twenty-first century more than a billion were in use. "
      "Explain in two sentences how a moving bicycle stays upright.");
  ASSERT_GT(prompt.size(), 64u + 32u);  // longer than the residual, so 1-bit groups exist
  const int n = 40;
  const std::vector<int32_t> full = Generate(KvConfig{KvMode::kFull}, prompt, n);
  KvConfig spec{KvMode::kSpeCache};
  spec.top_k = 4096;  // >= every length this test reaches
  EXPECT_EQ(Generate(spec, prompt, n), full);
  // k = 64 (the default) on the same prompt, against 1-bit KIVI alone (no rows fetched). Greedy
  // outputs part ways at their first differing token, so what is compared is how many tokens
  // each gives before that.
  spec.top_k = 64;
  KvConfig kivi{KvMode::kKivi};
  const int spec64 = LeadingAgreement(Generate(spec, prompt, n), full);
  const int kivi1 = LeadingAgreement(Generate(kivi, prompt, n), full);
  std::printf("tokens equal to full before the first difference, of %d: specache-1bit k=64 %d, kivi-1bit %d\n", n,
              spec64, kivi1);
  EXPECT_GE(spec64, kSpeCache64LeadingTokens);
  EXPECT_GT(spec64, kivi1) << "fetching the top-64 rows must recover more than the 1-bit replica alone";
}

// specache-run's default selection (the defaults of KvOptions, chosen by
// tools/bench/selection_grid.sh) at 1 bit finds a needle at 1K tokens as full precision does. (The
// paper's rule, the library's default, answers "PINNARED" here.)
TEST_F(ReferenceModelTest, DefaultOneBitSelectionFindsTheNeedle) {
  std::ifstream in(testing::SourcePath("tools/data/gpl-3.0.txt"));
  const std::string haystack((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  NiahSpec spec{haystack, "The secret password for the blue door is PINEAPPLE.",
                "What is the secret password for the blue door?", 1024, 0.5};
  auto prompt = BuildNiahPrompt(*model_->tokenizer, model_->chat, spec);
  ASSERT_TRUE(prompt.ok()) << prompt.status().ToString();
  auto answer = [&](const KvConfig& config) {
    const std::vector<int32_t> tokens = Generate(config, prompt->tokens, 16);
    return model_->tokenizer->Decode(tokens);
  };
  auto chosen = run::ToConfig(run::KvOptions{});
  ASSERT_TRUE(chosen.ok());
  const std::string full = answer(KvConfig{KvMode::kFull}), mine = answer(*chosen);
  std::printf("full: %s\n%s: %s\n", full.c_str(), DescribeKvConfig(*chosen).c_str(), mine.c_str());
  EXPECT_NE(full.find("PINEAPPLE"), std::string::npos) << full;
  EXPECT_NE(mine.find("PINEAPPLE"), std::string::npos) << mine;
}

TEST_F(ReferenceModelTest, DaemonPagesGiveTheSameTokensAsProcessMemory) {
  run::KvOptions options;  // kv_memory "embedded": a specached inside this process
  auto memory = run::OpenKvMemory(options, *model_->model, 1);
  if (memory.status().code() == StatusCode::kUnimplemented) GTEST_SKIP() << "built without the service";
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  const std::vector<int32_t> prompt = Chat("List four animals that live in the ocean, with one fact about each.");
  KvConfig spec{KvMode::kSpeCache};
  spec.top_k = 16;  // small k: many rows are fetched from the pages, and the answer depends on them
  const std::vector<int32_t> in_process = Generate(spec, prompt, 24);
  EXPECT_EQ(Generate(spec, prompt, 24, memory->get()), in_process);
  const nlohmann::json figures = (*memory)->Figures();
  EXPECT_EQ(figures["kv_memory"], "embedded daemon");
  // One ExtendSequence per 64-token page for the whole sequence (all layers at once).
  EXPECT_LE(figures["extend_rpcs"].get<int>(), static_cast<int>((prompt.size() + 24) / 64 + 1));
}

TEST_F(ReferenceModelTest, NiahPromptHasTheExactLengthAndTheNeedleAtTheDepth) {
  const std::string hay = "The sun rose over the hills. Birds sang in the trees. A river ran to the sea. ";
  NiahSpec spec{hay, "The code is 4817.", "What is the code?", 300, 0.5};
  auto p = BuildNiahPrompt(*model_->tokenizer, model_->chat, spec);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->tokens.size(), 300u);
  const std::vector<int32_t> needle = model_->tokenizer->Encode(" The code is 4817. ", false);
  EXPECT_TRUE(std::equal(needle.begin(), needle.end(), p->tokens.begin() + p->needle_position));
  const std::string before = model_->tokenizer->Decode(
      std::span<const int32_t>(p->tokens.data(), p->needle_position));
  EXPECT_EQ(before.back(), '.');  // after a sentence end
  EXPECT_NEAR(p->needle_position, 300 / 2, 40);

  spec.depth = 0;
  auto first = BuildNiahPrompt(*model_->tokenizer, model_->chat, spec);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(model_->tokenizer->Decode(std::span<const int32_t>(first->tokens.data(), first->needle_position), true)
                .substr(0, 12),
            "<|im_start|>");
  spec.depth = 1.5;
  EXPECT_EQ(BuildNiahPrompt(*model_->tokenizer, model_->chat, spec).status().code(), StatusCode::kInvalidArgument);
  spec.depth = 0.5;
  spec.context_tokens = 20;
  EXPECT_EQ(BuildNiahPrompt(*model_->tokenizer, model_->chat, spec).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specache

// Applies the engine's BLAS/OpenMP runtime settings (a re-exec when they change), as specache-run does.
int main(int argc, char** argv) {
  specache::ConfigureBlasRuntime(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
