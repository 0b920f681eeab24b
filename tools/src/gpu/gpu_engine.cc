#include "specache/gpu_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "cuda_call.h"

namespace specache::gpu {
namespace {

// Host time spent in the calls it times (steady clock).
struct HostClock {
  double ms = 0;
  template <typename Call>
  Status Time(Call call) {
    const auto start = std::chrono::steady_clock::now();
    Status status = call();
    ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return status;
  }
};

cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

GpuEngine::GpuEngine(GpuLlama* model, Agent* agent) : model_(model), agent_(agent) {}

GpuEngine::~GpuEngine() {
  // A queued step (or one whose queueing failed midway) may still copy to or from its buffers.
  if (queued_[0].tokens || queued_[1].tokens) (void)cudaStreamSynchronize(Stream(model_->stream()));
  for (QueuedStep& q : queued_) {
    if (q.copied) cudaEventDestroy(static_cast<cudaEvent_t>(q.copied));
    if (q.tokens) cudaFreeHost(q.tokens);
    if (q.inputs) cudaFreeHost(q.inputs);
  }
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

Result<std::vector<int32_t>> GpuEngine::Prefill(std::span<const SequenceId> ids,
                                                std::span<const std::vector<int32_t>> prompts,
                                                std::vector<float>* logits) {
  const LlamaConfig& c = model_->config();
  // Its Argmax would overwrite what a queued greedy step reads (and Reserve may move it).
  if (queued_count_ > 0) return Status::FailedPrecondition("GpuEngine::Prefill while a step is queued (FinishStep first)");
  if (ids.size() != prompts.size() || ids.empty()) return Status::InvalidArgument("one prompt per sequence, at least one");
  std::vector<int32_t> offsets{0}, tokens, positions;
  for (const std::vector<int32_t>& p : prompts) {
    if (p.empty()) return Status::InvalidArgument("empty prompt");
    if (static_cast<int>(p.size()) > c.context_length) {
      return Status::InvalidArgument("prompt of " + std::to_string(p.size()) + " tokens exceeds the model's context of " +
                                     std::to_string(c.context_length));
    }
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i] < 0 || p[i] >= c.vocab) return Status::InvalidArgument("token id " + std::to_string(p[i]) + " outside the vocabulary");
      tokens.push_back(p[i]);
      positions.push_back(static_cast<int32_t>(i));
    }
    offsets.push_back(static_cast<int32_t>(tokens.size()));
  }
  const int n = static_cast<int>(tokens.size());
  SPECACHE_RETURN_IF_ERROR(model_->Reserve(n));
  void* s = model_->stream();
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(model_->device_tokens(), tokens.data(), n * sizeof(int32_t),
                                                cudaMemcpyHostToDevice, Stream(s)), "prompt tokens"));
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(model_->device_positions(), positions.data(), n * sizeof(int32_t),
                                                cudaMemcpyHostToDevice, Stream(s)), "prompt positions"));
  for (SequenceId id : ids) SPECACHE_RETURN_IF_ERROR(agent_->AddSequence(id));
  marks_ = 0;
  SPECACHE_RETURN_IF_ERROR(Mark(Phase::kEdges));
  SPECACHE_RETURN_IF_ERROR(model_->Embed(model_->device_tokens(), n));
  SPECACHE_RETURN_IF_ERROR(Mark(Phase::kEdges));
  for (int l = 0; l < c.n_layers; ++l) {
    SPECACHE_RETURN_IF_ERROR(model_->ProjectQkv(l, n, model_->device_positions()));
    SPECACHE_RETURN_IF_ERROR(Mark(Phase::kGemm));
    SPECACHE_RETURN_IF_ERROR(
        agent_->PrefillLayer(l, {ids, offsets, model_->q(), model_->k(), model_->v(), model_->attn()}));
    SPECACHE_RETURN_IF_ERROR(Mark(Phase::kAttention));  // the agent's whole prefill: attention, quantizing, page writes
    SPECACHE_RETURN_IF_ERROR(model_->FinishLayer(l, n));
    SPECACHE_RETURN_IF_ERROR(Mark(Phase::kGemm));
  }
  std::vector<int32_t> first(ids.size());
  if (logits) logits->resize(ids.size() * static_cast<size_t>(c.vocab));
  for (size_t i = 0; i < ids.size(); ++i) {  // each prompt's last row
    SPECACHE_RETURN_IF_ERROR(model_->Logits(offsets[i + 1] - 1, 1));
    SPECACHE_RETURN_IF_ERROR(model_->Argmax(1));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(&first[i], model_->argmax(), sizeof(int32_t), cudaMemcpyDeviceToHost,
                                                  Stream(s)), "first token"));
    if (logits) {
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(logits->data() + i * c.vocab, model_->logits(),
                                                    c.vocab * sizeof(float), cudaMemcpyDeviceToHost, Stream(s)),
                                    "logits"));
    }
    // The next Logits call reuses the buffers: this row's copies must land first.
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(Stream(s)), "prefill"));
  }
  SPECACHE_RETURN_IF_ERROR(CollectTimes());  // the prefill counts as one step of the phase times
  return first;
}

