// The attention side of the CUDA agent, one layer at a time: it turns a layer's new rows into the
// kernels' work and launches it on the compute stream.
//
// - Decode: the step's new K/V to fp16, then one cuda::DeviceDecodeItem per (sequence, KV head)
//   of the step (Plan): the replica's view, the full-precision rows substituted (RowFetcher), the
//   queries and outputs, the probabilities and scratch the top-k reads. Then the attention and
//   the selection (top-k, kUnion's real-row ranking, the oracle's exact ranking) written into the
//   fetcher's next selection.
// - Prefill: one sequence's prompt rows to fp16 and their exact causal attention, every KV head
//   in one launch.
// - The fp16 rows stay in new_keys()/new_values() (prefill_keys()/prefill_values()) until the next
//   call, for the agent's page writes and replica appends.
//
// Every cuda::AttendDecodeBatch of the agent is launched from here (Attend). The planner owns the
// scratch this needs and grows it as needed; the step it plans is the StepProtocol's current one.
// Not thread-safe (the agent is used from one thread); Plan builds the items on
// CudaAgentOptions::plan_threads threads of its own, which only read the replicas and the fetcher.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "../step_protocol.h"
#include "device_buffer.h"
#include "device_page_table.h"
#include "replica_store.h"
#include "row_fetch.h"
#include "specache/agent.h"
#include "specache/cuda_attention.h"

namespace specache::cuda {

// One layer's decode work, for the sequences of the step in order.
struct LayerPlan {
  std::vector<DeviceDecodeItem> items;  // [sequence][KV head]
  std::vector<int32_t> candidates;      // [sequence] leading tokens that compete in its top-k
  std::vector<size_t> probs_offsets;    // [sequence] where its probabilities start in the scratch
};

class StepPlanner {
 public:
  // Everything given must outlive the planner; work is queued on `compute`. usable_cores: the
  // logical cores the process may use (UsableCores; 0: not known), which cap options.plan_threads.
  StepPlanner(const ModelShape& shape, const KvConfig& config, const CudaAgentOptions& options, int usable_cores,
              const StepProtocol* protocol, const ReplicaStore* replicas, RowFetcher* rows,
              const DevicePageTable* pages, cudaStream_t compute);
  // Waits for its selection stream.
  ~StepPlanner();
  StepPlanner(const StepPlanner&) = delete;
  StepPlanner& operator=(const StepPlanner&) = delete;

  // Rows [first, first + n) of the prompt batch (one sequence's): every KV head's K/V to fp16 and,
  // when batch.out is given, the exact causal attention of every query head into it.
  Status PrefillSequence(const PrefillBatch& batch, int32_t first, int32_t n);

  // The step's new K/V to fp16 and the layer's items, substituting the current selection.
  Result<LayerPlan> Plan(int layer, const DecodeRows& rows);
  // The modes that select for the step's own row (nonspec, oracle): the attention over the
  // replica alone (the oracle's over every full-precision row), then the top-k into the
  // fetcher's next selection. The plan's outputs are overwritten by AttendWithFetchedRows.
  Status AttendPlainAndSelect(int layer, const LayerPlan& plan);
  // The attention with the fetched selection substituted (after RowFetcher::Fetch). The plan's
  // items move into the launch (plan->items is empty after).
  Status AttendWithFetchedRows(int layer, LayerPlan* plan);
  // The attention, then in the modes that fetch rows the top-k for the next step into the
  // fetcher's next selection (kUnion ranks the real row too, from the same pass). The plan's items
  // move into the launch (plan->items is empty after; the selection reads the rest of the plan).
  // The selection runs on a stream of its own, forked from the compute stream after the
  // attention, beside what the engine queues after it; the next Attend, or JoinSelection, makes
  // the compute stream wait for it (CudaAgentOptions::selection_on_own_stream false: in order on
  // the compute stream instead). The selection's end is the fetcher's event of the layer
  // (RowFetcher::MarkSelected, recorded here), which its fetch waits for.
  Status AttendAndSelect(int layer, LayerPlan* plan);
  // The compute stream waits for the last selection (the step's end: everything the step queued
  // is then behind the engine's stream).
  Status JoinSelection();
  // The stream the last selection was queued on while the compute stream has yet to join it (own
  // stream only; null otherwise): work queued there after the selection (the agent's page writes)
  // runs beside the engine's kernels, with no fork of its own. Such work must end by an event
  // recorded on that stream and given to JoinSelectionAt, so that the join covers it.
  cudaStream_t pending_selection_stream() const { return selection_pending_ ? select_ : nullptr; }
  // The next join waits for `end` (recorded on pending_selection_stream() after the selection)
  // instead of the selection's own end: work that reads the last Plan's new rows (new_keys(),
  // new_values()), which the Plan after next rewrites (joining it first if still pending).
  void JoinSelectionAt(cudaEvent_t end) {
    selection_end_ = end;
    writes_kv_ = kv_;
  }
  // The host waits for the selection stream.
  Status WaitForSelection() const;

