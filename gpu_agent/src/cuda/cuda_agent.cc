// CUDA backend of the agent. Every piece of math runs on the GPU through kernels that equal the
// CPU reference (quantization bit for bit, attention within float rounding, top-k exactly), with
// the call protocol and fetch state machine of the CPU backend (both follow step_protocol.h).
//
// Data path (docs/method.md, docs/architecture.md):
// - The source's host pages are registered and mapped; the agent keeps a device copy of each
//   (sequence, layer)'s page table and reads and writes rows in place: appends are stores from the
//   GPU into the pages, fetches are SM loads from them (cuda_fetch.h). No row passes through a
//   host copy, and the selection never leaves the device.
// - One layer of a step is a handful of launches for all its (sequence, KV head) items: fp16
//   conversion of the new K/V, the batched attention, the top-k of each sequence, the page
//   writes, the replica appends.
// - In specache mode the fetch of layer L runs on the agent's fetch stream, after an event that
//   marks layer L's top-k, and the compute stream waits for it (another event) only at layer L of
//   the next step: later layers never wait for it, and nothing synchronises the device in the
//   decode loop. Rows resident from the previous step are copied on the device, not refetched.
// - Rows written in place are committed to the source (CommitRows) once an event says they
//   landed: BeginStep commits the batches already landed without waiting; ReleaseSequence,
//   stats() and destruction wait for all. Nothing waits in the decode loop.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <string>

#include "specache/agent.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_fetch.h"
#include "specache/cuda_gather.h"
#include "specache/cuda_replica.h"
#include "specache/cuda_selection.h"
#include "specache/cuda_tensors.h"
#include "specache/cuda_topk.h"
#include "specache/device_probe.h"
#include "../step_protocol.h"

namespace specache {
namespace {

Status Cuda(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  if (err == cudaErrorMemoryAllocation) return Status::ResourceExhausted(what + ": out of device memory");
  return Status::Unavailable(what + ": " + cudaGetErrorString(err));
}

// A device (or pinned host) array that only grows, by half again at least (a reallocation waits
// for the device); growing drops the contents.
template <typename T, bool kPinned = false>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  ~Buffer() { Free(); }
  Status Reserve(size_t n) {
    if (n <= n_) return Status::Ok();
    if (n_ > 0) n = std::max(n, n_ + n_ / 2);
    Free();
    void* p = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(kPinned ? cudaMallocHost(&p, n * sizeof(T)) : cudaMalloc(&p, n * sizeof(T)),
                                  kPinned ? "pinned buffer" : "device buffer"));
    p_ = static_cast<T*>(p);
    n_ = n;
    return Status::Ok();
  }
  T* get() const { return p_; }
  int64_t bytes() const { return static_cast<int64_t>(n_ * sizeof(T)); }

