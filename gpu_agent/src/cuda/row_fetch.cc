#include "row_fetch.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>

#include "seed_rows.h"
#include "../page_row_gather.h"
#include "../step_protocol.h"

namespace specache::cuda {

RowFetcher::RowFetcher(const ModelShape& shape, const KvConfig& config, const CudaAgentOptions& options,
                       const DevicePageTable* pages, cudaStream_t compute)
    : shape_(shape), config_(config), options_(options), pages_(pages), compute_(compute) {}

RowFetcher::~RowFetcher() {
  // The fetch and seed streams' kernels read the plans' slots and write the buffers below: done first.
  if (fetch_) cudaStreamSynchronize(fetch_);
  if (sm_fetch_) cudaStreamSynchronize(sm_fetch_);
  if (seed_) cudaStreamSynchronize(seed_);
  staged_worker_.reset();  // each waits for its last copy out of its pinned memory
  staged_inline_.reset();
  copy_engine_.reset();
  rows_.clear();
  spare_lists_.clear();
  fetched_rows_.clear();
  for (cudaEvent_t e : selected_) if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : fetched_) if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : appended_) if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : sm_fetched_) if (e) cudaEventDestroy(e);
  if (deferred_start_) cudaEventDestroy(deferred_start_);
  if (seed_) cudaStreamDestroy(seed_);
  if (seed_from_) cudaEventDestroy(seed_from_);
  if (seeded_) cudaEventDestroy(seeded_);
  if (sm_start_) cudaEventDestroy(sm_start_);
  if (sm_tail_) cudaEventDestroy(sm_tail_);
  if (sm_fetch_) cudaStreamDestroy(sm_fetch_);
  if (fetch_) cudaStreamDestroy(fetch_);
}

Status RowFetcher::Init() {
  // The fetch of layer l + 1's rows runs beside layer l + 1's kernels: its blocks are scheduled
  // first when SM slots free up (the highest priority), and the attention's one-wave plan leaves
  // it its slots (StepPlanner).
  int least_priority = 0, greatest_priority = 0;
  SPECACHE_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetStreamPriorityRange(&least_priority, &greatest_priority), "stream priorities"));
  SPECACHE_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithPriority(&fetch_, cudaStreamNonBlocking, greatest_priority), "fetch stream"));
  selected_.assign(shape_.n_layers, nullptr);
  fetched_.assign(shape_.n_layers, nullptr);
  appended_.assign(shape_.n_layers, nullptr);
  selected_on_.assign(shape_.n_layers, nullptr);
  writes_follow_selection_.assign(shape_.n_layers, 0);
  joined_.assign(shape_.n_layers, 0);
  for (int l = 0; l < shape_.n_layers; ++l) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&appended_[l], cudaEventDisableTiming), "event"));
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&selected_[l], cudaEventDisableTiming), "event"));
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&fetched_[l], cudaEventDisableTiming), "event"));
  }
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&deferred_start_, cudaEventDisableTiming), "event"));
  if (staged_source_) {
    staged_worker_ = std::make_unique<StagedFetch>(staged_source_, shape_.head_dim);
    staged_inline_ = std::make_unique<StagedFetch>(staged_source_, shape_.head_dim);
    handed_.assign(shape_.n_layers, {});
  }
  if (copy_engine_threads_ > 0) {
    copy_engine_ = std::make_unique<CopyEngineFetch>(shape_.head_dim, pages_->row_format(), pages_->page_tokens(),
                                                     copy_engine_threads_, options_.fetch_copy_piece_bytes,
                                                     options_.fetch_streaming_stores, options_.fetch_gather_spin_us);
    if (options_.fetch_sm_share > 0) {  // its blocks are scheduled first, as the fetch stream's
      SPECACHE_RETURN_IF_ERROR(
          CudaStatus(cudaStreamCreateWithPriority(&sm_fetch_, cudaStreamNonBlocking, greatest_priority), "fetch stream"));
      SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&sm_start_, cudaEventDisableTiming), "event"));
      SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&sm_tail_, cudaEventDisableTiming), "event"));
      sm_fetched_.assign(shape_.n_layers, nullptr);
      for (cudaEvent_t& e : sm_fetched_) {
        SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event"));
      }
    }
    handed_.assign(shape_.n_layers, {});
  }
  SPECACHE_RETURN_IF_ERROR(device_counters_.Reserve(1));
  return CudaStatus(cudaMemset(device_counters_.get(), 0, sizeof(FetchCounters)), "counters");
}

