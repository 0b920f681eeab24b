// The full-precision rows the CUDA agent's attention substitutes for low-bit ones, per (sequence,
// layer): the selection the top-k wrote, its fetch from the source's pages (read in place by the
// GPU, cuda_fetch.h), and the row cache (row_cache.h) that holds the selection's rows and through
// which rows resident from the previous step are copied on the device instead of read again.
//
// - The selection comes in two generations: the current one is what the attention substitutes
//   (Substitute); the other receives the next selection (SelectionTarget) and then, from the
//   fetch, where each of its rows is in the row cache (its slots), which makes it current. The
//   attention reads the selection's rows from the cache through those slots: the rows have no
//   other copy. The row cache is one per (sequence, layer): its rows stay in their slots, and a
//   fetch's update writes only the missed rows, into free slots, and a new list (tokens, use
//   marks, slots) into a spare list from a pool shared by all layers, which then takes the old
//   list's place while the old list becomes a spare. The cache's sizes are known on the device
//   only.
// - The fetch's missed rows reach the update either from FetchRows' output (a buffer from a pool
//   of the fetcher's, like the spares) or, by the copy engine, from its staged copy by rank.
// - In specache mode the fetch of layer L runs on the fetcher's own stream (StartFetch), after an
//   event that marks layer L's selection done on the stream it ran on (MarkSelected: the
//   planner's selection stream, forked from the compute stream after the attention, or the
//   compute stream itself with CudaAgentOptions::selection_on_own_stream false); the compute
//   stream waits for it (WaitFetched) only before layer L's next attention, so later layers never
//   wait for it. The other modes fetch on the compute stream (Fetch).
// - When that fetch is queued is CudaAgentOptions::fetch_overlap (agent.h): at StartFetch, or
//   deferred to the next WaitFetched (the next layer's attention is about to be queued), behind an
//   event recorded there, so that it runs beside the attention, which leaves it fetch_blocks SM
//   slots, rather than beside the engine's GEMMs. Within the next attention, JoinFetch (after that
//   attention is queued) makes the compute stream wait for it. Anything that waits for the fetch
//   stream queues a deferred fetch first.
// - Hits and misses are counted on the device by the fetch kernel; the rows selected on the host,
//   except the adaptive budget's (KvConfig::mass) and a merged union's, which the selection counts
//   on the device (budget_rows(); when the selection runs, so a step aborted before its fetch has
//   counted them already, where the CPU agent has not). Their selections end in
//   kNoToken padding (cuda_topk.h; a union's where the real row's picks repeat primary rows, as a
//   real row of NaN does, cuda_selection.h): no rows, skipped by the fetch, the cache update and
//   the attention, and left out of what is reported.
// - A source without zero-copy pages (UseStagedSource, chosen once by the agent) keeps all of the
//   above; only the rows the cache lacks come through pinned host memory (staged_fetch.h) instead
//   of being read from mapped pages. The overlapped fetch then runs on the agent's SourceWorker:
//   StartFetch hands it the layer's work, and WaitFetched joins it before the compute stream waits
//   for the fetch's event; an error of the source comes back from that WaitFetched.
// - FetchVia::kCopyEngine (UseCopyEngine, a source with pages) runs the overlapped fetch on the
//   worker the same way, through CopyEngineFetch (copy_engine_fetch.h): the worker waits for the
//   layer's list of missed rows, its threads gather them from the pages (their host addresses
//   captured by Prepare), and one copy moves them; Fetch and Gather still read the pages with SM
//   loads, on the calling thread. With CudaAgentOptions::fetch_sm_share, the first sequences of
//   each layer's fetch take the SM route instead, on a stream of their own (sm_fetch_) while the
//   host gathers the others'. On the device the two parts share nothing but the counters: the
//   SM share waits for the layer's selection and page writes itself, takes its update's lists
//   from a pool of its own (sm_spare_lists_) and its rows from fetched_rows_, which only it uses,
//   and ends in the layer's sm_fetched_ event, which WaitFetched joins beside fetched_. So
//   neither part of layer L + 1 waits on the device for the other part of layer L (on the host,
//   the worker queues layer L + 1's SM share once it has queued layer L's copies). The
//   exception is a fetch that empties caches first (fills: a (sequence, layer)'s first fetch,
//   after its admission or a failed fetch): the fills come after both streams' work so far (a
//   failed fetch's work may still touch the cache), and that fetch's SM share after the fills.
//
// Not thread-safe (the agent is used from one thread; the worker's jobs touch only the device
// memory and the events their work names, never the fetcher's tables).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "device_buffer.h"
#include "device_page_table.h"
#include "specache/agent.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_fetch.h"
#include "specache/status.h"
#include "copy_engine_fetch.h"
#include "staged_fetch.h"
#include "../source_worker.h"

