// The split of the device KV bytes, on a real CPU agent driven by the tiny model: the parts add
// up to what the agent reports, the window is the R-token fp16 part, and only the modes that
// fetch rows have a row cache.
#include <gtest/gtest.h>

#include "memory_breakdown.h"
#include "specache/in_memory_source.h"
#include "testing/tiny_model.h"

namespace specache::run {
namespace {

nlohmann::json Breakdown(KvMode mode, int prompt_tokens, AgentStats* stats_out,
                         HostRowFormat rows = HostRowFormat::kFp16) {
  testing::TinyModel model({});
  KvConfig config;
  config.mode = mode;
  config.top_k = 8;
  config.host_row_format = rows;
  InMemorySource source;
  auto agent = CreateCpuAgent(model.shape(), config, &source);
  EXPECT_TRUE(agent.ok());
  std::vector<int> prompt(prompt_tokens);
  for (int i = 0; i < prompt_tokens; ++i) prompt[i] = (i * 7) % 96;
  EXPECT_TRUE(model.Generate(agent->get(), 1, prompt, 6).ok());
  *stats_out = (*agent)->stats();
  const ModelShape shape = model.shape();
  const int64_t row = int64_t{shape.n_layers} * shape.n_kv_heads * 2 * shape.head_dim * 2;
  return MemoryBreakdown(shape, config, static_cast<int>(stats_out->full_precision_bytes / row), *stats_out);
}

TEST(MemoryBreakdownTest, PartsAddUpToTheAgentsDeviceBytes) {
  AgentStats s;
  const nlohmann::json b = Breakdown(KvMode::kSpeCache, 300, &s);
  const int tokens = b["tokens"].get<int>();
  EXPECT_GE(tokens, 300);
  EXPECT_EQ(b["codes_bytes"].get<int64_t>() + b["residual_window_bytes"].get<int64_t>() + b["row_cache_bytes"].get<int64_t>(),
            s.device_bytes);
  // Keys: tokens mod R in the residual; values: the R newest. 3 layers x 2 KV heads x 32 dims.
  const int64_t window_tokens = tokens % 64 + 64;
  EXPECT_EQ(b["residual_window_bytes"].get<int64_t>(), 3 * 2 * window_tokens * 32 * 2);
  EXPECT_GT(b["row_cache_bytes"].get<int64_t>(), 0);
  EXPECT_DOUBLE_EQ(b["ratio"].get<double>(), static_cast<double>(s.device_bytes) / s.full_precision_bytes);
  const std::string lines = MemoryLines(b, "  ");
  EXPECT_NE(lines.find("of which fixed: fp16 residual window (R = 64)"), std::string::npos) << lines;
  EXPECT_EQ(b["host_bytes"].get<int64_t>(), s.full_precision_bytes);
  EXPECT_EQ(lines.find("host rows"), std::string::npos) << lines;
}

// int8 host rows: the host's copy is (2 x head_dim + 16) / (4 x head_dim) of the fp16 rows, and
// the lines say so; the device's split does not change.
TEST(MemoryBreakdownTest, Int8HostRowsAreCountedAsStored) {
  AgentStats s;
  const nlohmann::json b = Breakdown(KvMode::kSpeCache, 300, &s, HostRowFormat::kInt8);
  EXPECT_EQ(b["host_row_format"], "int8");
  EXPECT_EQ(b["host_bytes"].get<int64_t>(), s.full_precision_bytes / (4 * 32) * (2 * 32 + 16));  // head_dim 32
  EXPECT_NE(MemoryLines(b, "").find("host rows"), std::string::npos) << MemoryLines(b, "");
}

TEST(MemoryBreakdownTest, KiviHasNoRowCacheAndFullIsNotSplit) {
  AgentStats s;
  const nlohmann::json kivi = Breakdown(KvMode::kKivi, 300, &s);
  EXPECT_EQ(kivi["row_cache_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(kivi["codes_bytes"].get<int64_t>() + kivi["residual_window_bytes"].get<int64_t>(), s.device_bytes);
  const nlohmann::json full = Breakdown(KvMode::kFull, 100, &s);
  EXPECT_FALSE(full.contains("codes_bytes"));
  EXPECT_EQ(MemoryLines(full, "").find("of which"), std::string::npos);
}

}  // namespace
}  // namespace specache::run
