// CPU backend of the agent. The "device" is host memory; the prefetch is a synchronous read from
// the full-precision source done in StartPrefetch, with the same state machine the CUDA backend
// runs asynchronously (selected -> in flight -> resident), so call-order errors show up here too.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "host_row_rounding.h"
#include "parallel_for.h"
#include "specache/agent.h"
#include "specache/cpu_attention.h"
#include "specache/head_replica.h"
#include "specache/row_cache.h"
#include "specache/selection.h"
#include "step_protocol.h"

namespace specache {
namespace {

struct HeadState {
  explicit HeadState(const ReplicaParams& p) : replica(p) {}
  HeadReplica replica;
  std::vector<int32_t> selected;    // the layer's last top-k, ascending
  std::vector<int32_t> resident;    // the selection whose rows the attention substitutes, ascending
  std::vector<Half> resident_rows;  // [resident.size()][2][head_dim]
  RowCacheEntries cache;            // rows kept for reuse (row_cache.h), with their rows:
  std::vector<Half> cache_rows;     // [cache.tokens.size()][2][head_dim]
  int64_t fetches = 0;
  // A fetch begun (StartPrefetch) and not yet finished (WaitPrefetch): the source may still be
  // writing `fetched`, so it is finished before the head is used or freed.
  struct PendingFetch {
    bool active = false;
    uint64_t read = 0;              // the source's handle (StartReadRows)
    std::vector<int32_t> selected;  // the selection being fetched (resident once finished)
    std::vector<int64_t> sources;   // UpdateRowCache's plan for cache_rows
    std::vector<Half> rows;         // the selection's rows, cache hits filled in
    std::vector<int32_t> missing;   // tokens read from the source...
    std::vector<size_t> missing_slot;  // ...and where they go in `rows`
    std::vector<Half> fetched;
  } pending;
};

struct SequenceState {
  std::vector<std::vector<HeadState>> heads;  // [layer][kv_head]
};

std::string Id(SequenceId id) { return std::to_string(id); }

class CpuAgent final : public Agent {
 public:
  CpuAgent(const ModelShape& shape, const KvConfig& config, FullPrecisionSource* source)
      : shape_(shape), config_(config), source_(source), protocol_(shape, config) {
    params_.head_dim = shape.head_dim;
    params_.key_bits = config.effective_key_bits();
    params_.value_bits = config.effective_value_bits();
    params_.group_size = config.group_size;
    params_.residual_tokens = config.residual_tokens;
    scale_ = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  }

  const ModelShape& shape() const override { return shape_; }
  const KvConfig& config() const override { return config_; }
  std::string_view backend_name() const override { return "cpu"; }

  Status AddSequence(SequenceId id) override {
    if (sequences_.count(id)) return Status::AlreadyExists("sequence " + Id(id) + " is already registered");
    SPECACHE_RETURN_IF_ERROR(
        source_->CreateSequence(id, {shape_.n_layers, shape_.n_kv_heads, shape_.head_dim, config_.host_row_format})
            .WithContext("source"));
    SequenceState state;
    state.heads.resize(shape_.n_layers);
    for (auto& layer : state.heads) layer.assign(shape_.n_kv_heads, HeadState(params_));
    sequences_.emplace(id, std::move(state));
    protocol_.AddSequence(id);
    return Status::Ok();
  }

  // No read may still write into a head; then every sequence still registered goes from the
  // source, as ReleaseSequence would (best effort: StepProtocol::ReleaseAllIn).
  ~CpuAgent() override {
    FinishAllFetches();
    protocol_.ReleaseAllIn(source_);
  }

  Status ReleaseSequence(SequenceId id) override {
    if (!sequences_.count(id)) return Status::NotFound("sequence " + Id(id) + " is not registered");
    SPECACHE_RETURN_IF_ERROR(protocol_.CheckRelease(id));
    FinishFetches(&sequences_.at(id));  // no read may still write into its heads
    sequences_.erase(id);
    protocol_.RemoveSequence(id);
    return source_->ReleaseSequence(id).WithContext("source");
  }

  Result<int32_t> SequenceLength(SequenceId id) const override { return LengthAt(id, 0); }