 private:
  void Free() {
    if (p_) kPinned ? cudaFreeHost(p_) : cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

// The full-precision rows of one (sequence, layer) on the device, for all its KV heads.
// - The selection, in two generations: `cur` is what the next attention substitutes, the other
//   receives the next selection and its fetched rows. Head h's list starts at h * count.
// - The row cache (row_cache.h), in two generations too: the fetch reads generation `cache_cur`
//   and the update writes the other. Head h's entries start at h * capacity; their number is
//   known on the device only (cache_count).
struct LayerRows {
  Buffer<int32_t> tokens[2];  // [n_kv][count] ascending per head
  Buffer<Half> rows[2];       // [n_kv][count][2][head_dim]
  int cur = 0;
  int32_t resident = 0;       // per head, in generation cur
  int32_t selected = 0;       // per head, in generation 1 - cur (waiting for the fetch)
  Buffer<int32_t> cache_tokens[2], cache_used[2], cache_count[2];  // [n_kv][capacity], [n_kv][capacity], [n_kv]
  Buffer<Half> cache_rows[2];                                      // [n_kv][capacity][2][head_dim]
  int cache_cur = 0;
  int32_t fetches = 0;
};

struct SequenceState {
  std::vector<std::vector<std::unique_ptr<cuda::DeviceHeadReplica>>> replicas;  // [layer][kv_head]
  std::vector<LayerRows> layers;
  Buffer<uint64_t> pages;               // [layer][max_pages] GPU-visible page addresses
  Buffer<uint64_t, true> pages_host;    // the same, staged (entries are written once)
  int32_t mapped_pages = 0;             // entries filled per layer
};

struct PendingCommit {
  SequenceId id;
  int layer;
  int32_t first, n;
};

// Rows whose page writes were queued before `landed` was recorded.
struct CommitBatch {
  cudaEvent_t landed = nullptr;
  std::vector<PendingCommit> commits;
};

std::string Id(SequenceId id) { return std::to_string(id); }

class CudaAgent final : public Agent {
 public:
  CudaAgent(const ModelShape& shape, const KvConfig& config, FullPrecisionSource* source, const CudaAgentOptions& o)
      : shape_(shape), config_(config), source_(source), options_(o), protocol_(shape, config.mode) {
    params_ = {shape.head_dim, config.effective_key_bits(), config.effective_value_bits(), config.group_size,
               config.residual_tokens};
    scale_ = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    compute_ = static_cast<cudaStream_t>(o.stream);
    page_tokens_ = source->page_tokens();
  }
  ~CudaAgent() override;
  Status Init();

  const ModelShape& shape() const override { return shape_; }
  const KvConfig& config() const override { return config_; }
  std::string_view backend_name() const override { return "cuda"; }

  Status AddSequence(SequenceId id) override;
  Status ReleaseSequence(SequenceId id) override;
  Result<int32_t> SequenceLength(SequenceId id) const override { return LengthAt(id, 0); }

  Status PrefillLayer(int layer, const PrefillBatch& batch) override;
  Status BeginStep(StepKind kind, std::span<const SequenceId> sequences) override;
  Status DecodeLayer(int layer, const DecodeRows& rows) override;
  Status StartPrefetch(int layer) override;
  Status WaitPrefetch(int layer) override;
  Status EndStep() override;
  void AbortStep() override;

  Result<std::vector<int32_t>> SelectedTokens(SequenceId id, int layer, int kv_head) const override;
  AgentStats stats() const override;

 private:
  Result<int32_t> LengthAt(SequenceId id, int layer) const {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
    return it->second.replicas[layer][0]->length();
  }
  // Makes the source's pages for tokens [0, tokens) of the sequence visible to the device: new
  // memory regions are registered, new page addresses go to the device page table.
  Status MapPages(SequenceId id, SequenceState* st, int32_t tokens);
  Status RegisterNewRegions();
  // Takes the pool blocks each sequence needs for `tokens` more tokens at every layer and KV head,
  // all or nothing: RESOURCE_EXHAUSTED naming the first sequence that cannot have them, and no
  // sequence keeps a block it took here.
  Status ReserveBlocks(const std::vector<SequenceId>& ids, int32_t tokens);
  // Gives back the blocks that these sequences' replicas hold beyond their length.
  void ReleaseUnused(std::span<const SequenceId> ids);
  Result<uint64_t> DeviceAddress(const uint8_t* host) const;
  const uint64_t* PageTable(const SequenceState& st, int layer) const {
    return st.pages.get() + static_cast<size_t>(layer) * max_pages_;
  }
  // Closes the rows appended since the last call into a batch that commits once an event
  // recorded now on the compute stream has completed.
  Status RecordCommits();
  // Commits the batches whose writes landed, in order; with `wait`, all of them (const: stats()
  // makes the source current too).
  Status CommitLanded(bool wait) const;
  Status WaitForStreams() const;
  // Resident <- selection for these sequences at a layer, on `stream` (compute or fetch).
  Status Fetch(int layer, const std::vector<size_t>& which, cudaStream_t stream);
  // Top-k of each sequence's candidates (probs at probs_offsets) into generation 1 - cur.
  // Softmax statistics of sequence s (of the step), KV head h: [GQA head][2].
  float* ProbsStats(size_t s, int h) {
    return probs_stats_.get() + (s * shape_.n_kv_heads + h) * size_t(shape_.group_size()) * 2;
  }
  Status Select(int layer, const std::vector<int32_t>& candidates);
  // The row-selection rule beyond the plain top-k (selection.h), in functions of their own:
  // kUnion's real-row ranking (a second, one-row attention pass whose probabilities go to
  // real_probs_), its mask-select-merge, the oracle's exact ranking over every full-precision
  // row, and the substituted rows of an item (the selection, or the whole row cache).
  Status RankRealRows(const std::vector<cuda::DeviceDecodeItem>& items);
  Status SelectUnion(int layer, const std::vector<int32_t>& candidates);
  Status RankExactly(int layer, std::vector<cuda::DeviceDecodeItem>* items, cudaStream_t stream);
  void Substitute(const LayerRows& lr, int kv_head, cuda::DeviceDecodeRows* rows) const;
  // Real-row scores of sequence s, KV head h in real_probs_, and their softmax statistics.
  float* RealProbs(size_t s, int h, int32_t n) {
    return real_probs_.get() + probs_offsets_[s] + size_t(h) * shape_.group_size() * n;
  }
  float* RealStats(size_t s, int h) {
    return real_stats_.get() + (s * shape_.n_kv_heads + h) * size_t(shape_.group_size()) * 2;
  }
  Status Attend(const std::vector<cuda::DeviceDecodeItem>& items) {
    return cuda::AttendDecodeBatch(items.data(), static_cast<int>(items.size()), compute_);
  }

  ModelShape shape_;
  KvConfig config_;
  FullPrecisionSource* source_;
  CudaAgentOptions options_;
  StepProtocol protocol_;
  ReplicaParams params_;
  float scale_ = 1.0f;
  int32_t page_tokens_ = 0, max_pages_ = 0;
  std::unique_ptr<cuda::DeviceBlockPool> pool_;  // before sequences_: their replicas give blocks back to it
  std::map<SequenceId, SequenceState> sequences_;
  AgentStats counters_;

  cudaStream_t compute_ = nullptr;  // the engine's stream (options.stream)
  cudaStream_t fetch_ = nullptr;
  std::vector<cudaEvent_t> selected_, fetched_;  // [layer]
  std::vector<PendingCommit> pending_;             // appended since the last RecordCommits
  mutable std::deque<CommitBatch> in_flight_;      // oldest first
  mutable std::vector<cudaEvent_t> free_events_;
  Buffer<cuda::FetchCounters> device_counters_;

  struct Region {
    size_t bytes;
    uint64_t device;
  };
  std::map<const uint8_t*, Region> regions_;  // registered by this agent, by host base

  // Scratch, grown as needed.
  Buffer<float> q_, out_, scores_, probs_, probs_stats_, topk_scratch_;
  Buffer<float> real_probs_, real_stats_, real_out_;  // kUnion: the real row's ranking
  Buffer<int32_t> union_tokens_;                      // kUnion: [segment][primary | extra]
  Buffer<float> real_shifted_;                        // kUnion with real_next: [segment][GQA head][n]
  Buffer<int32_t> every_token_;                       // oracle: 0, 1, 2, ... (every quantized token)
  Buffer<Half> every_row_;                            // oracle: every quantized row of the step's items
  Buffer<Half> k_, v_;
  std::vector<size_t> probs_offsets_;  // per sequence of the step, into probs_
  // probs_ holds raw scores; probs_stats_ [sequence][KV head][GQA head][2] their softmax statistics.
  int64_t counts_selected_ = 0;        // rows selected for fetches (hits and misses: device counters)
};

Status CudaAgent::Init() {
  if (page_tokens_ <= 0) return Status::InvalidArgument("the CUDA agent needs a source with zero-copy pages");
  max_pages_ = (options_.capacity_tokens + page_tokens_ - 1) / page_tokens_;
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&fetch_, cudaStreamNonBlocking), "fetch stream"));
  selected_.assign(shape_.n_layers, nullptr);
  fetched_.assign(shape_.n_layers, nullptr);
  for (int l = 0; l < shape_.n_layers; ++l) {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&selected_[l], cudaEventDisableTiming), "event"));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&fetched_[l], cudaEventDisableTiming), "event"));
  }
  SPECACHE_RETURN_IF_ERROR(device_counters_.Reserve(1));
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemset(device_counters_.get(), 0, sizeof(cuda::FetchCounters)), "counters"));
  SPECACHE_ASSIGN_OR_RETURN(pool_, cuda::DeviceBlockPool::Create(params_, options_.device_pool_bytes));
  return RegisterNewRegions();
}