void RowFetcher::UseStagedSource(FullPrecisionSource* source, SourceWorker* worker) {
  staged_source_ = source;
  worker_ = worker;
}

Status RowFetcher::CacheList::Reserve(int n_kv, int32_t capacity) {
  const size_t entries = size_t(n_kv) * capacity;
  SPECACHE_RETURN_IF_ERROR(tokens.Reserve(entries));
  SPECACHE_RETURN_IF_ERROR(used.Reserve(entries));
  SPECACHE_RETURN_IF_ERROR(slots.Reserve(entries));
  return count.Reserve(n_kv);
}

int64_t RowFetcher::CacheList::bytes() const { return tokens.bytes() + used.bytes() + slots.bytes() + count.bytes(); }

void RowFetcher::UseCopyEngine(SourceWorker* worker, int usable_cores) {
  worker_ = worker;
  copy_engine_threads_ = GatherThreadsFor(options_.fetch_threads, usable_cores);
}

void RowFetcher::AddSequence(SequenceId id) { rows_.emplace(id, std::vector<LayerRows>(shape_.n_layers)); }

void RowFetcher::RemoveSequence(SequenceId id) {
  rows_.erase(id);
  // A failed overlapped fetch's error waits with the worker for its layer's next WaitFetched, to
  // fail the step of the sequences it fetched for (handed_). Once they are all gone, it is
  // nobody's: it is dropped, instead of failing an unrelated batch's step. (The caller waited for
  // the worker first: the jobs that could fail have run.)
  for (size_t layer = 0; layer < handed_.size(); ++layer) {
    std::vector<SequenceId>& ids = handed_[layer];
    if (ids.empty()) continue;
    ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
    if (ids.empty() && worker_) (void)worker_->TakeError(static_cast<int>(layer));
  }
}

Status RowFetcher::ReserveCache(LayerRows* lr) const {
  const int n_kv = shape_.n_kv_heads;
  const int32_t capacity = config_.cache_rows();
  SPECACHE_RETURN_IF_ERROR(lr->cache.Reserve(n_kv, capacity));
  return lr->cache_rows.Reserve(size_t(n_kv) * capacity * 2 * shape_.head_dim);
}

Status RowFetcher::SeedFrom(SequenceId id, int layer, int32_t n) {
  if (!seed_) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&seed_, cudaStreamNonBlocking), "seed stream"));
  if (!seed_from_) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&seed_from_, cudaEventDisableTiming), "event"));
  if (!seeded_) SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&seeded_, cudaEventDisableTiming), "event"));
  SPECACHE_RETURN_IF_ERROR(ReserveCache(&rows_.at(id)[layer]));
  SPECACHE_RETURN_IF_ERROR(seed_logits_.Reserve(size_t(shape_.n_kv_heads) * SeedScratchFloats(shape_.group_size(), n)));
  return CudaStatus(cudaEventRecord(seed_from_, compute_), "seed start event");
}

Status RowFetcher::Seed(SequenceId id, int layer, const float* last_q, const Half* keys, const Half* values, int32_t n,
                        int32_t candidates, float scale) {
  if (!seeded_) return Status::FailedPrecondition("seed rows: Seed without SeedFrom");
  LayerRows& lr = rows_.at(id)[layer];
  const int n_kv = shape_.n_kv_heads, group = shape_.group_size(), d = shape_.head_dim;
  const int32_t capacity = config_.cache_rows();
  std::vector<SeedTask> tasks(static_cast<size_t>(n_kv));
  for (int h = 0; h < n_kv; ++h) {
    SeedTask& t = tasks[static_cast<size_t>(h)];
    t.q = last_q + size_t(h) * group * d;
    t.keys = keys + size_t(h) * n * d;
    t.values = values + size_t(h) * n * d;
    t.logits = seed_logits_.get() + size_t(h) * SeedScratchFloats(group, n);
    t.n = n;
    t.candidates = std::min(candidates, n);
    t.take = SeedCount(config_.seed_rows, t.candidates, capacity);
    t.tokens = lr.cache.tokens.get() + size_t(h) * capacity;
    t.used = lr.cache.used.get() + size_t(h) * capacity;
    t.slots = lr.cache.slots.get() + size_t(h) * capacity;
    t.list_count = lr.cache.count.get() + h;
    t.rows = lr.cache_rows.get() + size_t(h) * capacity * 2 * d;
    t.capacity = capacity;
  }
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(seed_, seed_from_, 0), "wait for the prompt's rows"));
  const Status queued = SeedRowCaches(tasks.data(), n_kv, group, d, scale, config_.reduction, seed_, &seed_plan_);
  // Joined whatever was queued (also up to a failed launch): the compute stream's later work may
  // rewrite what the seeding reads.
  Status joined = CudaStatus(cudaEventRecord(seeded_, seed_), "seed end event");
  if (joined.ok()) joined = CudaStatus(cudaStreamWaitEvent(compute_, seeded_, 0), "wait for the seeding");
  if (!joined.ok()) cudaStreamSynchronize(seed_);  // no join on the device: the host waits instead
  SPECACHE_RETURN_IF_ERROR(queued);
  SPECACHE_RETURN_IF_ERROR(joined);
  lr.seeded = true;
  return Status::Ok();
}

