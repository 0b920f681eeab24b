#include "step_planner.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "specache/cuda_fetch.h"
#include "specache/cuda_selection.h"
#include "specache/cuda_tensors.h"
#include "specache/cuda_topk.h"
#include "../parallel_for.h"
#include "prefill_attention.h"

namespace specache::cuda {

StepPlanner::StepPlanner(const ModelShape& shape, const KvConfig& config, const CudaAgentOptions& options,
                         int usable_cores, const StepProtocol* protocol, const ReplicaStore* replicas, RowFetcher* rows,
                         const DevicePageTable* pages, cudaStream_t compute)
    : shape_(shape),
      config_(config),
      options_(options),
      protocol_(protocol),
      replicas_(replicas),
      rows_(rows),
      pages_(pages),
      compute_(compute),
      topk_plan_(options.selection_on_own_stream && !config.selects_for_this_step()
                     ? DecodePlan::SlotReads::kInPlace
                     : DecodePlan::SlotReads::kDeviceCopy) {
  scale_ = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  plan_threads_ = std::max(1, usable_cores > 0 ? std::min(options.plan_threads, usable_cores) : options.plan_threads);
  if (config.mode == KvMode::kSpeCache) plan_.set_free_slots(options.fetch_blocks);
}

StepPlanner::~StepPlanner() {
  if (select_) {
    cudaStreamSynchronize(select_);
    cudaStreamDestroy(select_);
  }
  if (attended_) cudaEventDestroy(attended_);
}

Status StepPlanner::PrefillSequence(const PrefillBatch& batch, int32_t first, int32_t n) {
  const int d = shape_.head_dim, n_kv = shape_.n_kv_heads, n_q = shape_.n_q_heads, group = shape_.group_size();
  kv_ = 0;
  Buffer<Half>& keys = k_[kv_];
  Buffer<Half>& values = v_[kv_];
  SPECACHE_RETURN_IF_ERROR(keys.Reserve(size_t(n_kv) * n * d));
  SPECACHE_RETURN_IF_ERROR(values.Reserve(size_t(n_kv) * n * d));
  for (int h = 0; h < n_kv; ++h) {  // [n][n_kv][d] float -> [n_kv][n][d] fp16
    const size_t kv_at = (size_t(first) * n_kv + h) * d;
    SPECACHE_RETURN_IF_ERROR(FloatKeyValueRowsToHalf(batch.k + kv_at, batch.v + kv_at, n, d, int64_t{n_kv} * d,
                                                     keys.get() + size_t(h) * n * d, values.get() + size_t(h) * n * d,
                                                     compute_));
  }
  prefill_tokens_ = n;
  if (!batch.out) return Status::Ok();
  const size_t q_at = size_t(first) * n_q * d;  // the sequence's rows of every head, in place
  // Only the CUDA-core kernel needs scratch (PrefillScratchFloats: 134 MB at 32K tokens, GQA 4).
  if (!TensorPrefillServes(batch.q + q_at, keys.get(), values.get(), batch.out + q_at, d)) {
    SPECACHE_RETURN_IF_ERROR(scores_.Reserve(static_cast<size_t>(PrefillScratchFloats(n, group))));
  }
  return AttendPrefill(batch.q + q_at, keys.get(), values.get(), n, n_kv, group, d, scale_, batch.out + q_at,
                       scores_.get(), compute_);
}

Result<LayerPlan> StepPlanner::Plan(int layer, const DecodeRows& rows) {
  const int d = shape_.head_dim, group = shape_.group_size(), n_kv = shape_.n_kv_heads, n_q = shape_.n_q_heads;
  const int n_rows = protocol_->rows();
  const auto& ids = protocol_->ids();
  const size_t n_seq = ids.size(), total_rows = n_seq * n_rows;
  const bool selects = config_.fetches_rows();
  const bool appends = protocol_->kind() == StepKind::kDecode;
  const int probs_row = PrimaryRowOf(config_, appends);

  // The new K/V as fp16, [row][n_kv][d], for every sequence at once, into the pair the last Plan
  // did not write; the page writes still pending after a selection read the other one, unless a
  // layer failed between them (then they are joined first).
  kv_ ^= 1;
  if (selection_pending_ && writes_kv_ == kv_) SPECACHE_RETURN_IF_ERROR(JoinSelection());
  Buffer<Half>& keys = k_[kv_];
  Buffer<Half>& values = v_[kv_];
  SPECACHE_RETURN_IF_ERROR(keys.Reserve(total_rows * n_kv * d));
  SPECACHE_RETURN_IF_ERROR(values.Reserve(total_rows * n_kv * d));
  SPECACHE_RETURN_IF_ERROR(FloatKeyValueRowsToHalf(rows.k, rows.v, static_cast<int32_t>(total_rows * n_kv), d, d,
                                                   keys.get(), values.get(), compute_));

  LayerPlan plan;
  plan.candidates.resize(n_seq);
  plan.items.resize(n_seq * n_kv);
  plan.probs_offsets.assign(n_seq, 0);
  size_t scratch = 0, probs = 0;
  std::vector<const ReplicaStore::Heads*> heads_of(n_seq);  // one lookup per sequence
  std::vector<size_t> scratch_of(n_seq);                    // where sequence s's scratch starts
  for (size_t s = 0; s < n_seq; ++s) {
    heads_of[s] = &replicas_->Layer(ids[s], layer);
    const DeviceHeadReplica& rep0 = *(*heads_of[s])[0];
    plan.candidates[s] = TopKCandidates(config_, appends, rep0.length(), rep0.quantized_keys());
    plan.probs_offsets[s] = probs;
    probs += size_t(n_kv) * group * std::max<int32_t>(plan.candidates[s], 1);
    scratch_of[s] = scratch;
    scratch += static_cast<size_t>(DecodeScratchFloats(rep0.length(), n_rows, group, d)) * n_kv;
  }
  SPECACHE_RETURN_IF_ERROR(scores_.Reserve(scratch));
  SPECACHE_RETURN_IF_ERROR(probs_.Reserve(std::max<size_t>(probs, 1)));
  SPECACHE_RETURN_IF_ERROR(probs_stats_.Reserve(n_seq * n_kv * group * 2));
  // The union rule ranks the real row too: its scores come out of the same pass (real_probs).
  const bool ranks_real = selects && config_.extra_rows() > 0 && n_rows > 1 && probs_row != 0;
  if (ranks_real) {
    SPECACHE_RETURN_IF_ERROR(real_probs_.Reserve(std::max<size_t>(probs, 1)));
    SPECACHE_RETURN_IF_ERROR(real_stats_.Reserve(n_seq * n_kv * group * 2));
  }
  // Sequences [first, end)'s items: every write goes to their own items, every read is of state
  // nothing changes during the planning (the replicas, the fetcher's rows), so ranges of sequences
  // are made on options_.plan_threads threads at once.
  const auto make_items = [&](size_t first, size_t end) {
    if (first < end) {
      for (const auto& rep : *heads_of[first]) rep->Prefetch();
    }
    for (size_t s = first; s < end; ++s) {
      const int32_t candidates = plan.candidates[s];
      const ReplicaStore::Heads& heads = *heads_of[s];
      if (s + 1 < end) {  // the next sequence's replicas load while this one's items are made
        for (const auto& rep : *heads_of[s + 1]) rep->Prefetch();
      }
      size_t at = scratch_of[s];
      for (int h = 0; h < n_kv; ++h) {
        const DeviceHeadReplica& rep = *heads[h];
        DeviceDecodeItem& it = plan.items[s * n_kv + h];
        it.replica = rep.view();
        DeviceDecodeRows& r = it.rows;
        const size_t first_row = s * n_rows;
        r.q = rows.q + (first_row * n_q + size_t(h) * group) * d;
        r.out = rows.out + (first_row * n_q + size_t(h) * group) * d;
        r.q_stride = int64_t{n_q} * d;
        r.new_keys = keys.get() + (first_row * n_kv + h) * d;
        r.new_values = values.get() + (first_row * n_kv + h) * d;
        r.kv_stride = int64_t{n_kv} * d;
        r.n_rows = n_rows;
        r.n_heads = group;
        r.scale = scale_;
        r.probs_row = probs_row;
        r.n_candidates = candidates;
        r.probs = selects && candidates > 0 ? probs_.get() + plan.probs_offsets[s] + size_t(h) * group * candidates
                                            : nullptr;
        r.probs_stats = ProbsStats(s, h);
        if (ranks_real && r.probs) {
          r.real_probs = RealProbs(plan, s, h, candidates);
          r.real_probs_stats = RealStats(s, h);
        }
        r.scratch = scores_.get() + at;
        at += static_cast<size_t>(DecodeScratchFloats(rep.length(), n_rows, group, d));
      }
      rows_->Substitute(ids[s], layer, std::span(plan.items).subspan(s * n_kv, n_kv));
    }
  };
  // A range of at least kPlanSequencesPerThread sequences per thread: below that, waking the
  // threads costs more than the items (a few us a sequence).
  constexpr size_t kPlanSequencesPerThread = 16;
  const int threads = static_cast<int>(std::min<size_t>(
      static_cast<size_t>(plan_threads_), std::max<size_t>(n_seq / kPlanSequencesPerThread, 1)));
  if (threads <= 1) {
    make_items(0, n_seq);
  } else {
    ParallelFor(threads, threads, [&](int t, int) {
      make_items(n_seq * static_cast<size_t>(t) / threads, n_seq * static_cast<size_t>(t + 1) / threads);
    });
  }
  return plan;
}

Status StepPlanner::AttendPlainAndSelect(int layer, const LayerPlan& plan) {
  std::vector<DeviceDecodeItem> plain = plan.items;
  for (auto& it : plain) it.rows.n_sub = 0;
  if (config_.mode == KvMode::kSpeCacheOracle) SPECACHE_RETURN_IF_ERROR(RankExactly(layer, &plain, compute_));
  SPECACHE_RETURN_IF_ERROR(Attend(std::move(plain)));
  return Select(layer, plan, compute_);  // the fetch for this step follows on the compute stream
}

Status StepPlanner::AttendWithFetchedRows(int layer, LayerPlan* plan) {
  const int n_kv = shape_.n_kv_heads;
  const auto& ids = protocol_->ids();
  for (size_t s = 0; s < ids.size(); ++s) {
    rows_->Substitute(ids[s], layer, std::span(plan->items).subspan(s * n_kv, n_kv));
  }
  for (DeviceDecodeItem& it : plan->items) it.rows.probs = nullptr;
  return Attend(std::move(plan->items));
}

Status StepPlanner::AttendAndSelect(int layer, LayerPlan* plan) {
  const bool selects = config_.fetches_rows();
  SPECACHE_RETURN_IF_ERROR(Attend(std::move(plan->items)));  // with the real row's scores for the union rule
  if (!selects) return Status::Ok();
  if (!options_.selection_on_own_stream) {
    // In order on the compute stream (CudaAgentOptions::selection_on_own_stream): the next
    // attention, which overwrites the scores it reads, follows it there, so nothing joins it.
    // Whatever Select queued is what the layer's fetch waits for (as on the own stream); after a
    // failure the step protocol queues no fetch of the layer.
    const Status selected = Select(layer, *plan, compute_);
    const Status recorded = rows_->MarkSelected(layer, compute_);
    SPECACHE_RETURN_IF_ERROR(selected);
    return recorded;
  }
  // The selection forks off the compute stream after the attention (its scores and statistics)
  // and runs beside the engine's kernels that follow; the next attention joins it (Attend).
  // Each made once; one that failed is asked for again at the next call.
  if (!select_) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&select_, cudaStreamNonBlocking), "selection stream"));
  }
  if (!attended_) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&attended_, cudaEventDisableTiming), "event"));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(attended_, compute_), "attention event"));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(select_, attended_, 0), "wait for the attention"));
  const Status selected = Select(layer, *plan, select_);
  // Whatever Select queued (all of it, or up to a failed launch) is what the join waits for: the
  // fetcher's event of the layer, which its fetch waits for too (one record serves both).
  const Status recorded = rows_->MarkSelected(layer, select_);
  if (recorded.ok()) {
    selection_end_ = rows_->selection_done(layer);
    selection_pending_ = true;
  } else {
    // No event marks this selection's end: no later attention may start before its kernels are
    // done with the scores.
    cudaStreamSynchronize(select_);
  }
  SPECACHE_RETURN_IF_ERROR(selected);
  return recorded;
}