namespace specache::cuda {

class RowFetcher {
 public:
  // Rows are read through `pages` (must outlive the fetcher); `compute` is the engine's stream.
  RowFetcher(const ModelShape& shape, const KvConfig& config, const CudaAgentOptions& options,
             const DevicePageTable* pages, cudaStream_t compute);
  ~RowFetcher();
  RowFetcher(const RowFetcher&) = delete;
  RowFetcher& operator=(const RowFetcher&) = delete;
  // Before Init, for a source without zero-copy pages: rows come from `source` through pinned
  // memory, and the overlapped fetch runs on `worker`. Both must outlive the fetcher's use of them
  // (the worker's jobs use the fetcher: its owner destroys the worker first).
  void UseStagedSource(FullPrecisionSource* source, SourceWorker* worker);
  // Before Init, for a source with pages: the overlapped fetch's rows go by the copy engine, the
  // host's part on `worker` (FetchVia::kCopyEngine), as the options say (fetch_threads,
  // fetch_copy_piece_bytes, fetch_sm_share, fetch_streaming_stores, fetch_gather_spin_us);
  // usable_cores: the logical cores the process may use (UsableCores; 0: not known), which cap
  // the gather threads (GatherThreadsFor).
  void UseCopyEngine(SourceWorker* worker, int usable_cores);
  // Makes the fetch stream, the per-layer events and the device counters.
  Status Init();

  void AddSequence(SequenceId id);
  // No queued work may still read the sequence's rows, nor any row cache: its caches may have
  // been other sequences' (as spares) whose last fetch still reads them (the agent waits for the
  // streams first, WaitForFetchStream). A failed overlapped fetch not yet reported whose
  // sequences are now all removed is dropped (it would fail another batch's step).
  void RemoveSequence(SequenceId id);

  // KvConfig::seed_rows: the (sequence, layer)'s row cache starts with each KV head's seeds
  // (seed_rows.h); at prefill, before the layer's first fetch. In two calls, so that the seeding
  // runs beside what the caller queues between them (the sequence's page writes and appends):
  // SeedFrom reserves what the seeding of a prompt of n tokens writes (on an error nothing changed
  // that the fetcher reports) and marks where on the compute stream the prompt's K/V (and q) are
  // ready; Seed queues the seeding on the fetcher's seed stream from there, and makes the compute
  // stream wait for it (work queued after Seed, such as the next sequence's prefill, which rewrites
  // those K/V, runs after it; without that wait, Seed waits on the host). last_q: the prompt's
  // last token's query heads, [n_q_heads][head_dim] float; keys and values: the prompt's fp16
  // rows, [n_kv][n][head_dim]; the seeds come from tokens [0, candidates). All device memory.
  Status SeedFrom(SequenceId id, int layer, int32_t n);
  Status Seed(SequenceId id, int layer, const float* last_q, const Half* keys, const Half* values, int32_t n,
              int32_t candidates, float scale);

  // Where the top-k writes the (sequence, layer)'s next selection: per_head tokens for each KV
  // head, head h's at h * per_head, ascending (device memory; null when per_head is 0).
  // `counted_on_device`: the selection's kernels add its tokens to budget_rows() (the adaptive
  // budget, the union's merge), which may leave kNoToken padding; else the fetch's Prepare counts
  // all per_head places.
  Result<int32_t*> SelectionTarget(SequenceId id, int layer, int32_t per_head, bool counted_on_device);
  // The rows the attention of a (sequence, layer) substitutes, into heads[h].rows for each KV
  // head h: the current selection's, or, with KvConfig::attend_resident, the whole row cache.
  void Substitute(SequenceId id, int layer, std::span<DeviceDecodeItem> heads) const;