Status GpuEngine::Mark(Phase phase_before) {
  if (!timing_) return Status::Ok();
  if (marks_ == events_.size()) {
    cudaEvent_t e = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreate(&e), "timing event"));
    events_.push_back(e);
    phases_.push_back(phase_before);
  }
  phases_[marks_] = phase_before;
  return Cuda(cudaEventRecord(static_cast<cudaEvent_t>(events_[marks_++]), Stream(model_->stream())), "timing event");
}

Status GpuEngine::CollectTimes() {
  if (!timing_) return Status::Ok();
  for (size_t i = 1; i < marks_; ++i) {
    float ms = 0;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[i - 1]),
                                                       static_cast<cudaEvent_t>(events_[i])),
                                  "timing"));
    switch (phases_[i]) {
      case Phase::kGemm: times_.gemm_ms += ms; break;
      case Phase::kEdges: times_.edges_ms += ms; break;
      case Phase::kAttention: times_.attention_ms += ms; break;
      case Phase::kFetchWait: times_.fetch_wait_ms += ms; break;
    }
  }
  ++times_.steps;
  marks_ = 0;
  return Status::Ok();
}

void GpuEngine::HostDelay(bool before_projections) const {
  if (host_delay_us_ <= 0 || before_projections != delay_before_projections_) return;
  // A busy wait, as host work would be (set_host_delay_us).
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(host_delay_us_);
  while (std::chrono::steady_clock::now() < until) {
  }
}

