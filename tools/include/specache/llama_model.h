// A Llama-family decoder on the CPU (float32, matrix products through BLAS), loaded from a GGUF
// file: token embedding, per layer RMSNorm -> Q/K/V projections with RoPE -> (attention: the
// caller's) -> output projection -> RMSNorm -> SwiGLU MLP, final RMSNorm and the LM head (tied to
// the embedding when the file has no output.weight).
//
// The model holds no KV cache: attention is the caller's job (the reference engine hands it to a
// gpu_agent), so the same weights serve several KV modes side by side.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "specache/gguf.h"
#include "specache/kv_config.h"
#include "specache/status.h"

namespace specache {

struct LlamaConfig {
  int n_layers = 0;
  int d_model = 0;
  int d_ff = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int vocab = 0;
  int context_length = 0;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
};

// Scratch buffers of one forward call, reused across calls to avoid allocating per token.
struct LlamaScratch {
  std::vector<float> normed, qkv, gate_up, hidden, projected;
};

class LlamaModel {
 public:
  // UNIMPLEMENTED for other architectures or tensor types; NOT_FOUND / DATA_LOSS for missing or
  // mis-shaped tensors (named in the message).
  static Result<std::unique_ptr<LlamaModel>> Load(const gguf::GgufFile& file);

  const LlamaConfig& config() const { return c_; }
  ModelShape shape() const { return {c_.n_layers, c_.n_heads, c_.n_kv_heads, c_.head_dim}; }
  int64_t parameter_count() const;

  // x[n][d_model] = embeddings of the tokens (ids outside the vocabulary: INVALID_ARGUMENT).
  Status Embed(std::span<const int32_t> tokens, float* x) const;
  // From the residual stream x[n][d_model]: q[n][n_heads][head_dim] and k[n][n_kv_heads][head_dim]
  // with RoPE at `positions`, v[n][n_kv_heads][head_dim].
  void ProjectQkv(int layer, const float* x, int n, const int32_t* positions, float* q, float* k, float* v,
                  LlamaScratch* scratch) const;
  // x += attention output projection of attn[n][n_heads][head_dim]; then x += MLP(RMSNorm(x)).
  void FinishLayer(int layer, const float* attn, int n, float* x, LlamaScratch* scratch) const;
  // logits[n][vocab] of the residual rows x[n][d_model] (final RMSNorm, LM head).
  void Logits(const float* x, int n, float* logits, LlamaScratch* scratch) const;

  // The float32 weights, for an engine that copies them elsewhere (the GPU model, gpu_llama.h).
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;
    std::vector<float> wqkv;     // [(n_heads + 2 n_kv_heads) head_dim][d_model]
    std::vector<float> wo;       // [d_model][n_heads head_dim]
    std::vector<float> wgate_up;  // [2 d_ff][d_model]: gate rows, then up rows
    std::vector<float> wdown;    // [d_model][d_ff]
  };
  const Layer& layer(int l) const { return layers_[l]; }
  const std::vector<float>& embedding() const { return embedding_; }
  const std::vector<float>& lm_head() const { return output_.empty() ? embedding_ : output_; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  const std::vector<float>& rope_inv_freq() const { return rope_inv_freq_; }

 private:
  LlamaModel() = default;
  void RmsNorm(const float* x, int n, const std::vector<float>& weight, float* out) const;
  void ApplyRope(float* heads, int n, int n_heads, const int32_t* positions) const;

  LlamaConfig c_;
  std::vector<float> embedding_;  // [vocab][d_model]
  std::vector<float> output_;     // [vocab][d_model]; empty when tied to embedding_
  std::vector<float> output_norm_;
  std::vector<Layer> layers_;
  std::vector<float> rope_inv_freq_;  // [head_dim / 2]
};

// y[n][out] = x[n][in] * W^T for W[out][in] (row-major), through BLAS.
void MatMulTransposed(const float* x, int n, int in, const float* w, int out, float* y);

}  // namespace specache
