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
//   writes, the replica appends. In specache mode a decode step's page writes (stores over PCIe
//   into pinned host memory: ~8 us a layer at 32 x 8K on an H100, ~13-23 beside the fetch's
//   copies) are queued on the selection's stream after the layer's top-k
//   (CudaAgentOptions::page_writes_after_selection), which the next layer's attention joins: they
//   run beside the engine's products instead of in front of them, for no host call of their own.
// - In specache mode the fetch of layer L runs on the agent's fetch stream, after an event that
//   marks layer L's top-k, and the compute stream waits for it (another event) only at layer L of
//   the next step: later layers never wait for it, and nothing synchronises the device in the
//   decode loop. Rows resident from the previous step are copied on the device, not refetched.
// - Rows written in place are committed to the source (CommitRows) once an event says they
//   landed: EndStep commits the batches already landed without waiting (the step before's by
//   then: a step's rows are committed during the next one, while the GPU still runs it, not at
//   BeginStep, which the GPU waits for); ReleaseSequence, stats() and destruction wait for all.
//   Nothing waits in the decode loop.
// - A source without zero-copy pages (page_tokens() == 0, e.g. client_lib's RemoteSource) is
//   chosen once, at creation, for the staged path: the same calls, selection and overlap, but the
//   rows the fetch misses come from the source through pinned host memory (staged_fetch.h) and the
//   new rows go to it the same way (staged_commit.h). Every call into the source on the data path
//   then runs on one SourceWorker thread, so the thread that enqueues the layers never waits for
//   it, and an error of the source comes back from the next call that waits for that layer
//   (DecodeLayer, WaitPrefetch) or, for appends, from the next BeginStep or ReleaseSequence.
//
// The parts, one job each; this file only sequences them, call by call:
// - DevicePageTable (device_page_table.h): host regions registered with CUDA, page addresses.
// - ReplicaStore (replica_store.h): the low-bit replicas on the shared block pool, reservations.
// - StepPlanner (step_planner.h): a layer's decode items, attention launches and top-k.
// - RowFetcher (row_fetch.h): selection -> fetch of full-precision rows -> row buffers and cache.
// - CommitQueue (commit_queue.h): rows written to the pages, committed once they landed.
// - Staged path only: StagedFetch (inside RowFetcher), StagedCommit (staged_commit.h) and the
//   SourceWorker (../source_worker.h) their source calls run on.
// - FetchVia::kCopyEngine only (a source with pages, specache mode): CopyEngineFetch (inside
//   RowFetcher) and a SourceWorker that runs its host part, the gather of each layer's rows.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "commit_queue.h"
#include "device_buffer.h"
#include "device_page_table.h"
#include "replica_store.h"
#include "row_fetch.h"
#include "specache/agent.h"
#include "specache/cuda_fetch.h"
#include "specache/cuda_replica.h"
#include "specache/cuda_selection.h"
#include "specache/cuda_topk.h"
#include "specache/device_probe.h"
#include "staged_commit.h"
#include "step_planner.h"
#include "../source_worker.h"
#include "../usable_cores.h"
#include "../step_protocol.h"

namespace specache {
namespace {

std::string Id(SequenceId id) { return std::to_string(id); }

ReplicaParams ReplicaParamsOf(const ModelShape& shape, const KvConfig& config) {
  return {shape.head_dim, config.effective_key_bits(), config.effective_value_bits(), config.group_size,
          config.residual_tokens};
}

class CudaAgent final : public Agent {
 public:
  CudaAgent(const ModelShape& shape, const KvConfig& config, FullPrecisionSource* source, const CudaAgentOptions& o)
      : shape_(shape),
        config_(config),
        source_(source),
        options_(o),
        protocol_(shape, config),
        compute_(static_cast<cudaStream_t>(o.stream)),
        usable_cores_(UsableCores()),
        commits_(source, shape.n_kv_heads),
        pages_(source, shape.n_layers, o.capacity_tokens, config.host_row_format, compute_),
        replicas_(shape, ReplicaParamsOf(shape, config), o.capacity_tokens, compute_, o.mma_codes),
        rows_(shape, config, o, &pages_, compute_),
        planner_(shape, config, o, usable_cores_, &protocol_, &replicas_, &rows_, &pages_, compute_) {}
  ~CudaAgent() override;
  Status Init();