  Status PrefillLayer(int layer, const PrefillBatch& batch) override;
  Status BeginStep(StepKind kind, std::span<const SequenceId> sequences) override;
  Status DecodeLayer(int layer, const DecodeRows& rows) override;
  Status StartPrefetch(int layer) override;
  Status WaitPrefetch(int layer) override;
  Status EndStep() override;
  void AbortStep() override;

  Result<std::vector<int32_t>> SelectedTokens(SequenceId id, int layer, int kv_head) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
    SPECACHE_RETURN_IF_ERROR(protocol_.CheckHead(layer, kv_head));
    // A fetch begun by StartPrefetch and not yet waited for holds the selection the next
    // DecodeLayer will use (it finishes the fetch first).
    const HeadState& h = it->second.heads[layer][kv_head];
    return h.pending.active ? h.pending.selected : h.resident;
  }

  AgentStats stats() const override {
    AgentStats s = counters_;
    for (const auto& [id, seq] : sequences_) {
      for (const auto& layer : seq.heads) {
        for (const HeadState& h : layer) {
          // A begun fetch counts as landed (as the CUDA agent's stats, which wait for it): the
          // row cache it leaves behind. On the device the selection's rows are the cache's (the
          // attention reads them there), so they take no memory of their own.
          const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
          const size_t rows = h.pending.active ? h.pending.sources.size() * row : h.cache_rows.size();
          s.device_bytes += h.replica.device_bytes() + static_cast<int64_t>(rows * sizeof(Half));
          s.full_precision_bytes += int64_t{h.replica.length()} * 2 * shape_.head_dim * static_cast<int64_t>(sizeof(Half));
        }
      }
    }
    s.device_bytes_reserved = s.device_bytes;  // nothing is allocated ahead
    return s;
  }

 private:
  Status CheckLayer(int layer) const { return protocol_.CheckLayer(layer); }
  // Tokens of a sequence at a layer (the protocol's view of this backend's storage).
  Result<int32_t> LengthAt(SequenceId id, int layer) const {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
    return it->second.heads[layer][0].replica.length();
  }
  // The step's sequences, in BeginStep's order.
  SequenceState& StepSequence(size_t i) { return sequences_.at(protocol_.ids()[i]); }

  void AddFetchCounts(const std::vector<FetchCounts>& counts) {
    const int64_t row_bytes = HostRowBytes(config_.host_row_format, shape_.head_dim);
    for (const FetchCounts& c : counts) specache::AddFetchCounts(c, row_bytes, &counters_);
  }

  // The full-precision rows the attention substitutes: the selection, or with attend_resident the
  // whole row cache (which holds the selection).
  cpu::SubstitutedRows Substituted(const HeadState& h) const {
    if (config_.attend_resident) {
      return {h.cache.tokens.data(), h.cache_rows.data(), static_cast<int32_t>(h.cache.tokens.size())};
    }
    return {h.resident.data(), h.resident_rows.data(), static_cast<int32_t>(h.resident.size())};
  }

  // Makes `selected` resident: rows already resident are kept, the rest read from the source.
  // In two halves (BeginFetch starts the source's read, EndFetch waits for it and makes the rows
  // resident), so a prefetch's read runs while the engine computes other layers.
  Status Fetch(SequenceId id, int layer, int kv_head, HeadState* h, FetchCounts* counts) const;
  Status BeginFetch(SequenceId id, int layer, int kv_head, HeadState* h, FetchCounts* counts) const;
  Status EndFetch(SequenceId id, HeadState* h) const;
  // Finishes every begun fetch (errors dropped: the heads are about to go or be fetched again).
  void FinishFetches(SequenceState* s) const {
    for (auto& layer : s->heads) {
      for (HeadState& h : layer) (void)EndFetch(0, &h);
    }
  }
  void FinishAllFetches() {
    for (auto& [id, s] : sequences_) FinishFetches(&s);
  }

  // Rounds a [n][head_dim] float block with row stride `stride` floats into fp16.
  static void ToHalfRows(const float* src, int n, int head_dim, size_t stride, Half* dst) {
    for (int i = 0; i < n; ++i) {
      for (int c = 0; c < head_dim; ++c) dst[static_cast<size_t>(i) * head_dim + c] = FloatToHalf(src[i * stride + c]);
    }
  }