Result<int32_t*> RowFetcher::SelectionTarget(SequenceId id, int layer, int32_t per_head, bool counted_on_device) {
  LayerRows& lr = rows_.at(id)[layer];
  lr.selected = per_head;
  lr.selected_on_device = counted_on_device;
  if (per_head == 0) return static_cast<int32_t*>(nullptr);
  Buffer<int32_t>& next = lr.tokens[1 - lr.cur];
  SPECACHE_RETURN_IF_ERROR(next.Reserve(size_t(shape_.n_kv_heads) * config_.max_selected()));
  return next.get();
}

void RowFetcher::Substitute(SequenceId id, int layer, std::span<DeviceDecodeItem> heads) const {
  const LayerRows& lr = rows_.at(id)[layer];
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  for (size_t h = 0; h < heads.size(); ++h) {
    DeviceDecodeRows* r = &heads[h].rows;
    if (config_.attend_resident) {
      // The whole row cache (it holds the selection); entries past its count are kNoToken.
      const int32_t capacity = lr.filled() ? config_.cache_rows() : 0;
      r->sub_tokens = capacity ? lr.cache.tokens.get() + h * capacity : nullptr;
      r->sub_slots = capacity ? lr.cache.slots.get() + h * capacity : nullptr;
      r->sub_rows = capacity ? lr.cache_rows.get() + h * capacity * row : nullptr;
      r->n_sub = capacity;
      continue;
    }
    // The selection's rows, in the row cache (which holds them since the fetch), by their slots.
    r->sub_tokens = lr.tokens[lr.cur].get() + h * lr.resident;
    r->sub_slots = lr.slots[lr.cur].get() + h * lr.resident;
    r->sub_rows = lr.resident > 0 ? lr.cache_rows.get() + h * size_t(config_.cache_rows()) * row : nullptr;
    r->n_sub = lr.resident;
  }
}