  const ModelShape& shape() const override { return shape_; }
  const KvConfig& config() const override { return config_; }
  std::string_view backend_name() const override { return "cuda"; }

  Status AddSequence(SequenceId id) override;
  Status ReleaseSequence(SequenceId id) override;
  Result<int32_t> SequenceLength(SequenceId id) const override { return replicas_.Length(id, 0); }

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
  // The real token of each sequence of the step (its row 0) joins the pages and the replica.
  Status AppendRealTokens(int layer);
  // The step's sequences at these indices of protocol_.ids().
  std::vector<SequenceId> StepSequences(const std::vector<size_t>& which) const;
  Status WaitForStreams() const;
  // The new rows of some (sequence, layer, KV head)s, writes[i] of sequences[i]: into the pages
  // (local; noted for commit per sequence by the caller with NoteWritten, closed into a batch by
  // RecordWrites) or staged and handed to the worker for the source at once.
  // Local pages: queued on `stream` with `plan` (the compute stream's, or the selection stream's).
  Status WriteNewRows(int layer, std::span<const cuda::WriteTask> writes, std::span<const SequenceId> sequences,
                      cudaStream_t stream, cuda::DecodePlan* plan);
  void NoteWritten(SequenceId id, int layer, int32_t first, int32_t n);
  // The writes queued so far closed into a commit batch, behind the compute stream (which first
  // joins a pending selection: the page writes queued after it).
  Status RecordWrites();
  // The rows written so far committed to the source (local) or their appends' first error (staged).
  Status CommitWritten(bool wait) const;

