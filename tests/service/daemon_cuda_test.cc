// Label `gpu`: the CUDA agent over specached's pages (DaemonSource) against the CPU agent over an
// InMemorySource. Two agents, each on its own session of one real daemon, decode at once from two
// threads (two engines sharing the daemon): each gives the CPU agent's outputs, selections and
// counts, and the rows the GPU wrote into the daemon's pages read back as the CPU agent's rows.
#include <cmath>
#include <cstdio>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "processes.h"
#include "specache/agent.h"
#include "specache/client.h"
#include "specache/daemon_source.h"
#include "specache/device_probe.h"
#include "specache/host_tensor_agent.h"
#include "specache/in_memory_source.h"
#include "testing/cuda_device.h"
#include "testing/drive_batch.h"

namespace specache {
namespace {

struct Engine {
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::DaemonSource> source;
  std::unique_ptr<Agent> agent;
  Result<std::vector<float>> outputs = Status(StatusCode::kUnknown, "not run");
};

TEST(DaemonCudaTest, TwoCudaAgentsOnOneDaemonMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  testing::DaemonProcess d;
  ASSERT_TRUE(d.Start());
  auto c = client::Client::Connect({d.socket, std::chrono::milliseconds(2000), "test"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  const int steps = 40, capacity = 1024;
  KvConfig config;
  config.mode = KvMode::kSpeCache;
  config.key_bits = config.value_bits = 2;
  config.top_k = 24;

  Engine engines[2];
  for (Engine& e : engines) {
    auto session = (*c)->OpenSession("default", 16ull << 20);
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    e.session = std::move(session).value();
    e.source = std::make_unique<client::DaemonSource>(e.session.get(), 64, capacity);
    auto gpu = CreateCudaAgent(shape, config, e.source.get(), {capacity});
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    auto wrapped = WrapHostTensors(std::move(gpu).value());  // the test's rows are on the host
    ASSERT_TRUE(wrapped.ok());
    e.agent = std::move(wrapped).value();
  }
  std::thread threads[2];
  for (int i = 0; i < 2; ++i) {
    threads[i] = std::thread([&, i] {
      engines[i].outputs = testing::DriveBatch(engines[i].agent.get(), prompts, steps, std::mt19937(100 + i));
    });
  }
  for (auto& t : threads) t.join();

  for (int i = 0; i < 2; ++i) {
    Engine& e = engines[i];
    ASSERT_TRUE(e.outputs.ok()) << "engine " << i << ": " << e.outputs.status().ToString();
    InMemorySource cpu_source;
    auto cpu = CreateCpuAgent(shape, config, &cpu_source);
    ASSERT_TRUE(cpu.ok());
    auto want = testing::DriveBatch(cpu->get(), prompts, steps, std::mt19937(100 + i));
    ASSERT_TRUE(want.ok());
    ASSERT_EQ(e.outputs->size(), want->size());
    double worst = 0;
    for (size_t j = 0; j < want->size(); ++j) worst = std::max(worst, double(std::fabs((*e.outputs)[j] - (*want)[j])));
    EXPECT_LT(worst, 1e-3) << "engine " << i;
    const AgentStats a = (*cpu)->stats(), b = e.agent->stats();
    EXPECT_EQ(b.rows_selected, a.rows_selected) << "engine " << i;
    EXPECT_EQ(b.rows_fetched, a.rows_fetched) << "engine " << i;
    EXPECT_EQ(b.rows_reused, a.rows_reused) << "engine " << i;
    for (size_t s = 0; s < prompts.size(); ++s) {
      const SequenceId id = static_cast<SequenceId>(10 + s);
      for (int l = 0; l < shape.n_layers; ++l) {
        for (int h = 0; h < shape.n_kv_heads; ++h) {
          EXPECT_EQ(*e.agent->SelectedTokens(id, l, h), *(*cpu)->SelectedTokens(id, l, h)) << "engine " << i;
        }
      }
      // Every row of every layer and head, as the GPU stored it in the daemon's pages.
      std::vector<int32_t> tokens(prompts[s] + steps);
      for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = static_cast<int32_t>(t);
      for (int l = 0; l < shape.n_layers; ++l) {
        for (int h = 0; h < shape.n_kv_heads; ++h) {
          std::vector<Half> x(tokens.size() * 2 * shape.head_dim), y(x.size());
          const int32_t n = static_cast<int32_t>(tokens.size());
          ASSERT_TRUE(cpu_source.ReadRows(id, l, h, tokens.data(), n, x.data()).ok());
          ASSERT_TRUE(e.source->ReadRows(id, l, h, tokens.data(), n, y.data()).ok());
          EXPECT_EQ(x, y) << "engine " << i << " sequence " << id << " layer " << l << " head " << h;
        }
      }
    }
    std::printf("engine %d over the daemon: max |out diff| %.2e, %lld rows fetched, %lld reused\n", i, worst,
                static_cast<long long>(b.rows_fetched), static_cast<long long>(b.rows_reused));
  }
}

}  // namespace
}  // namespace specache