Status CudaAgent::ReserveBlocks(const std::vector<SequenceId>& ids, int32_t tokens) {
  std::vector<cuda::DeviceHeadReplica*> all;
  for (size_t i = 0; i < ids.size(); ++i) {
    all.clear();
    for (auto& layer : sequences_.at(ids[i]).replicas) {
      for (auto& r : layer) all.push_back(r.get());
    }
    const Status s = cuda::DeviceHeadReplica::Reserve(all, tokens);
    if (!s.ok()) {  // all or nothing per sequence; the ones reserved before it give theirs back too
      ReleaseUnused(std::span<const SequenceId>(ids).first(i));
      return s.WithContext("sequence " + Id(ids[i]) + ": device blocks for " + std::to_string(tokens) + " more tokens");
    }
  }
  return Status::Ok();
}

void CudaAgent::ReleaseUnused(std::span<const SequenceId> ids) {
  for (SequenceId id : ids) {
    for (auto& layer : sequences_.at(id).replicas) {
      for (auto& r : layer) r->ReleaseUnused();
    }
  }
}

CudaAgent::~CudaAgent() {
  // Best effort: rows the device wrote are committed to the source before the agent goes.
  (void)WaitForStreams();
  (void)RecordCommits();
  (void)CommitLanded(true);
  sequences_.clear();
  for (cudaEvent_t e : selected_) if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : fetched_) if (e) cudaEventDestroy(e);
  for (const CommitBatch& b : in_flight_) cudaEventDestroy(b.landed);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  if (fetch_) cudaStreamDestroy(fetch_);
  for (const auto& [host, region] : regions_) (void)cuda::UnregisterHostMemory(const_cast<uint8_t*>(host));
}

Status CudaAgent::WaitForStreams() const {
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(fetch_), "fetch stream"));
  return Cuda(cudaStreamSynchronize(compute_), "compute stream");
}

Status CudaAgent::RegisterNewRegions() {
  for (const HostRegion& r : source_->host_regions()) {
    const auto* base = static_cast<const uint8_t*>(r.base);
    if (regions_.count(base)) continue;
    SPECACHE_ASSIGN_OR_RETURN(uint64_t device, cuda::RegisterHostMemory(r.base, r.bytes));
    regions_[base] = {r.bytes, device};
  }
  return Status::Ok();
}

Result<uint64_t> CudaAgent::DeviceAddress(const uint8_t* host) const {
  auto it = regions_.upper_bound(host);
  if (it != regions_.begin()) {
    --it;
    if (host >= it->first && host < it->first + it->second.bytes) return it->second.device + (host - it->first);
  }
  return Status::Internal("a page of the source lies outside its host regions");
}

Status CudaAgent::MapPages(SequenceId id, SequenceState* st, int32_t tokens) {
  const int32_t need = (tokens + page_tokens_ - 1) / page_tokens_;
  if (need <= st->mapped_pages) return Status::Ok();
  if (need > max_pages_) {
    return Status::OutOfRange("sequence " + Id(id) + " would exceed capacity_tokens (" +
                              std::to_string(options_.capacity_tokens) + ")");
  }
  std::vector<uint8_t*> pages;
  bool registered = false;
  for (int l = 0; l < shape_.n_layers; ++l) {
    SPECACHE_RETURN_IF_ERROR(source_->HostPages(id, l, tokens, &pages).WithContext("source pages"));
    uint64_t* staged = st->pages_host.get() + static_cast<size_t>(l) * max_pages_;
    for (int32_t p = st->mapped_pages; p < need; ++p) {
      auto address = DeviceAddress(pages[p]);
      if (!address.ok() && !registered) {  // the source grew: register its new memory once
        SPECACHE_RETURN_IF_ERROR(RegisterNewRegions());
        registered = true;
        address = DeviceAddress(pages[p]);
      }
      SPECACHE_RETURN_IF_ERROR(address.status());
      staged[p] = *address;
    }
    // Entries are written once, so the staged copy stays valid while the copy is queued.
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(st->pages.get() + static_cast<size_t>(l) * max_pages_ + st->mapped_pages,
                                                  staged + st->mapped_pages, (need - st->mapped_pages) * sizeof(uint64_t),
                                                  cudaMemcpyHostToDevice, compute_),
                                  "page table"));
  }
  st->mapped_pages = need;
  return Status::Ok();
}

Status CudaAgent::RecordCommits() {
  if (pending_.empty()) return Status::Ok();
  CommitBatch batch;
  if (free_events_.empty()) {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&batch.landed, cudaEventDisableTiming), "event"));
  } else {
    batch.landed = free_events_.back();
    free_events_.pop_back();
  }
  const Status recorded = Cuda(cudaEventRecord(batch.landed, compute_), "page writes");
  if (!recorded.ok()) {
    free_events_.push_back(batch.landed);
    return recorded;
  }
  batch.commits.swap(pending_);
  in_flight_.push_back(std::move(batch));
  return Status::Ok();
}

Status CudaAgent::CommitLanded(bool wait) const {
  while (!in_flight_.empty()) {
    CommitBatch& b = in_flight_.front();
    if (wait) {
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(b.landed), "page writes"));
    } else {
      const cudaError_t e = cudaEventQuery(b.landed);
      if (e == cudaErrorNotReady) return Status::Ok();
      SPECACHE_RETURN_IF_ERROR(Cuda(e, "page writes"));
    }
    for (const PendingCommit& c : b.commits) {
      for (int h = 0; h < shape_.n_kv_heads; ++h) {
        SPECACHE_RETURN_IF_ERROR(source_->CommitRows(c.id, c.layer, h, c.first, c.n).WithContext("source"));
      }
    }
    free_events_.push_back(b.landed);
    in_flight_.pop_front();
  }
  return Status::Ok();
}

Status CudaAgent::AddSequence(SequenceId id) {
  if (sequences_.count(id)) return Status::AlreadyExists("sequence " + Id(id) + " is already registered");
  SequenceState st;
  st.replicas.resize(shape_.n_layers);
  for (auto& layer : st.replicas) {
    layer.resize(shape_.n_kv_heads);
    for (auto& r : layer) {
      SPECACHE_ASSIGN_OR_RETURN(r, cuda::DeviceHeadReplica::Create(params_, options_.capacity_tokens, compute_, pool_.get()));
    }
  }
  st.layers = std::vector<LayerRows>(shape_.n_layers);
  const size_t table = static_cast<size_t>(shape_.n_layers) * max_pages_;
  SPECACHE_RETURN_IF_ERROR(st.pages.Reserve(table));
  SPECACHE_RETURN_IF_ERROR(st.pages_host.Reserve(table));
  SPECACHE_RETURN_IF_ERROR(
      source_->CreateSequence(id, {shape_.n_layers, shape_.n_kv_heads, shape_.head_dim}).WithContext("source"));
  sequences_.emplace(id, std::move(st));
  protocol_.AddSequence(id);
  return Status::Ok();
}