  // Makes the next selection of these sequences' layer current, its rows fetched on `stream`
  // (staged: on the worker, after the appends handed to it, waiting for it). A fetcher fetches
  // either here, always on the same stream, or through StartFetch, never both (the agent's mode
  // picks): the caches' updates must share one stream (spare_lists_).
  Status Fetch(int layer, const std::vector<SequenceId>& ids, cudaStream_t stream);
  // Records on `stream`, where the layer's selection was queued (StepPlanner::AttendAndSelect, on
  // its selection stream, or on the compute stream with selection_on_own_stream false), that it
  // is done, in selection_done(layer): the planner's join waits for that event too (own stream),
  // until the layer's next MarkSelected.
  Status MarkSelected(int layer, cudaStream_t stream);
  // Records on `stream`, where the layer's page writes of this step were queued (the agent, right
  // after them: the compute stream, or the selection's stream after the layer's top-k, where the
  // planner's join then waits for append_done instead), that they are done; the layer's next
  // overlapped fetch waits for it too (appended_). Only after the layer's WaitFetched in the step,
  // which joined the fetch that waits for the previous record.
  Status MarkAppended(int layer, cudaStream_t stream);
  cudaEvent_t selection_done(int layer) const { return selected_[layer]; }
  // The event of the layer's last MarkAppended.
  cudaEvent_t append_done(int layer) const { return appended_[layer]; }
  // Fetch on the fetch stream, once the layer's selection is done; the layer's next WaitFetched
  // waits for it. Local: queued now, or (fetch_overlap) at the next WaitFetched of any layer or
  // WaitForFetchStream, to run beside the attention queued after it. Staged: the work is handed to
  // the worker and this returns at once.
  Status StartFetch(int layer, const std::vector<SequenceId>& ids);
  // The compute stream waits here for the fetch queued at the last WaitFetched (with
  // FetchOverlap::kWithinNextAttention; else nothing): called once the attention it ran beside is
  // queued.
  Status JoinFetch();
  // Queues a local fetch started before (StartFetch), then: work queued on the compute stream
  // from here sees the rows of the layer's last StartFetch
  // (stream order, no host wait). Staged: first waits on the host until the worker queued that
  // fetch's copies, and returns its error (the source's, with context) if it failed; the failed
  // fetch's sequences then hold no rows at the layer (the attention substitutes none) until their
  // next fetch. Once it succeeded for a layer, later calls until the layer's next StartFetch only
  // queue a deferred fetch: the compute stream already waits (the agent's DecodeLayer after the
  // engine's WaitPrefetch).
  Status WaitFetched(int layer);
  // Waits on the host until the fetch streams are idle (staged: and the worker ran every fetch
  // handed to it; their errors stay for WaitFetched), all of them even after an error (the first
  // is returned).
  Status WaitForFetchStream() const;
  // Reads the tasks' rows (no resident lists, not counted) into their out_rows on `stream`: from
  // the pages in place, or staged (tasks[i] is KV head tasks[i].kv_head of (sequences[i], layer)).
  Status Gather(int layer, std::span<const FetchTask> tasks, std::span<const SequenceId> sequences, cudaStream_t stream);

  // Tokens per KV head of the (sequence, layer)'s current selection.
  int32_t resident(SequenceId id, int layer) const;
  // Copies KV head kv_head's current selection into *tokens (sized resident(); its kNoToken
  // padding, the adaptive budget's or a union's, is then erased); synchronous, so only after the
  // streams that write it are idle.
  Status CopyResidentTokens(SequenceId id, int layer, int kv_head, std::vector<int32_t>* tokens) const;

  // Rows selected for fetches so far, hits and misses, counted on the host (not those counted on
  // the device: DeviceCounters().selected).
  int64_t rows_selected() const { return rows_selected_; }
  // Device memory the adaptive budget's selections and the union's merge add their rows to
  // (FetchCounters::selected).
  unsigned long long* budget_rows() const { return &device_counters_.get()->selected; }
  // The device's counts of rows fetched and reused, and of the rows selected there (synchronous:
  // after the streams are idle).
  FetchCounters DeviceCounters() const;
  // Adds the device memory of the rows to the stats: device_bytes (the row caches' entries, read
  // from the device; the resident selection's rows are among them) and device_bytes_reserved
  // (every buffer, the spare lists and FetchRows' output buffers included).
  void AddStats(AgentStats* stats) const;