  ModelShape shape_;
  KvConfig config_;
  FullPrecisionSource* source_;
  CudaAgentOptions options_;
  StepProtocol protocol_;
  AgentStats counters_;
  cudaStream_t compute_ = nullptr;  // the engine's stream (options.stream)
  // The logical cores this process may use (UsableCores; 0: not known), read once for the
  // planner's threads and the copy-engine fetch's gather threads.
  int usable_cores_ = 0;
  // The parts, declared so that each outlives the ones after it that read it. commits_ is
  // mutable: stats() commits the rows that landed, so that the source agrees with its figures.
  mutable cuda::CommitQueue commits_;
  cuda::DevicePageTable pages_;
  cuda::ReplicaStore replicas_;
  cuda::RowFetcher rows_;
  cuda::StepPlanner planner_;
  // The page writes' task lists (WriteNewRows, on the agent's thread), read in place: a copy on
  // the compute stream's path could queue behind the fetch's on the copy engine.
  cuda::DecodePlan writes_plan_{cuda::DecodePlan::SlotReads::kInPlace};
  // The same for the page writes on the selection's stream (a plan's slots are released by one
  // event per group of calls only while all its calls come on one stream).
  cuda::DecodePlan selection_writes_plan_{cuda::DecodePlan::SlotReads::kInPlace};
  // Staged path only (null otherwise); the worker also for the copy-engine fetch. The worker is
  // last, so that it goes first: its destructor runs the jobs still queued, which use the parts
  // above.
  std::unique_ptr<cuda::StagedCommit> staged_commits_;
  std::unique_ptr<SourceWorker> worker_;
};

Status CudaAgent::Init() {
  // The worker of the staged path and of the copy-engine fetch, on this thread's device.
  auto make_worker = [this]() -> Status {
    int device = 0;
    SPECACHE_RETURN_IF_ERROR(cuda::CudaStatus(cudaGetDevice(&device), "device"));
    worker_ = std::make_unique<SourceWorker>([device] { return cuda::CudaStatus(cudaSetDevice(device), "worker's device"); });
    return Status::Ok();
  };
  if (pages_.page_tokens() <= 0) {  // no pages to map: the staged path, chosen here once
    SPECACHE_RETURN_IF_ERROR(make_worker());
    staged_commits_ = std::make_unique<cuda::StagedCommit>(source_, shape_.head_dim, worker_.get());
    rows_.UseStagedSource(source_, worker_.get());
  } else if (options_.fetch_via == FetchVia::kCopyEngine && config_.mode == KvMode::kSpeCache) {
    SPECACHE_RETURN_IF_ERROR(make_worker());
    rows_.UseCopyEngine(worker_.get(), usable_cores_);
  }
  SPECACHE_RETURN_IF_ERROR(rows_.Init());
  SPECACHE_RETURN_IF_ERROR(replicas_.Init(options_.device_pool_bytes));
  return pages_.RegisterNewRegions();
}

CudaAgent::~CudaAgent() {
  // Best effort: rows the device wrote are committed to the source before the agent goes, and
  // then, nothing in flight reading their pages any more, every sequence still registered is
  // released in the source (best effort: StepProtocol::ReleaseAllIn). The parts then free their
  // memory, events and streams, the last declared first.
  (void)WaitForStreams();
  (void)RecordWrites();
  (void)CommitWritten(true);
  protocol_.ReleaseAllIn(source_);
}

Status CudaAgent::WaitForStreams() const {
  // Every stream is waited for even after one failed (the destructor frees what they use); the
  // first error is returned.
  const Status selection = planner_.WaitForSelection();
  const Status fetch = rows_.WaitForFetchStream();
  const Status compute = cuda::CudaStatus(cudaStreamSynchronize(compute_), "compute stream");
  if (!selection.ok()) return selection;
  if (!fetch.ok()) return fetch;
  return compute;
}

Status CudaAgent::WriteNewRows(int layer, std::span<const cuda::WriteTask> writes, std::span<const SequenceId> sequences,
                               cudaStream_t stream, cuda::DecodePlan* plan) {
  if (staged_commits_) {
    // Handed to the worker at once, not at the step's end: a fetch started after this layer may
    // select these rows (when the append fills the residual), and the worker runs it after them.
    SPECACHE_RETURN_IF_ERROR(staged_commits_->Stage(layer, writes, sequences, compute_));
    return staged_commits_->Record(compute_);
  }
  return cuda::WriteRows(writes.data(), static_cast<int>(writes.size()), shape_.head_dim, pages_.row_format(),
                         pages_.page_tokens(), stream, plan);
}

void CudaAgent::NoteWritten(SequenceId id, int layer, int32_t first, int32_t n) {
  if (!staged_commits_) commits_.Add(id, layer, first, n);  // staged rows carry their own appends
}

Status CudaAgent::RecordWrites() {
  if (staged_commits_) return staged_commits_->Record(compute_);
  SPECACHE_RETURN_IF_ERROR(planner_.JoinSelection());  // nothing when joined already (EndStep, AbortStep)
  return commits_.Record(compute_);
}

Status CudaAgent::CommitWritten(bool wait) const {
  return staged_commits_ ? staged_commits_->CommitLanded(wait) : commits_.CommitLanded(wait);
}

std::vector<SequenceId> CudaAgent::StepSequences(const std::vector<size_t>& which) const {
  std::vector<SequenceId> ids;
  ids.reserve(which.size());
  for (size_t s : which) ids.push_back(protocol_.ids()[s]);
  return ids;
}

Status CudaAgent::AddSequence(SequenceId id) {
  if (replicas_.Contains(id)) return Status::AlreadyExists("sequence " + Id(id) + " is already registered");
  SPECACHE_RETURN_IF_ERROR(replicas_.AddSequence(id));
  Status added = pages_.AddSequence(id);
  if (added.ok()) {
    added = source_->CreateSequence(id, {shape_.n_layers, shape_.n_kv_heads, shape_.head_dim, pages_.row_format()})
                .WithContext("source");
  }
  if (!added.ok()) {  // nothing of the sequence stays
    pages_.RemoveSequence(id);
    replicas_.RemoveSequence(id);
    return added;
  }
  rows_.AddSequence(id);
  protocol_.AddSequence(id);
  return Status::Ok();
}

Status CudaAgent::ReleaseSequence(SequenceId id) {
  if (!replicas_.Contains(id)) return Status::NotFound("sequence " + Id(id) + " is not registered");
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckRelease(id));
  // Nothing in flight may still read its buffers or pages, and its rows are committed first.
  SPECACHE_RETURN_IF_ERROR(WaitForStreams());
  SPECACHE_RETURN_IF_ERROR(RecordWrites());
  SPECACHE_RETURN_IF_ERROR(CommitWritten(true));
  rows_.RemoveSequence(id);
  replicas_.RemoveSequence(id);
  pages_.RemoveSequence(id);
  protocol_.RemoveSequence(id);
  return source_->ReleaseSequence(id).WithContext("source");
}

Status CudaAgent::PrefillLayer(int layer, const PrefillBatch& batch) {
  SPECACHE_RETURN_IF_ERROR(
      protocol_.CheckPrefill(layer, batch, [this](SequenceId id, int l) { return replicas_.Length(id, l); }));
  // The planner rewrites its rows below: the last decode step's page writes read them first
  // (joined at its end already, unless that failed).
  SPECACHE_RETURN_IF_ERROR(planner_.JoinSelection());
  const int d = shape_.head_dim, n_kv = shape_.n_kv_heads;
  // (seed_rows is specache's only, ValidateKvConfig; measured without the fetch nothing becomes resident.)
  const bool seeds = config_.seed_rows > 0 && options_.fetch;
  // What may run out is taken for the whole batch before anything of it is written, so that such
  // a failure leaves every sequence as it was (the batch may be retried): a sequence's first
  // prefilled layer takes its blocks at every layer (a pool too small refuses it here; only the
  // blocks taken by this call are given back), then every sequence's pages are mapped (a source
  // out of room refuses here; pages mapped for earlier sequences stay, for their retry).
  std::vector<SequenceId> reserved_now;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    if (!replicas_.Empty(batch.sequences[s])) continue;
    const Status reserved =
        replicas_.Reserve(batch.sequences.subspan(s, 1), batch.token_offsets[s + 1] - batch.token_offsets[s]);
    if (!reserved.ok()) {
      replicas_.ReleaseUnused(reserved_now);
      return reserved;
    }
    reserved_now.push_back(batch.sequences[s]);
  }
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const Status mapped = pages_.Map(batch.sequences[s], batch.token_offsets[s + 1] - batch.token_offsets[s]);
    if (!mapped.ok()) {
      replicas_.ReleaseUnused(reserved_now);
      return mapped;
    }
  }
  // From here a failure (CUDA's, the source's appends) leaves the batch part-way: its sequences
  // must be released.
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceId id = batch.sequences[s];
    const int32_t first = batch.token_offsets[s], n = batch.token_offsets[s + 1] - first;
    SPECACHE_RETURN_IF_ERROR(planner_.PrefillSequence(batch, first, n));
    // KvConfig::seed_rows: the layer's row cache starts with the quantized tokens the prompt's last
    // token attends most (seed_rows.h), seeded from here beside the page writes and appends below.
    if (seeds) SPECACHE_RETURN_IF_ERROR(rows_.SeedFrom(id, layer, n));  // reserves first: fails before any write
    std::vector<cuda::WriteTask> writes;
    for (int h = 0; h < n_kv; ++h) {
      writes.push_back({planner_.prefill_keys(h), planner_.prefill_values(h), pages_.Layer(id, layer), d, 0, n, h});
    }
    SPECACHE_RETURN_IF_ERROR(WriteNewRows(layer, writes, std::vector<SequenceId>(n_kv, id), compute_, &writes_plan_));
    for (int h = 0; h < n_kv; ++h) {
      SPECACHE_RETURN_IF_ERROR(replicas_.Layer(id, layer)[h]->Append(planner_.prefill_keys(h), planner_.prefill_values(h), n));
    }
    NoteWritten(id, layer, 0, n);
    if (seeds) {
      const float* last_q = batch.q + size_t(first + n - 1) * shape_.n_q_heads * d;
      SPECACHE_RETURN_IF_ERROR(rows_.Seed(id, layer, last_q, planner_.prefill_keys(0), planner_.prefill_values(0), n,
                                          replicas_.Layer(id, layer)[0]->quantized_keys(), planner_.scale()));
    }
  }
  return RecordWrites();
}