Result<RowFetcher::FetchWork> RowFetcher::Prepare(int layer, const std::vector<SequenceId>& ids, bool by_copy_engine) {
  const size_t row = 2 * static_cast<size_t>(shape_.head_dim);
  const int n_kv = shape_.n_kv_heads;
  const int32_t capacity = config_.cache_rows();
  // First every buffer the fetch writes, so that running out of device memory changes nothing the
  // fetcher reports (a reservation only grows a buffer whose contents nothing needs yet).
  size_t fetched = 0;  // sequences whose rows are fetched: each takes a spare list
  if (options_.fetch) {
    for (SequenceId id : ids) {
      LayerRows& lr = rows_.at(id)[layer];
      if (lr.selected == 0) continue;
      SPECACHE_RETURN_IF_ERROR(lr.slots[1 - lr.cur].Reserve(size_t(n_kv) * config_.max_selected()));
      if (lr.fetches == 0) SPECACHE_RETURN_IF_ERROR(ReserveCache(&lr));
      ++fetched;
    }
  }
  const size_t by_sm = by_copy_engine ? SmSequences(fetched) : fetched;  // the first ones fetched
  // The copy engine's SM share runs on a stream of its own: its lists come from a pool of their own.
  const size_t sm_pool = by_copy_engine ? by_sm : 0;
  if (sm_spare_lists_.size() < sm_pool) sm_spare_lists_.resize(sm_pool);
  if (spare_lists_.size() < fetched - sm_pool) spare_lists_.resize(fetched - sm_pool);
  for (size_t i = 0; i < sm_pool; ++i) SPECACHE_RETURN_IF_ERROR(sm_spare_lists_[i].Reserve(n_kv, capacity));
  for (size_t i = 0; i < fetched - sm_pool; ++i) SPECACHE_RETURN_IF_ERROR(spare_lists_[i].Reserve(n_kv, capacity));
  if (by_sm > 0) {
    if (fetched_rows_.size() < by_sm) fetched_rows_.resize(by_sm);
    for (size_t i = 0; i < by_sm; ++i) {
      SPECACHE_RETURN_IF_ERROR(fetched_rows_[i].Reserve(size_t(n_kv) * config_.max_selected() * row));
    }
  }

  FetchWork w;
  w.layer = layer;
  w.ids = ids;
  const size_t n_tasks = fetched * n_kv;  // one allocation each, not one per doubling
  w.tasks.reserve(n_tasks), w.task_sequences.reserve(n_tasks), w.host_pages.reserve(n_tasks), w.updates.reserve(n_tasks);
  FetchCounts counts;
  size_t spare = 0;
  for (SequenceId id : ids) {
    LayerRows& lr = rows_.at(id)[layer];
    const uint64_t* pages = pages_->Layer(id, layer);  // null for a staged source
    const uint8_t* const* host_pages = pages_->HostLayer(id, layer);
    const int next = 1 - lr.cur;
    if (!lr.selected_on_device) counts.selected += int64_t{lr.selected} * n_kv;
    if (!options_.fetch) {  // measuring without the fetch: nothing becomes resident
      lr.selected = 0;
      continue;
    }
    if (lr.selected > 0) {
      CacheList& old = lr.cache;
      Half* const cache_rows = lr.cache_rows.get();
      Half* const fetched_rows = spare < by_sm ? fetched_rows_[spare].get() : nullptr;
      const bool sm_share = spare < sm_pool;  // the copy engine's SM share
      CacheList& target = sm_share ? sm_spare_lists_[spare] : spare_lists_[spare - sm_pool];
      ++spare;
      if (!lr.filled()) {  // the cache starts empty; the update writes all of the target
        w.fills.push_back({old.tokens.get(), size_t(n_kv) * capacity * sizeof(int32_t), 0x7f});  // kNoToken
        w.fills.push_back({old.count.get(), n_kv * sizeof(int32_t), 0});
        if (sm_share) w.sm_fills = w.fills.size();  // the share's sequences come first
      }
      ++lr.fetches;
      for (int h = 0; h < n_kv; ++h) {
        FetchTask t;
        t.selected = lr.tokens[next].get() + size_t(h) * lr.selected;
        t.n_selected = lr.selected;
        t.resident = old.tokens.get() + size_t(h) * capacity;
        t.resident_rows = cache_rows + size_t(h) * capacity * row;
        t.resident_slots = old.slots.get() + size_t(h) * capacity;
        t.resident_count = old.count.get() + h;
        t.out_rows = fetched_rows ? fetched_rows + size_t(h) * lr.selected * row : nullptr;
        t.pages = pages;
        t.kv_head = h;
        w.tasks.push_back(t);
        w.task_sequences.push_back(id);
        w.host_pages.push_back(host_pages);
        CacheUpdateTask u;
        u.old_tokens = t.resident;
        u.old_used = old.used.get() + size_t(h) * capacity;
        u.old_slots = t.resident_slots;
        u.old_count = t.resident_count;
        u.selected = t.selected;
        u.selected_rows = t.out_rows;
        u.n_selected = lr.selected;
        u.new_tokens = target.tokens.get() + size_t(h) * capacity;
        u.new_used = target.used.get() + size_t(h) * capacity;
        u.rows = cache_rows + size_t(h) * capacity * row;
        u.new_slots = target.slots.get() + size_t(h) * capacity;
        u.new_count = target.count.get() + h;
        u.selected_slots = lr.slots[next].get() + size_t(h) * lr.selected;
        u.now = lr.fetches;
        u.capacity = capacity;
        w.updates.push_back(u);
      }
      // The update's target becomes the layer's list, and the old list a spare of the same pool
      // that a later update, queued after this one on the same stream, may write (spare_lists_).
      std::swap(old, target);
    }
    lr.cur = next;
    lr.resident = lr.selected;
    lr.selected = 0;
  }
  // Hits and misses are counted on the device (DeviceCounters); the selection here.
  rows_selected_ += counts.selected;
  if (by_copy_engine) w.sm_tasks = by_sm * static_cast<size_t>(n_kv);
  return w;
}