Status CudaAgent::ReleaseSequence(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckRelease(id));
  // Nothing in flight may still read its buffers or pages, and its rows are committed first.
  SPECACHE_RETURN_IF_ERROR(WaitForStreams());
  SPECACHE_RETURN_IF_ERROR(RecordCommits());
  SPECACHE_RETURN_IF_ERROR(CommitLanded(true));
  sequences_.erase(it);
  protocol_.RemoveSequence(id);
  return source_->ReleaseSequence(id).WithContext("source");
}

Status CudaAgent::PrefillLayer(int layer, const PrefillBatch& batch) {
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckPrefill(layer, batch, [this](SequenceId id, int l) { return LengthAt(id, l); }));
  const int d = shape_.head_dim, n_kv = shape_.n_kv_heads, n_q = shape_.n_q_heads, group = shape_.group_size();
  const size_t width = size_t(group) * d;
  // A sequence's first prefilled layer takes its blocks at every layer, so that a pool too small
  // refuses it here, before anything of it (or of the batch) changed.
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceState& st = sequences_.at(batch.sequences[s]);
    bool empty = true;
    for (const auto& layer : st.replicas) empty = empty && layer[0]->length() == 0;
    if (!empty) continue;
    const Status reserved =
        ReserveBlocks({batch.sequences[s]}, batch.token_offsets[s + 1] - batch.token_offsets[s]);
    if (!reserved.ok()) {
      ReleaseUnused(batch.sequences.first(s));
      return reserved;
    }
  }
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceId id = batch.sequences[s];
    SequenceState& st = sequences_.at(id);
    const int32_t first = batch.token_offsets[s], n = batch.token_offsets[s + 1] - first;
    SPECACHE_RETURN_IF_ERROR(MapPages(id, &st, n));
    SPECACHE_RETURN_IF_ERROR(k_.Reserve(size_t(n) * d));
    SPECACHE_RETURN_IF_ERROR(v_.Reserve(size_t(n) * d));
    for (int h = 0; h < n_kv; ++h) {  // head by head: prefill is not the hot path
      const size_t kv_at = (size_t(first) * n_kv + h) * d;
      SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(batch.k + kv_at, n, d, int64_t{n_kv} * d, k_.get(), compute_));
      SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(batch.v + kv_at, n, d, int64_t{n_kv} * d, v_.get(), compute_));
      if (batch.out) {
        const size_t q_at = (size_t(first) * n_q + size_t(h) * group) * d, pitch = size_t(n_q) * d * sizeof(float);
        SPECACHE_RETURN_IF_ERROR(q_.Reserve(size_t(n) * width));
        SPECACHE_RETURN_IF_ERROR(out_.Reserve(size_t(n) * width));
        SPECACHE_RETURN_IF_ERROR(scores_.Reserve(static_cast<size_t>(cuda::PrefillScratchFloats(n, group))));
        SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy2DAsync(q_.get(), width * sizeof(float), batch.q + q_at, pitch,
                                                        width * sizeof(float), n, cudaMemcpyDeviceToDevice, compute_),
                                      "prefill queries"));
        SPECACHE_RETURN_IF_ERROR(cuda::AttendPrefill(q_.get(), k_.get(), v_.get(), n, group, d, scale_, out_.get(),
                                                     scores_.get(), compute_));
        SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy2DAsync(batch.out + q_at, pitch, out_.get(), width * sizeof(float),
                                                        width * sizeof(float), n, cudaMemcpyDeviceToDevice, compute_),
                                      "prefill output"));
      }
      const cuda::WriteTask write{k_.get(), v_.get(), PageTable(st, layer), d, 0, n, h};
      SPECACHE_RETURN_IF_ERROR(cuda::WriteRows(&write, 1, d, page_tokens_, compute_));
      SPECACHE_RETURN_IF_ERROR(st.replicas[layer][h]->Append(k_.get(), v_.get(), n));
    }
    pending_.push_back({id, layer, 0, n});
  }
  return RecordCommits();
}

Status CudaAgent::BeginStep(StepKind kind, std::span<const SequenceId> sequences) {
  SPECACHE_RETURN_IF_ERROR(CommitLanded(false));  // no wait: rows still landing commit later
  SPECACHE_RETURN_IF_ERROR(protocol_.Begin(kind, RowsPerSequence(kind), sequences,
                                           [this](SequenceId id, int layer) { return LengthAt(id, layer); }));
  if (kind == StepKind::kDecode) {  // the step appends one token: its pages and blocks must exist
    for (SequenceId id : sequences) {
      SequenceState& st = sequences_.at(id);
      const Status s = MapPages(id, &st, st.replicas[0][0]->length() + 1);
      if (!s.ok()) {
        protocol_.Abort();
        return s;
      }
    }
    const Status s = ReserveBlocks(std::vector<SequenceId>(sequences.begin(), sequences.end()), 1);
    if (!s.ok()) {
      protocol_.Abort();
      return s;
    }
  }
  return Status::Ok();
}

Status CudaAgent::Select(int layer, const std::vector<int32_t>& candidates) {
  if (config_.extra_rows() > 0) return SelectUnion(layer, candidates);
  const int group = shape_.group_size(), n_kv = shape_.n_kv_heads;
  const auto& ids = protocol_.ids();
  size_t scratch = 0;
  for (int32_t n : candidates) scratch += size_t(n_kv) * std::max(n, 0);
  SPECACHE_RETURN_IF_ERROR(topk_scratch_.Reserve(std::max<size_t>(scratch, 1)));
  std::vector<cuda::TopKSegment> segments;
  // kReal with real_next ranks a copy of the scores that credits each token with its predecessor's.
  const bool shift = config_.real_next && config_.mode == KvMode::kSpeCache && config_.select == SelectFrom::kReal;
  std::vector<cuda::ShiftTask> shifts;
  if (shift) SPECACHE_RETURN_IF_ERROR(real_shifted_.Reserve(std::max<size_t>(scratch * group, 1)));
  scratch = 0;
  for (size_t s = 0; s < ids.size(); ++s) {
    LayerRows& lr = sequences_.at(ids[s]).layers[layer];
    const int32_t n = candidates[s];
    const int32_t k = std::max(0, std::min<int32_t>(config_.top_k, n));
    lr.selected = k;
    if (k == 0) continue;
    const int next = 1 - lr.cur;
    SPECACHE_RETURN_IF_ERROR(lr.tokens[next].Reserve(size_t(n_kv) * config_.max_selected()));
    for (int h = 0; h < n_kv; ++h) {  // head h's selection at h * k, as the resident rows are laid out
      float* probs = probs_.get() + probs_offsets_[s] + size_t(h) * group * n;
      if (shift) {
        float* copy = real_shifted_.get() + scratch * group;
        shifts.push_back({probs, copy, n});
        probs = copy;
      }
      segments.push_back({probs, lr.tokens[next].get() + size_t(h) * k, topk_scratch_.get() + scratch, n, ProbsStats(s, h)});
      scratch += n;
    }
  }
  SPECACHE_RETURN_IF_ERROR(cuda::WithPredecessors(shifts.data(), static_cast<int>(shifts.size()), group, compute_));
  return cuda::SelectTopKBatch(segments.data(), static_cast<int>(segments.size()), group, config_.top_k,
                               config_.reduction, compute_);
}