Status CudaAgent::BeginStep(StepKind kind, std::span<const SequenceId> sequences) {
  // The rows' commits since the last step that failed, reported once, here: with local pages a
  // commit the source refused (EndStep commits them), on the staged path an append (CommitWritten
  // waits for nothing).
  SPECACHE_RETURN_IF_ERROR(staged_commits_ ? CommitWritten(false) : commits_.TakeError());
  SPECACHE_RETURN_IF_ERROR(protocol_.Begin(kind, RowsPerSequence(kind), sequences,
                                           [this](SequenceId id, int layer) { return replicas_.Length(id, layer); }));
  if (kind == StepKind::kDecode) {  // the step appends one token: its pages and blocks must exist
    for (SequenceId id : sequences) {
      const Status s = pages_.Map(id, replicas_.Layer(id, 0)[0]->length() + 1);
      if (!s.ok()) {
        protocol_.Abort();
        return s;
      }
    }
    const Status s = replicas_.Reserve(sequences, 1);
    if (!s.ok()) {
      protocol_.Abort();
      return s;
    }
  }
  return Status::Ok();
}

Status CudaAgent::DecodeLayer(int layer, const DecodeRows& rows) {
  SPECACHE_RETURN_IF_ERROR(protocol_.BeforeDecode(layer));
  if (!rows.q || !rows.k || !rows.v || !rows.out) return Status::InvalidArgument("decode rows have a null tensor");
  // This layer's rows fetched during the previous step must be resident before its attention.
  if (config_.mode == KvMode::kSpeCache) SPECACHE_RETURN_IF_ERROR(rows_.WaitFetched(layer));
  SPECACHE_ASSIGN_OR_RETURN(cuda::LayerPlan plan, planner_.Plan(layer, rows));
  if (config_.selects_for_this_step()) {
    // nonspec, oracle: select from the plain low-bit attention, fetch now, then attend with the
    // fetched rows.
    SPECACHE_RETURN_IF_ERROR(planner_.AttendPlainAndSelect(layer, plan));
    SPECACHE_RETURN_IF_ERROR(rows_.Fetch(layer, protocol_.ids(), compute_));
    SPECACHE_RETURN_IF_ERROR(planner_.AttendWithFetchedRows(layer, &plan));
  } else {
    SPECACHE_RETURN_IF_ERROR(planner_.AttendAndSelect(layer, &plan));  // marks the fetch's start (MarkSelected)
    SPECACHE_RETURN_IF_ERROR(rows_.JoinFetch());  // FetchOverlap::kWithinNextAttention
  }
  if (protocol_.kind() == StepKind::kDecode) SPECACHE_RETURN_IF_ERROR(AppendRealTokens(layer));
  protocol_.AfterDecode(layer);
  return Status::Ok();
}

