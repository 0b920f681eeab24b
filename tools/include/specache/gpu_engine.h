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
  // agent's EndStep (before the tokens' copy back); and its part inside the agent's calls
  // (BeginStep, WaitPrefetch, DecodeLayer, StartPrefetch, EndStep). Well below the step's wall
  // time, the GPU is the bound. Near it, either the host's own work is, or the host waited for the
  // GPU inside the step (a full launch queue, a plan's slot, the fetch's gather). Which of the two:
  // the host's stacks (tools/profile). (Until 2026-12-05 the figure also held that copy, so it was
  // near the step's time in every run, GPU-bound or not.)
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
  // ([sequences][vocab], host). FAILED_PRECONDITION while a step is queued (below).
  Result<std::vector<int32_t>> Step(std::span<const int32_t> tokens, std::vector<float>* logits = nullptr);

  // Greedy decode with the host a step ahead of the GPU, as serving engines overlap their
  // scheduling with the device's work: the GPU does not wait between two steps for the host to
  // read the tokens and queue the next one.
  // - QueueStep(tokens): queues a decode step as Step(tokens) runs it, without waiting for it.
  // - QueueGreedyStep(): queues the step after the last one queued, fed that step's greedy tokens
  //   (real and speculative) on the device, while it still runs.
  // - FinishStep(): waits for the oldest queued step; returns what Step would have.
  // So QueueStep(t), then QueueGreedyStep() + FinishStep() n times, then FinishStep(), gives the
  // tokens of n + 1 calls of Step each fed the last one's output. At most two steps are queued;
  // QueueStep (and Step, Prefill) only when none is, QueueGreedyStep only after one and with
  // neither step under phase timing (which times one step at a time): FAILED_PRECONDITION
  // otherwise. A queued step is the agent's as soon as it is queued (its rows are appended whether
  // or not it is finished); the engine's destruction waits for it. An agent whose BeginStep waits
  // for the GPU (the full-offload anchor's flushes its appends) runs the same, without the overlap.
  //
  // A step that fails after the agent began it (its rows may be partly appended, the device's
  // tokens overwritten), or whose tokens cannot be read back, leaves the batch unusable: every
  // later step and Start are refused with its error (FAILED_PRECONDITION); a step queued before it
  // still finishes. A step the agent refused at BeginStep changes nothing in the engine and may be
  // tried again, as the agent's error allows (agent.h: a refused commit reported there means its
  // sequence must be released, so that batch cannot go on). The queue's input is the model's
  // argmax buffer: two engines over one model must not have steps queued at the same time.
  Status QueueStep(std::span<const int32_t> tokens);
  Status QueueGreedyStep();
  Result<std::vector<int32_t>> FinishStep();
  int queued_steps() const { return queued_count_; }

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
  // The speculative tokens of the last finished step (specache).
  std::span<const int32_t> speculative_tokens() const { return speculative_; }
  int64_t steps() const { return steps_; }  // decode steps finished

 private:
  enum class Phase { kGemm, kEdges, kAttention, kFetchWait };
  // A step queued and not yet finished: its rows' greedy tokens come back to `tokens` (pinned,
  // [sequence][rows per sequence]), then `copied` is recorded.
  struct QueuedStep {
    int32_t* tokens = nullptr;     // pinned [GpuLlama::kMaxLogitRows]: the step's argmax
    int32_t* inputs = nullptr;     // pinned [2][kMaxLogitRows]: its tokens (when from the host), positions
    void* copied = nullptr;        // cudaEvent_t, after the step's last copy back
    int rows = 0;                  // of the batch
    bool timed = false;            // its phase times are the engine's marks
    Status failed = Status::Ok();  // queued, then a copy back failed: FinishAgentStep returns it
  };
  // Queues one agent step over rows [sequence][rows per sequence] whose tokens are `host_tokens`,
  // or when null the device's argmax of the step queued before (the same layout: its real and
  // speculative next tokens), at `positions`, into the next queued slot; with `logits`, the real
  // rows' logits (row 0 of each sequence) are copied to it (pageable: the copy waits for the step).
  Status QueueAgentStep(StepKind kind, const std::vector<int32_t>* host_tokens, const std::vector<int32_t>& positions,
                        std::vector<float>* logits);
  // Waits for the oldest queued step: its argmax to argmax_host_, its phase times collected.
  Status FinishAgentStep();
  // Keeps `status` as the failure that stops the batch (broken_), and returns it.
  Status StopBatch(const Status& status);
  // OK, or FAILED_PRECONDITION with broken_.
  Status Usable() const;
  // Step's and QueueStep's checks: started, usable, nothing queued, one token per sequence in the vocabulary.
  Status CheckStepTokens(std::span<const int32_t> tokens) const;
  // A decode step of tokens (host; empty: the device's argmax of the step queued before) queued
  // through QueueAgentStep, positions_ advanced once it is queued.
  Status QueueDecodeStep(std::span<const int32_t> tokens, std::vector<float>* logits);
  // A decode step's rows (real, then speculative) and their positions from positions_ (checked
  // against the model's context); the tokens from `tokens` and speculative_ when given.
  Status NextDecodeRows(std::span<const int32_t> tokens, std::vector<int32_t>* in, std::vector<int32_t>* pos);
  // The finished decode step's tokens to the caller's form, and speculative_ from them.
  std::vector<int32_t> TakeDecodeTokens();
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
  QueuedStep queued_[2];  // a ring: the oldest at queued_first_
  int queued_first_ = 0, queued_count_ = 0;
  Status broken_ = Status::Ok();  // the first failure of a step the agent had begun (above)

  bool timing_ = false;
  int host_delay_us_ = 0;  // set_host_delay_us
  bool delay_before_projections_ = false;
  PhaseTimes times_;
  std::vector<void*> events_;  // cudaEvent_t pool
  size_t marks_ = 0;           // events recorded this step
  std::vector<Phase> phases_;  // phase of the interval ending at mark i
};

}  // namespace specache::gpu
