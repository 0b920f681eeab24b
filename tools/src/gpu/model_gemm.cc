#include "model_gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_call.h"

namespace specache::gpu {
namespace {

// cuBLAS's advice for Hopper; allocated once, so no call allocates (decode graphs capture them).
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kTimedCalls = 5;  // per kernel, after one warm-up call

cublasHandle_t Blas(void* h) { return static_cast<cublasHandle_t>(h); }
cublasLtHandle_t Lt(void* h) { return static_cast<cublasLtHandle_t>(h); }

// cuBLASLt's heuristics assume 256-byte aligned operands unless told otherwise; cudaMalloc's are.
bool Aligned(const void* x, const void* w, const void* y) {
  return (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(y)) % 256 == 0;
}

// cuda_call.h's Cuda, the error cleared (a failed timing call must not surface in the model's
// next check of cudaGetLastError).
Status CudaCall(cudaError_t e, const char* what) {
  const Status s = Cuda(e, what);
  if (!s.ok()) (void)cudaGetLastError();
  return s;
}

}  // namespace

// A shape's cuBLASLt descriptors (made while it is chosen) and what was kept.
struct ModelGemm::Shape {
  Chosen figures;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // W^T's operand, x's, y's
  cublasLtMatmulAlgo_t algo{};
  size_t algo_workspace = 0;

  ~Shape() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  // Column-major, as cuBLAS sees the row-major arrays: W[out][in] is [in][out] used transposed,
  // x[n][in] is [in][n], y[n][out] is [out][n].
  bool Describe(int n, int in, int out) {
    const cublasOperation_t transpose = CUBLAS_OP_T, as_is = CUBLAS_OP_N;
    return cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)) ==
               CUBLAS_STATUS_SUCCESS &&
           cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &as_is, sizeof(as_is)) ==
               CUBLAS_STATUS_SUCCESS &&
           cublasLtMatrixLayoutCreate(&a, CUDA_R_16F, in, out, in) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatrixLayoutCreate(&b, CUDA_R_16F, in, n, in) == CUBLAS_STATUS_SUCCESS &&
           cublasLtMatrixLayoutCreate(&c, CUDA_R_32F, out, n, out) == CUBLAS_STATUS_SUCCESS;
  }
};

Result<std::unique_ptr<ModelGemm>> ModelGemm::Create(cudaStream_t stream, Choice choice) {
  std::unique_ptr<ModelGemm> g(new ModelGemm());
  g->stream_ = stream;
  g->choice_ = choice;
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return Status::Unavailable("cublasCreate failed");
  g->blas_ = h;
  if (cublasSetStream(h, stream) != CUBLAS_STATUS_SUCCESS) return Status::Unavailable("cublasSetStream failed");
  // The workspace after cublasSetStream, which resets it; cuBLASLt's calls take the same one (every
  // call is on the one stream, in order).
  SPECACHE_RETURN_IF_ERROR(CudaCall(cudaMalloc(&g->workspace_, kWorkspaceBytes), "GEMM workspace"));
  g->workspace_bytes_ = kWorkspaceBytes;
  if (cublasSetWorkspace(h, g->workspace_, kWorkspaceBytes) != CUBLAS_STATUS_SUCCESS) {
    return Status::Unavailable("cublasSetWorkspace failed");
  }
  cublasLtHandle_t lt = nullptr;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return Status::Unavailable("cublasLtCreate failed");
  g->lt_ = lt;
  return g;
}

ModelGemm::~ModelGemm() {
  if (stream_) (void)cudaStreamSynchronize(stream_);
  shapes_.clear();
  if (lt_) cublasLtDestroy(Lt(lt_));
  if (blas_) cublasDestroy(Blas(blas_));
  if (workspace_) cudaFree(workspace_);
  if (scratch_) cudaFree(scratch_);
}

Status ModelGemm::Run(const Half* x, int n, int in, const Half* w, int out, float* y, bool accumulate) {
  if (choice_ == Choice::kDefault || n > kMaxTimedRows) return RunDefault(x, n, in, w, out, y, accumulate);
  const Key key{n, in, out, accumulate};
  Shape* shape = nullptr;
  if (const auto it = shapes_.find(key); it != shapes_.end()) {
    shape = it->second.get();
  } else {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &capturing) != cudaSuccess) {
      (void)cudaGetLastError();
      capturing = cudaStreamCaptureStatusActive;  // unknown: nothing is timed
    }
    if (capturing != cudaStreamCaptureStatusNone) return RunDefault(x, n, in, w, out, y, accumulate);
    SPECACHE_ASSIGN_OR_RETURN(shape, Choose(key, x, w, y));
  }
  return shape->figures.lt && Aligned(x, w, y) ? RunLt(*shape, x, w, y, accumulate)
                                                : RunDefault(x, n, in, w, out, y, accumulate);
}

Status ModelGemm::RunDefault(const Half* x, int n, int in, const Half* w, int out, float* y, bool accumulate) {
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cublasStatus_t s = cublasGemmEx(Blas(blas_), CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, CUDA_R_16F, in, x,
                                        CUDA_R_16F, in, &beta, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) return Status::Internal("cublasGemmEx failed: status " + std::to_string(int(s)));
  return Status::Ok();
}

Status ModelGemm::RunLt(const Shape& s, const Half* x, const Half* w, float* y, bool accumulate) {
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cublasStatus_t r = cublasLtMatmul(Lt(lt_), s.op, &one, w, s.a, x, s.b, &beta, y, s.c, y, s.c, &s.algo,
                                          workspace_, s.algo_workspace, stream_);
  if (r != CUBLAS_STATUS_SUCCESS) return Status::Internal("cublasLtMatmul failed: status " + std::to_string(int(r)));
  return Status::Ok();
}

