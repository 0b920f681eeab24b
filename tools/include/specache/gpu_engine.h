// Greedy prefill and batched decode on the GPU: the model's matrix products by GpuLlama, the KV
// cache and attention by an agent that takes device tensors (CreateCudaAgent on the model's
// stream), driven as agent.h describes. Only tokens cross between host and device (and logits when
// a caller asks for them). A batch's sequences may have different lengths (ragged): each row gets
// its own position, and the agent attends each sequence over its own cache.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "specache/agent.h"
#include "specache/gpu_llama.h"

namespace specache::gpu {

// GPU time of decode steps by phase (CUDA events on the model's stream), summed over the steps
// run while timing was on. A prefill run while timing is on counts as one step: its attention_ms
// is the agent's whole PrefillLayer (attention, quantizing, page writes), edges_ms the embedding.
struct PhaseTimes {
  double gemm_ms = 0;        // each layer's norms, projections, RoPE and MLP
  double edges_ms = 0;       // the step's edges: token upload, embedding, the agent's BeginStep and
                             // EndStep, LM head, argmax, tokens back (the GPU waiting for the host counts)
  double attention_ms = 0;   // the agent's DecodeLayer and StartPrefetch: attention, the top-k of the
                             // speculative modes, and the synchronous fetch of specache-nonspec
  double fetch_wait_ms = 0;  // the stream stalled in WaitPrefetch for rows still in flight
  // Host time (steady clock), not GPU time: the host's enqueueing of the whole step, up to the
  // tokens' copy back (a copy to pageable memory, which waits for the step's end); and its part
  // inside the agent's calls (BeginStep, WaitPrefetch, DecodeLayer, StartPrefetch, EndStep). Well
  // below the step's wall time, the GPU is the bound. Near it, either the host's own work is, or
  // the host waited for the GPU inside the step (a full launch queue, a plan's slot, the fetch's
  // gather). Which of the two: the host's stacks (tools/profile). (Until 2026-12-05 the figure
  // also held that copy, so it was near the step's time in every run, GPU-bound or not.)
  double enqueue_host_ms = 0;
  double agent_host_ms = 0;
  int64_t steps = 0;
};

class GpuEngine {
 public:
  // Both must outlive the engine; the agent computes on model->stream().
  GpuEngine(GpuLlama* model, Agent* agent);
  ~GpuEngine();
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  // Registers the sequences in the agent and prefills their prompts in one ragged batch (the
  // agent computes the prompts' attention). Returns each sequence's greedy first token; with
  // `logits`, also the logits at each prompt's last position ([sequences][vocab], host).
  Result<std::vector<int32_t>> Prefill(std::span<const SequenceId> ids,
                                       std::span<const std::vector<int32_t>> prompts,
                                       std::vector<float>* logits = nullptr);

  // Starts decoding `ids` (all prefilled, or filled by the caller through the agent) whose next
  // positions are `lengths`, with their first generated tokens: in specache mode, the pre-decode
  // step that picks the first rows to fetch and the first speculative tokens.
  Status Start(std::span<const SequenceId> ids, std::span<const int32_t> lengths, std::span<const int32_t> first_tokens);
  // One decode step of the batch given to Start: tokens[i] is sequence i's real token at its next
  // position. Returns each sequence's greedy next token; with `logits`, the real rows' logits
  // ([sequences][vocab], host).
  Result<std::vector<int32_t>> Step(std::span<const int32_t> tokens, std::vector<float>* logits = nullptr);

  // Records per-phase GPU time of the following Prefill/Start/Step calls (a Prefill counts as one
  // step of PhaseTimes: reset_phase_times() after it to time decode steps alone).
  void set_phase_timing(bool on) { timing_ = on; }
  const PhaseTimes& phase_times() const { return times_; }
  void reset_phase_times() { times_ = {}; }
  // A probe for benchmarks (causal profiling): each decode step busy-waits `us` microseconds on
  // the host before each layer's attention is planned (or, `before_projections`, before the
  // layer's first products are queued). If the step grows by n_layers x us, the host's pace sets
  // the step's; if it does not, the GPU had that much slack. 0: none.
  void set_host_delay_us(int us, bool before_projections = false) {
    host_delay_us_ = us;
    delay_before_projections_ = before_projections;
  }
  std::span<const int32_t> speculative_tokens() const { return speculative_; }
  int64_t steps() const { return steps_; }

 private:
  enum class Phase { kGemm, kEdges, kAttention, kFetchWait };
  // One agent step over rows [sequence][rows per sequence] with their positions; leaves each row's
  // argmax in argmax_host_ (and logits of rows with `logit_stride`, from row 0, when asked).
  Status RunStep(StepKind kind, const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                 std::vector<float>* logits);
  Status Mark(Phase phase_before);
  // set_host_delay_us's wait, at the point named (before the layer's products, or its attention)
  // when it is the point chosen.
  void HostDelay(bool before_projections) const;
  Status CollectTimes();

  GpuLlama* model_;
  Agent* agent_;
  std::vector<SequenceId> ids_;
  std::vector<int32_t> positions_;    // next real position per sequence
  std::vector<int32_t> speculative_;  // per sequence (specache)
  std::vector<int32_t> argmax_host_;
  bool started_ = false;
  int64_t steps_ = 0;

  bool timing_ = false;
  int host_delay_us_ = 0;  // set_host_delay_us
  bool delay_before_projections_ = false;
  PhaseTimes times_;
  std::vector<void*> events_;  // cudaEvent_t pool
  size_t marks_ = 0;           // events recorded this step
  std::vector<Phase> phases_;  // phase of the interval ending at mark i
};

}  // namespace specache::gpu
