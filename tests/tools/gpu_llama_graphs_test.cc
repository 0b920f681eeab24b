// GpuLlama's decode graphs (SetDecodeGraphs): decode steps through captured CUDA graphs give
// bit-equal logits to the same steps launched kernel by kernel, while the shapes change (rows,
// the positions' buffer), across a Reserve that moves the buffers, and inside a caller's own
// capture of the stream; with the products' kernels timed and kept per shape (SetTimedGemms), the
// same step gives the same logits every time, close to cuBLAS's default's. Random weights of
// SmolLM2-135M's shapes; needs a device (label gpu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "model_gemm.h"
#include "specache/gpu_llama.h"
#include "testing/cuda_device.h"

namespace specache::gpu {
namespace {

struct ModelRun {
  std::unique_ptr<GpuLlama> model;
  int32_t* positions = nullptr;  // a buffer of the test's own, for the shapes' second pointer
};

ModelRun Make(bool graphs, bool timed_gemms = false) {
  ModelRun r;
  auto m = GpuLlama::Random(SmolLm2Config(), 7, /*tied_head=*/true);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return r;
  r.model = std::move(*m);
  r.model->SetDecodeGraphs(graphs);
  r.model->SetTimedGemms(timed_gemms);
  EXPECT_TRUE(r.model->Reserve(8).ok());
  EXPECT_EQ(cudaMalloc(&r.positions, 64 * sizeof(int32_t)), cudaSuccess);
  return r;
}

// One decode step of n rows at `position`: every layer's projections, the attention output taken
// as the queries themselves (attn and q have the same shape), the layer's rest; then the logits.
std::vector<float> Step(ModelRun& r, int n, int32_t position, bool own_positions) {
  GpuLlama& m = *r.model;
  auto* stream = static_cast<cudaStream_t>(m.stream());
  const int32_t* positions = own_positions ? r.positions : m.device_positions();
  std::vector<int32_t> host(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) host[static_cast<size_t>(i)] = position + i;
  EXPECT_EQ(cudaMemcpyAsync(const_cast<int32_t*>(positions), host.data(), host.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice, stream), cudaSuccess);
  for (int i = 0; i < n; ++i) host[static_cast<size_t>(i)] = (position * 31 + i * 17) % m.config().vocab;
  EXPECT_EQ(cudaMemcpyAsync(m.device_tokens(), host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  EXPECT_TRUE(m.Embed(m.device_tokens(), n).ok());
  const size_t q_bytes = size_t(n) * m.config().n_heads * m.config().head_dim * sizeof(float);
  for (int l = 0; l < m.config().n_layers; ++l) {
    EXPECT_TRUE(m.ProjectQkv(l, n, positions).ok());
    EXPECT_EQ(cudaMemcpyAsync(m.attn(), m.q(), q_bytes, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    EXPECT_TRUE(m.FinishLayer(l, n).ok());
  }
  EXPECT_TRUE(m.Logits(0, n).ok());
  std::vector<float> logits(size_t(n) * m.config().vocab);
  EXPECT_EQ(cudaMemcpyAsync(logits.data(), m.logits(), logits.size() * sizeof(float), cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return logits;
}

void ExpectBitEqual(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

TEST(GpuLlamaGraphsTest, ReplayedStepsEqualLaunchedStepsAsShapesChange) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  ModelRun plain = Make(false), graphed = Make(true);
  ASSERT_TRUE(plain.model && graphed.model);
  // (rows, own positions' buffer): repeats (captured at the second call, replayed from the third),
  // new row counts, the other positions' buffer, and back; it ends on the test's own positions,
  // which Reserve does not move (below).
  const std::vector<std::pair<int, bool>> shapes = {{4, false}, {4, false}, {4, false}, {4, false}, {2, false},
                                                    {2, false}, {2, false}, {4, true},  {4, true},  {4, true},
                                                    {4, false}, {4, false}, {4, false}, {4, true},  {4, true}};
  int32_t position = 3;
  for (size_t i = 0; i < shapes.size(); ++i, position += 5) {
    const auto [n, own] = shapes[i];
    ExpectBitEqual(Step(plain, n, position, own), Step(graphed, n, position, own), "step");
  }
  EXPECT_EQ(plain.model->graph_launches(), 0);
  EXPECT_TRUE(graphed.model->decode_graphs());
  // Per layer, a key's first call runs as it is and every later one goes through its graph
  // (captured at the second). ProjectQkv's keys (rows, positions): 4 calls, 3 through the graph;
  // 3 (2); 3 (2); 3 (2); 2 (1). FinishLayer's (rows only): 4 (3); 3 (2); 8 (7).
  const int64_t layers = graphed.model->config().n_layers;
  EXPECT_EQ(graphed.model->graph_launches(), layers * ((3 + 2 + 2 + 2 + 1) + (3 + 2 + 7)));

  // A Reserve that moves the buffers drops the graphs, though both keys repeat (the last shape
  // again, its positions the test's own): that step runs as it is, the next ones through new graphs.
  ASSERT_TRUE(plain.model->Reserve(16).ok());
  ASSERT_TRUE(graphed.model->Reserve(16).ok());
  int64_t before = graphed.model->graph_launches();
  ExpectBitEqual(Step(plain, 4, position, true), Step(graphed, 4, position, true), "first step after Reserve");
  position += 5;
  EXPECT_EQ(graphed.model->graph_launches(), before) << "a graph of the freed buffers was replayed";
  for (int i = 0; i < 2; ++i, position += 5) {
    ExpectBitEqual(Step(plain, 4, position, true), Step(graphed, 4, position, true), "after Reserve");
  }
  EXPECT_EQ(graphed.model->graph_launches(), before + 2 * 2 * layers);

  // Inside the caller's own capture the calls run as they are (captured by the caller's graph).
  auto* stream = static_cast<cudaStream_t>(graphed.model->stream());
  before = graphed.model->graph_launches();
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  bool finished = true;
  for (int l = 0; l < graphed.model->config().n_layers; ++l) finished = finished && graphed.model->FinishLayer(l, 8).ok();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);  // the stream is not left capturing
  cudaGraphDestroy(graph);
  EXPECT_TRUE(finished);
  EXPECT_EQ(graphed.model->graph_launches(), before);
  EXPECT_TRUE(graphed.model->decode_graphs());
  ExpectBitEqual(Step(plain, 8, position, false), Step(graphed, 8, position, false), "after the caller's capture");

  for (ModelRun* r : {&plain, &graphed}) cudaFree(r->positions);
}

// SetTimedGemms: each product shape's kernel is timed at its first call and kept, so the same
// step gives bit-equal logits at that first (eager) call, captured into a graph at the second and
// replayed from it after; the kept kernels differ from cuBLAS's default only in fp32 rounding.
// (ModelGemmTest checks a kept cuBLASLt kernel against a CPU product.)
TEST(GpuLlamaGraphsTest, TimedGemmsKeepOneKernelPerShape) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  ModelRun plain = Make(false), timed = Make(true, /*timed_gemms=*/true);
  ASSERT_TRUE(plain.model && timed.model);
  EXPECT_TRUE(timed.model->timed_gemms());
  EXPECT_FALSE(plain.model->timed_gemms());
  for (int n : {4, 2}) {
    const std::vector<float> reference = Step(plain, n, 11, false);
    const std::vector<float> first = Step(timed, n, 11, false);  // chooses, then runs the choice
    ASSERT_EQ(first.size(), reference.size());
    float largest = 0.0f, worst = 0.0f;
    for (size_t i = 0; i < first.size(); ++i) {
      largest = std::max(largest, std::fabs(reference[i]));
      worst = std::max(worst, std::fabs(first[i] - reference[i]));
    }
    EXPECT_LE(worst, 1e-3f * largest + 1e-4f) << n << " rows: the kept kernels against cuBLAS's default";
    for (int again = 0; again < 3; ++again) {  // the keys' second call is captured, the later ones replayed
      ExpectBitEqual(first, Step(timed, n, 11, false), "the same step with the kernels kept");
    }
  }
  EXPECT_GT(timed.model->graph_launches(), 0);
  // SmolLM2's products (QKV, output, gate and up, down; the LM head) at 4 and 2 rows, each timed once.
  const std::vector<ModelGemm::Chosen> chosen = timed.model->gemms().chosen();
  EXPECT_EQ(chosen.size(), 10u);
  for (const ModelGemm::Chosen& c : chosen) {
    EXPECT_GT(c.default_ms, 0.0) << c.n << " x " << c.in << " -> " << c.out;
    EXPECT_LE(c.chosen_ms, c.default_ms);
    EXPECT_EQ(c.lt, c.chosen_ms < c.default_ms);
  }
  EXPECT_TRUE(plain.model->gemms().chosen().empty()) << "the default choice times nothing";
  for (ModelRun* r : {&plain, &timed}) cudaFree(r->positions);
}

}  // namespace
}  // namespace specache::gpu