Status RowFetcher::Launch(const FetchWork& w, StagedFetch* staged, CopyEngineFetch* copy_engine,
                          cudaStream_t stream, DecodePlan* plan) const {
  if (copy_engine && sm_fetch_ && !w.fills.empty()) {
    // A cache emptied after a failed fetch may still be touched by that fetch's work, on either
    // stream: the fills come after both (a (sequence, layer)'s first fetch: after its admission
    // or a failed fetch).
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(sm_tail_, sm_fetch_), "fetch event"));
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream, sm_tail_, 0), "wait for the fetch's SM share"));
  }
  for (const FetchWork::Fill& f : w.fills) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(f.at, f.value, f.bytes, stream), "row cache"));
  }
  if (staged) {
    SPECACHE_RETURN_IF_ERROR(
        staged->Stage(w.layer, w.tasks, w.task_sequences, config_.cache_rows(), stream).status());
  }
  if (copy_engine) return LaunchByCopyEngine(w, copy_engine, stream, plan);
  return LaunchBySmLoads(w, w.tasks.size(), stream, plan);
}

Status RowFetcher::LaunchBySmLoads(const FetchWork& w, size_t n, cudaStream_t stream, DecodePlan* plan) const {
  SPECACHE_RETURN_IF_ERROR(FetchRows(w.tasks.data(), static_cast<int>(n), shape_.head_dim, pages_->row_format(),
                                     pages_->page_tokens(), options_.fetch_blocks, device_counters_.get(), stream, plan));
  return UpdateRowCaches(w.updates.data(), static_cast<int>(n), shape_.head_dim, pages_->row_format(), nullptr, stream,
                         plan);  // counted
}

size_t RowFetcher::SmSequences(size_t fetched) const {
  if (!sm_fetch_) return 0;
  return std::min(fetched, static_cast<size_t>(options_.fetch_sm_share * static_cast<double>(fetched) + 0.5));
}

Status RowFetcher::LaunchByCopyEngine(const FetchWork& w, CopyEngineFetch* copy_engine, cudaStream_t stream,
                                      DecodePlan* plan) const {
  const size_t sm = w.sm_tasks, n = w.tasks.size();
  // 1. The SM share, from the mapped pages, on its own stream, once the layer's selection and
  //    page writes are done (or, when it fills a cache, from here on `stream`, behind the fills);
  //    it runs while this thread lists and gathers the rest. Its end is the layer's
  //    sm_fetched_ event, which WaitFetched joins beside fetched_.
  Status by_sm = Status::Ok();
  if (sm > 0) {
    if (w.sm_fills > 0) {
      by_sm = CudaStatus(cudaEventRecord(sm_start_, stream), "fetch start event");
      if (by_sm.ok()) by_sm = CudaStatus(cudaStreamWaitEvent(sm_fetch_, sm_start_, 0), "wait for the fetch's start");
    } else {
      by_sm = WaitForSelectionAndWrites(w, sm_fetch_);
    }
    if (by_sm.ok()) by_sm = LaunchBySmLoads(w, sm, sm_fetch_, &sm_plan_);
    // Recorded after an error too: what was queued is what the layer's WaitFetched waits for.
    const Status recorded = CudaStatus(cudaEventRecord(sm_fetched_[w.layer], sm_fetch_), "fetch end event");
    if (!recorded.ok()) cudaStreamSynchronize(sm_fetch_);  // no join on the device: the host waits instead
    if (by_sm.ok()) by_sm = recorded;
  }
  SPECACHE_RETURN_IF_ERROR(by_sm);
  // 2. The rest by the copy engine: the cache update takes the missed rows from its copy by rank
  //    (and counts them). A cache's first fetch: the list must see the fills queued before.
  if (sm == n) return Status::Ok();
  const auto tasks = std::span(w.tasks).subspan(sm);
  cudaEvent_t storage[2];
  const std::span<const cudaEvent_t> ready = ReadyEvents(w, storage);
  const bool fills = w.fills.size() > w.sm_fills;
  SPECACHE_ASSIGN_OR_RETURN(std::vector<FetchTask> routed,
                            copy_engine->Stage(tasks, std::span(w.host_pages).subspan(sm), ready, stream, fills, plan));
  std::vector<CacheUpdateTask> updates(w.updates.begin() + static_cast<std::ptrdiff_t>(sm), w.updates.end());
  for (size_t i = 0; i < updates.size(); ++i) {
    updates[i].staged_rank = routed[i].staged_rank;
    updates[i].selected_rows = routed[i].staged_rows;
  }
  return UpdateRowCaches(updates.data(), static_cast<int>(updates.size()), shape_.head_dim, pages_->row_format(),
                         device_counters_.get(), stream, plan);
}