  ModelShape shape_;
  KvConfig config_;
  FullPrecisionSource* source_;
  ReplicaParams params_;
  float scale_ = 1.0f;
  std::map<SequenceId, SequenceState> sequences_;
  AgentStats counters_;
  StepProtocol protocol_;
};

Status CpuAgent::PrefillLayer(int layer, const PrefillBatch& batch) {
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckPrefill(layer, batch, [this](SequenceId id, int l) { return LengthAt(id, l); }));
  const size_t n_seq = batch.sequences.size();
  std::vector<SequenceState*> states(n_seq);
  for (size_t i = 0; i < n_seq; ++i) states[i] = &sequences_.at(batch.sequences[i]);

  const int d = shape_.head_dim;
  const int group = shape_.group_size();
  const int n_kv = shape_.n_kv_heads;
  const int n_q = shape_.n_q_heads;
  std::vector<Status> errors(n_seq * n_kv);
  ParallelFor(static_cast<int>(n_seq * n_kv), [&](int item, int) {
    const size_t s = item / n_kv;
    const int h = item % n_kv;
    const int32_t first = batch.token_offsets[s];
    const int32_t n = batch.token_offsets[s + 1] - first;
    std::vector<Half> keys(static_cast<size_t>(n) * d), values(keys.size()), rows(2 * keys.size());
    const size_t kv_stride = static_cast<size_t>(n_kv) * d;
    ToHalfRows(batch.k + (first * kv_stride) + static_cast<size_t>(h) * d, n, d, kv_stride, keys.data());
    ToHalfRows(batch.v + (first * kv_stride) + static_cast<size_t>(h) * d, n, d, kv_stride, values.data());
    if (batch.out) {
      std::vector<float> q(static_cast<size_t>(n) * group * d), out(q.size());
      for (int32_t t = 0; t < n; ++t) {
        std::copy_n(batch.q + ((static_cast<size_t>(first + t) * n_q) + static_cast<size_t>(h) * group) * d, group * d,
                    q.data() + static_cast<size_t>(t) * group * d);
      }
      cpu::AttentionWorkspace ws;
      cpu::AttendPrefill(q.data(), keys.data(), values.data(), n, group, d, scale_, out.data(), &ws);
      for (int32_t t = 0; t < n; ++t) {
        std::copy_n(out.data() + static_cast<size_t>(t) * group * d, group * d,
                    batch.out + ((static_cast<size_t>(first + t) * n_q) + static_cast<size_t>(h) * group) * d);
      }
    }
    for (int32_t t = 0; t < n; ++t) {
      std::copy_n(keys.data() + static_cast<size_t>(t) * d, d, rows.data() + static_cast<size_t>(t) * 2 * d);
      std::copy_n(values.data() + static_cast<size_t>(t) * d, d, rows.data() + static_cast<size_t>(t) * 2 * d + d);
      RoundHostRow(config_.round_host_rows, rows.data() + static_cast<size_t>(t) * 2 * d, d);  // for the source only
    }
    errors[item] = source_->AppendRows(batch.sequences[s], layer, h, 0, rows.data(), n).WithContext("source");
    if (!errors[item].ok()) return;
    HeadState& head = states[s]->heads[layer][h];
    head.replica.Append(keys.data(), values.data(), n);
    if (config_.seed_rows > 0) {
      // KvConfig::seed_rows: the row cache starts with the quantized tokens the prompt's last
      // token attends most, their rows from this call's own K/V (nothing fetched). A sequence is
      // prefilled once (StepProtocol::CheckPrefill), into an empty cache.
      const float* last_q = batch.q + ((static_cast<size_t>(first + n - 1) * n_q) + static_cast<size_t>(h) * group) * d;
      std::vector<int32_t> rank;
      cpu::SeedTokens(last_q, keys.data(), group, n, d, scale_, head.replica.quantized_keys(),
                      std::min(config_.seed_rows, config_.cache_rows()), config_.reduction, &head.cache.tokens, &rank);
      // Marked used before any fetch (fetch numbers start at 1), the least attended longest ago:
      // the seeds leave the cache before any fetched row, the weakest first.
      head.cache.used.resize(rank.size());
      for (size_t i = 0; i < rank.size(); ++i) head.cache.used[i] = -int64_t{rank[i]};
      // The prompt's own fp16 rows (keys, values), not the source's (KvConfig::round_host_rows
      // rounds those): on a GPU the seeds never leave the device.
      head.cache_rows.resize(head.cache.tokens.size() * 2 * static_cast<size_t>(d));
      for (size_t i = 0; i < head.cache.tokens.size(); ++i) {
        const size_t token = static_cast<size_t>(head.cache.tokens[i]) * d;
        std::copy_n(keys.data() + token, d, head.cache_rows.data() + i * 2 * d);
        std::copy_n(values.data() + token, d, head.cache_rows.data() + i * 2 * d + d);
      }
    }
  });
  for (const Status& e : errors) SPECACHE_RETURN_IF_ERROR(e);
  return Status::Ok();
}