Status GpuEngine::QueueAgentStep(StepKind kind, const std::vector<int32_t>* host_tokens,
                                 const std::vector<int32_t>& positions, std::vector<float>* logits) {
  const LlamaConfig& c = model_->config();
  const int n = static_cast<int>(positions.size());
  const int rows = agent_->RowsPerSequence(kind);
  if (queued_count_ == 2) return Status::FailedPrecondition("two steps are queued already");
  if (n > GpuLlama::kMaxLogitRows) return Status::InvalidArgument("a step of more rows than the LM head takes");
  QueuedStep& q = queued_[(queued_first_ + queued_count_) % 2];  // not queued: its last use finished
  if (q.tokens == nullptr) {  // for the most rows a step may have (GpuEngine::Start's limit)
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaHostAlloc(reinterpret_cast<void**>(&q.tokens),
                                                GpuLlama::kMaxLogitRows * sizeof(int32_t), cudaHostAllocDefault),
                                  "pinned tokens"));
  }
  if (q.inputs == nullptr) {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaHostAlloc(reinterpret_cast<void**>(&q.inputs),
                                                2 * GpuLlama::kMaxLogitRows * sizeof(int32_t), cudaHostAllocDefault),
                                  "pinned step inputs"));
  }
  if (q.copied == nullptr) {
    cudaEvent_t e = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "step event"));
    q.copied = e;
  }
  const auto begun = std::chrono::steady_clock::now();
  SPECACHE_RETURN_IF_ERROR(model_->Reserve(n));
  void* s = model_->stream();
  marks_ = 0;
  SPECACHE_RETURN_IF_ERROR(Mark(Phase::kEdges));
  // From pinned memory, so that the copies never wait for the step queued before.
  int32_t* in_tokens = q.inputs;
  int32_t* in_positions = q.inputs + GpuLlama::kMaxLogitRows;
  std::copy(positions.begin(), positions.end(), in_positions);
  if (host_tokens) {
    std::copy(host_tokens->begin(), host_tokens->end(), in_tokens);
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(model_->device_tokens(), in_tokens, n * sizeof(int32_t),
                                                  cudaMemcpyHostToDevice, Stream(s)), "step tokens"));
  }
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(model_->device_positions(), in_positions, n * sizeof(int32_t),
                                                cudaMemcpyHostToDevice, Stream(s)), "step positions"));
  // The step before's argmax is read in stream order: after its copy to the host, before this
  // step's Argmax overwrites it.
  SPECACHE_RETURN_IF_ERROR(model_->Embed(host_tokens ? model_->device_tokens() : model_->argmax(), n));
  HostClock agent_clock;
  SPECACHE_RETURN_IF_ERROR(agent_clock.Time([&] { return agent_->BeginStep(kind, ids_); }));
  // From here on a failure leaves the batch unusable (gpu_engine.h): StopBatch.
  Status status = Mark(Phase::kEdges);
  for (int l = 0; l < c.n_layers && status.ok(); ++l) {
    HostDelay(/*before_projections=*/true);
    status = model_->ProjectQkv(l, n, model_->device_positions());
    if (status.ok()) status = Mark(Phase::kGemm);
    HostDelay(/*before_projections=*/false);
    if (status.ok()) status = agent_clock.Time([&] { return agent_->WaitPrefetch(l); });
    if (status.ok()) status = Mark(Phase::kFetchWait);
    if (status.ok()) {
      status = agent_clock.Time(
          [&] { return agent_->DecodeLayer(l, {model_->q(), model_->k(), model_->v(), model_->attn()}); });
    }
    if (status.ok()) status = Mark(Phase::kAttention);
    if (status.ok()) status = model_->FinishLayer(l, n);
    // specache: the layer's fetch overlaps the later layers. Started once the layer's output
    // projection and MLP are queued, so that the host's planning of the fetch never leaves the GPU
    // waiting for them (a host-bound step: specache-bench step --start-prefetch).
    if (status.ok()) status = agent_clock.Time([&] { return agent_->StartPrefetch(l); });
  }
  if (status.ok()) status = Mark(Phase::kGemm);
  // The LM head and the argmax are queued before the agent's EndStep, whose host work (the rows'
  // commits) then overlaps them.
  if (status.ok()) status = model_->Logits(0, n);
  if (status.ok()) status = model_->Argmax(n);
  if (!status.ok()) {
    agent_->AbortStep();
    return StopBatch(status);
  }
  status = agent_clock.Time([&] { return agent_->EndStep(); });
  if (!status.ok()) return StopBatch(status);
  // The step is queued (its rows are the agent's from here on, whatever follows): what the host took.
  const double enqueue_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begun).count();
  q.rows = n;
  q.timed = timing_;
  q.failed = Status::Ok();
  ++queued_count_;
  status = Cuda(cudaMemcpyAsync(q.tokens, model_->argmax(), n * sizeof(int32_t), cudaMemcpyDeviceToHost, Stream(s)),
                "tokens");
  if (status.ok() && logits) {  // the real rows: row 0 of each sequence
    const size_t sequences = ids_.size(), row_bytes = size_t(c.vocab) * sizeof(float);
    logits->resize(sequences * c.vocab);
    status = Cuda(cudaMemcpy2DAsync(logits->data(), row_bytes, model_->logits(), rows * row_bytes, row_bytes,
                                    sequences, cudaMemcpyDeviceToHost, Stream(s)),
                  "logits");
  }
  if (status.ok()) status = Cuda(cudaEventRecord(static_cast<cudaEvent_t>(q.copied), Stream(s)), "step event");
  if (status.ok()) status = Mark(Phase::kEdges);
  if (!status.ok()) {
    // Queued but its results cannot be had: FinishAgentStep reports it, nothing reads the slot
    // before the stream is through with it.
    (void)cudaStreamSynchronize(Stream(s));
    q.failed = status;
    return StopBatch(status);
  }
  if (timing_) {
    times_.enqueue_host_ms += enqueue_ms;
    times_.agent_host_ms += agent_clock.ms;
  }
  return Status::Ok();
}

