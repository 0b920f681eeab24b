#include "tiny_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace specache::testing {
namespace {

std::vector<float> Gaussian(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> w(n);
  for (auto& x : w) x = dist(rng);
  return w;
}

// y[n][out] = x[n][in] * w[in][out]
std::vector<float> MatMul(const std::vector<float>& x, int n, int in, const std::vector<float>& w, int out) {
  std::vector<float> y(static_cast<size_t>(n) * out, 0.0f);
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < in; ++k) {
      const float a = x[static_cast<size_t>(i) * in + k];
      for (int j = 0; j < out; ++j) y[static_cast<size_t>(i) * out + j] += a * w[static_cast<size_t>(k) * out + j];
    }
  }
  return y;
}

std::vector<float> RmsNorm(const std::vector<float>& x, int n, int d) {
  std::vector<float> y(x.size());
  for (int i = 0; i < n; ++i) {
    double ss = 0;
    for (int c = 0; c < d; ++c) ss += x[static_cast<size_t>(i) * d + c] * x[static_cast<size_t>(i) * d + c];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / d) + 1e-6f);
    for (int c = 0; c < d; ++c) y[static_cast<size_t>(i) * d + c] = x[static_cast<size_t>(i) * d + c] * inv;
  }
  return y;
}

int Argmax(const std::vector<float>& v) { return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin()); }

}  // namespace

float TopTwoMargin(const std::vector<float>& logits) {
  if (logits.size() < 2) return std::numeric_limits<float>::infinity();
  float best = -std::numeric_limits<float>::infinity(), second = best;
  for (float x : logits) {
    if (x > best) {
      second = best;
      best = x;
    } else if (x > second) {
      second = x;
    }
  }
  return best - second;
}

TinyModel::TinyModel(const TinyModelConfig& c) : c_(c) {
  std::mt19937 rng(c.seed);
  const int dq = c.n_q_heads * c.head_dim;
  const int dkv = c.n_kv_heads * c.head_dim;
  embed_ = Gaussian(static_cast<size_t>(c.vocab) * c.d_model, 1.0f, rng);
  unembed_ = Gaussian(static_cast<size_t>(c.d_model) * c.vocab, 1.0f / std::sqrt(float(c.d_model)), rng);
  for (int l = 0; l < c.n_layers; ++l) {
    // q.k/sqrt(head_dim) has a standard deviation of about 3: attention is peaked.
    wq_.push_back(Gaussian(static_cast<size_t>(c.d_model) * dq, 0.22f, rng));
    wk_.push_back(Gaussian(static_cast<size_t>(c.d_model) * dkv, 0.22f, rng));
    wv_.push_back(Gaussian(static_cast<size_t>(c.d_model) * dkv, 1.0f / std::sqrt(float(c.d_model)), rng));
    wo_.push_back(Gaussian(static_cast<size_t>(dq) * c.d_model, 1.0f / std::sqrt(float(dq)), rng));
    w1_.push_back(Gaussian(static_cast<size_t>(c.d_model) * 2 * c.d_model, 1.0f / std::sqrt(float(c.d_model)), rng));
    w2_.push_back(Gaussian(static_cast<size_t>(2 * c.d_model) * c.d_model, 1.0f / std::sqrt(float(2 * c.d_model)), rng));
  }
}

ModelShape TinyModel::shape() const { return {c_.n_layers, c_.n_q_heads, c_.n_kv_heads, c_.head_dim}; }

std::vector<float> TinyModel::Embed(const std::vector<int>& tokens, const std::vector<int>& positions) const {
  std::vector<float> x(tokens.size() * c_.d_model);
  for (size_t i = 0; i < tokens.size(); ++i) {
    for (int c = 0; c < c_.d_model; ++c) {
      // A sinusoidal position signal keeps repeated tokens distinguishable without RoPE.
      const float angle = positions[i] / std::pow(100.0f, float(c / 2 * 2) / c_.d_model);
      x[i * c_.d_model + c] = embed_[static_cast<size_t>(tokens[i]) * c_.d_model + c] +
                              0.5f * (c % 2 ? std::cos(angle) : std::sin(angle));
    }
  }
  return x;
}

void TinyModel::Project(int layer, const std::vector<float>& x, int n, const std::vector<int>&,
                        std::vector<float>* q, std::vector<float>* k, std::vector<float>* v) const {
  const std::vector<float> h = RmsNorm(x, n, c_.d_model);
  *q = MatMul(h, n, c_.d_model, wq_[layer], c_.n_q_heads * c_.head_dim);
  *k = MatMul(h, n, c_.d_model, wk_[layer], c_.n_kv_heads * c_.head_dim);
  *v = MatMul(h, n, c_.d_model, wv_[layer], c_.n_kv_heads * c_.head_dim);
}

