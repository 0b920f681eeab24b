// The GPU model's matrix products: y[n][out] (fp32, or += y) = x[n][in] (fp16) x W[out][in]^T
// (fp16), fp32 accumulation, on the model's stream.
//
// Each shape's kernel can be chosen by timing (Choice::kTimed): the first call of a shape
// (n <= kMaxTimedRows, in, out, accumulate) made while the stream is not being captured times
// cuBLAS's default (cublasGemmEx, the only kernel of Choice::kDefault) and up to kCandidates of
// cuBLASLt's heuristic algorithms for the shape, on the call's own operands, in two interleaved
// rounds (each kernel's faster round counts), and keeps the fastest for every later call of that
// shape. A candidate must be at least min_gain() faster than the default to be taken, so that
// timing noise does not swap kernels that tie; even so, the choice is a measurement, and two
// processes may keep different kernels for a shape (results that differ in fp32 rounding). An
// accumulating product is timed into scratch, not y: the call itself writes y once, after the
// choice. Shapes of more rows (a prefill's) run the default untimed: their timing would weigh on
// the prefill it happens in, and their scratch would be large. A shape first met inside a capture
// runs the default and is timed at its first uncaptured call, so a graph captured (by the caller)
// before that call keeps the default while later calls run the choice; the model's own decode
// graphs run a new shape eagerly first, so their captures always hold the choice. A kept cuBLASLt
// kernel assumes 256-byte aligned operands (cudaMalloc's): a call with others runs the default.
//
// What it gave (H100, `specache-bench layers`, 2026-12-05): Llama-3-8B's layers within 3% of
// cuBLAS's default at 7-176 rows (5.91 -> 5.88 ms a step at 7 rows, 7.46 -> 7.39 at 176, against
// 4.64 ms for reading their weights at the copy's rate; single products up to 12%), and the whole
// model at 48 GB within its run-to-run spread: cuBLAS's default stays the default. In the whole
// model at 176 x 8K the products' kernels ran ~1.4x their time alone (CUPTI: the gate and up
// product 141 us against 98, beside the agent's top-k and fetch kernels on other streams): that,
// not the kernels' choice, is much of their distance to the bound there.
//
// Results differ between kernels only in fp32 rounding (the order of the sums). Not thread-safe
// (the model is used from one thread). UNAVAILABLE without CUDA or cuBLAS.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "specache/half.h"
#include "specache/status.h"

namespace specache::gpu {

class ModelGemm {
 public:
  enum class Choice { kDefault, kTimed };
  static constexpr int kCandidates = 8;
  static constexpr int kMaxTimedRows = 1024;  // larger shapes run the default untimed

  // A handle and a workspace on `stream` (which must outlive the object).
  static Result<std::unique_ptr<ModelGemm>> Create(cudaStream_t stream, Choice choice);
  ~ModelGemm();
  ModelGemm(const ModelGemm&) = delete;
  ModelGemm& operator=(const ModelGemm&) = delete;

  Choice choice() const { return choice_; }
  // From the next call: kDefault runs the default for every shape; kTimed runs each shape's kept
  // kernel, timing the shapes not chosen yet.
  void set_choice(Choice c) { choice_ = c; }
  // The share of the default's time a candidate must save to be kept (default 0.03). For tests:
  // a negative one keeps the fastest candidate whatever the default's time, so that the cuBLASLt
  // path runs. Applies to shapes not chosen yet.
  double min_gain() const { return min_gain_; }
  void set_min_gain(double g) { min_gain_ = g; }

  // y = x W^T (+ y when accumulate), as above. x, w, y device memory.
  Status Run(const Half* x, int n, int in, const Half* w, int out, float* y, bool accumulate);

  // What the timing chose for each shape timed so far (for benchmarks).
  struct Chosen {
    int n = 0, in = 0, out = 0;
    bool accumulate = false;
    double default_ms = 0;  // cublasGemmEx's time per call (its faster round's mean)
    double chosen_ms = 0;   // the kept kernel's (== default_ms when the default is kept)
    int candidates = 0;     // cuBLASLt algorithms timed beside the default
    bool lt = false;        // a cuBLASLt algorithm was kept
  };
  std::vector<Chosen> chosen() const;

 private:
  ModelGemm() = default;
  struct Shape;  // a shape's cuBLASLt descriptors and kept algorithm (model_gemm.cc)
  using Key = std::tuple<int, int, int, bool>;  // n, in, out, accumulate
  // Times the default and the candidates for the key's shape; the shape's entry either way (one
  // that keeps the default when nothing could be timed).
  Result<Shape*> Choose(const Key& key, const Half* x, const Half* w, float* y);
  Status RunDefault(const Half* x, int n, int in, const Half* w, int out, float* y, bool accumulate);
  Status RunLt(const Shape& s, const Half* x, const Half* w, float* y, bool accumulate);
  // Mean ms per call of `call` over a few calls after one warm-up (events on the stream).
  Result<double> TimeCalls(const std::function<Status()>& call);

  cudaStream_t stream_ = nullptr;
  Choice choice_ = Choice::kDefault;
  double min_gain_ = 0.03;
  void* blas_ = nullptr;  // cublasHandle_t
  void* lt_ = nullptr;    // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  float* scratch_ = nullptr;  // an accumulating product's timing output
  size_t scratch_floats_ = 0;
  std::map<Key, std::unique_ptr<Shape>> shapes_;
};

}  // namespace specache::gpu