Status GpuEngine::FinishAgentStep() {
  if (queued_count_ == 0) return Status::FailedPrecondition("GpuEngine: no step is queued");
  QueuedStep& q = queued_[queued_first_];
  queued_first_ = (queued_first_ + 1) % 2;
  --queued_count_;
  SPECACHE_RETURN_IF_ERROR(q.failed);
  // A step whose tokens cannot be had leaves the engine's speculative tokens behind its positions.
  Status status = Cuda(cudaEventSynchronize(static_cast<cudaEvent_t>(q.copied)), "decode step");
  if (!status.ok()) return StopBatch(status);
  argmax_host_.assign(q.tokens, q.tokens + q.rows);
  if (!q.timed) return Status::Ok();
  // Its last mark comes after the copies back: wait for it too (a timed step is the only one queued).
  status = Cuda(cudaStreamSynchronize(Stream(model_->stream())), "decode step");
  if (status.ok()) status = CollectTimes();
  return status.ok() ? status : StopBatch(status);
}

Status GpuEngine::StopBatch(const Status& status) {
  broken_ = status;
  return status;
}

Status GpuEngine::Usable() const {
  if (broken_.ok()) return Status::Ok();
  return Status::FailedPrecondition("GpuEngine: an earlier step failed after the agent began it (or its tokens could "
                                    "not be read back), so the batch cannot go on: " + broken_.ToString());
}

Status GpuEngine::Start(std::span<const SequenceId> ids, std::span<const int32_t> lengths,
                        std::span<const int32_t> first_tokens) {
  if (started_) return Status::FailedPrecondition("GpuEngine::Start called twice");
  SPECACHE_RETURN_IF_ERROR(Usable());
  if (ids.empty() || lengths.size() != ids.size() || first_tokens.size() != ids.size()) {
    return Status::InvalidArgument("Start needs one length and one first token per sequence");
  }
  // Refused here, not after a step's layers appended their rows: the LM head's rows at once.
  const size_t step_rows = ids.size() * std::max(1, agent_->RowsPerSequence(StepKind::kDecode));
  if (step_rows > static_cast<size_t>(GpuLlama::kMaxLogitRows)) {
    return Status::InvalidArgument(std::to_string(ids.size()) + " sequences decode " + std::to_string(step_rows) +
                                   " rows a step; the LM head takes at most " + std::to_string(GpuLlama::kMaxLogitRows));
  }
  std::vector<int32_t> tokens(first_tokens.begin(), first_tokens.end());
  for (int32_t t : tokens) {
    if (t < 0 || t >= model_->config().vocab) return Status::InvalidArgument("token id " + std::to_string(t) + " outside the vocabulary");
  }
  ids_.assign(ids.begin(), ids.end());
  positions_.assign(lengths.begin(), lengths.end());
  speculative_.assign(ids.size(), -1);
  // Started only once the first speculative tokens are known (a step fed -1 would embed out of bounds).
  if (agent_->RowsPerSequence(StepKind::kPreDecode) > 0) {
    SPECACHE_RETURN_IF_ERROR(QueueAgentStep(StepKind::kPreDecode, &tokens, positions_, nullptr));
    SPECACHE_RETURN_IF_ERROR(FinishAgentStep());
    speculative_ = argmax_host_;
  }
  started_ = true;
  return Status::Ok();
}