Status CpuAgent::BeginStep(StepKind kind, std::span<const SequenceId> sequences) {
  return protocol_.Begin(kind, RowsPerSequence(kind), sequences,
                         [this](SequenceId id, int layer) { return LengthAt(id, layer); });
}

Status CpuAgent::Fetch(SequenceId id, int layer, int kv_head, HeadState* h, FetchCounts* counts) const {
  SPECACHE_RETURN_IF_ERROR(BeginFetch(id, layer, kv_head, h, counts));
  return EndFetch(id, h);
}

Status CpuAgent::BeginFetch(SequenceId id, int layer, int kv_head, HeadState* h, FetchCounts* counts) const {
  SPECACHE_RETURN_IF_ERROR(EndFetch(id, h));  // a fetch never waited for (an aborted step)
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  RowCacheEntries before = h->cache;
  std::vector<bool> hit;
  const std::vector<int64_t> sources =
      UpdateRowCache(&h->cache, h->selected, ++h->fetches, static_cast<size_t>(config_.cache_rows()), &hit);
  // The selection's rows: hits from the cache, the rest read from the source.
  std::vector<Half> rows(h->selected.size() * row);
  std::vector<int32_t> missing;
  std::vector<size_t> missing_slot;
  for (size_t i = 0; i < h->selected.size(); ++i) {
    if (hit[i]) {
      const size_t at = std::lower_bound(before.tokens.begin(), before.tokens.end(), h->selected[i]) - before.tokens.begin();
      std::copy_n(h->cache_rows.data() + at * row, row, rows.data() + i * row);
    } else {
      missing.push_back(h->selected[i]);
      missing_slot.push_back(i);
    }
  }
  counts->selected += static_cast<int64_t>(h->selected.size());
  counts->fetched += static_cast<int64_t>(missing.size());
  counts->reused += static_cast<int64_t>(h->selected.size() - missing.size());
  HeadState::PendingFetch& p = h->pending;
  p.selected = h->selected;
  p.sources = sources;
  p.rows = std::move(rows);
  p.missing = std::move(missing);
  p.missing_slot = std::move(missing_slot);
  p.fetched.assign(p.missing.size() * row, 0);
  p.read = 0;
  if (!p.missing.empty()) {
    auto read = source_->StartReadRows(id, layer, kv_head, p.missing.data(), static_cast<int32_t>(p.missing.size()),
                                       p.fetched.data());
    SPECACHE_RETURN_IF_ERROR(read.status().WithContext("fetching rows of sequence " + Id(id)));
    p.read = *read;
  }
  p.active = true;
  return Status::Ok();
}

Status CpuAgent::EndFetch(SequenceId id, HeadState* h) const {
  HeadState::PendingFetch& p = h->pending;
  if (!p.active) return Status::Ok();
  p.active = false;
  if (!p.missing.empty()) {
    SPECACHE_RETURN_IF_ERROR(source_->FinishReadRows(p.read).WithContext("fetching rows of sequence " + Id(id)));
  }
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  for (size_t m = 0; m < p.missing.size(); ++m) {
    std::copy_n(p.fetched.data() + m * row, row, p.rows.data() + p.missing_slot[m] * row);
  }
  std::vector<Half> cache_rows(p.sources.size() * row);
  for (size_t i = 0; i < p.sources.size(); ++i) {
    const Half* src =
        p.sources[i] >= 0 ? p.rows.data() + p.sources[i] * row : h->cache_rows.data() + (-1 - p.sources[i]) * row;
    std::copy_n(src, row, cache_rows.data() + i * row);
  }
  h->cache_rows = std::move(cache_rows);
  h->resident = std::move(p.selected);
  h->resident_rows = std::move(p.rows);
  p.selected.clear();
  p.rows.clear();
  return Status::Ok();
}