Status CudaAgent::RankRealRows(const std::vector<cuda::DeviceDecodeItem>& items) {
  // Row 0 alone sees the cache and its own token, exactly as it does in the two-row pass, so its
  // scores are the real row's. Outputs go to scratch; the engine's `out` already has them.
  const int n_kv = shape_.n_kv_heads, group = shape_.group_size(), d = shape_.head_dim;
  std::vector<cuda::DeviceDecodeItem> real = items;
  SPECACHE_RETURN_IF_ERROR(real_stats_.Reserve(items.size() * group * 2));
  SPECACHE_RETURN_IF_ERROR(real_out_.Reserve(items.size() * group * d));
  size_t most = 1;
  for (size_t i = 0; i < real.size(); ++i) {
    const size_t s = i / n_kv;
    const int32_t n = real[i].rows.n_candidates;
    most = std::max(most, probs_offsets_[s] + size_t(n_kv) * group * std::max<int32_t>(n, 1));
  }
  SPECACHE_RETURN_IF_ERROR(real_probs_.Reserve(most));
  for (size_t i = 0; i < real.size(); ++i) {
    const size_t s = i / n_kv;
    const int h = static_cast<int>(i % n_kv);
    cuda::DeviceDecodeRows& r = real[i].rows;
    r.n_rows = 1;
    r.probs_row = 0;
    r.out = real_out_.get() + i * group * d;
    r.q_stride = int64_t{group} * d;
    r.probs = r.n_candidates > 0 ? RealProbs(s, h, r.n_candidates) : nullptr;
    r.probs_stats = RealStats(s, h);
  }
  return Attend(real);
}

Status CudaAgent::SelectUnion(int layer, const std::vector<int32_t>& candidates) {
  // selection.h: the primary top-k, then the real row's best extra_rows() others, merged. A
  // segment with no more candidates than both together selects them all.
  const int group = shape_.group_size(), n_kv = shape_.n_kv_heads;
  const int32_t k = config_.top_k, extra = config_.extra_rows();
  const bool pre_decode = protocol_.kind() == StepKind::kPreDecode;  // one row: primary and real
  const auto& ids = protocol_.ids();
  size_t scratch = 0, n_union = 0, shifted = 0;
  for (int32_t n : candidates) {
    scratch += size_t(n_kv) * std::max(n, 0);
    if (n > k + extra) ++n_union, shifted += size_t(n_kv) * group * n;
  }
  SPECACHE_RETURN_IF_ERROR(topk_scratch_.Reserve(std::max<size_t>(scratch, 1)));
  SPECACHE_RETURN_IF_ERROR(union_tokens_.Reserve(std::max<size_t>(n_union * n_kv * (k + extra), 1)));
  if (config_.real_next) SPECACHE_RETURN_IF_ERROR(real_shifted_.Reserve(std::max<size_t>(shifted, 1)));
  std::vector<cuda::TopKSegment> all, primary, others;
  std::vector<cuda::MaskTask> masks;
  std::vector<cuda::MergeTask> merges;
  std::vector<cuda::ShiftTask> shifts;
  scratch = 0;
  shifted = 0;
  size_t slot = 0;
  for (size_t s = 0; s < ids.size(); ++s) {
    LayerRows& lr = sequences_.at(ids[s]).layers[layer];
    const int32_t n = std::max<int32_t>(candidates[s], 0);
    const int next = 1 - lr.cur;
    lr.selected = std::min(n, k + extra);
    if (n == 0) continue;
    SPECACHE_RETURN_IF_ERROR(lr.tokens[next].Reserve(size_t(n_kv) * config_.max_selected()));
    for (int h = 0; h < n_kv; ++h) {
      float* probs = probs_.get() + probs_offsets_[s] + size_t(h) * group * n;
      int32_t* out = lr.tokens[next].get() + size_t(h) * lr.selected;
      float* part = topk_scratch_.get() + scratch;
      scratch += n;
      if (n <= k + extra) {
        all.push_back({probs, out, part, n, ProbsStats(s, h)});
        continue;
      }
      int32_t* mine = union_tokens_.get() + slot;
      slot += k + extra;
      float* real = pre_decode ? probs : RealProbs(s, h, n);
      if (config_.real_next) {  // ranked on a copy that credits each token with its predecessor
        float* copy = real_shifted_.get() + shifted;
        shifted += size_t(group) * n;
        shifts.push_back({real, copy, n});
        real = copy;
      }
      const float* real_stats = pre_decode ? ProbsStats(s, h) : RealStats(s, h);
      primary.push_back({probs, mine, part, n, ProbsStats(s, h)});
      masks.push_back({real, mine, n, k});
      others.push_back({real, mine + k, part, n, real_stats});
      merges.push_back({mine, mine + k, out, k, extra});
    }
  }
  SPECACHE_RETURN_IF_ERROR(cuda::SelectTopKBatch(all.data(), static_cast<int>(all.size()), group, k + extra,
                                                 config_.reduction, compute_));
  SPECACHE_RETURN_IF_ERROR(cuda::SelectTopKBatch(primary.data(), static_cast<int>(primary.size()), group, k,
                                                 config_.reduction, compute_));
  SPECACHE_RETURN_IF_ERROR(cuda::WithPredecessors(shifts.data(), static_cast<int>(shifts.size()), group, compute_));
  SPECACHE_RETURN_IF_ERROR(cuda::MaskTokens(masks.data(), static_cast<int>(masks.size()), group, compute_));
  SPECACHE_RETURN_IF_ERROR(cuda::SelectTopKBatch(others.data(), static_cast<int>(others.size()), group, extra,
                                                 config_.reduction, compute_));
  return cuda::MergeSelections(merges.data(), static_cast<int>(merges.size()), compute_);
}

