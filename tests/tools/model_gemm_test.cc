// ModelGemm (tools/src/gpu/model_gemm.h), the GPU model's products: against a CPU reference on
// random fp16 operands, with cuBLAS's default and with a cuBLASLt candidate kept (min_gain < 0
// keeps the fastest candidate, so the cuBLASLt path runs whatever the timing says); an
// accumulating product adds once, though its first call times several kernels; a kept kernel
// replayed from a graph gives the eager call's bits. Needs a device (label gpu).
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model_gemm.h"
#include "specache/half.h"
#include "testing/cuda_device.h"
#include "testing/device_buffers.h"

namespace specache::gpu {
namespace {

struct Operands {
  int n = 0, in = 0, out = 0;
  std::vector<Half> x, w;      // [n][in], [out][in]
  std::vector<float> y0;       // [n][out]: y before the call
  testing::DeviceBuffers device;
  Half *dx = nullptr, *dw = nullptr;
  float* dy = nullptr;

  Operands(int n_, int in_, int out_, uint32_t seed) : n(n_), in(in_), out(out_) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int i = 0; i < n * in; ++i) x.push_back(FloatToHalf(u(rng)));
    for (int i = 0; i < out * in; ++i) w.push_back(FloatToHalf(0.05f * u(rng)));
    for (int i = 0; i < n * out; ++i) y0.push_back(u(rng));
    dx = device.Copy(x);
    dw = device.Copy(w);
    dy = device.Allocate<float>(y0.size());
  }
  void ResetY() { EXPECT_EQ(cudaMemcpy(dy, y0.data(), y0.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<float> Y() const { return testing::Download(dy, y0.size()); }
  // y (+ y0) = x W^T in double, and each entry's sum of |terms| (the bound's scale).
  void Reference(bool accumulate, std::vector<double>* ref, std::vector<double>* magnitude) const {
    ref->assign(y0.size(), 0.0);
    magnitude->assign(y0.size(), 0.0);
    for (int r = 0; r < n; ++r) {
      for (int o = 0; o < out; ++o) {
        double sum = accumulate ? y0[size_t(r) * out + o] : 0.0, mag = accumulate ? std::fabs(sum) : 0.0;
        for (int k = 0; k < in; ++k) {
          const double t = double(HalfToFloat(x[size_t(r) * in + k])) * HalfToFloat(w[size_t(o) * in + k]);
          sum += t;
          mag += std::fabs(t);
        }
        (*ref)[size_t(r) * out + o] = sum;
        (*magnitude)[size_t(r) * out + o] = mag;
      }
    }
  }
};

// The call's y against the reference: fp16 products are exact in fp32, so only the sums' order
// and rounding (the tensor cores' accumulation truncates) separate a kernel from the reference;
// a wrong layout or transpose is off by the products themselves.
void ExpectMatches(const Operands& o, bool accumulate, const std::vector<float>& y, const char* what) {
  std::vector<double> ref, magnitude;
  o.Reference(accumulate, &ref, &magnitude);
  ASSERT_EQ(y.size(), ref.size());
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_NEAR(y[i], ref[i], 1e-4 * magnitude[i] + 1e-6) << what << ", entry " << i;
  }
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(s); }
};

TEST(ModelGemmTest, DefaultAndKeptCandidatesMatchTheCpuProductAndAccumulateOnce) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  Stream stream;
  auto made = ModelGemm::Create(stream.s, ModelGemm::Choice::kDefault);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ModelGemm& gemm = **made;
  // (rows, in, out): a decode batch's ragged sizes, the last above the timed rows (untimed).
  const int shapes[][3] = {{4, 256, 384}, {37, 512, 256}, {176, 1024, 512}, {ModelGemm::kMaxTimedRows + 8, 128, 64}};
  for (const bool accumulate : {false, true}) {
    for (const auto& s : shapes) {
      Operands o(s[0], s[1], s[2], 11 + s[0]);
      const std::string name = std::to_string(s[0]) + " x " + std::to_string(s[1]) + " -> " + std::to_string(s[2]) +
                               (accumulate ? " (+=)" : "");
      gemm.set_choice(ModelGemm::Choice::kDefault);
      o.ResetY();
      ASSERT_TRUE(gemm.Run(o.dx, o.n, o.in, o.dw, o.out, o.dy, accumulate).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
      ExpectMatches(o, accumulate, o.Y(), ("default, " + name).c_str());
      // Timed, any candidate kept: the first call chooses (timing into y or scratch), then runs.
      gemm.set_choice(ModelGemm::Choice::kTimed);
      gemm.set_min_gain(-1.0);
      o.ResetY();
      ASSERT_TRUE(gemm.Run(o.dx, o.n, o.in, o.dw, o.out, o.dy, accumulate).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
      const std::vector<float> first = o.Y();
      ExpectMatches(o, accumulate, first, ("kept, first call, " + name).c_str());
      o.ResetY();
      ASSERT_TRUE(gemm.Run(o.dx, o.n, o.in, o.dw, o.out, o.dy, accumulate).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
      const std::vector<float> again = o.Y();
      ASSERT_EQ(std::memcmp(first.data(), again.data(), first.size() * sizeof(float)), 0) << "kept, again, " << name;
      // Replayed from a graph of the same call: the same kernel, the same bits.
      o.ResetY();
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      const Status captured = gemm.Run(o.dx, o.n, o.in, o.dw, o.out, o.dy, accumulate);
      ASSERT_EQ(cudaStreamEndCapture(stream.s, &graph), cudaSuccess);
      ASSERT_TRUE(captured.ok()) << captured.ToString();
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream.s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      const std::vector<float> replayed = o.Y();
      ASSERT_EQ(std::memcmp(first.data(), replayed.data(), first.size() * sizeof(float)), 0) << "replayed, " << name;
    }
  }
  // Every timed shape kept a cuBLASLt candidate (min_gain < 0); the one above the timed rows
  // was never timed.
  const std::vector<ModelGemm::Chosen> chosen = gemm.chosen();
  EXPECT_EQ(chosen.size(), 6u);
  for (const ModelGemm::Chosen& c : chosen) {
    EXPECT_LE(c.n, ModelGemm::kMaxTimedRows);
    EXPECT_GT(c.candidates, 0) << c.n << " x " << c.in << " -> " << c.out;
    EXPECT_TRUE(c.lt) << c.n << " x " << c.in << " -> " << c.out;
    EXPECT_GT(c.default_ms, 0.0);
    EXPECT_GT(c.chosen_ms, 0.0);
  }
}

}  // namespace
}  // namespace specache::gpu