Status StepPlanner::JoinSelection() {
  if (!selection_pending_) return Status::Ok();
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(compute_, selection_end_, 0), "wait for the selection"));
  selection_pending_ = false;  // only once the wait is queued: a failed join is tried again
  writes_kv_ = -1;
  return Status::Ok();
}

Status StepPlanner::WaitForSelection() const {
  return select_ ? CudaStatus(cudaStreamSynchronize(select_), "selection stream") : Status::Ok();
}

Status StepPlanner::Attend(std::vector<DeviceDecodeItem> items) {
  // The previous layer's selection still reads the scores and statistics this attention writes.
  SPECACHE_RETURN_IF_ERROR(JoinSelection());
  return AttendDecodeBatch(std::move(items), compute_, &plan_);
}

Status StepPlanner::Select(int layer, const LayerPlan& plan, cudaStream_t stream) {
  if (config_.extra_rows() > 0) return SelectUnion(layer, plan, stream);
  const int group = shape_.group_size(), n_kv = shape_.n_kv_heads;
  const auto& ids = protocol_->ids();
  // The adaptive budget keeps its rows at the front of each head's k_max (cuda_topk.h) and counts
  // them on the device: the selection stays k_max per head, its padding no row to the fetch.
  const bool adaptive = config_.adaptive();
  const TopKBudget budget{static_cast<float>(config_.mass), config_.k_min, rows_->budget_rows()};
  size_t scratch = 0;
  for (int32_t n : plan.candidates) scratch += size_t(n_kv) * TopKScratchFloats(std::max(n, 0), adaptive);
  SPECACHE_RETURN_IF_ERROR(topk_scratch_.Reserve(std::max<size_t>(scratch, 1)));
  std::vector<TopKSegment> segments;
  segments.reserve(ids.size() * n_kv);
  // kReal with real_next ranks a copy of the scores that credits each token with its predecessor's.
  const bool shift = config_.real_next && config_.mode == KvMode::kSpeCache && config_.select == SelectFrom::kReal;
  std::vector<ShiftTask> shifts;
  if (shift) SPECACHE_RETURN_IF_ERROR(real_shifted_.Reserve(std::max<size_t>(scratch * group, 1)));
  scratch = 0;
  for (size_t s = 0; s < ids.size(); ++s) {
    const int32_t n = plan.candidates[s];
    const int32_t k = std::max(0, std::min<int32_t>(config_.primary_rows(), n));
    SPECACHE_ASSIGN_OR_RETURN(int32_t* const selection, rows_->SelectionTarget(ids[s], layer, k, adaptive));
    if (k == 0) continue;
    for (int h = 0; h < n_kv; ++h) {  // head h's selection at h * k, as the resident rows are laid out
      float* probs = probs_.get() + plan.probs_offsets[s] + size_t(h) * group * n;
      if (shift) {
        float* copy = real_shifted_.get() + scratch * group;
        shifts.push_back({probs, copy, n});
        probs = copy;
      }
      segments.push_back({probs, selection + size_t(h) * k, topk_scratch_.get() + scratch, n, ProbsStats(s, h)});
      scratch += TopKScratchFloats(n, adaptive);
    }
  }
  SPECACHE_RETURN_IF_ERROR(
      WithPredecessors(shifts.data(), static_cast<int>(shifts.size()), group, stream, &selection_tasks_));
  return SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), group, config_.primary_rows(),
                         config_.reduction, stream, adaptive ? &budget : nullptr, &topk_plan_);
}

