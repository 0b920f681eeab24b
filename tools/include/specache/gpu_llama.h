// A Llama-family decoder on the GPU: fp16 weights in device memory (dequantized once from a
// LlamaModel, or random for benchmarks), matrix products through cuBLAS (fp16 inputs, fp32
// accumulation), RMSNorm, RoPE, SwiGLU, embedding and argmax by small kernels. Attention is the
// caller's (a CUDA agent, agent.h): the model fills q/k/v for a layer, the caller writes the
// attention output into attn(), and FinishLayer goes on from there. The residual stream stays in
// float32 on the device; nothing crosses to the host unless the caller copies it.
//
// Every call queues work on the model's stream and returns; errors of queued kernels surface in a
// later call or at the caller's synchronisation. One thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "specache/half.h"
#include "specache/kv_config.h"
#include "specache/llama_model.h"
#include "specache/status.h"

namespace specache::gpu {

class ModelGemm;  // model_gemm.h (tools/src/gpu): the matrix products and their kernels' choice

// Llama-3-8B's shapes (32 layers, 32 query heads, 8 KV heads, head_dim 128, hidden 4096, MLP
// 14336, vocabulary 128256, RoPE theta 500000) and SmolLM2-135M's (30 layers, 9/3 heads, 64, 576,
// 1536, 49152, theta 100000), for random-weight runs.
LlamaConfig Llama3_8bConfig();
LlamaConfig SmolLm2Config();

class GpuLlama {
 public:
  // Most rows one Logits call takes (a decode step of 512 sequences x 2 rows).
  static constexpr int kMaxLogitRows = 1024;

  // Copies the model's weights to the device as fp16. `stream` is a cudaStream_t (null: a stream
  // of the model's own). UNAVAILABLE without CUDA or a device; RESOURCE_EXHAUSTED when the
  // weights do not fit.
  static Result<std::unique_ptr<GpuLlama>> FromModel(const LlamaModel& model, void* stream = nullptr);
  // Random weights (uniform in +-0.02, norms 1) of this shape, drawn on the device from `seed`;
  // the LM head is separate from the embedding when `tied_head` is false.
  static Result<std::unique_ptr<GpuLlama>> Random(const LlamaConfig& config, uint32_t seed, bool tied_head,
                                                  void* stream = nullptr);
  ~GpuLlama();
  GpuLlama(const GpuLlama&) = delete;
  GpuLlama& operator=(const GpuLlama&) = delete;

  const LlamaConfig& config() const { return c_; }
  ModelShape shape() const { return {c_.n_layers, c_.n_heads, c_.n_kv_heads, c_.head_dim}; }
  void* stream() const { return stream_; }
  int64_t weight_bytes() const { return weight_bytes_; }
  // Of those, the layers' matrices (QKV, output, gate and up, down; all layers): what a decode
  // step's products read once.
  int64_t layer_matrix_bytes() const { return layer_matrix_bytes_; }
  // Device bytes of the activation buffers (grown by Reserve).
  int64_t workspace_bytes() const;

  // Activation buffers for up to `rows` rows (and LM-head rows). Grows only.
  Status Reserve(int rows);
  int reserved_rows() const { return rows_; }
  // Device buffers of the current layer, float32: q [rows][n_heads][hd], k and v
  // [rows][n_kv_heads][hd] (RoPE applied), attn [rows][n_heads][hd] (the caller writes it).
  float* q() const { return q_; }
  float* k() const { return k_; }
  float* v() const { return v_; }
  float* attn() const { return attn_; }
  // Device scratch for `n` int32 tokens and positions, for callers that stage their inputs.
  int32_t* device_tokens() const { return tokens_; }
  int32_t* device_positions() const { return positions_; }
  const float* logits() const { return logits_; }  // [n][vocab] of the last Logits call
  int32_t* argmax() const { return argmax_; }       // [n] of the last Argmax call

  // Residual rows x[i] = embedding of tokens[i] (device ids, all in the vocabulary), i < n.
  Status Embed(const int32_t* device_tokens, int n);
  // q/k/v of layer `layer` for residual rows [0, n) at the device positions.
  Status ProjectQkv(int layer, int n, const int32_t* device_positions);
  // x += attn x Wo^T; x += MLP(RMSNorm(x)), rows [0, n).
  Status FinishLayer(int layer, int n);
  // logits()[i] for residual rows first_row + i, i < n <= kMaxLogitRows (final RMSNorm, LM head).
  Status Logits(int first_row, int n);
  // argmax()[i] = the largest logit's index of logits() row i, i < n.
  Status Argmax(int n);