Status GpuEngine::NextDecodeRows(std::span<const int32_t> tokens, std::vector<int32_t>* in, std::vector<int32_t>* pos) {
  const int rows = agent_->RowsPerSequence(StepKind::kDecode);
  for (size_t i = 0; i < ids_.size(); ++i) {
    if (positions_[i] + rows > model_->config().context_length) {
      return Status::OutOfRange("decoding past the model's context of " + std::to_string(model_->config().context_length) +
                                " tokens");
    }
  }
  for (size_t i = 0; i < ids_.size(); ++i) {
    if (!tokens.empty()) {
      in->push_back(tokens[i]);
      if (rows == 2) in->push_back(speculative_[i]);  // the speculative row: the guess of the token after tokens[i]
    }
    pos->push_back(positions_[i]);
    if (rows == 2) pos->push_back(positions_[i] + 1);
  }
  return Status::Ok();
}

std::vector<int32_t> GpuEngine::TakeDecodeTokens() {
  const int rows = agent_->RowsPerSequence(StepKind::kDecode);
  std::vector<int32_t> next(ids_.size());
  for (size_t i = 0; i < ids_.size(); ++i) {
    next[i] = argmax_host_[i * rows];
    if (rows == 2) speculative_[i] = argmax_host_[i * rows + 1];
  }
  ++steps_;
  return next;
}

// The checks common to the steps fed host tokens (Step, QueueStep).
Status GpuEngine::CheckStepTokens(std::span<const int32_t> tokens) const {
  if (!started_) return Status::FailedPrecondition("GpuEngine: a step before Start");
  SPECACHE_RETURN_IF_ERROR(Usable());
  if (queued_count_ > 0) {
    return Status::FailedPrecondition("GpuEngine: a step with tokens while one is queued (its speculative tokens are "
                                      "not back: FinishStep first)");
  }
  if (tokens.size() != ids_.size()) return Status::InvalidArgument("Step needs one token per sequence");
  for (int32_t t : tokens) {
    if (t < 0 || t >= model_->config().vocab) return Status::InvalidArgument("token id " + std::to_string(t) + " outside the vocabulary");
  }
  return Status::Ok();
}

Status GpuEngine::QueueDecodeStep(std::span<const int32_t> tokens, std::vector<float>* logits) {
  std::vector<int32_t> in, pos;
  SPECACHE_RETURN_IF_ERROR(NextDecodeRows(tokens, &in, &pos));
  const int queued = queued_count_;
  const Status status = QueueAgentStep(StepKind::kDecode, tokens.empty() ? nullptr : &in, pos, logits);
  if (queued_count_ > queued) {  // queued (whatever followed): its rows are appended
    for (int32_t& p : positions_) ++p;
  }
  return status;
}

Status GpuEngine::QueueStep(std::span<const int32_t> tokens) {
  SPECACHE_RETURN_IF_ERROR(CheckStepTokens(tokens));
  return QueueDecodeStep(tokens, nullptr);
}

Status GpuEngine::QueueGreedyStep() {
  if (!started_) return Status::FailedPrecondition("GpuEngine: a step before Start");
  SPECACHE_RETURN_IF_ERROR(Usable());
  if (queued_count_ != 1) {
    return Status::FailedPrecondition(queued_count_ == 0 ? "GpuEngine: a greedy step needs the step before it queued"
                                                         : "GpuEngine: two steps are queued already");
  }
  if (timing_ || queued_[queued_first_].timed) {
    return Status::FailedPrecondition("GpuEngine: phase timing times one step at a time (Step)");
  }
  return QueueDecodeStep({}, nullptr);
}

Result<std::vector<int32_t>> GpuEngine::FinishStep() {
  SPECACHE_RETURN_IF_ERROR(FinishAgentStep());
  return TakeDecodeTokens();
}

Result<std::vector<int32_t>> GpuEngine::Step(std::span<const int32_t> tokens, std::vector<float>* logits) {
  SPECACHE_RETURN_IF_ERROR(CheckStepTokens(tokens));
  const Status queued = QueueDecodeStep(tokens, logits);
  if (!queued.ok()) {
    if (queued_count_ > 0) (void)FinishAgentStep();  // queued, then a copy back failed: drop it
    return queued;
  }
  return FinishStep();
}

}  // namespace specache::gpu
