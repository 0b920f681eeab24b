#include "specache/gpu_llama.h"

#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda_call.h"
#include "llama_kernels.h"
#include "model_gemm.h"
#include "specache/half.h"

namespace specache::gpu {
namespace {

cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

LlamaConfig Llama3_8bConfig() {
  LlamaConfig c;
  c.n_layers = 32;
  c.d_model = 4096;
  c.d_ff = 14336;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.vocab = 128256;
  c.context_length = 131072;
  c.rope_theta = 500000.0f;
  c.rms_eps = 1e-5f;
  return c;
}

LlamaConfig SmolLm2Config() {
  LlamaConfig c;
  c.n_layers = 30;
  c.d_model = 576;
  c.d_ff = 1536;
  c.n_heads = 9;
  c.n_kv_heads = 3;
  c.head_dim = 64;
  c.vocab = 49152;
  c.context_length = 8192;
  c.rope_theta = 100000.0f;
  c.rms_eps = 1e-5f;
  return c;
}

template <typename T>
Result<T*> GpuLlama::Allocate(size_t n, std::vector<void*>* list) {
  void* p = nullptr;
  SPECACHE_RETURN_IF_ERROR(
      Cuda(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "device memory (" + std::to_string(n * sizeof(T)) + " bytes)"));
  list->push_back(p);
  return static_cast<T*>(p);
}

Status GpuLlama::Init(const LlamaConfig& c, void* stream, bool tied_head) {
  c_ = c;
  if (stream) {
    stream_ = stream;
    // A blocking stream's capture breaks whenever any thread uses the legacy default stream
    // meanwhile (the agent's synchronous copies do): decode graphs only on non-blocking streams.
    unsigned int flags = 0;
    graphs_allowed_ = cudaStreamGetFlags(Stream(stream), &flags) == cudaSuccess && (flags & cudaStreamNonBlocking) != 0;
    (void)cudaGetLastError();
    graphs_on_ = graphs_allowed_;
  } else {
    cudaStream_t s = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"));
    stream_ = s;
    own_stream_ = true;
  }
  SPECACHE_ASSIGN_OR_RETURN(gemm_, ModelGemm::Create(Stream(stream_), ModelGemm::Choice::kDefault));
  const size_t d = c.d_model, qkv = size_t(c.n_heads + 2 * c.n_kv_heads) * c.head_dim, qw = size_t(c.n_heads) * c.head_dim;
  const size_t ff = c.d_ff, vocab = c.vocab;
  SPECACHE_ASSIGN_OR_RETURN(embedding_, Allocate<Half>(vocab * d, &allocations_));
  weight_bytes_ += int64_t(vocab * d * sizeof(Half));
  if (tied_head) {
    lm_head_ = embedding_;
  } else {
    SPECACHE_ASSIGN_OR_RETURN(lm_head_, Allocate<Half>(vocab * d, &allocations_));
    weight_bytes_ += int64_t(vocab * d * sizeof(Half));
  }
  SPECACHE_ASSIGN_OR_RETURN(output_norm_, Allocate<float>(d, &allocations_));
  SPECACHE_ASSIGN_OR_RETURN(inv_freq_, Allocate<float>(c.head_dim / 2, &allocations_));
  weight_bytes_ += int64_t(d * sizeof(float));
  layers_.resize(c.n_layers);
  qkv_graphs_.resize(layers_.size());
  finish_graphs_.resize(layers_.size());
  for (Layer& l : layers_) {
    SPECACHE_ASSIGN_OR_RETURN(l.attn_norm, Allocate<float>(d, &allocations_));
    SPECACHE_ASSIGN_OR_RETURN(l.ffn_norm, Allocate<float>(d, &allocations_));
    SPECACHE_ASSIGN_OR_RETURN(l.wqkv, Allocate<Half>(qkv * d, &allocations_));
    SPECACHE_ASSIGN_OR_RETURN(l.wo, Allocate<Half>(d * qw, &allocations_));
    SPECACHE_ASSIGN_OR_RETURN(l.wgate_up, Allocate<Half>(2 * ff * d, &allocations_));
    SPECACHE_ASSIGN_OR_RETURN(l.wdown, Allocate<Half>(d * ff, &allocations_));
    const int64_t matrices = int64_t((qkv * d + d * qw + 3 * ff * d) * sizeof(Half));
    layer_matrix_bytes_ += matrices;
    weight_bytes_ += int64_t(2 * d * sizeof(float)) + matrices;
  }
  std::vector<float> inv_freq;
  for (int i = 0; i < c.head_dim / 2; ++i) {
    inv_freq.push_back(static_cast<float>(std::pow(double{c.rope_theta}, -2.0 * i / c.head_dim)));
  }
  return Cuda(cudaMemcpy(inv_freq_, inv_freq.data(), inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice),
              "RoPE frequencies");
}

GpuLlama::~GpuLlama() {
  if (stream_) cudaStreamSynchronize(Stream(stream_));
  DropGraphs();
  for (void* p : activations_) cudaFree(p);
  for (void* p : allocations_) cudaFree(p);
  gemm_.reset();  // (its handles before the stream)
  if (own_stream_) cudaStreamDestroy(Stream(stream_));
}

Result<std::unique_ptr<GpuLlama>> GpuLlama::FromModel(const LlamaModel& model, void* stream) {
  std::unique_ptr<GpuLlama> m(new GpuLlama());
  const bool tied = &model.lm_head() == &model.embedding();
  SPECACHE_RETURN_IF_ERROR(m->Init(model.config(), stream, tied));
  // One staging buffer of fp16, reused tensor by tensor (the copies are synchronous).
  std::vector<Half> staged;
  auto upload = [&](const std::vector<float>& src, Half* dst, const char* what) -> Status {
    staged.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) staged[i] = ::specache::FloatToHalf(src[i]);
    return Cuda(cudaMemcpy(dst, staged.data(), staged.size() * sizeof(Half), cudaMemcpyHostToDevice), what);
  };
  auto upload_float = [&](const std::vector<float>& src, float* dst, const char* what) -> Status {
    return Cuda(cudaMemcpy(dst, src.data(), src.size() * sizeof(float), cudaMemcpyHostToDevice), what);
  };
  SPECACHE_RETURN_IF_ERROR(upload(model.embedding(), m->embedding_, "embedding"));
  if (!tied) SPECACHE_RETURN_IF_ERROR(upload(model.lm_head(), m->lm_head_, "LM head"));
  SPECACHE_RETURN_IF_ERROR(upload_float(model.output_norm(), m->output_norm_, "output norm"));
  SPECACHE_RETURN_IF_ERROR(upload_float(model.rope_inv_freq(), m->inv_freq_, "RoPE frequencies"));
  for (int l = 0; l < model.config().n_layers; ++l) {
    const LlamaModel::Layer& src = model.layer(l);
    Layer& dst = m->layers_[l];
    SPECACHE_RETURN_IF_ERROR(upload_float(src.attn_norm, dst.attn_norm, "attn_norm"));
    SPECACHE_RETURN_IF_ERROR(upload_float(src.ffn_norm, dst.ffn_norm, "ffn_norm"));
    SPECACHE_RETURN_IF_ERROR(upload(src.wqkv, dst.wqkv, "wqkv"));
    SPECACHE_RETURN_IF_ERROR(upload(src.wo, dst.wo, "wo"));
    SPECACHE_RETURN_IF_ERROR(upload(src.wgate_up, dst.wgate_up, "wgate_up"));
    SPECACHE_RETURN_IF_ERROR(upload(src.wdown, dst.wdown, "wdown"));
  }
  return m;
}

Result<std::unique_ptr<GpuLlama>> GpuLlama::Random(const LlamaConfig& c, uint32_t seed, bool tied_head, void* stream) {
  std::unique_ptr<GpuLlama> m(new GpuLlama());
  SPECACHE_RETURN_IF_ERROR(m->Init(c, stream, tied_head));
  const int64_t d = c.d_model, qkv = int64_t(c.n_heads + 2 * c.n_kv_heads) * c.head_dim, qw = int64_t(c.n_heads) * c.head_dim;
  const int64_t ff = c.d_ff, vocab = c.vocab;
  constexpr float kScale = 0.02f;
  void* s = m->stream_;
  Fill(m->embedding_, vocab * d, seed, kScale, s);
  if (!tied_head) Fill(m->lm_head_, vocab * d, seed + 1, kScale, s);
  Set(m->output_norm_, d, 1.0f, s);
  for (int l = 0; l < c.n_layers; ++l) {
    Layer& w = m->layers_[l];
    const uint32_t base = seed + 16 * (l + 1);
    Set(w.attn_norm, d, 1.0f, s);
    Set(w.ffn_norm, d, 1.0f, s);
    Fill(w.wqkv, qkv * d, base + 1, kScale, s);
    Fill(w.wo, d * qw, base + 2, kScale, s);
    Fill(w.wgate_up, 2 * ff * d, base + 3, kScale, s);
    Fill(w.wdown, d * ff, base + 4, kScale, s);
  }
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(Stream(s)), "random weights"));
  return m;
}