void TinyModel::Finish(int layer, const std::vector<float>& attn, int n, std::vector<float>* x) const {
  const std::vector<float> o = MatMul(attn, n, c_.n_q_heads * c_.head_dim, wo_[layer], c_.d_model);
  for (size_t i = 0; i < x->size(); ++i) (*x)[i] += o[i];
  std::vector<float> hidden = MatMul(RmsNorm(*x, n, c_.d_model), n, c_.d_model, w1_[layer], 2 * c_.d_model);
  for (auto& a : hidden) a = std::max(a, 0.0f);
  const std::vector<float> m = MatMul(hidden, n, 2 * c_.d_model, w2_[layer], c_.d_model);
  for (size_t i = 0; i < x->size(); ++i) (*x)[i] += m[i];
}

std::vector<float> TinyModel::Logits(const float* x) const {
  std::vector<float> row(x, x + c_.d_model);
  return MatMul(RmsNorm(row, 1, c_.d_model), 1, c_.d_model, unembed_, c_.vocab);
}

Result<GenerationTrace> TinyModel::Generate(Agent* agent, SequenceId id, const std::vector<int>& prompt,
                                            int n_tokens, const std::vector<int>* forced,
                                            const std::vector<int>* forced_speculative) const {
  SPECACHE_RETURN_IF_ERROR(agent->AddSequence(id));
  const int n = static_cast<int>(prompt.size());
  std::vector<int> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  std::vector<float> x = Embed(prompt, positions);
  const SequenceId ids[] = {id};
  const int32_t offsets[] = {0, n};
  std::vector<float> q, k, v, attn;
  for (int l = 0; l < c_.n_layers; ++l) {
    Project(l, x, n, positions, &q, &k, &v);
    attn.assign(q.size(), 0.0f);
    SPECACHE_RETURN_IF_ERROR(agent->PrefillLayer(l, {ids, offsets, q.data(), k.data(), v.data(), attn.data()}));
    Finish(l, attn, n, &x);
  }
  GenerationTrace trace;
  trace.logits.push_back(Logits(x.data() + static_cast<size_t>(n - 1) * c_.d_model));
  trace.tokens.push_back(Argmax(trace.logits.back()));

  // Runs one step over `tokens` (one row each) at consecutive positions from `position`;
  // returns the final hidden states [rows][d_model].
  auto step = [&](StepKind kind, const std::vector<int>& tokens, int position) -> Result<std::vector<float>> {
    const int rows = static_cast<int>(tokens.size());
    std::vector<int> pos(rows);
    for (int r = 0; r < rows; ++r) pos[r] = position + r;
    std::vector<float> h = Embed(tokens, pos);
    SPECACHE_RETURN_IF_ERROR(agent->BeginStep(kind, ids));
    for (int l = 0; l < c_.n_layers; ++l) {
      Project(l, h, rows, pos, &q, &k, &v);
      attn.assign(q.size(), 0.0f);
      SPECACHE_RETURN_IF_ERROR(agent->WaitPrefetch(l));
      SPECACHE_RETURN_IF_ERROR(agent->DecodeLayer(l, {q.data(), k.data(), v.data(), attn.data()}));
      SPECACHE_RETURN_IF_ERROR(agent->StartPrefetch(l));
      Finish(l, attn, rows, &h);
    }
    SPECACHE_RETURN_IF_ERROR(agent->EndStep());
    return h;
  };

  int speculative = -1;
  if (agent->RowsPerSequence(StepKind::kPreDecode) > 0) {
    SPECACHE_ASSIGN_OR_RETURN(std::vector<float> h,
                              step(StepKind::kPreDecode, {forced ? (*forced)[0] : trace.tokens[0]}, n));
    const std::vector<float> logits = Logits(h.data());
    speculative = Argmax(logits);
    trace.speculative.push_back(speculative);
    trace.speculative_margins.push_back(TopTwoMargin(logits));
  }
  const bool two_rows = agent->RowsPerSequence(StepKind::kDecode) == 2;
  for (int t = 1; t < n_tokens; ++t) {
    std::vector<int> rows = {forced ? (*forced)[t - 1] : trace.tokens.back()};
    if (two_rows) rows.push_back(forced_speculative ? (*forced_speculative)[t - 1] : speculative);
    SPECACHE_ASSIGN_OR_RETURN(std::vector<float> h, step(StepKind::kDecode, rows, n + t - 1));
    trace.logits.push_back(Logits(h.data()));
    trace.tokens.push_back(Argmax(trace.logits.back()));
    if (two_rows) {
      const std::vector<float> logits = Logits(h.data() + c_.d_model);
      speculative = Argmax(logits);
      trace.speculative.push_back(speculative);
      trace.speculative_margins.push_back(TopTwoMargin(logits));
    }
  }
  return trace;
}

}  // namespace specache::testing
