// Label `gpu`: the CUDA agent over client_lib's RemoteSource (a specached with [remote] on
// loopback, rows over UCX; the agent's staged path) against the CUDA agent over an InMemorySource
// with pages: the same outputs, selections and counts for a ragged batch in specache mode, and
// the rows it appended read back from the daemon. Then the daemon is killed under it: the agent
// answers with an error Status, without hanging, and goes away cleanly.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "processes.h"
#include "remote_daemon.h"
#include "specache/agent.h"
#include "specache/client.h"
#include "specache/host_tensor_agent.h"
#include "specache/in_memory_source.h"
#include "specache/remote_session.h"
#include "specache/remote_source.h"
#include "testing/cuda_device.h"
#include "testing/drive_batch.h"

namespace specache {
namespace {

TEST(RemoteCudaTest, TheCudaAgentOverARemoteDaemonMatchesItselfOverLocalPagesAndSurvivesTheDaemonsDeath) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  testing::Pki pki;
  ASSERT_TRUE(pki.ok) << "openssl could not make the test certificates";
  const uint16_t control_port = testing::FreePort(), data_port = testing::FreePort();
  const std::string secret_a = testing::WriteSecret(pki.dir, "a", "tenant-a-secret-0123456789");
  const std::string secret_b = testing::WriteSecret(pki.dir, "b", "tenant-b-secret-9876543210");
  testing::DaemonProcess daemon;
  daemon.capture_log = true;
  ASSERT_TRUE(daemon.Start(testing::RemoteDaemonToml(pki, secret_a, secret_b, control_port, data_port, false, false)))
      << daemon.Log();
  client::RemoteCredentials credentials;
  credentials.ca_file = pki.path("ca.pem");
  credentials.tenant = "a";
  credentials.secret_file = secret_a;
  const int deadline_ms = 2000;
  auto c = client::Client::Connect(
      {"tcp://127.0.0.1:" + std::to_string(control_port), std::chrono::milliseconds(3000), "remote-cuda-test"}, credentials);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto session = client::RemoteSession::Open(c->get(), "a", 16 << 20,
                                             {client::FetchMethod::kServerGather, std::chrono::milliseconds(deadline_ms)});
  ASSERT_TRUE(session.ok()) << session.status().ToString() << "\n" << daemon.Log();
  auto remote_source = std::make_unique<client::RemoteSource>(session->get(), 16, 1024);

  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  KvConfig config;
  config.mode = KvMode::kSpeCache;
  config.key_bits = config.value_bits = 2;
  config.top_k = 24;
  InMemorySource paged;
  auto local = CreateCudaAgent(shape, config, &paged, {1024});
  auto remote = CreateCudaAgent(shape, config, remote_source.get(), {1024});
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  auto want_agent = WrapHostTensors(std::move(local).value());
  auto got_agent = WrapHostTensors(std::move(remote).value());
  ASSERT_TRUE(want_agent.ok() && got_agent.ok());
  Agent& want_host = **want_agent;
  Agent& got_host = **got_agent;
  const int steps = 20;
  auto want = testing::DriveBatch(&want_host, prompts, steps, std::mt19937(31));
  auto got = testing::DriveBatch(&got_host, prompts, steps, std::mt19937(31));
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  ASSERT_TRUE(got.ok()) << got.status().ToString() << "\n" << daemon.Log();
  ASSERT_EQ(got->size(), want->size());
  double worst = 0;
  for (size_t i = 0; i < want->size(); ++i) worst = std::max(worst, double(std::fabs((*got)[i] - (*want)[i])));
  EXPECT_LE(worst, 1e-6);
  const AgentStats a = want_host.stats(), b = got_host.stats();
  EXPECT_EQ(b.rows_selected, a.rows_selected);
  EXPECT_EQ(b.rows_fetched, a.rows_fetched);
  EXPECT_EQ(b.rows_reused, a.rows_reused);
  EXPECT_GT(b.rows_fetched, 0);
  for (size_t s = 0; s < prompts.size(); ++s) {
    const SequenceId id = static_cast<SequenceId>(10 + s);
    for (int l = 0; l < shape.n_layers; ++l) {
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        EXPECT_EQ(*got_host.SelectedTokens(id, l, h), *want_host.SelectedTokens(id, l, h))
            << "sequence " << id << " layer " << l << " head " << h;
      }
    }
  }
  // The rows the staged path appended over UCX are the rows the GPU wrote into local pages.
  for (int h = 0; h < shape.n_kv_heads; ++h) {
    const int32_t length = *paged.Length(11, 2, h);
    ASSERT_EQ(*remote_source->Length(11, 2, h), length);
    std::vector<int32_t> tokens(static_cast<size_t>(length));
    for (int32_t t = 0; t < length; ++t) tokens[t] = t;
    std::vector<Half> x(tokens.size() * 2 * shape.head_dim), y(x.size());
    ASSERT_TRUE(paged.ReadRows(11, 2, h, tokens.data(), length, x.data()).ok());
    ASSERT_TRUE(remote_source->ReadRows(11, 2, h, tokens.data(), length, y.data()).ok());
    EXPECT_TRUE(x == y) << "head " << h;
  }
  std::printf("over UCX: max |out diff| %.2e, %lld rows fetched, %lld reused\n", worst,
              static_cast<long long>(b.rows_fetched), static_cast<long long>(b.rows_reused));

  // The daemon dies: within a few deadlines a call of the agent says so; nothing hangs.
  daemon.child->Kill(SIGKILL);
  ASSERT_EQ(daemon.child->Wait(5000), 128 + SIGKILL);
  const std::vector<SequenceId> ids{10, 11, 12, 13};
  std::mt19937 rng(32);
  const auto start = std::chrono::steady_clock::now();
  Status failed;
  for (int attempt = 0; attempt < 4 && failed.ok(); ++attempt) failed = testing::DecodeStepWithRandomRows(&got_host, ids, &rng);
  EXPECT_FALSE(failed.ok()) << "no call noticed the daemon's death";
  std::printf("after the daemon's death: %s\n", failed.ToString().c_str());
  const auto teardown = std::chrono::steady_clock::now();
  got_agent->reset();  // waits for the worker: every queued read and append ends at its deadline
  remote_source.reset();
  session->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - teardown, std::chrono::seconds(30));
}

}  // namespace
}  // namespace specache