Status CudaAgent::AppendRealTokens(int layer) {
  const int d = shape_.head_dim, n_kv = shape_.n_kv_heads, n_rows = protocol_.rows();
  const auto& ids = protocol_.ids();
  const Half* k = planner_.new_keys();
  const Half* v = planner_.new_values();
  std::vector<cuda::WriteTask> writes;
  std::vector<SequenceId> owners;  // [writes]
  std::vector<cuda::DeviceHeadReplica*> replicas;
  std::vector<const Half*> keys, values;
  const size_t n = ids.size() * n_kv;  // one allocation each, not one per doubling
  writes.reserve(n), owners.reserve(n), replicas.reserve(n), keys.reserve(n), values.reserve(n);
  for (size_t s = 0; s < ids.size(); ++s) {
    cuda::ReplicaStore::Heads& heads = replicas_.Layer(ids[s], layer);
    const uint64_t* pages = pages_.Layer(ids[s], layer);
    const int32_t at = heads[0]->length();
    for (int h = 0; h < n_kv; ++h) {
      const size_t kv_at = (s * n_rows * n_kv + h) * d;
      writes.push_back({k + kv_at, v + kv_at, pages, d, at, 1, h});
      owners.push_back(ids[s]);
      replicas.push_back(heads[h].get());
      keys.push_back(k + kv_at);
      values.push_back(v + kv_at);
    }
    NoteWritten(ids[s], layer, at, 1);
  }
  // The page writes after the layer's top-k on its stream, beside the compute stream (local pages,
  // specache with the selection on its own stream): that stream already follows the attention,
  // which follows the rows' conversion, and the next attention joins it (after the next Plan wrote
  // the planner's other pair of rows). Nothing queued after them here reads the pages.
  const cudaStream_t beside =
      options_.page_writes_after_selection && !staged_commits_ && config_.mode == KvMode::kSpeCache
          ? planner_.pending_selection_stream()
          : nullptr;
  const cudaStream_t writes_stream = beside ? beside : compute_;
  const Status written =
      WriteNewRows(layer, writes, owners, writes_stream, beside ? &selection_writes_plan_ : &writes_plan_);
  if (!written.ok()) {
    if (beside) cudaStreamSynchronize(beside);  // what was queued of them ends before any join
    return written;
  }
  // The layer's next fetch may select the row just written (a filled residual): it waits for this.
  if (config_.mode == KvMode::kSpeCache) {
    const Status marked = rows_.MarkAppended(layer, writes_stream);
    if (beside) {
      // The next join waits for the writes too; without their event the host waits for them here.
      if (marked.ok()) {
        planner_.JoinSelectionAt(rows_.append_done(layer));
      } else {
        cudaStreamSynchronize(beside);
      }
    }
    SPECACHE_RETURN_IF_ERROR(marked);
  }
  return cuda::DeviceHeadReplica::AppendTokens(replicas, keys, values);
}