Status CudaAgent::RankExactly(int layer, std::vector<cuda::DeviceDecodeItem>* items, cudaStream_t stream) {
  // Every quantized row of every item, read from the pages into scratch (not through the row
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
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy(every_token_.get(), iota.data(), iota.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice),
                                  "oracle tokens"));
  }
  SPECACHE_RETURN_IF_ERROR(every_row_.Reserve(rows * row));
  std::vector<cuda::FetchTask> tasks;
  size_t at = 0;
  for (size_t i = 0; i < items->size(); ++i) {
    cuda::DeviceDecodeItem& it = (*items)[i];
    const SequenceState& st = sequences_.at(protocol_.ids()[i / n_kv]);
    cuda::FetchTask t;
    t.selected = every_token_.get();
    t.n_selected = it.replica.quantized_keys;
    t.out_rows = every_row_.get() + at * row;
    t.pages = PageTable(st, layer);
    t.kv_head = static_cast<int>(i % n_kv);
    tasks.push_back(t);
    it.rows.sub_tokens = every_token_.get();
    it.rows.sub_rows = t.out_rows;
    it.rows.n_sub = it.replica.quantized_keys;
    at += static_cast<size_t>(it.replica.quantized_keys);
  }
  return cuda::FetchRows(tasks.data(), static_cast<int>(tasks.size()), shape_.head_dim, page_tokens_,
                         options_.fetch_blocks, nullptr, stream);
}

void CudaAgent::Substitute(const LayerRows& lr, int h, cuda::DeviceDecodeRows* r) const {
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  if (config_.attend_resident) {
    // The whole row cache (it holds the selection); entries past its count are kNoToken.
    const int32_t capacity = lr.fetches > 0 ? config_.cache_rows() : 0;
    r->sub_tokens = capacity ? lr.cache_tokens[lr.cache_cur].get() + size_t(h) * capacity : nullptr;
    r->sub_rows = capacity ? lr.cache_rows[lr.cache_cur].get() + size_t(h) * capacity * row : nullptr;
    r->n_sub = capacity;
    return;
  }
  r->sub_tokens = lr.tokens[lr.cur].get() + size_t(h) * lr.resident;
  r->sub_rows = lr.rows[lr.cur].get() + size_t(h) * lr.resident * row;
  r->n_sub = lr.resident;
}

Status CudaAgent::Fetch(int layer, const std::vector<size_t>& which, cudaStream_t stream) {
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  const int n_kv = shape_.n_kv_heads;
  const int32_t capacity = config_.cache_rows();
  std::vector<cuda::FetchTask> tasks;
  std::vector<cuda::CacheUpdateTask> updates;
  FetchCounts counts;
  for (size_t s : which) {
    SequenceState& st = sequences_.at(protocol_.ids()[s]);
    LayerRows& lr = st.layers[layer];
    const int next = 1 - lr.cur;
    counts.selected += int64_t{lr.selected} * n_kv;
    if (!options_.fetch) {  // measuring without the fetch: nothing becomes resident
      lr.selected = 0;
      continue;
    }
    if (lr.selected > 0) {
      SPECACHE_RETURN_IF_ERROR(lr.rows[next].Reserve(size_t(n_kv) * config_.max_selected() * row));
      if (lr.fetches == 0) {  // the cache starts empty
        for (int g = 0; g < 2; ++g) {
          SPECACHE_RETURN_IF_ERROR(lr.cache_tokens[g].Reserve(size_t(n_kv) * capacity));
          SPECACHE_RETURN_IF_ERROR(lr.cache_used[g].Reserve(size_t(n_kv) * capacity));
          SPECACHE_RETURN_IF_ERROR(lr.cache_rows[g].Reserve(size_t(n_kv) * capacity * row));
          SPECACHE_RETURN_IF_ERROR(lr.cache_count[g].Reserve(n_kv));
          SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemsetAsync(lr.cache_tokens[g].get(), 0x7f,
                                                        size_t(n_kv) * capacity * sizeof(int32_t), stream),
                                        "cache tokens"));  // every entry kNoToken
          SPECACHE_RETURN_IF_ERROR(
              Cuda(cudaMemsetAsync(lr.cache_count[g].get(), 0, n_kv * sizeof(int32_t), stream), "cache counts"));
        }
      }
      const int cc = lr.cache_cur;
      ++lr.fetches;
      for (int h = 0; h < n_kv; ++h) {
        cuda::FetchTask t;
        t.selected = lr.tokens[next].get() + size_t(h) * lr.selected;
        t.n_selected = lr.selected;
        t.resident = lr.cache_tokens[cc].get() + size_t(h) * capacity;
        t.resident_rows = lr.cache_rows[cc].get() + size_t(h) * capacity * row;
        t.resident_count = lr.cache_count[cc].get() + h;
        t.out_rows = lr.rows[next].get() + size_t(h) * lr.selected * row;
        t.pages = PageTable(st, layer);
        t.kv_head = h;
        tasks.push_back(t);
        cuda::CacheUpdateTask u;
        u.old_tokens = t.resident;
        u.old_used = lr.cache_used[cc].get() + size_t(h) * capacity;
        u.old_rows = t.resident_rows;
        u.old_count = t.resident_count;
        u.selected = t.selected;
        u.selected_rows = t.out_rows;
        u.n_selected = lr.selected;
        u.new_tokens = lr.cache_tokens[1 - cc].get() + size_t(h) * capacity;
        u.new_used = lr.cache_used[1 - cc].get() + size_t(h) * capacity;
        u.new_rows = lr.cache_rows[1 - cc].get() + size_t(h) * capacity * row;
        u.new_count = lr.cache_count[1 - cc].get() + h;
        u.now = lr.fetches;
        u.capacity = capacity;
        updates.push_back(u);
      }
      lr.cache_cur = 1 - cc;
    }
    lr.cur = next;
    lr.resident = lr.selected;
    lr.selected = 0;
  }
  // Hits and misses are counted on the device (stats() reads them); the selection here.
  counts_selected_ += counts.selected;
  SPECACHE_RETURN_IF_ERROR(cuda::FetchRows(tasks.data(), static_cast<int>(tasks.size()), shape_.head_dim, page_tokens_,
                                           options_.fetch_blocks, device_counters_.get(), stream));
  return cuda::UpdateRowCaches(updates.data(), static_cast<int>(updates.size()), shape_.head_dim, stream);
}