  // The fp16 K/V of the last Plan ([row][n_kv][head_dim]).
  const Half* new_keys() const { return k_[kv_].get(); }
  const Half* new_values() const { return v_[kv_].get(); }
  // KV head h's fp16 K/V of the last PrefillSequence ([n][head_dim]).
  const Half* prefill_keys(int h) const { return k_[kv_].get() + size_t(h) * prefill_tokens_ * shape_.head_dim; }
  const Half* prefill_values(int h) const { return v_[kv_].get() + size_t(h) * prefill_tokens_ * shape_.head_dim; }
  // The attention's softmax scale, 1 / sqrt(head_dim).
  float scale() const { return scale_; }

 private:
  // The only launch of the batched decode attention (after joining a pending selection).
  Status Attend(std::vector<DeviceDecodeItem> items);
  // Top-k of each sequence's candidates into the fetcher's next selection, on `stream`.
  Status Select(int layer, const LayerPlan& plan, cudaStream_t stream);
  // The row-selection rule beyond the plain top-k (selection.h), in functions of their own:
  // kUnion's mask-select-merge (the real row's scores come from the attention's own pass, into
  // real_probs_), and the oracle's exact ranking over every full-precision row.
  Status SelectUnion(int layer, const LayerPlan& plan, cudaStream_t stream);
  Status RankExactly(int layer, std::vector<DeviceDecodeItem>* items, cudaStream_t stream);
  // Softmax statistics of sequence s (of the step), KV head h: [GQA head][2].
  float* ProbsStats(size_t s, int h) {
    return probs_stats_.get() + (s * shape_.n_kv_heads + h) * size_t(shape_.group_size()) * 2;
  }
  // Real-row scores of sequence s, KV head h in real_probs_, and their softmax statistics.
  float* RealProbs(const LayerPlan& plan, size_t s, int h, int32_t n) {
    return real_probs_.get() + plan.probs_offsets[s] + size_t(h) * shape_.group_size() * n;
  }
  float* RealStats(size_t s, int h) {
    return real_stats_.get() + (s * shape_.n_kv_heads + h) * size_t(shape_.group_size()) * 2;
  }

  ModelShape shape_;
  KvConfig config_;
  CudaAgentOptions options_;
  const StepProtocol* protocol_;
  const ReplicaStore* replicas_;
  RowFetcher* rows_;
  const DevicePageTable* pages_;
  cudaStream_t compute_;
  // AttendAndSelect's selection on a stream of its own (CudaAgentOptions::selection_on_own_stream;
  // none of these is made or used when it is false): its stream, the fork after the attention,
  // the selection's end (the fetcher's event of the last selection's layer), and whether the
  // compute stream has yet to wait for that end. One stream serves every layer: the
  // selection reads the planner's scratch (probs_, probs_stats_, the union's), which the next
  // attention overwrites, so that attention waits for it (Attend); it overlaps the engine's work
  // between two attentions (the output projection, the MLP, the next layer's QKV).
  cudaStream_t select_ = nullptr;
  cudaEvent_t attended_ = nullptr, selection_end_ = nullptr;
  bool selection_pending_ = false;
  float scale_ = 1.0f;
  int plan_threads_ = 1;  // options_.plan_threads, at most the machine's cores
  // The attention's launch plans. In specache mode it leaves the fetch's blocks their slots on the
  // GPU, so that a fetch started before an attention kernel runs beside it instead of after it.
  DecodePlan plan_;
  // The top-k's segments: a plan apart from the attention's, so that each plan's calls stay on
  // one stream (the selection's runs on select_ in specache mode) and release their slots in
  // groups (decode_plan_slots.h) instead of one event a call. On select_ (off the engine's path)
  // its kernels read them in place (a block's segment over the link, before the kernel waits for
  // its predecessor): no host call at all, where a copy in select_'s order cost the host's thread
  // ~6% of a host-bound 32 x 8K layer (H100) and a side stream's copy three calls.
  DecodePlan topk_plan_;
  // The selection rule's small task lists (mask, shift, merge: a task per block), read in place.
  DecodePlan selection_tasks_{DecodePlan::SlotReads::kInPlace};

  // Scratch, grown as needed.
  Buffer<float> scores_, probs_, probs_stats_, topk_scratch_;
  Buffer<float> real_probs_, real_stats_;  // kUnion: the real row's scores and statistics
  Buffer<int32_t> union_tokens_;           // kUnion: [segment][primary | extra]
  Buffer<float> real_shifted_;             // kUnion with real_next: [segment][GQA head][n]
  Buffer<int32_t> every_token_;            // oracle: 0, 1, 2, ... (every quantized token)
  Buffer<Half> every_row_;                 // oracle: every quantized row of the step's items
  // The new rows in fp16, two pairs of buffers that decode Plans take in turn (kv_: the last
  // call's), whatever the order of the layers: what the agent queues after a selection
  // (pending_selection_stream, JoinSelectionAt) reads one layer's rows until the next attention
  // joins it, after the next Plan wrote the other pair; writes_kv_ is the pair such work still
  // reads (-1: none pending). Prefill uses pair 0.
  Buffer<Half> k_[2], v_[2];
  int kv_ = 0;
  int writes_kv_ = -1;
  int32_t prefill_tokens_ = 0;  // of the last PrefillSequence
  // probs_ holds raw scores; probs_stats_ [sequence][KV head][GQA head][2] their softmax statistics.
};

}  // namespace specache::cuda