int64_t GpuLlama::workspace_bytes() const { return activation_bytes_; }

Status GpuLlama::Reserve(int rows) {
  if (rows <= rows_) return Status::Ok();
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(Stream(stream_)), "model stream"));
  DropGraphs();  // they name the buffers freed here
  for (void* p : activations_) cudaFree(p);
  activations_.clear();
  rows_ = 0;
  const size_t n = rows, d = c_.d_model, qw = size_t(c_.n_heads) * c_.head_dim, kw = size_t(c_.n_kv_heads) * c_.head_dim;
  const size_t ff = c_.d_ff;
  SPECACHE_ASSIGN_OR_RETURN(x_, Allocate<float>(n * d, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(q_, Allocate<float>(n * qw, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(k_, Allocate<float>(n * kw, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(v_, Allocate<float>(n * kw, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(attn_, Allocate<float>(n * qw, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(qkv_, Allocate<float>(n * (qw + 2 * kw), &activations_));
  SPECACHE_ASSIGN_OR_RETURN(gate_up_, Allocate<float>(n * 2 * ff, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(normed_, Allocate<Half>(n * std::max(d, qw), &activations_));
  SPECACHE_ASSIGN_OR_RETURN(attn_h_, Allocate<Half>(n * qw, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(act_, Allocate<Half>(n * ff, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(tokens_, Allocate<int32_t>(n, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(positions_, Allocate<int32_t>(n, &activations_));
  SPECACHE_ASSIGN_OR_RETURN(argmax_, Allocate<int32_t>(n, &activations_));
  // Decode needs logits for every row; a long prefill only for its last one.
  const size_t logit_rows = std::min<size_t>(n, kMaxLogitRows);
  SPECACHE_ASSIGN_OR_RETURN(logits_, Allocate<float>(logit_rows * c_.vocab, &activations_));
  activation_bytes_ = int64_t(n * (d + 2 * qw + 2 * kw + qw + 2 * kw + 2 * ff) * sizeof(float) +
                              n * (std::max(d, qw) + qw + ff) * sizeof(Half) + 3 * n * sizeof(int32_t) +
                              logit_rows * c_.vocab * sizeof(float));
  rows_ = rows;
  return Status::Ok();
}

void GpuLlama::SetDecodeGraphs(bool on) {
  if (!on) DropGraphs();
  graphs_on_ = on && graphs_allowed_;
  graphs_failed_ = false;  // asked again: try again
}

void GpuLlama::SetTimedGemms(bool on) {
  DropGraphs();
  gemm_->set_choice(on ? ModelGemm::Choice::kTimed : ModelGemm::Choice::kDefault);
}

bool GpuLlama::timed_gemms() const { return gemm_->choice() == ModelGemm::Choice::kTimed; }

void GpuLlama::DropGraphs() {
  for (auto* graphs : {&qkv_graphs_, &finish_graphs_}) {
    for (LayerGraph& g : *graphs) {
      if (g.exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g.exec));
      g = LayerGraph{};
    }
  }
}

template <typename Launch>
Status GpuLlama::Replayed(LayerGraph& g, int n, const int32_t* positions, Launch&& launch) {
  cudaStream_t s = Stream(stream_);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (!graphs_on_ || graphs_failed_ || n > kMaxGraphRows || cudaStreamIsCapturing(s, &capturing) != cudaSuccess ||
      capturing != cudaStreamCaptureStatusNone) {
    return launch();  // (the caller's capture, if any, takes the kernels as they are)
  }
  if (g.n != n || g.positions != positions) {  // a new shape: run as it is, captured if it repeats
    if (g.exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g.exec));
    g = LayerGraph{n, positions, nullptr};
    return launch();
  }
  if (!g.exec) {
    // Thread-local: the agent's other threads (its fetch worker) go on calling CUDA meanwhile.
    if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      (void)cudaGetLastError();
      graphs_failed_ = true;
      return launch();
    }
    const Status captured = launch();
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(s, &graph);
    cudaGraphExec_t exec = nullptr;
    if (captured.ok() && e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (!captured.ok() || e != cudaSuccess || exec == nullptr) {
      // Nothing captured ran (an error inside the capture may be the capture's own): run the call
      // as it is, whose status is the call's, and leave graphs off.
      (void)cudaGetLastError();
      graphs_failed_ = true;
      return launch();
    }
    g.exec = exec;
  }
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaGraphLaunch(static_cast<cudaGraphExec_t>(g.exec), s), "decode graph"));
  ++graph_launches_;
  return Status::Ok();
}

Status GpuLlama::Gemm(const Half* x, int n, int in, const Half* w, int out, float* y, bool accumulate) {
  return gemm_->Run(x, n, in, w, out, y, accumulate);
}

Status GpuLlama::Embed(const int32_t* device_tokens, int n) {
  if (n > rows_) return Status::InvalidArgument("Embed of " + std::to_string(n) + " rows; Reserve(" + std::to_string(n) + ") first");
  EmbedRows(embedding_, device_tokens, n, c_.d_model, x_, stream_);
  return Cuda(cudaGetLastError(), "embedding");
}

Status GpuLlama::ProjectQkv(int layer, int n, const int32_t* device_positions) {
  if (layer < 0 || layer >= c_.n_layers) return Status::OutOfRange("layer " + std::to_string(layer));
  if (n > rows_) return Status::InvalidArgument("ProjectQkv of more rows than reserved");
  const Layer& w = layers_[layer];
  const int width = (c_.n_heads + 2 * c_.n_kv_heads) * c_.head_dim;
  return Replayed(qkv_graphs_[layer], n, device_positions, [&]() -> Status {
    RmsNormToHalf(x_, n, c_.d_model, w.attn_norm, c_.rms_eps, normed_, stream_);
    SPECACHE_RETURN_IF_ERROR(Gemm(normed_, n, c_.d_model, w.wqkv, width, qkv_, false));
    SplitQkvRope(qkv_, n, c_.n_heads, c_.n_kv_heads, c_.head_dim, device_positions, inv_freq_, q_, k_, v_, stream_);
    return Cuda(cudaGetLastError(), "projections");
  });
}

Status GpuLlama::FinishLayer(int layer, int n) {
  if (layer < 0 || layer >= c_.n_layers) return Status::OutOfRange("layer " + std::to_string(layer));
  if (n > rows_) return Status::InvalidArgument("FinishLayer of more rows than reserved");
  const Layer& w = layers_[layer];
  const int qw = c_.n_heads * c_.head_dim;
  return Replayed(finish_graphs_[layer], n, nullptr, [&]() -> Status {
    FloatToHalf(attn_, attn_h_, int64_t{n} * qw, stream_);
    SPECACHE_RETURN_IF_ERROR(Gemm(attn_h_, n, qw, w.wo, c_.d_model, x_, /*accumulate=*/true));
    RmsNormToHalf(x_, n, c_.d_model, w.ffn_norm, c_.rms_eps, normed_, stream_);
    SPECACHE_RETURN_IF_ERROR(Gemm(normed_, n, c_.d_model, w.wgate_up, 2 * c_.d_ff, gate_up_, false));
    SiluMul(gate_up_, act_, n, c_.d_ff, stream_);
    SPECACHE_RETURN_IF_ERROR(Gemm(act_, n, c_.d_ff, w.wdown, c_.d_model, x_, /*accumulate=*/true));
    return Cuda(cudaGetLastError(), "layer output");
  });
}

Status GpuLlama::Logits(int first_row, int n) {
  if (first_row < 0 || first_row + n > rows_ || n > std::min(rows_, kMaxLogitRows)) {
    return Status::InvalidArgument("Logits rows out of the reserved range");
  }
  RmsNormToHalf(x_ + size_t(first_row) * c_.d_model, n, c_.d_model, output_norm_, c_.rms_eps, normed_, stream_);
  SPECACHE_RETURN_IF_ERROR(Gemm(normed_, n, c_.d_model, lm_head_, c_.vocab, logits_, false));
  return Cuda(cudaGetLastError(), "logits");
}

Status GpuLlama::Argmax(int n) {
  if (n > std::min(rows_, kMaxLogitRows)) return Status::InvalidArgument("Argmax of more rows than logits");
  ArgmaxRows(logits_, n, c_.vocab, argmax_, stream_);
  return Cuda(cudaGetLastError(), "argmax");
}

}  // namespace specache::gpu