Status CudaAgent::DecodeLayer(int layer, const DecodeRows& rows) {
  SPECACHE_RETURN_IF_ERROR(protocol_.BeforeDecode(layer));
  if (!rows.q || !rows.k || !rows.v || !rows.out) return Status::InvalidArgument("decode rows have a null tensor");
  const int d = shape_.head_dim, group = shape_.group_size(), n_kv = shape_.n_kv_heads, n_q = shape_.n_q_heads;
  const int n_rows = protocol_.rows();
  const auto& ids = protocol_.ids();
  const size_t n_seq = ids.size(), total_rows = n_seq * n_rows;
  const bool nonspec = config_.selects_for_this_step();  // nonspec, oracle: select, fetch, attend
  const bool selects = config_.fetches_rows();
  const bool appends = protocol_.kind() == StepKind::kDecode;
  const int probs_row = PrimaryRowOf(config_, appends);

  // This layer's rows fetched during the previous step must be resident before its attention.
  if (config_.mode == KvMode::kSpeCache) {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(compute_, fetched_[layer], 0), "wait for the fetch"));
  }
  // The new K/V as fp16, [row][n_kv][d], for every sequence at once.
  SPECACHE_RETURN_IF_ERROR(k_.Reserve(total_rows * n_kv * d));
  SPECACHE_RETURN_IF_ERROR(v_.Reserve(total_rows * n_kv * d));
  SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(rows.k, static_cast<int32_t>(total_rows * n_kv), d, d, k_.get(), compute_));
  SPECACHE_RETURN_IF_ERROR(cuda::FloatRowsToHalf(rows.v, static_cast<int32_t>(total_rows * n_kv), d, d, v_.get(), compute_));

  std::vector<cuda::DeviceDecodeItem> items;
  std::vector<int32_t> candidates(n_seq);
  items.reserve(n_seq * n_kv);
  probs_offsets_.assign(n_seq, 0);
  size_t scratch = 0, probs = 0;
  for (size_t s = 0; s < n_seq; ++s) {
    const SequenceState& st = sequences_.at(ids[s]);
    const cuda::DeviceHeadReplica& rep0 = *st.replicas[layer][0];
    candidates[s] = TopKCandidates(config_, appends, rep0.length(), rep0.quantized_keys());
    probs_offsets_[s] = probs;
    probs += size_t(n_kv) * group * std::max<int32_t>(candidates[s], 1);
    scratch += static_cast<size_t>(cuda::DecodeScratchFloats(rep0.length(), n_rows, group, d)) * n_kv;
  }
  SPECACHE_RETURN_IF_ERROR(scores_.Reserve(scratch));
  SPECACHE_RETURN_IF_ERROR(probs_.Reserve(std::max<size_t>(probs, 1)));
  SPECACHE_RETURN_IF_ERROR(probs_stats_.Reserve(n_seq * n_kv * group * 2));
  scratch = 0;
  for (size_t s = 0; s < n_seq; ++s) {
    const SequenceState& st = sequences_.at(ids[s]);
    const LayerRows& lr = st.layers[layer];
    for (int h = 0; h < n_kv; ++h) {
      const cuda::DeviceHeadReplica& rep = *st.replicas[layer][h];
      cuda::DeviceDecodeItem it;
      it.replica = rep.view();
      cuda::DeviceDecodeRows& r = it.rows;
      const size_t first_row = s * n_rows;
      Substitute(lr, h, &r);
      r.q = rows.q + (first_row * n_q + size_t(h) * group) * d;
      r.out = rows.out + (first_row * n_q + size_t(h) * group) * d;
      r.q_stride = int64_t{n_q} * d;
      r.new_keys = k_.get() + (first_row * n_kv + h) * d;
      r.new_values = v_.get() + (first_row * n_kv + h) * d;
      r.kv_stride = int64_t{n_kv} * d;
      r.n_rows = n_rows;
      r.n_heads = group;
      r.scale = scale_;
      r.probs_row = probs_row;
      r.n_candidates = candidates[s];
      r.probs = selects && candidates[s] > 0 ? probs_.get() + probs_offsets_[s] + size_t(h) * group * candidates[s]
                                             : nullptr;
      r.probs_stats = ProbsStats(s, h);
      r.scratch = scores_.get() + scratch;
      scratch += static_cast<size_t>(cuda::DecodeScratchFloats(rep.length(), n_rows, group, d));
      items.push_back(it);
    }
  }
  if (nonspec) {
    // Select from the plain low-bit attention, fetch now, then attend with the fetched rows.
    std::vector<cuda::DeviceDecodeItem> plain = items;
    for (auto& it : plain) it.rows.n_sub = 0;
    if (config_.mode == KvMode::kSpeCacheOracle) SPECACHE_RETURN_IF_ERROR(RankExactly(layer, &plain, compute_));
    SPECACHE_RETURN_IF_ERROR(Attend(plain));
    SPECACHE_RETURN_IF_ERROR(Select(layer, candidates));
    std::vector<size_t> all(n_seq);
    for (size_t s = 0; s < n_seq; ++s) all[s] = s;
    SPECACHE_RETURN_IF_ERROR(Fetch(layer, all, compute_));
    for (size_t i = 0; i < items.size(); ++i) {
      const LayerRows& lr = sequences_.at(ids[i / n_kv]).layers[layer];
      Substitute(lr, static_cast<int>(i % n_kv), &items[i].rows);
      items[i].rows.probs = nullptr;
    }
    SPECACHE_RETURN_IF_ERROR(Attend(items));
  } else {
    SPECACHE_RETURN_IF_ERROR(Attend(items));
    if (selects && config_.extra_rows() > 0 && n_rows > 1) SPECACHE_RETURN_IF_ERROR(RankRealRows(items));
    if (selects) {
      SPECACHE_RETURN_IF_ERROR(Select(layer, candidates));
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventRecord(selected_[layer], compute_), "selection event"));
    }
  }
  if (appends) {  // the real token (row 0 of each sequence) joins the pages and the replica
    std::vector<cuda::WriteTask> writes;
    std::vector<cuda::DeviceHeadReplica*> replicas;
    std::vector<const Half*> keys, values;
    for (size_t s = 0; s < n_seq; ++s) {
      SequenceState& st = sequences_.at(ids[s]);
      const int32_t at = st.replicas[layer][0]->length();
      for (int h = 0; h < n_kv; ++h) {
        const size_t kv_at = (s * n_rows * n_kv + h) * d;
        writes.push_back({k_.get() + kv_at, v_.get() + kv_at, PageTable(st, layer), d, at, 1, h});
        replicas.push_back(st.replicas[layer][h].get());
        keys.push_back(k_.get() + kv_at);
        values.push_back(v_.get() + kv_at);
      }
      pending_.push_back({ids[s], layer, at, 1});
    }
    SPECACHE_RETURN_IF_ERROR(cuda::WriteRows(writes.data(), static_cast<int>(writes.size()), d, page_tokens_, compute_));
    SPECACHE_RETURN_IF_ERROR(cuda::DeviceHeadReplica::AppendTokens(replicas, keys, values));
  }
  protocol_.AfterDecode(layer);
  return Status::Ok();
}