Status CudaAgent::StartPrefetch(int layer) {
  SPECACHE_ASSIGN_OR_RETURN(std::vector<size_t> which, protocol_.PrefetchList(layer));
  if (!which.empty()) SPECACHE_RETURN_IF_ERROR(rows_.StartFetch(layer, StepSequences(which)));
  protocol_.PrefetchStarted(layer, which);
  return Status::Ok();
}

Status CudaAgent::WaitPrefetch(int layer) {
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckLayer(layer));
  // Stream order, not a host wait: work queued on the compute stream from here sees the rows.
  if (config_.mode == KvMode::kSpeCache) SPECACHE_RETURN_IF_ERROR(rows_.WaitFetched(layer));
  protocol_.Wait(layer);
  return Status::Ok();
}

Status CudaAgent::EndStep() {
  SPECACHE_ASSIGN_OR_RETURN(bool decode, protocol_.End());
  if (decode) ++counters_.steps;
  SPECACHE_RETURN_IF_ERROR(planner_.JoinSelection());  // the step's last selection behind the engine's stream
  SPECACHE_RETURN_IF_ERROR(RecordWrites());
  // The rows whose page writes landed (the step before's, by now) are committed here, while the
  // GPU still runs this step's last layers: at BeginStep the GPU waited for them (at 176 x 8K, int8
  // rows, a step's 5632 commits were ~60% of BeginStep's host time). No wait: the rows of this
  // step commit at the next EndStep.
  if (!staged_commits_) SPECACHE_RETURN_IF_ERROR(commits_.CommitLanded(false));
  return Status::Ok();
}

void CudaAgent::AbortStep() {
  protocol_.Abort();
  (void)planner_.JoinSelection();
  (void)RecordWrites();  // appends already queued are kept (agent.h)
}