void RowFetcher::Forget(int layer, const std::vector<SequenceId>& ids) {
  for (SequenceId id : ids) {
    auto it = rows_.find(id);
    if (it == rows_.end()) continue;  // released since
    LayerRows& lr = it->second[layer];
    lr.resident = 0;
    lr.fetches = 0;  // the next fetch fills the caches afresh
    lr.seeded = false;
  }
}

Status RowFetcher::OnSourceThread(const std::function<Status(DecodePlan*)>& job) {
  if (!staged_source_) return job(&caller_plan_);  // the copy engine's worker runs only the overlapped fetch
  // Staged: the worker makes every call into the source, in order, so this read comes after the
  // appends handed to it before (the selection may name their rows). The caller waits, so the
  // job may use what it refers to.
  worker_->Submit(SourceWorker::kCallerKey, [this, &job] { return job(&worker_plan_); });
  return worker_->Wait(SourceWorker::kCallerKey);
}

Status RowFetcher::Fetch(int layer, const std::vector<SequenceId>& ids, cudaStream_t stream) {
  SPECACHE_ASSIGN_OR_RETURN(FetchWork w, Prepare(layer, ids, /*by_copy_engine=*/false));
  const Status s = OnSourceThread([&](DecodePlan* plan) { return Launch(w, staged_inline_.get(), nullptr, stream, plan); });
  if (!s.ok()) Forget(layer, ids);
  return s;
}

Status RowFetcher::Gather(int layer, std::span<const FetchTask> tasks, std::span<const SequenceId> sequences,
                          cudaStream_t stream) {
  return OnSourceThread([&](DecodePlan* plan) -> Status {
    if (staged_inline_) SPECACHE_RETURN_IF_ERROR(staged_inline_->Stage(layer, tasks, sequences, 0, stream).status());
    return FetchRows(tasks.data(), static_cast<int>(tasks.size()), shape_.head_dim, pages_->row_format(), pages_->page_tokens(),
                     options_.fetch_blocks, nullptr, stream, plan);
  });
}

Status RowFetcher::MarkAppended(int layer, cudaStream_t stream) {
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(appended_[layer], stream), "append event"));
  writes_follow_selection_[layer] = stream == selected_on_[layer];
  return Status::Ok();
}

Status RowFetcher::MarkSelected(int layer, cudaStream_t stream) {
  writes_follow_selection_[layer] = 0;  // until this step's writes of the layer come after it
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(selected_[layer], stream), "selection event"));
  selected_on_[layer] = stream;
  return Status::Ok();
}

std::span<const cudaEvent_t> RowFetcher::ReadyEvents(const FetchWork& w, cudaEvent_t (&storage)[2]) const {
  storage[0] = selected_[w.layer];
  storage[1] = appended_[w.layer];
  return std::span<const cudaEvent_t>(storage).subspan(w.writes_follow_selection ? 1 : 0);
}

Status RowFetcher::WaitForSelectionAndWrites(const FetchWork& w, cudaStream_t stream) const {
  cudaEvent_t storage[2];
  for (cudaEvent_t e : ReadyEvents(w, storage)) {
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream, e, 0), "wait for the selection and page writes"));
  }
  return Status::Ok();
}