Status StepPlanner::SelectUnion(int layer, const LayerPlan& plan, cudaStream_t stream) {
  // selection.h: the primary top-k, then the real row's best extra_rows() others, merged. A
  // segment with no more candidates than both together selects them all (without the adaptive
  // budget). The others are merged: the merge drops the real row's picks that are primary (fewer
  // others than `extra` rank above -inf) and counts the rows on the device.
  const int group = shape_.group_size(), n_kv = shape_.n_kv_heads;
  const int32_t k = config_.primary_rows(), extra = config_.extra_rows();
  const bool adaptive = config_.adaptive();
  const int32_t whole = adaptive ? 0 : k + extra;  // segments of at most this many candidates take them all
  const TopKBudget budget{static_cast<float>(config_.mass), config_.k_min, nullptr};
  const bool pre_decode = protocol_->kind() == StepKind::kPreDecode;  // one row: primary and real
  const auto& ids = protocol_->ids();
  size_t scratch = 0, n_union = 0, shifted = 0;
  for (int32_t n : plan.candidates) {
    scratch += size_t(n_kv) * TopKScratchFloats(std::max(n, 0), adaptive);
    if (n > whole) ++n_union, shifted += size_t(n_kv) * group * n;
  }
  SPECACHE_RETURN_IF_ERROR(topk_scratch_.Reserve(std::max<size_t>(scratch, 1)));
  SPECACHE_RETURN_IF_ERROR(union_tokens_.Reserve(std::max<size_t>(n_union * n_kv * (k + extra), 1)));
  if (config_.real_next) SPECACHE_RETURN_IF_ERROR(real_shifted_.Reserve(std::max<size_t>(shifted, 1)));
  std::vector<TopKSegment> all, primary, others;
  std::vector<MaskTask> masks;
  std::vector<MergeTask> merges;
  std::vector<ShiftTask> shifts;
  const size_t segments = ids.size() * n_kv;  // each vector holds at most one entry per segment
  all.reserve(segments), primary.reserve(segments), others.reserve(segments), masks.reserve(segments);
  merges.reserve(segments);
  scratch = 0;
  shifted = 0;
  size_t slot = 0;
  for (size_t s = 0; s < ids.size(); ++s) {
    const int32_t n = std::max<int32_t>(plan.candidates[s], 0);
    const int32_t selected = adaptive ? std::min(n, k) + std::min(n, extra) : std::min(n, k + extra);
    SPECACHE_ASSIGN_OR_RETURN(int32_t* const selection,
                              rows_->SelectionTarget(ids[s], layer, selected, n > whole));
    if (n == 0) continue;
    for (int h = 0; h < n_kv; ++h) {
      float* probs = probs_.get() + plan.probs_offsets[s] + size_t(h) * group * n;
      int32_t* out = selection + size_t(h) * selected;
      float* part = topk_scratch_.get() + scratch;
      scratch += TopKScratchFloats(n, adaptive);
      if (n <= whole) {
        all.push_back({probs, out, part, n, ProbsStats(s, h)});
        continue;
      }
      int32_t* mine = union_tokens_.get() + slot;
      slot += k + extra;
      float* real = pre_decode ? probs : RealProbs(plan, s, h, n);
      if (config_.real_next) {  // ranked on a copy that credits each token with its predecessor
        float* copy = real_shifted_.get() + shifted;
        shifted += size_t(group) * n;
        shifts.push_back({real, copy, n});
        real = copy;
      }
      const float* real_stats = pre_decode ? ProbsStats(s, h) : RealStats(s, h);
      primary.push_back({probs, mine, part, n, ProbsStats(s, h)});
      masks.push_back({real, mine, n, std::min(n, k)});
      others.push_back({real, mine + k, part, n, real_stats});
      merges.push_back({mine, mine + k, out, std::min(n, k), std::min(n, extra)});
    }
  }
  SPECACHE_RETURN_IF_ERROR(
      SelectTopKBatch(all.data(), static_cast<int>(all.size()), group, k + extra, config_.reduction, stream, nullptr,
                      &topk_plan_));
  SPECACHE_RETURN_IF_ERROR(
      SelectTopKBatch(primary.data(), static_cast<int>(primary.size()), group, k, config_.reduction, stream,
                      adaptive ? &budget : nullptr, &topk_plan_));
  SPECACHE_RETURN_IF_ERROR(
      WithPredecessors(shifts.data(), static_cast<int>(shifts.size()), group, stream, &selection_tasks_));
  SPECACHE_RETURN_IF_ERROR(
      MaskTokens(masks.data(), static_cast<int>(masks.size()), group, stream, &selection_tasks_));
  SPECACHE_RETURN_IF_ERROR(
      SelectTopKBatch(others.data(), static_cast<int>(others.size()), group, extra, config_.reduction, stream, nullptr,
                      &topk_plan_));
  // Without the budget too the two lists may share tokens: the primary ones, masked as NaN, rank as
  // -inf, tied with the real row's own -inf and NaN tokens (a row of NaN), so the real row's picks
  // can repeat one. The merge counts it once and ends the list with padding.
  return MergeSelections(merges.data(), static_cast<int>(merges.size()), rows_->budget_rows(), stream,
                         &selection_tasks_);
}