 private:
  // The list of the row cache (row_cache.h) of one (sequence, layer) on the device, for all its KV
  // heads, or a spare one (CacheUpdateTask): head h's entries start at h * capacity
  // (KvConfig::cache_rows()); their number is known on the device only (count), the tokens past it
  // are kNoToken, and the slots name where each entry's row lies in the layer's cache_rows.
  struct CacheList {
    Buffer<int32_t> tokens;  // [n_kv][capacity] ascending per head
    Buffer<int32_t> used;    // [n_kv][capacity] the fetch number each entry was last selected at
    Buffer<int32_t> slots;   // [n_kv][capacity]: the entries' rows, then the free slots
    Buffer<int32_t> count;   // [n_kv]
    // Makes the buffers hold a list of `capacity` entries per head, keeping what they held if they
    // did already.
    Status Reserve(int n_kv, int32_t capacity);
    int64_t bytes() const;
  };
  // The full-precision rows of one (sequence, layer) on the device, for all its KV heads.
  // - The selection, in two generations: `cur` is what the next attention substitutes, the other
  //   receives the next selection and, from the fetch's cache update, its rows' slots in the
  //   row cache. Head h's list starts at h * count.
  // - The row cache: what the next fetch hits, and (KvConfig::attend_resident) what the attention
  //   substitutes. Reserved at the first fetch (or seeding); while it holds no entries (!filled():
  //   before the first fetch unless seeded, and after a failed fetch) its contents are void, and
  //   the next fetch empties it first.
  struct LayerRows {
    Buffer<int32_t> tokens[2];  // [n_kv][count] ascending per head
    Buffer<int32_t> slots[2];   // [n_kv][count]: the cache row of each token (head h's from h * capacity)
    int cur = 0;
    int32_t resident = 0;       // per head, in generation cur
    int32_t selected = 0;       // per head, in generation 1 - cur (waiting for the fetch)
    bool selected_on_device = false;  // its tokens counted by the selection's kernels (SelectionTarget)
    CacheList cache;
    Buffer<Half> cache_rows;    // [n_kv][capacity][2][head_dim] by slot: rows never move (CacheUpdateTask)
    int32_t fetches = 0;        // since the cache was last emptied
    bool seeded = false;        // its list was written at prefill (Seed), until a failed fetch voids it
    bool filled() const { return fetches > 0 || seeded; }
  };
  // One fetch's device work: planned on the agent's thread (Prepare), queued on a stream by the
  // thread that runs it (Launch). It names device memory only: the caches it reads and writes
  // stay allocated while it is queued, whoever holds them by then (spare_lists_).
  struct FetchWork {
    struct Fill {  // a row cache's first use: its tokens all kNoToken, its counts 0
      void* at;
      size_t bytes;
      int value;
    };
    int layer = 0;
    std::vector<SequenceId> ids;  // the sequences fetched
    std::vector<Fill> fills;
    std::vector<FetchTask> tasks;
    std::vector<SequenceId> task_sequences;  // [tasks]
    std::vector<const uint8_t* const*> host_pages;  // [tasks] DevicePageTable::HostLayer (null: staged source)
    std::vector<CacheUpdateTask> updates;  // [tasks]: task i's rows go into update i's cache
    // By the copy engine: its first sm_tasks tasks (whole sequences) are read by FetchRows
    // instead, on sm_fetch_ (fetch_sm_share); their out_rows are set, and their fills are the
    // first sm_fills.
    size_t sm_tasks = 0;
    size_t sm_fills = 0;
    // The layer's page writes were queued after its selection on the same stream (MarkAppended):
    // their event alone orders both.
    bool writes_follow_selection = false;
  };
  // The events a fetch of the work's layer waits for: its selection's and its page writes' (the
  // writes' alone when they follow the selection, FetchWork::writes_follow_selection), in `storage`.
  std::span<const cudaEvent_t> ReadyEvents(const FetchWork& work, cudaEvent_t (&storage)[2]) const;
  // `stream` waits for ReadyEvents.
  Status WaitForSelectionAndWrites(const FetchWork& work, cudaStream_t stream) const;
  // The row cache of a (sequence, layer), list and rows, at KvConfig::cache_rows() (kept if it was).
  Status ReserveCache(LayerRows* lr) const;
  // The layer's next selection of these sequences made current, its work planned: each fetched
  // sequence's row cache list is swapped with a spare, which the work's update writes from the old
  // one (the rows stay: the update writes the missed ones into free slots).
  // `by_copy_engine`: the work's Launch stages the missed rows by the copy engine (FetchRows
  // output buffers only for its SM share: SmSequences). Reserves all the device memory it needs first: on an error
  // (RESOURCE_EXHAUSTED) nothing changed.
  Result<FetchWork> Prepare(int layer, const std::vector<SequenceId>& ids, bool by_copy_engine);
  // Queues the work on `stream`; `staged` (a source without pages) or `copy_engine` brings the
  // missed rows first (both null: FetchRows reads them from the pages). The kernels' task lists go
  // through `plan`, the one of the thread that calls (worker_plan_, caller_plan_).
  Status Launch(const FetchWork& work, StagedFetch* staged, CopyEngineFetch* copy_engine, cudaStream_t stream,
                DecodePlan* plan) const;
  // Launch's SM route for the work's first n tasks: FetchRows from the pages (which counts the hits
  // and misses), then their caches' update, on `stream`.
  Status LaunchBySmLoads(const FetchWork& work, size_t n, cudaStream_t stream, DecodePlan* plan) const;
  // The copy engine's part of Launch: the work's SM share (sm_tasks) on sm_fetch_, ending in the
  // layer's sm_fetched_ event, and the rest staged by the copy engine on `stream`.
  Status LaunchByCopyEngine(const FetchWork& work, CopyEngineFetch* copy_engine, cudaStream_t stream,
                            DecodePlan* plan) const;
  // Of `fetched` sequences, how many the SM route takes (fetch_sm_share, rounded to nearest).
  size_t SmSequences(size_t fetched) const;
  // Queues the deferred fetch, if any, on the fetch stream behind everything queued so far on the
  // compute stream and behind its layer's selection and page writes (selected_, appended_: they
  // may run on the selection's own stream, which the compute stream joins only at the next
  // attention), then records its layer's fetched_ event.
  Status LaunchDeferred() const;
  // After a failed fetch: the sequences hold no rows at the layer, and their caches start over.
  void Forget(int layer, const std::vector<SequenceId>& ids);
  // Runs `job` now: on this thread, or staged on the worker, waiting for it; with the plan of the
  // thread it runs on.
  Status OnSourceThread(const std::function<Status(DecodePlan*)>& job);

