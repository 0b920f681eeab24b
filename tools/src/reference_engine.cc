#include "specache/reference_engine.h"

#include <cblas.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <limits>

#include "specache/half.h"

namespace specache {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

int32_t Argmax(std::span<const float> logits) {
  // The first maximum, NaN never one (std::max_element answered 0 whenever logits[0] was NaN),
  // and 0 when nothing beats -FLT_MAX: as the GPU engine's argmax kernel.
  int32_t best = 0;
  float value = -FLT_MAX;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] > value) value = logits[i], best = static_cast<int32_t>(i);
  }
  return best;
}

void CausalAttention(const float* q, const float* k, const float* v, int n, int n_heads, int n_kv_heads, int head_dim,
                     float* out) {
  constexpr int kBlock = 128;  // query rows per block
  const int group = n_heads / n_kv_heads;
  const int q_stride = n_heads * head_dim, kv_stride = n_kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> scores(static_cast<size_t>(kBlock) * n);
  for (int h = 0; h < n_heads; ++h) {
    const float* kh = k + static_cast<size_t>(h / group) * head_dim;
    const float* vh = v + static_cast<size_t>(h / group) * head_dim;
    for (int first = 0; first < n; first += kBlock) {
      const int rows = std::min(kBlock, n - first);
      const int keys = first + rows;  // causal: the block's last row sees keys [0, keys)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, head_dim, scale,
                  q + static_cast<size_t>(first) * q_stride + static_cast<size_t>(h) * head_dim, q_stride, kh,
                  kv_stride, 0.0f, scores.data(), keys);
      for (int r = 0; r < rows; ++r) {
        float* s = scores.data() + static_cast<size_t>(r) * keys;
        const int visible = first + r + 1;
        const float m = *std::max_element(s, s + visible);
        double sum = 0;
        for (int j = 0; j < visible; ++j) sum += (s[j] = std::exp(s[j] - m));
        const float inv = static_cast<float>(1.0 / sum);
        for (int j = 0; j < visible; ++j) s[j] *= inv;
        std::fill(s + visible, s + keys, 0.0f);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, head_dim, keys, 1.0f, scores.data(), keys, vh,
                  kv_stride, 0.0f, out + static_cast<size_t>(first) * q_stride + static_cast<size_t>(h) * head_dim,
                  q_stride);
    }
  }
}

Result<PrefillResult> Prefill(const LlamaModel& model, std::span<Agent* const> agents, SequenceId id,
                              std::span<const int32_t> prompt, bool agent_attention) {
  const auto start = std::chrono::steady_clock::now();
  const LlamaConfig& c = model.config();
  const int n = static_cast<int>(prompt.size());
  if (n == 0) return Status::InvalidArgument("empty prompt");
  if (n > c.context_length) {
    return Status::InvalidArgument("prompt of " + std::to_string(n) + " tokens exceeds the model's context of " +
                                   std::to_string(c.context_length));
  }
  if (agents.empty()) return Status::InvalidArgument("prefill needs at least one agent");
  for (Agent* a : agents) SPECACHE_RETURN_IF_ERROR(a->AddSequence(id));

  const size_t qw = static_cast<size_t>(c.n_heads) * c.head_dim, kw = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  std::vector<float> x(static_cast<size_t>(n) * c.d_model), q(n * qw), k(n * kw), v(n * kw), attn(n * qw);
  std::vector<int32_t> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  LlamaScratch scratch;
  SPECACHE_RETURN_IF_ERROR(model.Embed(prompt, x.data()));
  const SequenceId ids[] = {id};
  const int32_t offsets[] = {0, n};
  for (int l = 0; l < c.n_layers; ++l) {
    model.ProjectQkv(l, x.data(), n, positions.data(), q.data(), k.data(), v.data(), &scratch);
    for (float& e : k) e = RoundToHalf(e);  // the cache holds fp16: attend over what it will hold
    for (float& e : v) e = RoundToHalf(e);
    size_t first_store = 0;
    if (agent_attention) {
      SPECACHE_RETURN_IF_ERROR(agents[0]->PrefillLayer(l, {ids, offsets, q.data(), k.data(), v.data(), attn.data()}));
      first_store = 1;
    } else {
      CausalAttention(q.data(), k.data(), v.data(), n, c.n_heads, c.n_kv_heads, c.head_dim, attn.data());
    }
    for (size_t a = first_store; a < agents.size(); ++a) {
      // q only for an agent that seeds its row cache at prefill (KvConfig::seed_rows): a wrapped
      // CUDA agent would copy it to the device for nothing.
      const float* seed_q = agents[a]->config().seed_rows > 0 ? q.data() : nullptr;
      SPECACHE_RETURN_IF_ERROR(agents[a]->PrefillLayer(l, {ids, offsets, seed_q, k.data(), v.data(), nullptr}));
    }
    model.FinishLayer(l, attn.data(), n, x.data(), &scratch);
  }
  PrefillResult result;
  result.logits.resize(c.vocab);
  model.Logits(x.data() + static_cast<size_t>(n - 1) * c.d_model, 1, result.logits.data(), &scratch);
  result.seconds = Seconds(start);
  return result;
}