Result<std::vector<int32_t>> CudaAgent::SelectedTokens(SequenceId id, int layer, int kv_head) const {
  if (!replicas_.Contains(id)) return Status::NotFound("sequence " + Id(id) + " is not registered");
  SPECACHE_RETURN_IF_ERROR(protocol_.CheckHead(layer, kv_head));
  std::vector<int32_t> tokens(static_cast<size_t>(rows_.resident(id, layer)));
  if (tokens.empty()) return tokens;
  SPECACHE_RETURN_IF_ERROR(WaitForStreams());
  SPECACHE_RETURN_IF_ERROR(rows_.CopyResidentTokens(id, layer, kv_head, &tokens));
  return tokens;
}

AgentStats CudaAgent::stats() const {
  // Waits for the device (agent.h): the fetch's hits and misses and the row caches' sizes are
  // known on the device only, and the rows whose page writes landed are committed first so that
  // the source agrees with full_precision_bytes.
  AgentStats s = counters_;
  cuda::FetchCounters device{0, 0, 0};
  if (WaitForStreams().ok()) {
    device = rows_.DeviceCounters();
    // A failure shows at the next call that needs the source. Staged appends ran already (the
    // worker is idle after WaitForStreams); their error stays for the next BeginStep.
    if (!staged_commits_) (void)commits_.CommitLanded(true);  // its refused commits' error stays for BeginStep
  }
  s.commits_failed = commits_.failed();
  // The adaptive budget's and the merged unions' rows are counted on the device (device.selected),
  // the others on the host.
  AddFetchCounts({rows_.rows_selected() + static_cast<int64_t>(device.selected), static_cast<int64_t>(device.fetched),
                  static_cast<int64_t>(device.reused)},
                 HostRowBytes(pages_.row_format(), shape_.head_dim), &s);
  replicas_.AddStats(&s);
  rows_.AddStats(&s);
  s.device_bytes_reserved += pages_.device_bytes();
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
  if (options.fetch_copy_piece_bytes < 0) return Status::InvalidArgument("fetch_copy_piece_bytes must be >= 0");
  if (!(options.fetch_sm_share >= 0.0 && options.fetch_sm_share <= 1.0)) {
    return Status::InvalidArgument("fetch_sm_share must be in [0, 1]");
  }
  if (options.plan_threads < 1) return Status::InvalidArgument("plan_threads must be at least 1");
  if (config.round_host_rows != HostRowRounding::kNone) {
    return Status::Unimplemented("round_host_rows (8-bit host rows, a fidelity measure) runs on the CPU agent only");
  }
  SPECACHE_RETURN_IF_ERROR(cuda::CheckKernelRows(config.host_row_format, shape.head_dim).WithContext("the CUDA agent"));
  if (config.adaptive() && config.k_max > cuda::kMaxBudgetRows) {
    return Status::InvalidArgument("the CUDA adaptive budget takes k_max up to " + std::to_string(cuda::kMaxBudgetRows));
  }
  if (config.extra_rows() > 0 && config.max_selected() > cuda::kMaxMergedRows) {
    return Status::InvalidArgument("the CUDA union's merge takes up to " + std::to_string(cuda::kMaxMergedRows) +
                                   " rows (top_k, or k_max with the budget, plus the real row's top_k_real, or "
                                   "top_k when 0), not " + std::to_string(config.max_selected()));
  }
  if (config.fetches_rows() && config.cache_rows() > cuda::kMaxCacheRows) {
    return Status::InvalidArgument("the CUDA row cache holds up to " + std::to_string(cuda::kMaxCacheRows) +
                                   " rows per (sequence, layer, KV head), not " + std::to_string(config.cache_rows()) +
                                   " (cached_rows, or 2 x the rows selected)");
  }
  SPECACHE_RETURN_IF_ERROR(ProbeCudaDevice().status());
  auto agent = std::make_unique<CudaAgent>(shape, config, source, options);
  SPECACHE_RETURN_IF_ERROR(agent->Init());
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace specache
