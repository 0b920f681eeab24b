// The reference engine: runs a LlamaModel with its KV cache held by gpu_agent Agents, driving the
// agent API exactly as an inference engine does (see agent.h): prefill, the pre-decode step and
// one- or two-row decode steps with the prefetch started after each layer.
//
// One prompt can be prefilled into several agents at once (one per KV mode): prefill is exact in
// every mode, so the engine computes it once (its own causal attention over the fp16-rounded K/V,
// through BLAS) and hands each agent the layer's K/V. Decoders then run each mode on its own.
#pragma once

#include <cstdint>
#include <ostream>
#include <span>
#include <vector>

#include "specache/agent.h"
#include "specache/llama_model.h"

namespace specache {

// Exact causal attention for one prompt: q[n][n_heads][hd], k/v[n][n_kv_heads][hd] (callers pass
// fp16-rounded K/V), out[n][n_heads][hd]; scale 1/sqrt(hd). Blocked, products through BLAS.
void CausalAttention(const float* q, const float* k, const float* v, int n, int n_heads, int n_kv_heads, int head_dim,
                     float* out);

struct PrefillResult {
  std::vector<float> logits;  // [vocab] at the prompt's last position
  double seconds = 0;
};

// Registers `id` in every agent and prefills `prompt` into all of them. With
// `agent_attention`, the first agent computes the prompt's attention (its PrefillLayer with out)
// instead of the engine; results agree to float rounding.
Result<PrefillResult> Prefill(const LlamaModel& model, std::span<Agent* const> agents, SequenceId id,
                              std::span<const int32_t> prompt, bool agent_attention = false);

// Decodes one sequence through one agent after Prefill.
class Decoder {
 public:
  Decoder(const LlamaModel& model, Agent* agent, SequenceId id, int32_t prompt_length);

  // Call once after Prefill with the first generated token T1. In specache mode this runs the
  // pre-decode step (T1 over the replica: the first fetch, and the speculative token T'2).
  Status Start(int32_t first_token);
  // Feeds `token` (the real row) at the next position and returns the logits for the position
  // after it. In specache mode the step's second row is the current speculative token, and the
  // speculative token is updated to that row's argmax.
  Result<std::span<const float>> Step(int32_t token);

  // After every step, writes the rows each (layer, KV head) selected for the next step, one line
  // each: "step layer head n token...". The trace specache-bench reuse reads. `out` must outlive
  // the decoder; null stops recording.
  void RecordSelections(std::ostream* out) { trace_ = out; }

  int32_t speculative_token() const { return speculative_; }
  int32_t position() const { return position_; }
  double decode_seconds() const { return decode_seconds_; }
  int64_t steps() const { return steps_; }

 private:
  // One agent step over `tokens` at positions position_, position_ + 1, ...; leaves the final
  // residual rows in x_.
  Status RunStep(StepKind kind, std::span<const int32_t> tokens);

  const LlamaModel& model_;
  Agent* agent_;
  SequenceId id_;
  int32_t position_;  // where the next real token goes
  int32_t speculative_ = -1;
  bool started_ = false;
  std::vector<float> x_, q_, k_, v_, attn_, logits_;
  LlamaScratch scratch_;
  double decode_seconds_ = 0;
  int64_t steps_ = 0;
  std::ostream* trace_ = nullptr;
  int64_t traced_steps_ = 0;
};

int32_t Argmax(std::span<const float> logits);

}  // namespace specache
