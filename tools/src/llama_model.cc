#include "specache/llama_model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

namespace specache {
namespace {

Result<std::vector<float>> LoadTensor(const gguf::GgufFile& file, const std::string& name,
                                      std::vector<uint64_t> dims) {
  SPECACHE_ASSIGN_OR_RETURN(const gguf::TensorInfo* t, file.FindTensor(name));
  if (t->dims != dims) {
    std::string want, got;
    for (uint64_t d : dims) want += (want.empty() ? "" : "x") + std::to_string(d);
    for (uint64_t d : t->dims) got += (got.empty() ? "" : "x") + std::to_string(d);
    return Status::DataLoss("tensor " + name + " has shape " + got + ", expected " + want);
  }
  return file.Dequantize(*t);
}

// Appends a tensor's rows to `dst`.
Status AppendTensor(const gguf::GgufFile& file, const std::string& name, std::vector<uint64_t> dims,
                    std::vector<float>* dst) {
  SPECACHE_ASSIGN_OR_RETURN(std::vector<float> w, LoadTensor(file, name, std::move(dims)));
  dst->insert(dst->end(), w.begin(), w.end());
  return Status::Ok();
}

}  // namespace

void MatMulTransposed(const float* x, int n, int in, const float* w, int out, float* y) {
  if (n <= 4) {
    // Decode rows: matrix-vector products read W once each, where sgemm would first pack all of W.
    for (int i = 0; i < n; ++i) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, w, in, x + static_cast<size_t>(i) * in, 1, 0.0f,
                  y + static_cast<size_t>(i) * out, 1);
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 0.0f, y, out);
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::Load(const gguf::GgufFile& file) {
  SPECACHE_ASSIGN_OR_RETURN(std::string arch, file.GetString("general.architecture"));
  if (arch != "llama") return Status::Unimplemented("architecture '" + arch + "' (only llama)");
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  LlamaConfig& c = m->c_;
  auto get_int = [&](const std::string& key, int* out) -> Status {
    SPECACHE_ASSIGN_OR_RETURN(int64_t v, file.GetInt(arch + "." + key));
    if (v <= 0 || v > (1 << 24)) return Status::DataLoss(arch + "." + key + " = " + std::to_string(v) + " is out of range");
    *out = static_cast<int>(v);
    return Status::Ok();
  };
  SPECACHE_RETURN_IF_ERROR(get_int("block_count", &c.n_layers));
  SPECACHE_RETURN_IF_ERROR(get_int("embedding_length", &c.d_model));
  SPECACHE_RETURN_IF_ERROR(get_int("feed_forward_length", &c.d_ff));
  SPECACHE_RETURN_IF_ERROR(get_int("attention.head_count", &c.n_heads));
  SPECACHE_RETURN_IF_ERROR(get_int("attention.head_count_kv", &c.n_kv_heads));
  SPECACHE_RETURN_IF_ERROR(get_int("context_length", &c.context_length));
  if (c.d_model % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0) {
    return Status::DataLoss("head counts do not divide the model width");
  }
  c.head_dim = c.d_model / c.n_heads;
  if (auto theta = file.GetFloat(arch + ".rope.freq_base"); theta.ok()) c.rope_theta = static_cast<float>(*theta);
  if (auto eps = file.GetFloat(arch + ".attention.layer_norm_rms_epsilon"); eps.ok()) c.rms_eps = static_cast<float>(*eps);
  // Both feed divisions and roots of every token: a value that is not a positive finite number
  // turns every logit into inf or NaN.
  if (!(std::isfinite(c.rope_theta) && c.rope_theta > 0)) {
    return Status::DataLoss("rope.freq_base " + std::to_string(c.rope_theta) + " is not a positive number");
  }
  if (!(std::isfinite(c.rms_eps) && c.rms_eps > 0)) {
    return Status::DataLoss("attention.layer_norm_rms_epsilon " + std::to_string(c.rms_eps) + " is not a positive number");
  }
  if (c.head_dim % 8 != 0) {  // the agent's layouts (kv_config.h): found before anything is dequantized
    return Status::Unimplemented("head_dim " + std::to_string(c.head_dim) + " is not a multiple of 8");
  }
  if (auto rope_dims = file.GetInt(arch + ".rope.dimension_count"); rope_dims.ok() && *rope_dims != c.head_dim) {
    return Status::Unimplemented("partial RoPE (" + std::to_string(*rope_dims) + " of " + std::to_string(c.head_dim) +
                                 " dimensions)");
  }

  SPECACHE_ASSIGN_OR_RETURN(const gguf::TensorInfo* embd, file.FindTensor("token_embd.weight"));
  if (embd->dims.size() != 2 || embd->dims[0] != static_cast<uint64_t>(c.d_model)) {
    return Status::DataLoss("token_embd.weight does not have rows of embedding_length");
  }
  if (embd->dims[1] > (uint64_t{1} << 24)) {
    return Status::DataLoss("token_embd.weight has " + std::to_string(embd->dims[1]) + " rows (a vocabulary past 16 M)");
  }
  c.vocab = static_cast<int>(embd->dims[1]);
  SPECACHE_ASSIGN_OR_RETURN(m->embedding_, file.Dequantize(*embd));
  const uint64_t d = c.d_model, hd = c.head_dim, ff = c.d_ff, vocab = c.vocab;
  if (file.FindTensor("output.weight").ok()) {
    SPECACHE_ASSIGN_OR_RETURN(m->output_, LoadTensor(file, "output.weight", {d, vocab}));
  }
  SPECACHE_ASSIGN_OR_RETURN(m->output_norm_, LoadTensor(file, "output_norm.weight", {d}));
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer layer;
    SPECACHE_ASSIGN_OR_RETURN(layer.attn_norm, LoadTensor(file, p + "attn_norm.weight", {d}));
    SPECACHE_ASSIGN_OR_RETURN(layer.ffn_norm, LoadTensor(file, p + "ffn_norm.weight", {d}));
    SPECACHE_RETURN_IF_ERROR(AppendTensor(file, p + "attn_q.weight", {d, c.n_heads * hd}, &layer.wqkv));
    SPECACHE_RETURN_IF_ERROR(AppendTensor(file, p + "attn_k.weight", {d, c.n_kv_heads * hd}, &layer.wqkv));
    SPECACHE_RETURN_IF_ERROR(AppendTensor(file, p + "attn_v.weight", {d, c.n_kv_heads * hd}, &layer.wqkv));
    SPECACHE_ASSIGN_OR_RETURN(layer.wo, LoadTensor(file, p + "attn_output.weight", {c.n_heads * hd, d}));
    SPECACHE_RETURN_IF_ERROR(AppendTensor(file, p + "ffn_gate.weight", {d, ff}, &layer.wgate_up));
    SPECACHE_RETURN_IF_ERROR(AppendTensor(file, p + "ffn_up.weight", {d, ff}, &layer.wgate_up));
    SPECACHE_ASSIGN_OR_RETURN(layer.wdown, LoadTensor(file, p + "ffn_down.weight", {ff, d}));
    m->layers_.push_back(std::move(layer));
  }
  for (int i = 0; i < c.head_dim / 2; ++i) {
    m->rope_inv_freq_.push_back(static_cast<float>(std::pow(double{c.rope_theta}, -2.0 * i / c.head_dim)));
  }
  return m;
}