Status StepPlanner::RankExactly(int layer, std::vector<DeviceDecodeItem>* items, cudaStream_t stream) {
  // Every quantized row of every item, read from the source into scratch (not through the row
  // cache and not counted as fetched: the oracle only measures), substituted for the ranking pass.
  const int n_kv = shape_.n_kv_heads;
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  int32_t most = 0;
  size_t rows = 0;
  for (const auto& it : *items) {
    most = std::max(most, it.replica.quantized_keys);
    rows += static_cast<size_t>(it.replica.quantized_keys);
  }
  if (most == 0) return Status::Ok();
  if (every_token_.bytes() < int64_t{most} * int64_t{sizeof(int32_t)}) {
    std::vector<int32_t> iota(static_cast<size_t>(options_.capacity_tokens));
    for (size_t t = 0; t < iota.size(); ++t) iota[t] = static_cast<int32_t>(t);
    SPECACHE_RETURN_IF_ERROR(every_token_.Reserve(iota.size()));
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(every_token_.get(), iota.data(), iota.size() * sizeof(int32_t),
                                                   cudaMemcpyHostToDevice),
                                        "oracle tokens"));
  }
  SPECACHE_RETURN_IF_ERROR(every_row_.Reserve(rows * row));
  std::vector<FetchTask> tasks;
  std::vector<SequenceId> sequences;
  size_t at = 0;
  for (size_t i = 0; i < items->size(); ++i) {
    DeviceDecodeItem& it = (*items)[i];
    FetchTask t;
    t.selected = every_token_.get();
    t.n_selected = it.replica.quantized_keys;
    t.out_rows = every_row_.get() + at * row;
    t.pages = pages_->Layer(protocol_->ids()[i / n_kv], layer);
    t.kv_head = static_cast<int>(i % n_kv);
    tasks.push_back(t);
    sequences.push_back(protocol_->ids()[i / n_kv]);
    it.rows.sub_tokens = every_token_.get();
    it.rows.sub_rows = t.out_rows;
    it.rows.sub_slots = nullptr;  // rows in token order (the items came with the row cache's slots)
    it.rows.n_sub = it.replica.quantized_keys;
    at += static_cast<size_t>(it.replica.quantized_keys);
  }
  return rows_->Gather(layer, tasks, sequences, stream);
}

}  // namespace specache::cuda