  // Decode graphs (on by default): a call of ProjectQkv or FinishLayer for a layer with the same
  // rows (at most kMaxGraphRows) and positions as that layer's previous call is captured once into
  // a CUDA graph and replayed from then on, so a decode step's matrix products and small kernels
  // cost the host one graph launch per call instead of cuBLAS's per-call work and each kernel's
  // launch (the GPU runs the same kernels on the same buffers). The first call of a shape runs as
  // it is; so does every call while the stream is being captured by the caller, and every call
  // after a capture failed (then graphs stay off until SetDecodeGraphs(true), silently: the calls'
  // results are the same). One graph is kept per layer and call: a caller whose rows change every
  // call or two gains nothing (each capture is replayed once or never). Reserve drops the graphs
  // when it moves the buffers. A stream given at creation must be non-blocking (a blocking
  // stream's capture breaks on any thread's use of the legacy default stream): on a blocking one
  // graphs stay off. Off: every call launches its kernels.
  static constexpr int kMaxGraphRows = kMaxLogitRows;
  void SetDecodeGraphs(bool on);
  bool decode_graphs() const { return graphs_on_ && !graphs_failed_; }
  // Graphs launched so far (for tests and benchmarks; none while graphs are off).
  int64_t graph_launches() const { return graph_launches_; }

  // The matrix products' kernels: cuBLAS's default for every shape (off, the default), or each
  // shape's fastest of that default and cuBLASLt's candidates, timed at the shape's first call
  // outside a capture and kept (model_gemm.h). Either way drops the decode graphs, which hold the
  // kernels chosen before.
  void SetTimedGemms(bool on);
  bool timed_gemms() const;
  // What the timing chose so far, shape by shape (for benchmarks).
  const ModelGemm& gemms() const { return *gemm_; }

 private:
  GpuLlama() = default;
  Status Init(const LlamaConfig& config, void* stream, bool tied_head);
  // One layer's captured call: its key (rows, positions) and, from its second call with that
  // key, its graph (cudaGraphExec_t).
  struct LayerGraph {
    int n = -1;
    const int32_t* positions = nullptr;
    void* exec = nullptr;
  };
  // Runs `launch` (the call's kernels on the stream) eagerly, or through g's graph (Decode graphs
  // above); captures it when g's key repeats.
  template <typename Launch>
  Status Replayed(LayerGraph& g, int n, const int32_t* positions, Launch&& launch);
  void DropGraphs();
  // y[n][out] (fp32, += when accumulate) = x[n][in] (fp16) x W[out][in]^T (fp16).
  Status Gemm(const Half* x, int n, int in, const Half* w, int out, float* y, bool accumulate);

  struct Layer {
    float* attn_norm = nullptr;
    float* ffn_norm = nullptr;
    Half* wqkv = nullptr;
    Half* wo = nullptr;
    Half* wgate_up = nullptr;
    Half* wdown = nullptr;
  };
  LlamaConfig c_;
  void* stream_ = nullptr;
  bool own_stream_ = false;
  std::unique_ptr<ModelGemm> gemm_;
  int64_t weight_bytes_ = 0;
  int64_t layer_matrix_bytes_ = 0;
  std::vector<void*> allocations_;  // everything cudaMalloc'd here
  std::vector<Layer> layers_;
  Half* embedding_ = nullptr;
  Half* lm_head_ = nullptr;  // == embedding_ when tied
  float* output_norm_ = nullptr;
  float* inv_freq_ = nullptr;

  int rows_ = 0;
  std::vector<void*> activations_;
  int64_t activation_bytes_ = 0;
  float *x_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *attn_ = nullptr, *qkv_ = nullptr,
        *gate_up_ = nullptr, *logits_ = nullptr;
  Half *normed_ = nullptr, *attn_h_ = nullptr, *act_ = nullptr;
  int32_t *tokens_ = nullptr, *positions_ = nullptr, *argmax_ = nullptr;

  bool graphs_allowed_ = true;  // false on a blocking stream of the caller's
  bool graphs_on_ = true, graphs_failed_ = false;
  std::vector<LayerGraph> qkv_graphs_, finish_graphs_;  // [layer]
  int64_t graph_launches_ = 0;

  template <typename T>
  Result<T*> Allocate(size_t n, std::vector<void*>* list);
};

}  // namespace specache::gpu