int64_t LlamaModel::parameter_count() const {
  int64_t n = static_cast<int64_t>(embedding_.size() + output_.size() + output_norm_.size());
  for (const Layer& l : layers_) {
    n += static_cast<int64_t>(l.attn_norm.size() + l.ffn_norm.size() + l.wqkv.size() + l.wo.size() +
                              l.wgate_up.size() + l.wdown.size());
  }
  return n;
}

Status LlamaModel::Embed(std::span<const int32_t> tokens, float* x) const {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= c_.vocab) {
      return Status::InvalidArgument("token id " + std::to_string(tokens[i]) + " outside the vocabulary");
    }
    std::copy_n(embedding_.data() + static_cast<size_t>(tokens[i]) * c_.d_model, c_.d_model, x + i * c_.d_model);
  }
  return Status::Ok();
}

void LlamaModel::RmsNorm(const float* x, int n, const std::vector<float>& weight, float* out) const {
  const int d = c_.d_model;
  for (int i = 0; i < n; ++i) {
    const float* row = x + static_cast<size_t>(i) * d;
    double ss = 0;
    for (int j = 0; j < d; ++j) ss += double{row[j]} * row[j];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / d + c_.rms_eps));
    float* o = out + static_cast<size_t>(i) * d;
    for (int j = 0; j < d; ++j) o[j] = row[j] * inv * weight[j];
  }
}