Status CudaAgent::StartPrefetch(int layer) {
  SPECACHE_ASSIGN_OR_RETURN(std::vector<size_t> which, protocol_.PrefetchList(layer));
  if (!which.empty()) {
    // The fetch stream takes the selection once the layer's top-k is done, and the compute stream
    // goes on with the next layers.
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(fetch_, selected_[layer], 0), "wait for the selection"));
    SPECACHE_RETURN_IF_ERROR(Fetch(layer, which, fetch_));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventRecord(fetched_[layer], fetch_), "fetch event"));
  }
  protocol_.PrefetchStarted(layer, which);
  return Status::Ok();
}

Status CudaAgent::WaitPrefetch(int layer) {
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckLayer(layer));
  // Stream order, not a host wait: work queued on the compute stream from here sees the rows.
  if (config_.mode == KvMode::kSpeCache) {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamWaitEvent(compute_, fetched_[layer], 0), "wait for the fetch"));
  }
  protocol_.Wait(layer);
  return Status::Ok();
}

Status CudaAgent::EndStep() {
  SPECACHE_ASSIGN_OR_RETURN(bool decode, protocol_.End());
  if (decode) ++counters_.steps;
  return RecordCommits();
}

void CudaAgent::AbortStep() {
  protocol_.Abort();
  (void)RecordCommits();  // appends already queued are kept (agent.h)
}

Result<std::vector<int32_t>> CudaAgent::SelectedTokens(SequenceId id, int layer, int kv_head) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return Status::NotFound("sequence " + Id(id) + " is not registered");
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckHead(layer, kv_head));
  const LayerRows& lr = it->second.layers[layer];
  std::vector<int32_t> tokens(static_cast<size_t>(lr.resident));
  if (tokens.empty()) return tokens;
  SPECACHE_RETURN_IF_ERROR(WaitForStreams());
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpy(tokens.data(), lr.tokens[lr.cur].get() + size_t(kv_head) * lr.resident,
                                           tokens.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
                                "selected tokens"));
  return tokens;
}

AgentStats CudaAgent::stats() const {
  AgentStats s = counters_;
  cuda::FetchCounters device{0, 0};
  if (WaitForStreams().ok()) {
    cudaMemcpy(&device, device_counters_.get(), sizeof(device), cudaMemcpyDeviceToHost);
    (void)CommitLanded(true);  // a failure shows at the next call that needs the source
  }
  AddFetchCounts({counts_selected_, static_cast<int64_t>(device.fetched), static_cast<int64_t>(device.reused)},
                 shape_.head_dim, &s);
  const int64_t row = 2 * int64_t{shape_.head_dim} * static_cast<int64_t>(sizeof(Half));
  std::vector<int32_t> cached(static_cast<size_t>(shape_.n_kv_heads));
  s.device_pool_bytes = pool_->reserved_bytes();
  s.device_pool_used_bytes = pool_->used_bytes();
  s.device_bytes_reserved += s.device_pool_bytes;
  for (const auto& [id, seq] : sequences_) {
    s.device_bytes_reserved += seq.pages.bytes();
    for (size_t l = 0; l < seq.replicas.size(); ++l) {
      const LayerRows& lr = seq.layers[l];
      int64_t cache_rows = 0;  // the row caches' sizes live on the device
      if (lr.fetches > 0 && cudaMemcpy(cached.data(), lr.cache_count[lr.cache_cur].get(), cached.size() * sizeof(int32_t),
                                       cudaMemcpyDeviceToHost) == cudaSuccess) {
        for (int32_t c : cached) cache_rows += c;
      }
      s.device_bytes += cache_rows * row;
      for (int g = 0; g < 2; ++g) {
        s.device_bytes_reserved += lr.tokens[g].bytes() + lr.rows[g].bytes() + lr.cache_tokens[g].bytes() +
                                   lr.cache_used[g].bytes() + lr.cache_count[g].bytes() + lr.cache_rows[g].bytes();
      }
      for (const auto& r : seq.replicas[l]) {
        s.device_bytes += r->device_bytes() + int64_t{lr.resident} * row;
        s.device_bytes_reserved += r->fixed_bytes();  // its blocks are in the pool's figure
        s.full_precision_bytes += int64_t{r->length()} * row;
      }
    }
  }
  return s;
}

}  // namespace

Result<std::unique_ptr<Agent>> CreateCudaAgent(const ModelShape& shape, const KvConfig& config,
                                               FullPrecisionSource* source, const CudaAgentOptions& options) {
  SPECACHE_RETURN_IF_ERROR(ValidateKvConfig(config, shape));
  if (source == nullptr) return Status::InvalidArgument("a full-precision source is required");
  if (options.capacity_tokens <= 0) return Status::InvalidArgument("capacity_tokens must be positive");
  if (options.fetch_blocks <= 0) return Status::InvalidArgument("fetch_blocks must be positive");
  if (options.device_pool_bytes < 0) return Status::InvalidArgument("device_pool_bytes must be >= 0");
  if (config.adaptive()) {
    return Status::Unimplemented("the adaptive row budget (mass) runs on the CPU backend only; use a fixed top_k");
  }
  SPECACHE_RETURN_IF_ERROR(ProbeCudaDevice().status());
  auto agent = std::make_unique<CudaAgent>(shape, config, source, options);
  SPECACHE_RETURN_IF_ERROR(agent->Init());
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace specache