Result<double> ModelGemm::TimeCalls(const std::function<Status()>& call) {
  cudaEvent_t start = nullptr, end = nullptr;
  Status made = CudaCall(cudaEventCreate(&start), "GEMM timing event");
  if (made.ok()) made = CudaCall(cudaEventCreate(&end), "GEMM timing event");
  Status s = made.ok() ? call() : made;
  if (s.ok()) s = CudaCall(cudaEventRecord(start, stream_), "GEMM timing");
  for (int i = 0; s.ok() && i < kTimedCalls; ++i) s = call();
  if (s.ok()) s = CudaCall(cudaEventRecord(end, stream_), "GEMM timing");
  if (s.ok()) s = CudaCall(cudaEventSynchronize(end), "GEMM timing");
  float ms = 0.0f;
  if (s.ok()) s = CudaCall(cudaEventElapsedTime(&ms, start, end), "GEMM timing");
  if (start) cudaEventDestroy(start);
  if (end) cudaEventDestroy(end);
  SPECACHE_RETURN_IF_ERROR(s);
  return static_cast<double>(ms) / kTimedCalls;
}

Result<ModelGemm::Shape*> ModelGemm::Choose(const Key& key, const Half* x, const Half* w, float* y) {
  const auto [n, in, out, accumulate] = key;
  auto shape = std::make_unique<Shape>();
  shape->figures = Chosen{n, in, out, accumulate};
  Chosen& f = shape->figures;
  auto keep = [&]() -> Shape* {
    Shape* kept = shape.get();
    shapes_[key] = std::move(shape);
    return kept;
  };
  float* target = y;  // overwritten by the call itself after the timing
  if (accumulate) {   // y must not take the timed calls' sums: scratch of its size, zeroed
    const size_t floats = size_t(n) * out;
    if (floats > scratch_floats_) {
      SPECACHE_RETURN_IF_ERROR(CudaCall(cudaStreamSynchronize(stream_), "GEMM timing"));
      if (scratch_) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_floats_ = 0;
      if (cudaMalloc(&scratch_, floats * sizeof(float)) != cudaSuccess) {
        (void)cudaGetLastError();
        scratch_ = nullptr;
        return keep();  // no room to time it: the default, untimed (figures 0)
      }
      scratch_floats_ = floats;
    }
    SPECACHE_RETURN_IF_ERROR(
        CudaCall(cudaMemsetAsync(scratch_, 0, floats * sizeof(float), stream_), "GEMM timing scratch"));
    target = scratch_;
  }
  // cuBLASLt's candidates; a shape that cannot be described or has none keeps the default.
  cublasLtMatmulPreference_t preference = nullptr;
  cublasLtMatmulHeuristicResult_t found[kCandidates] = {};
  int count = 0;
  if (!Aligned(x, w, target) || !shape->Describe(n, in, out) ||
      cublasLtMatmulPreferenceCreate(&preference) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                           sizeof(workspace_bytes_)) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulAlgoGetHeuristic(Lt(lt_), shape->op, shape->a, shape->b, shape->c, shape->c, preference,
                                     kCandidates, found, &count) != CUBLAS_STATUS_SUCCESS) {
    count = 0;
  }
  if (preference) cublasLtMatmulPreferenceDestroy(preference);
  std::vector<int> usable;
  for (int i = 0; i < count; ++i) {
    if (found[i].state == CUBLAS_STATUS_SUCCESS && found[i].workspaceSize <= workspace_bytes_) usable.push_back(i);
  }
  f.candidates = static_cast<int>(usable.size());
  // Two rounds, the default then each candidate in turn; each kernel's faster round counts (a
  // kernel that failed to run in a round is out).
  constexpr double kNotRun = -1.0;
  double default_ms = kNotRun;
  std::vector<double> ms(usable.size(), kNotRun);
  std::vector<bool> failed(usable.size(), false);
  for (int round = 0; round < 2; ++round) {
    SPECACHE_ASSIGN_OR_RETURN(const double d, TimeCalls([&] { return RunDefault(x, n, in, w, out, target, accumulate); }));
    default_ms = default_ms == kNotRun ? d : std::min(default_ms, d);
    for (size_t c = 0; c < usable.size(); ++c) {
      if (failed[c]) continue;
      shape->algo = found[usable[c]].algo;
      shape->algo_workspace = found[usable[c]].workspaceSize;
      const Result<double> t = TimeCalls([&] { return RunLt(*shape, x, w, target, accumulate); });
      if (!t.ok()) {
        failed[c] = true;
        ms[c] = kNotRun;
        continue;
      }
      ms[c] = ms[c] == kNotRun ? *t : std::min(ms[c], *t);
    }
  }
  f.default_ms = f.chosen_ms = default_ms;
  int best = -1;
  for (size_t c = 0; c < usable.size(); ++c) {
    if (!failed[c] && ms[c] != kNotRun && (best < 0 || ms[c] < ms[best])) best = static_cast<int>(c);
  }
  if (best >= 0 && (min_gain_ < 0 || ms[best] <= (1.0 - min_gain_) * default_ms)) {
    shape->algo = found[usable[best]].algo;
    shape->algo_workspace = found[usable[best]].workspaceSize;
    f.lt = true;
    f.chosen_ms = ms[best];
  }
  return keep();
}

std::vector<ModelGemm::Chosen> ModelGemm::chosen() const {
  std::vector<Chosen> all;
  for (const auto& [key, shape] : shapes_) all.push_back(shape->figures);
  return all;
}

}  // namespace specache::gpu