void LlamaModel::ApplyRope(float* heads, int n, int n_heads, const int32_t* positions) const {
  // Adjacent pairs (x[2i], x[2i+1]) rotate by position * theta^(-2i/head_dim): GGUF's llama
  // tensors are stored for this ("normal") RoPE.
  const int hd = c_.head_dim;
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < hd / 2; ++i) {
      const double angle = double{rope_inv_freq_[i]} * positions[t];
      const float cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
      for (int h = 0; h < n_heads; ++h) {
        float* p = heads + (static_cast<size_t>(t) * n_heads + h) * hd + 2 * i;
        const float a = p[0], b = p[1];
        p[0] = a * cs - b * sn;
        p[1] = a * sn + b * cs;
      }
    }
  }
}

void LlamaModel::ProjectQkv(int layer, const float* x, int n, const int32_t* positions, float* q, float* k, float* v,
                            LlamaScratch* s) const {
  const Layer& L = layers_[layer];
  const int d = c_.d_model, qw = c_.n_heads * c_.head_dim, kw = c_.n_kv_heads * c_.head_dim;
  const int width = qw + 2 * kw;
  s->normed.resize(static_cast<size_t>(n) * d);
  s->qkv.resize(static_cast<size_t>(n) * width);
  RmsNorm(x, n, L.attn_norm, s->normed.data());
  MatMulTransposed(s->normed.data(), n, d, L.wqkv.data(), width, s->qkv.data());
  for (int t = 0; t < n; ++t) {
    const float* row = s->qkv.data() + static_cast<size_t>(t) * width;
    std::copy_n(row, qw, q + static_cast<size_t>(t) * qw);
    std::copy_n(row + qw, kw, k + static_cast<size_t>(t) * kw);
    std::copy_n(row + qw + kw, kw, v + static_cast<size_t>(t) * kw);
  }
  ApplyRope(q, n, c_.n_heads, positions);
  ApplyRope(k, n, c_.n_kv_heads, positions);
}

void LlamaModel::FinishLayer(int layer, const float* attn, int n, float* x, LlamaScratch* s) const {
  const Layer& L = layers_[layer];
  const int d = c_.d_model, ff = c_.d_ff;
  const size_t nd = static_cast<size_t>(n) * d;
  s->projected.resize(nd);
  MatMulTransposed(attn, n, c_.n_heads * c_.head_dim, L.wo.data(), d, s->projected.data());
  for (size_t i = 0; i < nd; ++i) x[i] += s->projected[i];

  s->normed.resize(nd);
  s->gate_up.resize(static_cast<size_t>(n) * 2 * ff);
  s->hidden.resize(static_cast<size_t>(n) * ff);
  RmsNorm(x, n, L.ffn_norm, s->normed.data());
  MatMulTransposed(s->normed.data(), n, d, L.wgate_up.data(), 2 * ff, s->gate_up.data());
  for (int t = 0; t < n; ++t) {
    const float* gate = s->gate_up.data() + static_cast<size_t>(t) * 2 * ff;
    const float* up = gate + ff;
    float* h = s->hidden.data() + static_cast<size_t>(t) * ff;
    for (int j = 0; j < ff; ++j) h[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];  // SiLU(gate) * up
  }
  MatMulTransposed(s->hidden.data(), n, ff, L.wdown.data(), d, s->projected.data());
  for (size_t i = 0; i < nd; ++i) x[i] += s->projected[i];
}

void LlamaModel::Logits(const float* x, int n, float* logits, LlamaScratch* s) const {
  s->normed.resize(static_cast<size_t>(n) * c_.d_model);
  RmsNorm(x, n, output_norm_, s->normed.data());
  const std::vector<float>& head = output_.empty() ? embedding_ : output_;
  MatMulTransposed(s->normed.data(), n, c_.d_model, head.data(), c_.vocab, logits);
}

}  // namespace specache