Decoder::Decoder(const LlamaModel& model, Agent* agent, SequenceId id, int32_t prompt_length)
    : model_(model), agent_(agent), id_(id), position_(prompt_length) {}

Status Decoder::RunStep(StepKind kind, std::span<const int32_t> tokens) {
  const LlamaConfig& c = model_.config();
  const int rows = static_cast<int>(tokens.size());
  if (position_ + rows > c.context_length) {
    return Status::OutOfRange("decoding past the model's context of " + std::to_string(c.context_length) + " tokens");
  }
  const size_t qw = static_cast<size_t>(c.n_heads) * c.head_dim, kw = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  x_.resize(static_cast<size_t>(rows) * c.d_model);
  q_.resize(rows * qw);
  k_.resize(rows * kw);
  v_.resize(rows * kw);
  attn_.resize(rows * qw);
  const int32_t positions[2] = {position_, position_ + 1};
  SPECACHE_RETURN_IF_ERROR(model_.Embed(tokens, x_.data()));
  const SequenceId ids[] = {id_};
  SPECACHE_RETURN_IF_ERROR(agent_->BeginStep(kind, ids));
  for (int l = 0; l < c.n_layers; ++l) {
    model_.ProjectQkv(l, x_.data(), rows, positions, q_.data(), k_.data(), v_.data(), &scratch_);
    Status s = agent_->WaitPrefetch(l);
    if (s.ok()) s = agent_->DecodeLayer(l, {q_.data(), k_.data(), v_.data(), attn_.data()});
    if (s.ok()) s = agent_->StartPrefetch(l);  // specache: this layer's fetch overlaps later layers
    if (!s.ok()) {
      agent_->AbortStep();
      return s;
    }
    model_.FinishLayer(l, attn_.data(), rows, x_.data(), &scratch_);
  }
  SPECACHE_RETURN_IF_ERROR(agent_->EndStep());
  if (trace_ && agent_->config().mode != KvMode::kFull && agent_->config().mode != KvMode::kKivi) {
    const ModelShape& shape = agent_->shape();
    for (int l = 0; l < shape.n_layers; ++l) {
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        SPECACHE_ASSIGN_OR_RETURN(std::vector<int32_t> rows, agent_->SelectedTokens(id_, l, h));
        *trace_ << traced_steps_ << ' ' << l << ' ' << h << ' ' << rows.size();
        for (int32_t t : rows) *trace_ << ' ' << t;
        *trace_ << '\n';
      }
    }
    ++traced_steps_;
  }
  return Status::Ok();
}

Status Decoder::Start(int32_t first_token) {
  if (started_) return Status::FailedPrecondition("Decoder::Start called twice");
  started_ = true;
  if (agent_->RowsPerSequence(StepKind::kPreDecode) == 0) return Status::Ok();
  const auto start = std::chrono::steady_clock::now();
  const int32_t tokens[] = {first_token};
  SPECACHE_RETURN_IF_ERROR(RunStep(StepKind::kPreDecode, tokens));
  logits_.resize(model_.config().vocab);
  model_.Logits(x_.data(), 1, logits_.data(), &scratch_);
  speculative_ = Argmax(logits_);
  decode_seconds_ += Seconds(start);
  return Status::Ok();
}

Result<std::span<const float>> Decoder::Step(int32_t token) {
  if (!started_) return Status::FailedPrecondition("Decoder::Step before Start");
  const auto start = std::chrono::steady_clock::now();
  const int rows = agent_->RowsPerSequence(StepKind::kDecode);
  const int32_t tokens[2] = {token, speculative_};
  SPECACHE_RETURN_IF_ERROR(RunStep(StepKind::kDecode, std::span<const int32_t>(tokens, rows)));
  const int vocab = model_.config().vocab;
  logits_.resize(static_cast<size_t>(rows) * vocab);
  // In specache mode the speculative row needs the LM head too: its argmax is the next
  // speculative token. This is part of the method's cost.
  model_.Logits(x_.data(), rows, logits_.data(), &scratch_);
  if (rows == 2) speculative_ = Argmax(std::span<const float>(logits_.data() + vocab, vocab));
  ++position_;
  ++steps_;
  decode_seconds_ += Seconds(start);
  return std::span<const float>(logits_.data(), vocab);
}

}  // namespace specache