// The overlapped fetch of layer L, in order (both paths):
//   compute: ... attention of L, L's page writes, record appended_[L] (MarkAppended) ... later
//            layers ... (in specache mode the page writes and the record go on the select stream)
//   select:  (forked after that attention) top-k of L, record selected_[L] (MarkSelected), [L's
//            page writes, record appended_[L]]; joined by the compute stream before L + 1's
//            attention, at the last of the two events (with
//            selection_on_own_stream false both run on the compute stream, in order, after the
//            attention: nothing to join)
//   fetch:   wait selected_[L] and appended_[L] (appended_[L] alone where the writes follow the
//            selection on its stream); [staged: selection down, host waits; source reads; rows up];
//            fetch kernel (hits from the cache); cache update; record fetched_[L]
//   sm_fetch: (copy engine with fetch_sm_share) wait selected_[L] and appended_[L] (or, when it
//            fills caches, sm_start_ on the fetch stream after the fills); fetch kernel of the
//            first sequences; their cache update; record sm_fetched_[L]
//   compute: (next step, before L's attention) wait fetched_[L] (and sm_fetched_[L]) (WaitFetched)
// Local: the agent's thread queues the fetch stream's part right here (kFromSelection), or at the
// next WaitFetched (of layer L + 1, or of the next step's first layer after the last), waiting for
// deferred_start_ recorded there on the compute stream, and for selected_[L] and appended_[L] (the
// compute stream joins L's selection, and the page writes after it, only at L + 1's attention,
// after that WaitFetched); kWithinNextAttention
// adds, at that layer's JoinFetch,
//   compute: (after the attention and selection of L + 1) wait fetched_[L]
// Staged: the worker does,
// because its middle waits on the host; the agent's thread queues nothing on the fetch stream, so
// the worker's copies are never interleaved with other fetch-stream work. selected_[L] is
// recorded again only at L's next MarkSelected, which comes after L's next WaitFetched, which
// joins this job first: the job always waits for the record it was started for. And WaitFetched
// waits for fetched_[L] only after the join, so never for an event the job has not recorded yet
// (waiting for an event before its record is no wait at all); the same holds for sm_fetched_[L],
// which the worker's job records.
Status RowFetcher::StartFetch(int layer, const std::vector<SequenceId>& ids) {
  joined_[layer] = 0;  // a new fetch of the layer: the compute stream has yet to wait for it
  SPECACHE_RETURN_IF_ERROR(LaunchDeferred());  // two StartFetch without a WaitFetched between
  SPECACHE_ASSIGN_OR_RETURN(FetchWork w, Prepare(layer, ids, /*by_copy_engine=*/copy_engine_ != nullptr));
  w.writes_follow_selection = writes_follow_selection_[layer];
  // std::function copies its callable: the work travels behind a shared pointer.
  auto work = std::make_shared<const FetchWork>(std::move(w));
  if (!worker_ && options_.fetch_overlap != FetchOverlap::kFromSelection) {
    deferred_ = std::move(work);
    return Status::Ok();
  }
  auto run = [this, layer, work]() -> Status {
    SPECACHE_RETURN_IF_ERROR(WaitForSelectionAndWrites(*work, fetch_));
    SPECACHE_RETURN_IF_ERROR(Launch(*work, staged_worker_.get(), copy_engine_.get(), fetch_,
                                    worker_ ? &worker_plan_ : &caller_plan_));
    return CudaStatus(cudaEventRecord(fetched_[layer], fetch_), "fetch event");
  };
  if (!worker_) {
    // A fetch that failed to queue leaves rows (and a cache) that were never written: its
    // sequences forget them, as the other paths' failures do, and substitute none.
    const Status s = run();
    if (!s.ok()) Forget(layer, ids);
    return s;
  }
  handed_[layer] = ids;
  worker_->Submit(layer, std::move(run));
  return Status::Ok();
}

Status RowFetcher::LaunchDeferred() const {
  if (!deferred_) return Status::Ok();
  const int layer = deferred_->layer;
  // Kept until all of it is queued: after an error each later wait fails with it again (so the
  // layer's attention never reads rows that were not fetched), and queueing it once more is safe
  // (the fills, the fetch and the cache update give the same result run twice).
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(deferred_start_, compute_), "fetch start event"));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(fetch_, deferred_start_, 0), "wait for the fetch's start"));
  // The selection, and the page writes queued after it, may run on a stream of their own
  // (StepPlanner), which the compute stream joins only at the next attention.
  SPECACHE_RETURN_IF_ERROR(WaitForSelectionAndWrites(*deferred_, fetch_));
  SPECACHE_RETURN_IF_ERROR(Launch(*deferred_, nullptr, nullptr, fetch_, &caller_plan_));
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(fetched_[layer], fetch_), "fetch event"));
  deferred_.reset();
  return Status::Ok();
}

Status RowFetcher::JoinFetch() {
  if (join_layer_ < 0) return Status::Ok();
  const int layer = join_layer_;
  join_layer_ = -1;
  return CudaStatus(cudaStreamWaitEvent(compute_, fetched_[layer], 0), "wait for the fetch beside the attention");
}