Status CpuAgent::DecodeLayer(int layer, const DecodeRows& rows) {
  SPECACHE_RETURN_IF_ERROR(protocol_.BeforeDecode(layer));
  if (!rows.q || !rows.k || !rows.v || !rows.out) return Status::InvalidArgument("decode rows have a null tensor");

  const int d = shape_.head_dim;
  const int group = shape_.group_size();
  const int n_kv = shape_.n_kv_heads;
  const int n_q = shape_.n_q_heads;
  const int n_rows = protocol_.rows();
  const bool this_step = config_.selects_for_this_step();  // nonspec, oracle: select, fetch, attend
  const bool oracle = config_.mode == KvMode::kSpeCacheOracle;
  const bool selects = config_.fetches_rows();
  const bool appends = protocol_.kind() == StepKind::kDecode;
  const int probs_row = PrimaryRowOf(config_, protocol_.kind() == StepKind::kDecode);
  // kUnion also ranks the real row (row 0); in the pre-decode step that is the primary row itself.
  const bool union_rows = config_.extra_rows() > 0;
  const int n_items = static_cast<int>(protocol_.ids().size()) * n_kv;
  std::vector<Status> errors(n_items);
  std::vector<FetchCounts> counts(n_items);

  ParallelFor(n_items, [&](int item, int) {
    const int s = item / n_kv;
    const int h = item % n_kv;
    const SequenceId id = protocol_.ids()[s];
    HeadState& head = StepSequence(s).heads[layer][h];
    // A prefetch still in flight (the engine did not call WaitPrefetch): DecodeLayer waits for it.
    errors[item] = EndFetch(id, &head);
    if (!errors[item].ok()) return;
    std::vector<float> q(static_cast<size_t>(n_rows) * group * d), out(q.size());
    std::vector<Half> new_keys(static_cast<size_t>(n_rows) * d), new_values(new_keys.size());
    for (int r = 0; r < n_rows; ++r) {
      const size_t row = static_cast<size_t>(s) * n_rows + r;
      std::copy_n(rows.q + (row * n_q + static_cast<size_t>(h) * group) * d, group * d, q.data() + static_cast<size_t>(r) * group * d);
      ToHalfRows(rows.k + (row * n_kv + h) * d, 1, d, d, new_keys.data() + static_cast<size_t>(r) * d);
      ToHalfRows(rows.v + (row * n_kv + h) * d, 1, d, d, new_values.data() + static_cast<size_t>(r) * d);
    }
    cpu::AttentionWorkspace ws;
    const int32_t n_qk = head.replica.quantized_keys();
    const int32_t n_candidates = TopKCandidates(config_, appends, head.replica.length(), n_qk);
    std::vector<float> probs(selects ? static_cast<size_t>(group) * n_candidates : 0);
    std::vector<float> real_probs(union_rows && probs_row != 0 ? probs.size() : 0);
    const float* real = real_probs.empty() ? probs.data() : real_probs.data();
    cpu::SelectionScratch scratch;
    if (this_step) {
      // Select for this step, fetch, then attend with the fetched rows. The replica alone ranks
      // the rows (nonspec), or the exact scores over every full-precision row (oracle).
      cpu::SubstitutedRows ranking{};
      std::vector<int32_t> every;
      std::vector<Half> every_row;
      if (oracle) {
        every.resize(static_cast<size_t>(n_qk));
        for (int32_t t = 0; t < n_qk; ++t) every[t] = t;
        every_row.resize(every.size() * 2 * d);
        if (n_qk > 0) {
          errors[item] = source_->ReadRows(id, layer, h, every.data(), n_qk, every_row.data())
                             .WithContext("oracle: reading the rows of sequence " + Id(id));
          if (!errors[item].ok()) return;
        }
        ranking = {every.data(), every_row.data(), n_qk};
      }
      cpu::AttendDecodeRows(head.replica, ranking, q.data(), new_keys.data(), new_values.data(), n_rows, group, scale_,
                            out.data(), 0, n_candidates, probs.data(), &ws);
      cpu::SelectRows(config_, probs.data(), probs.data(), group, n_candidates, &head.selected, &scratch);
      errors[item] = Fetch(id, layer, h, &head, &counts[item]);
      if (!errors[item].ok()) return;
      cpu::AttendDecodeRows(head.replica, Substituted(head), q.data(), new_keys.data(), new_values.data(), n_rows, group,
                            scale_, out.data(), 0, 0, nullptr, &ws);
    } else {
      cpu::AttendDecodeRows(head.replica, Substituted(head), q.data(), new_keys.data(), new_values.data(), n_rows, group,
                            scale_, out.data(), probs_row, n_candidates, selects ? probs.data() : nullptr, &ws,
                            real_probs.empty() ? nullptr : real_probs.data());
      if (selects) cpu::SelectRows(config_, probs.data(), real, group, n_candidates, &head.selected, &scratch);
    }
    for (int r = 0; r < n_rows; ++r) {
      const size_t row = static_cast<size_t>(s) * n_rows + r;
      std::copy_n(out.data() + static_cast<size_t>(r) * group * d, group * d, rows.out + (row * n_q + static_cast<size_t>(h) * group) * d);
    }
    if (appends) {
      std::vector<Half> kv(2 * static_cast<size_t>(d));
      std::copy_n(new_keys.data(), d, kv.data());
      std::copy_n(new_values.data(), d, kv.data() + d);
      RoundHostRow(config_.round_host_rows, kv.data(), d);
      errors[item] = source_->AppendRows(id, layer, h, head.replica.length(), kv.data(), 1).WithContext("source");
      if (errors[item].ok()) head.replica.Append(new_keys.data(), new_values.data(), 1);
    }
  });
  protocol_.AfterDecode(layer);
  AddFetchCounts(counts);
  for (const Status& e : errors) SPECACHE_RETURN_IF_ERROR(e);
  return Status::Ok();
}

