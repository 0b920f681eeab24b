// A tiny random decoder-only transformer that drives the agent exactly as an engine does
// (prefill, pre-decode, two-row decode steps), for end-to-end tests of the agent's numerics.
// Attention is peaked on purpose (large q/k weights) so that which rows are fetched matters.
#pragma once

#include <cstdint>
#include <vector>

#include "specache/agent.h"

namespace specache::testing {

struct TinyModelConfig {
  int vocab = 96;
  int d_model = 64;
  int n_layers = 3;
  int n_q_heads = 4;
  int n_kv_heads = 2;
  int head_dim = 32;
  uint32_t seed = 7;
};

struct GenerationTrace {
  std::vector<int> tokens;               // generated tokens T1, T2, ...
  std::vector<std::vector<float>> logits;  // logits that produced each token
  std::vector<int> speculative;            // specache: T'2, T'3, ... (the speculative row's input tokens)
  std::vector<float> speculative_margins;  // [speculative]: its logits' best minus second best
};

// The best logit minus the second best: how far a greedy choice is from a tie.
float TopTwoMargin(const std::vector<float>& logits);



class TinyModel {
 public:
  explicit TinyModel(const TinyModelConfig& config);

  ModelShape shape() const;

  // Greedy generation of `n_tokens` tokens after `prompt`, through the agent (which must not know
  // `id`). In specache mode runs the pre-decode step and two rows per decode step.
  // With `forced` (teacher forcing, at least n_tokens - 1 tokens), the real row of step t is
  // forced[t - 1] instead of the previous argmax, so traces of different modes stay comparable
  // position by position; the speculative row feeds on its own predictions unless
  // `forced_speculative` (at least n_tokens - 1 tokens) gives its input of step t too. A trace
  // records the model's own choices (argmax) either way.
  Result<GenerationTrace> Generate(Agent* agent, SequenceId id, const std::vector<int>& prompt, int n_tokens,
                                   const std::vector<int>* forced = nullptr,
                                   const std::vector<int>* forced_speculative = nullptr) const;

 private:
  // rows: hidden states [n][d_model] at the given positions; runs `layer`'s q/k/v projections.
  void Project(int layer, const std::vector<float>& x, int n, const std::vector<int>& positions, std::vector<float>* q,
               std::vector<float>* k, std::vector<float>* v) const;
  // x += attention output projection and MLP of `layer`.
  void Finish(int layer, const std::vector<float>& attn, int n, std::vector<float>* x) const;
  std::vector<float> Embed(const std::vector<int>& tokens, const std::vector<int>& positions) const;
  std::vector<float> Logits(const float* x) const;

  TinyModelConfig c_;
  std::vector<float> embed_, unembed_;                  // [vocab][d_model], [d_model][vocab]
  std::vector<std::vector<float>> wq_, wk_, wv_, wo_;  // per layer
  std::vector<std::vector<float>> w1_, w2_;            // per layer MLP
};

}  // namespace specache::testing