Status RowFetcher::WaitFetched(int layer) {
  const int deferred = deferred_ ? deferred_->layer : -1;
  SPECACHE_RETURN_IF_ERROR(LaunchDeferred());
  if (deferred >= 0 && options_.fetch_overlap == FetchOverlap::kWithinNextAttention) join_layer_ = deferred;
  if (joined_[layer]) return Status::Ok();  // waited for already (DecodeLayer after WaitPrefetch)
  if (worker_) {
    const auto waiting = std::chrono::steady_clock::now();
    const Status s = worker_->Wait(layer);
    if (copy_engine_) {  // AgentStats::fetch_caller_wait_ns is the copy engine's
      caller_wait_ns_ +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - waiting).count();
    }
    if (!s.ok()) {
      Forget(layer, handed_[layer]);
      return s;
    }
  }
  if (sm_fetch_) {  // the copy engine's SM share of the layer (an older record when it had none)
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(compute_, sm_fetched_[layer], 0), "wait for the fetch"));
  }
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(compute_, fetched_[layer], 0), "wait for the fetch"));
  joined_[layer] = 1;
  return Status::Ok();
}

Status RowFetcher::WaitForFetchStream() const {
  // Everything is waited for even after a failure (what was queued before it may still read the
  // pages, which the agent's destructor then releases): the first error.
  const Status deferred = LaunchDeferred();
  if (worker_) worker_->WaitAll();
  const Status sm = sm_fetch_ ? CudaStatus(cudaStreamSynchronize(sm_fetch_), "fetch stream") : Status::Ok();
  const Status fetch = CudaStatus(cudaStreamSynchronize(fetch_), "fetch stream");
  if (!deferred.ok()) return deferred;
  return sm.ok() ? fetch : sm;
}

int32_t RowFetcher::resident(SequenceId id, int layer) const { return rows_.at(id)[layer].resident; }

Status RowFetcher::CopyResidentTokens(SequenceId id, int layer, int kv_head, std::vector<int32_t>* tokens) const {
  const LayerRows& lr = rows_.at(id)[layer];
  SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpy(tokens->data(), lr.tokens[lr.cur].get() + size_t(kv_head) * lr.resident,
                                                 tokens->size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
                                      "selected tokens"));
  tokens->erase(std::find(tokens->begin(), tokens->end(), kNoToken), tokens->end());  // the budget's padding
  return Status::Ok();
}

FetchCounters RowFetcher::DeviceCounters() const {
  FetchCounters device{0, 0, 0};
  cudaMemcpy(&device, device_counters_.get(), sizeof(device), cudaMemcpyDeviceToHost);
  return device;
}

void RowFetcher::AddStats(AgentStats* s) const {
  const int64_t row = 2 * int64_t{shape_.head_dim} * static_cast<int64_t>(sizeof(Half));
  // The row caches' sizes live on the device (the selection's rows are among the cache's): summed
  // there in one launch, not read a (sequence, layer) at a time (5632 copies at 176 x 32 layers).
  std::vector<const int32_t*> counts;
  for (const auto& [id, layers] : rows_) {
    for (const LayerRows& lr : layers) {
      if (lr.filled()) counts.push_back(lr.cache.count.get());
      s->device_bytes_reserved += lr.tokens[0].bytes() + lr.tokens[1].bytes() + lr.slots[0].bytes() +
                                  lr.slots[1].bytes() + lr.cache.bytes() + lr.cache_rows.bytes();
    }
  }
  int64_t cache_rows = 0;  // 0 after a failure (e.g. no memory for its scratch): device_bytes then lacks them
  if (count_lists_.Reserve(counts.size()).ok() && count_sum_.Reserve(1).ok()) {
    (void)SumCacheCounts(counts.data(), static_cast<int>(counts.size()), shape_.n_kv_heads, &cache_rows,
                         {count_lists_.get(), count_sum_.get()});
  }
  s->device_bytes_reserved += count_lists_.bytes() + count_sum_.bytes();
  s->device_bytes += cache_rows * row;
  for (const CacheList& spare : spare_lists_) s->device_bytes_reserved += spare.bytes();
  for (const CacheList& spare : sm_spare_lists_) s->device_bytes_reserved += spare.bytes();
  if (copy_engine_) {
    const CopyEngineFetch::Times t = copy_engine_->times();
    s->fetch_host_list_wait_ns += t.list_wait_ns;
    s->fetch_host_buffer_wait_ns += t.buffer_wait_ns;
    s->fetch_host_gather_ns += t.gather_ns;
    s->fetch_caller_wait_ns += caller_wait_ns_;
  }
  for (const Buffer<Half>& rows : fetched_rows_) s->device_bytes_reserved += rows.bytes();
}

}  // namespace specache::cuda