  ModelShape shape_;
  KvConfig config_;
  CudaAgentOptions options_;
  const DevicePageTable* pages_;
  cudaStream_t compute_;
  cudaStream_t fetch_ = nullptr;
  std::vector<cudaEvent_t> selected_, fetched_;  // [layer]
  // [layer]: recorded right after the layer's page writes of the step, on their stream
  // (MarkAppended; a step without appends leaves the last record, long complete): when an append
  // fills the residual, the selection's candidates include the row written in that same step
  // (TopKCandidates), and the selection's own event (selected_, on the planner's selection
  // stream, where it has one) does not order that write. The deferred fetch starts later on the compute stream.
  std::vector<cudaEvent_t> appended_;
  // [layer]: the stream of the layer's last MarkSelected, and whether its last MarkAppended came on
  // that stream after it (FetchWork::writes_follow_selection). The agent's thread only.
  std::vector<cudaStream_t> selected_on_;
  std::vector<uint8_t> writes_follow_selection_;
  // [layer]: the compute stream waits for the layer's last fetch already (WaitFetched succeeded
  // since the layer's last StartFetch).
  std::vector<uint8_t> joined_;
  cudaEvent_t deferred_start_ = nullptr;          // where on the compute stream the deferred fetch begins
  // The seeding's stream (made at the first SeedFrom), where it starts on the compute stream, and
  // its end, which the compute stream waits for.
  cudaStream_t seed_ = nullptr;
  cudaEvent_t seed_from_ = nullptr, seeded_ = nullptr;
  // The local overlapped fetch started but not yet queued (StartFetch to the next WaitFetched or
  // WaitForFetchStream), its layer in it. Mutable: queueing it changes nothing the fetcher reports.
  mutable std::shared_ptr<const FetchWork> deferred_;
  int join_layer_ = -1;  // kWithinNextAttention: the fetch queued at the last WaitFetched, until JoinFetch
  Buffer<FetchCounters> device_counters_;
  std::unordered_map<SequenceId, std::vector<LayerRows>> rows_;  // [layer] per sequence; hashed (decode loop)
  // The targets of the cache updates' lists, shared by all (sequence, layer)s: Prepare swaps the
  // first ones with the lists of the caches it fetches for. So the pool only grows to the most
  // sequences one fetch (of one layer) fetched for: one layer's lists of the largest batch (~96 KB
  // per sequence at Llama-3-8B shapes with 1024-row caches; with an SM share the two pools
  // together, give or take one from rounding). A list needs no second generation of
  // its own because its old generation is done with once its update is queued, and the rows, in
  // place, need none because the update writes only slots that no entry of either list that a
  // queued reader may read still names (the old list's evicted entries):
  // - every update that takes its target from a pool runs on that pool's one stream (this pool:
  //   the fetch stream, or Fetch's; sm_spare_lists_: sm_fetch_), in the order of the Prepares
  //   that planned them: StartFetch queues a deferred fetch before it prepares the next one (and
  //   prepares none while that fails, so a deferred fetch queued again finds its old cache as it
  //   was), and the worker runs the staged fetches in the order they were handed to it. A list
  //   swapped out of a cache goes into the pool its replacement came from. So the next update
  //   that writes a cache put back into a pool runs after this fetch's kernel and update, the old
  //   cache's last readers on that stream (and, staged, the copy of its tokens to the host; by
  //   the copy engine, the list of missed rows, which the host waits for before queueing the
  //   update);
  // - the only other reader of the old cache (list and rows) is the layer's attention, queued
  //   on the compute stream before the selection this fetch waits for (MarkSelected: the
  //   selection forks off after the attention; or the deferred start recorded after it; Fetch
  //   runs on the compute stream itself), and every
  //   attention queued from now on substitutes the new cache, after waiting for this fetch (both
  //   parts of it, by the copy engine with an SM share); so a (sequence, layer) whose fetches
  //   change part from step to step is ordered through the compute stream (and one whose fetch
  //   failed, whose list may still have a writer on the other stream, through the fills' wait for
  //   both streams: Launch);
  // - the host reads a cache (AddStats) only once the streams are idle.
  // A spare's contents do not matter: the update writes all of the new list.
  std::vector<CacheList> spare_lists_;
  // The copy engine's SM share's pool, the same way on sm_fetch_ (the first sequences of a fetch).
  std::vector<CacheList> sm_spare_lists_;
  // FetchRows' output for the routes other than the copy engine (and its SM share), one per sequence of a fetch
  // ([n_kv][max_selected][2][head_dim], each reserved once at that size), read by the same
  // fetch's cache update: the next fetch's FetchRows, which writes it again, runs after that
  // update on the same stream (as the spares' writes).
  std::vector<Buffer<Half>> fetched_rows_;
  // AddStats' scratch for SumCacheCounts (grown to the filled caches' count; the agent's one
  // thread at a time, with the streams idle).
  mutable Buffer<const int32_t*> count_lists_;
  mutable Buffer<unsigned long long> count_sum_;
  Buffer<float> seed_logits_;  // Seed's scratch: the next Seed's kernels run after this one's (one stream)
  int64_t rows_selected_ = 0;
  // Staged only (UseStagedSource): one StagedFetch per stream it stages on (the overlapped fetch
  // on the fetch stream; Fetch and Gather on the stream they are given, the compute stream), both
  // used on the worker only, and per layer the sequences of the fetch handed to the worker.
  FullPrecisionSource* staged_source_ = nullptr;
  SourceWorker* worker_ = nullptr;
  std::unique_ptr<StagedFetch> staged_worker_, staged_inline_;
  std::vector<std::vector<SequenceId>> handed_;  // [layer]
  // Copy engine only (UseCopyEngine): the overlapped fetch's route, used on the worker only.
  int copy_engine_threads_ = 0;  // the gather's threads; 0: no copy engine
  std::unique_ptr<CopyEngineFetch> copy_engine_;
  // fetch_sm_share > 0: the SM share's stream; where it starts when it fills a cache (recorded on
  // the fetch stream after the fills); its tail, which the fetch stream waits for before fills;
  // per layer its end, which WaitFetched joins; its kernels' task lists (the worker's thread).
  int64_t caller_wait_ns_ = 0;  // AgentStats::fetch_caller_wait_ns
  cudaStream_t sm_fetch_ = nullptr;
  cudaEvent_t sm_start_ = nullptr, sm_tail_ = nullptr;
  std::vector<cudaEvent_t> sm_fetched_;  // [layer]
  mutable DecodePlan sm_plan_{DecodePlan::SlotReads::kInPlace};
  // The task lists of the kernels queued from the worker's thread and from the caller's (a plan
  // serves one thread), read in place: a copy would queue behind the fetch's own on the copy
  // engine. Each destructor waits for the kernels that read its slots.
  mutable DecodePlan worker_plan_{DecodePlan::SlotReads::kInPlace}, caller_plan_{DecodePlan::SlotReads::kInPlace};
  // Seed's task lists (on the seed stream: a plan's calls stay on one stream, decode_plan_slots.h).
  DecodePlan seed_plan_{DecodePlan::SlotReads::kInPlace};
};

}  // namespace specache::cuda