Status CpuAgent::StartPrefetch(int layer) {
  SPECACHE_ASSIGN_OR_RETURN(std::vector<size_t> which, protocol_.PrefetchList(layer));
  const int n_kv = shape_.n_kv_heads;
  const int n_items = static_cast<int>(which.size()) * n_kv;
  std::vector<Status> errors(n_items);
  std::vector<FetchCounts> counts(n_items);
  ParallelFor(n_items, [&](int item, int) {
    const size_t s = which[item / n_kv];
    // Started here, finished in WaitPrefetch: a source that reads over the network (or any with
    // StartReadRows) reads while the engine computes the layers in between.
    errors[item] =
        BeginFetch(protocol_.ids()[s], layer, item % n_kv, &StepSequence(s).heads[layer][item % n_kv], &counts[item]);
  });
  AddFetchCounts(counts);
  for (const Status& e : errors) SPECACHE_RETURN_IF_ERROR(e);
  protocol_.PrefetchStarted(layer, which);
  return Status::Ok();
}

Status CpuAgent::WaitPrefetch(int layer) {
  SPECACHE_RETURN_IF_ERROR(CheckLayer(layer));
  protocol_.Wait(layer);
  const int n_kv = shape_.n_kv_heads;
  const int n_items = static_cast<int>(protocol_.ids().size()) * n_kv;
  std::vector<Status> errors(n_items);
  ParallelFor(n_items, [&](int item, int) {
    const size_t s = static_cast<size_t>(item / n_kv);
    errors[item] = EndFetch(protocol_.ids()[s], &StepSequence(s).heads[layer][item % n_kv]);
  });
  for (const Status& e : errors) SPECACHE_RETURN_IF_ERROR(e);
  return Status::Ok();
}

Status CpuAgent::EndStep() {
  SPECACHE_ASSIGN_OR_RETURN(bool decode, protocol_.End());
  if (decode) ++counters_.steps;
  return Status::Ok();
}

void CpuAgent::AbortStep() {
  FinishAllFetches();  // reads begun in this step write nothing after it
  protocol_.Abort();
}

}  // namespace

Result<std::unique_ptr<Agent>> CreateCpuAgent(const ModelShape& shape, const KvConfig& config,
                                              FullPrecisionSource* source) {
  SPECACHE_RETURN_IF_ERROR(ValidateKvConfig(config, shape));
  if (source == nullptr) return Status::InvalidArgument("a full-precision source is required");
  return std::unique_ptr<Agent>(new CpuAgent(shape, config, source));
}

}  // namespace specache
