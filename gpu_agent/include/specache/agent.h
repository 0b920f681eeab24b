// The GPU agent: the per-step API an inference loop calls to keep its KV cache as a low-bit
// replica on the device and the full precision in host memory (docs/method.md).
//
// An engine's loop, per batch of sequences (each may have a different length):
//
//   agent->AddSequence(id) for each new sequence
//   for layer in 0..L-1:  ... project Q,K,V of the prompt ...; agent->PrefillLayer(layer, batch)
//   -> sample T1 from the logits
//   if agent->RowsPerSequence(StepKind::kPreDecode) > 0:       // specache mode only
//     agent->BeginStep(kPreDecode, ids)                           // rows: [T1]
//     for layer: agent->DecodeLayer(layer, rows); agent->StartPrefetch(layer)
//     agent->EndStep()                                            // -> speculative token T'2
//   loop:
//     agent->BeginStep(kDecode, ids)                              // rows: [T_t, T'_{t+1}] in specache
//     for layer: agent->WaitPrefetch(layer)   (optional: DecodeLayer waits itself)
//                agent->DecodeLayer(layer, rows)
//                agent->StartPrefetch(layer)  (specache: the fetch runs while later layers compute)
//     agent->EndStep()                                            // -> T_{t+1}, T'_{t+2}
//
// Rows of a step (RowsPerSequence):
//   kPreDecode (specache only): 1 row, the first generated token T1. Its attention runs over the
//     replica, its top-k becomes the first fetch, and its K/V are NOT appended (T1 is appended by
//     the first kDecode step, where it is the real row).
//   kDecode: row 0 is the real token; its K/V are appended. In specache mode row 1 is the
//     speculative token: it sees row 0's K/V, its top-k picks the rows to fetch for the next step,
//     and its K/V are discarded. Other modes have 1 row.
//   specache-nonspec: 1 row; DecodeLayer computes the row's top-k over the replica, fetches those
//     rows synchronously and recomputes the attention with them (the paper's Table 4 baseline).
//
// Tensors are float32 and live where the backend computes (host memory for the CPU backend,
// device memory for the CUDA backend). K/V are rounded to fp16 on entry; all attention, including
// prefill, runs over the fp16 values, so `full` mode equals a model with an fp16 KV cache.
// Attention scale is 1/sqrt(head_dim).
//
// Errors: INVALID_ARGUMENT for bad shapes/sizes, NOT_FOUND for unknown sequences, OUT_OF_RANGE for
// layer indices, FAILED_PRECONDITION for calls out of order (the message says which call was
// expected). A failed call leaves the agent usable: the step can be abandoned with AbortStep().
//
// Thread safety: an Agent is used by one thread at a time (the engine's loop); the backend may use
// threads internally.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "specache/full_precision_source.h"
#include "specache/kv_config.h"
#include "specache/status.h"

namespace specache {

enum class StepKind { kPreDecode, kDecode };

// Prompt tokens of several sequences, concatenated (ragged batch).
struct PrefillBatch {
  std::span<const SequenceId> sequences;
  // [sequences.size() + 1], token_offsets[0] == 0: sequence i owns tokens
  // [token_offsets[i], token_offsets[i+1]) of the arrays below; each sequence >= 1 token.
  std::span<const int32_t> token_offsets;
  const float* q = nullptr;  // [total_tokens][n_q_heads][head_dim], RoPE applied
  const float* k = nullptr;  // [total_tokens][n_kv_heads][head_dim], RoPE applied
  const float* v = nullptr;  // [total_tokens][n_kv_heads][head_dim]
  // [total_tokens][n_q_heads][head_dim] attention output. May be null (then q may be too): the K/V
  // are only stored, for an engine that runs the prompt's attention with its own kernel (it must
  // use the fp16-rounded K/V to match `full` decode), or that loads the same prompt into several
  // agents. A q given without out is read only to seed the row cache (KvConfig::seed_rows).
  float* out = nullptr;
};

// The step's rows for one layer, for the sequences given to BeginStep, in that order.
// rows = RowsPerSequence(kind of the step).
struct DecodeRows {
  const float* q = nullptr;  // [n_sequences][rows][n_q_heads][head_dim]
  const float* k = nullptr;  // [n_sequences][rows][n_kv_heads][head_dim]
  const float* v = nullptr;  // [n_sequences][rows][n_kv_heads][head_dim]
  float* out = nullptr;      // [n_sequences][rows][n_q_heads][head_dim]
};

struct AgentStats {
  int64_t device_bytes = 0;          // replica + fetched rows resident on the device, all sequences
  // Device memory held for them, >= device_bytes: what the backend allocated ahead (the CUDA
  // agent: its block pool, whole, and each sequence's residual, window, row buffers and tables;
  // the CPU agent grows its replicas as tokens come, so there it equals device_bytes).
  int64_t device_bytes_reserved = 0;
  int64_t device_pool_bytes = 0;       // of device_bytes_reserved, the replica block pool (CUDA)
  int64_t device_pool_used_bytes = 0;  // the pool's blocks held by sequences
  int64_t full_precision_bytes = 0;  // fp16 K/V rows written to the source, all sequences
  int64_t rows_selected = 0;         // top-k rows asked for, all steps
  int64_t rows_fetched = 0;          // rows read from the source (selected minus reused)
  int64_t rows_reused = 0;           // selected rows already resident from the previous step
  int64_t bytes_fetched = 0;         // rows_fetched * bytes of a row as the source stores it
  int64_t steps = 0;                 // EndStep calls of kind kDecode
  // Rows' commits the source refused (the CUDA agent's writes into the source's own pages): each
  // is tried once, once its writes landed, at an EndStep (a driver that waits for each step's end
  // commits a step's rows at the next one's), stats(), ReleaseSequence or destruction; the first
  // error is reported by the next BeginStep. The sequences whose rows they were must be released.
  int64_t commits_failed = 0;
  // The CUDA agent's copy-engine fetch (FetchVia::kCopyEngine): where its worker thread's time
  // went, all steps. A step whose fetch is not hidden waits for this thread: list waits that
  // grow point at the device (the selection comes late), buffer waits at the link, gather time
  // at host memory.
  int64_t fetch_host_list_wait_ns = 0;    // waiting for the device's lists of missed rows
  int64_t fetch_host_buffer_wait_ns = 0;  // waiting for a pinned buffer's copy to the device
  int64_t fetch_host_gather_ns = 0;       // gathering the missed rows from host pages
  // The agent's own thread waiting on the host for that worker to queue a layer's fetch
  // (WaitFetched), all steps: the gather late, the engine's step stalls there (on the H200 it
  // tracked the step's wait for the fetch on the GPU, e.g. 9.2 against 8.3 ms a step).
  int64_t fetch_caller_wait_ns = 0;
};

class Agent {
 public:
  // The CPU and CUDA agents (and WrapHostTensors' through the agent it owns) release every
  // sequence still registered in their full-precision source, as ReleaseSequence does, once
  // nothing in flight uses its rows (best effort: a sequence the source refuses to release stays
  // there; after an answer that the source cannot be reached, UNAVAILABLE or DEADLINE_EXCEEDED,
  // the rest are left to the source's own teardown). A sequence kept in the daemon
  // (client::DaemonSource::Keep) stays kept.
  virtual ~Agent() = default;

  virtual const ModelShape& shape() const = 0;
  virtual const KvConfig& config() const = 0;
  virtual std::string_view backend_name() const = 0;  // "cpu" or "cuda"

  // Rows per sequence in a step of this kind; 0 when the mode has no such step
  // (kPreDecode outside specache mode).
  int RowsPerSequence(StepKind kind) const;

  // Registers a sequence and creates it in the full-precision source.
  // ALREADY_EXISTS if known; errors of the source are passed through.
  virtual Status AddSequence(SequenceId id) = 0;
  // Forgets the sequence and releases it in the source. FAILED_PRECONDITION inside a step that
  // includes it.
  virtual Status ReleaseSequence(SequenceId id) = 0;
  // Tokens appended so far (prompt + real decoded tokens), as seen by layer 0.
  virtual Result<int32_t> SequenceLength(SequenceId id) const = 0;

  // Causal attention over each sequence's prompt in full precision (the fp16-rounded K/V; the CPU
  // agent in fp32, the CUDA agent on the tensor cores at head_dim 64 / 128 with the probabilities
  // in fp16, as flash-attention keeps them: ~2e-4 relative), then the layer's K/V go to the
  // replica and to the source. Each sequence must be empty at this layer (FAILED_PRECONDITION
  // otherwise). Not allowed inside a step. After an error the batch may be part-way through the
  // layer: its sequences must be released. (The CUDA agent takes the replica blocks and the
  // source's pages of the whole batch first: when those run out, nothing of the batch changed and
  // it may be retried.)
  virtual Status PrefillLayer(int layer, const PrefillBatch& batch) = 0;

  // Starts a step for these sequences (distinct, all prefilled at every layer to equal lengths).
  virtual Status BeginStep(StepKind kind, std::span<const SequenceId> sequences) = 0;
  // Attention of the step's rows at this layer; each layer exactly once per step, any order.
  virtual Status DecodeLayer(int layer, const DecodeRows& rows) = 0;
  // Starts fetching the rows the layer's last DecodeLayer selected (specache mode; a no-op that
  // returns OK in other modes). FAILED_PRECONDITION if DecodeLayer(layer) has not run this step.
  virtual Status StartPrefetch(int layer) = 0;
  // Waits until the layer's started fetch is resident (OK if none is in flight).
  virtual Status WaitPrefetch(int layer) = 0;
  // Ends the step. FAILED_PRECONDITION unless every layer was decoded and, in specache mode,
  // every layer's prefetch was started.
  virtual Status EndStep() = 0;
  // Abandons the current step after an error. Appends already made by the step's layers are NOT
  // undone, so the sequences of an aborted kDecode step must be released.
  virtual void AbortStep() = 0;

  // The tokens whose full-precision rows the next DecodeLayer(layer) of this sequence will use
  // (ascending), for inspection and tests.
  virtual Result<std::vector<int32_t>> SelectedTokens(SequenceId id, int layer, int kv_head) const = 0;

  // Counters since creation and the memory held now. The CUDA backend waits on the host for the
  // device here (its compute and fetch streams): the fetch's hits and misses (rows_fetched,
  // rows_reused) and the row caches' sizes are counted on the device, and the rows whose page
  // writes are still landing are committed to the source first, so that it holds what
  // full_precision_bytes says. Call it between steps, not inside the decode loop.
  virtual AgentStats stats() const = 0;
};

// The CPU backend: float32 math on the host. StartPrefetch starts reading the selected rows from
// the source (FullPrecisionSource::StartReadRows); WaitPrefetch, or the layer's next DecodeLayer,
// finishes the read.
// `source` must outlive the agent. INVALID_ARGUMENT for a bad shape or config.
Result<std::unique_ptr<Agent>> CreateCpuAgent(const ModelShape& shape, const KvConfig& config,
                                              FullPrecisionSource* source);

// When the CUDA agent queues the speculative fetch of layer L (specache mode, a source with
// zero-copy pages) on its own stream. The fetch holds fetch_blocks SMs while it runs, and an
// engine's GEMMs that fill every SM in one wave (cuBLAS's decode GEMMs do) take a second wave beside
// it (on the H200 the layers of Llama-3-8B at 198 rows: 6.84 ms alone, at least 9.68 beside 32 held
// slots; gpu_agent/bench_results/NOTES.md).
enum class FetchOverlap {
  kFromSelection,        // as soon as L's selection is queued: beside the rest of layer L's work,
                         // the engine's kernels after it and layer L + 1's attention
  kBesideNextAttention,  // when layer L + 1's attention is about to be queued (its WaitFetched):
                         // beside that attention, which leaves it fetch_blocks slots
  kWithinNextAttention,  // the same, and the compute stream waits for it after that attention and
                         // selection, so it never runs beside the engine's kernels (a fetch longer
                         // than the attention stalls the step instead)
};
// "from-selection", "beside-next-attention", "within-next-attention".
std::string_view FetchOverlapName(FetchOverlap overlap);
// Every overlap's name, in the enum's order (command lines check against it).
std::vector<std::string> FetchOverlapNames();
Result<FetchOverlap> ParseFetchOverlap(std::string_view name);

// What moves the rows of the speculative fetch (specache mode, a source with zero-copy pages)
// from host to device.
enum class FetchVia {
  kSmLoads,     // the fetch kernel's blocks load them from the mapped host pages (up to fetch_blocks
                // SMs, beside the engine's kernels: FetchOverlap)
  kCopyEngine,  // the agent's threads gather the missed rows from the pages into pinned memory and
                // copies move them (fetch_copy_piece_bytes each: a DMA engine, no SM reads host memory); the device
                // is told which rows to gather through mapped memory, and the row cache's update
                // takes them from that copy (no other device-side pass). It costs a host round trip per
                // layer (the worker waits for the layer's selection) and fetch_threads host cores.
};
// "sm-loads", "copy-engine".
std::string_view FetchViaName(FetchVia via);
std::vector<std::string> FetchViaNames();
// INVALID_ARGUMENT for an unknown name.
Result<FetchVia> ParseFetchVia(std::string_view name);

struct CudaAgentOptions {
  int32_t capacity_tokens = 32768;  // most tokens per sequence (the length of its block and page tables)
  void* stream = nullptr;           // the engine's cudaStream_t: the agent's compute is queued on it
  int fetch_blocks = 32;            // most blocks of the fetch kernel; in specache mode the attention leaves them
                                    // as many CTA slots on the GPU, so a fetch runs beside it
  // false: only for measuring what the fetch costs (specache-bench step). Rows are selected as
  // usual but none is fetched, so the attention substitutes nothing; results are not SpeCache's.
  bool fetch = true;
  FetchOverlap fetch_overlap = FetchOverlap::kFromSelection;
  // kCopyEngine: the overlapped fetch's rows go through pinned memory, gathered by fetch_threads
  // host threads (at most the cores the process may use, its affinity capped by its cgroup's CPU
  // quota, less two, which the agent's own thread and the CUDA driver need: on a 16-core H100
  // host 16 threads made the 176 x 8K step 10-51% slower than 12; hosts of fewer cores not
  // measured; on the H200 host 12 threads gather one layer of 32 sequences x 8K, 8.4 MB of
  // scattered 512-byte rows, in ~0.22 ms, 8 in ~0.33; the link takes ~55 GB/s). The fetch is
  // then queued at the selection (fetch_overlap does not apply). Ignored for a source without
  // zero-copy pages (always staged) and by the modes that fetch for the step itself (nonspec,
  // oracle: they read the pages with SM loads). The default:
  // on the H200 (Llama-3-8B shapes, random data, specache-bench step) the step with the fetch
  // over the step without, kSmLoads against kCopyEngine: 32 x 8K 1.44 against 1.21-1.34 (the
  // fetch kernel with four rows in flight; one at a time it was 1.86-1.94), 8 x 8K 1.20 against
  // 1.06-1.07, 1 x 8K 1.05-1.07 against 1.04-1.05; specache-run bench at 48 GB +7% tok/s at 8K
  // (99 sequences) and +11% at 32K (24), the engine's GEMMs no longer sharing the SMs. kSmLoads
  // needs no host core.
  FetchVia fetch_via = FetchVia::kCopyEngine;
  int fetch_threads = 12;
  // kCopyEngine: a layer's rows go up in copies of at most this many bytes (0: one copy). Copies
  // of one direction run one at a time on the copy engine, so the step's own small uploads (the
  // attention's and the top-k's task lists) wait for one piece, not for the layer's rows (26 MB
  // at 99 x 8K); smaller pieces cost a driver call each.
  int64_t fetch_copy_piece_bytes = int64_t{2} << 20;
  // kCopyEngine, x86-64: the gather writes the pinned buffer with non-temporal stores (true), or
  // with plain stores (false), which leave a layer's rows in the host CPU's caches for the copy
  // engine to read there while the last-level cache holds them (the aim: a row crosses the host's
  // DRAM once, read from its page, instead of three times; not measured with memory counters).
  // The default: on an H100 host (16 cores, 300 MiB L3; Llama-3-8B shapes, random weights,
  // 176 x 8K with int8 rows, 23 MB gathered a layer) the whole model at 48 GB ran 4807-4881 tok/s
  // with plain stores against 4088-4562 with streaming ones in three alternated pairs (two
  // unpaired streaming runs the same session: 4794, 4920), and the step bench's gather took
  // 28.3-28.5 ms a step against 27.9-39.1. An earlier H200 host's 32 x 8K step (8 MB a layer) was
  // 3-9% faster with streaming stores: a host whose last-level cache cannot hold two layers' rows
  // may want true. docs/performance.md.
  bool fetch_streaming_stores = false;
  // kCopyEngine: 0, the gather's threads are OpenMP's, which follow the process's OMP_WAIT_POLICY
  // between two layers' gathers (specache-run sets passive for its CPU engine: they sleep and are
  // woken for each layer); above 0, a pool of the agent's own (spinning_pool.h) whose threads spin
  // this many microseconds after a layer's gather before they sleep, whatever the policy. Measured
  // on an H100 host (specache-run bench, 176 x 8K, int8 rows, one process each): 2000 us of spin
  // 4621 tok/s (gather 34.5 ms a step), active OpenMP 4741 (30.3 ms), passive OpenMP 5011 (30.6
  // ms, one copy a layer): the wait policy is not what bounds the gather there: default 0.
  int fetch_gather_spin_us = 0;
  // kCopyEngine: the share of each layer's fetched sequences whose missed rows the fetch kernel
  // loads from the mapped pages instead (up to fetch_blocks SMs, on a stream of its own), while
  // the host's threads gather the others': both routes read host memory over the link at once,
  // so a fetch bound by the host's gather (a large batch with little reuse) moves more rows a
  // layer. 0: the copy engine alone; 1: every row by SM loads (still through the worker). In [0, 1].
  // On the H200 (Llama-3-8B shapes, random weights, 48 GB), 0.3 took the whole model's wait for
  // the fetch at 8K (98 sequences) from ~9-12 ms a step to ~0.2 and its tok/s up 18-23%, at 32K
  // (24, no wait) down 5%; the agent alone at 32 x 8K (specache-bench step, no wait on the host's gather)
  // was ~5% slower at 0.25-0.5 and unchanged at 8 x 8K: the SM loads take SMs from the engine's
  // kernels. So the default stays 0: set it where AgentStats::fetch_caller_wait_ns shows the
  // gather late.
  double fetch_sm_share = 0.0;
  // Host threads that build a decode layer's attention items (one per sequence and KV head; the
  // calling thread is one of them). The layer's planning is on the GPU's critical path when the
  // batch is large (at 2K, 382 sequences: 3056 items a layer, ~12% of the host's step); 1: the
  // calling thread alone. At most the machine's cores (with the copy-engine fetch, mind its
  // fetch_threads gathering at the same time); without OpenMP in the build, one thread.
  int plan_threads = 1;
  // Modes that fetch the next step's rows (specache): the top-k after each layer's attention (and
  // the union rule's ranking) runs on a stream of the agent's own, forked after the attention and
  // joined by the next attention, so that it overlaps the engine's kernels in between: the output
  // projection, the MLP and the next layer's QKV (true); or in order on the engine's stream
  // (false). The default: at 32 x 8K on the H200 the step without the fetch took 9.28 ms at the
  // median against 9.94 in order (five alternated rounds, 2026-12-04). Where the GPU is full
  // (176 x 8K on an H100) the products' kernels ran ~1.4x their time alone beside it and the
  // fetch's kernels: false is the A/B for such batches (specache-bench step and specache-run bench
  // --selection-stream; gpu_agent_checks.sh selection). Compare steps and tokens/s: the split's
  // top-k, timed alone, comes out of the attention's phase only where it runs in order.
  bool selection_on_own_stream = true;
  // specache mode with the selection on its own stream (selection_on_own_stream): a decode
  // step's new rows are written into the source's pages (local pages: stores over PCIe from a
  // kernel) on the selection's stream after the layer's top-k, which the next layer's attention
  // joins, so that they run beside the engine's output projection and MLP for no host call of
  // their own (true); or in order on the engine's stream (false, and always in the other modes
  // and on the staged path), where each layer's writes stand between its attention and its output
  // projection: on an H100 at 32 x 8K ~8 us a layer alone, 13-23 beside the fetch's copies on the
  // PCIe bus. (A stream of their own, forked and joined each layer, cost the host four calls a
  // layer: 8 x 8K without the fetch +2%.) false: the A/B (specache-bench step --page-writes
  // compute).
  bool page_writes_after_selection = true;
  // The device pool of replica blocks (the quantized tokens of every sequence, taken as they grow,
  // given back at release). > 0: that many bytes, allocated when the agent is created; a sequence
  // that needs a block the pool no longer has gets RESOURCE_EXHAUSTED (PrefillLayer, BeginStep)
  // and nothing of it changes, the others go on. 0: the pool grows by 64 MiB slabs while the device
  // has memory. Each sequence also holds, outside the pool, its key residual and value window
  // (4 R rows per layer and KV head), its row buffers and caches, and its tables.
  int64_t device_pool_bytes = 0;
  // 1-bit replicas (group 32, head_dim 64 or 128, at most 4 query heads per KV head) keep the
  // groups whose keys and values are both quantized in the decode attention's mma layout, which
  // its lean path reads with one load and one AND per operand: at Llama-3-8B shapes on the H200,
  // one layer's attention at 99 x 8K in 0.37 instead of 0.62 ms. false: the previous layout and
  // kernel, only for measuring the difference (specache-run bench --replica-layout natural).
  bool mma_codes = true;
};

// The CUDA backend. Tensors are device pointers, read and written in the order of
// options.stream: calls queue work and return; the engine synchronises its stream before it
// reads `out` on the host. A source with zero-copy pages (full_precision_source.h) has its rows
// read from and written to them by the GPU in place (the fetch's rows by the fetch kernel's loads,
// or, with fetch_via = kCopyEngine, gathered by the agent's threads and copied). A source without
// them (page_tokens() == 0, e.g. client_lib's RemoteSource) is staged, chosen once here: the rows
// the fetch needs and the
// device does not hold are read from the source (StartReadRows for all of a layer's heads, then
// FinishReadRows) into pinned host memory and copied to the device; new rows are copied back and
// appended (AppendRows). Those source calls run on a thread of the agent, so the calls here never
// wait for the source; an error of a fetch comes back from the next call that waits for that layer
// (DecodeLayer, WaitPrefetch), an error of an append from the next BeginStep or ReleaseSequence.
// Either way the fetch of layer L overlaps the layers after it (it runs on the agent's own stream).
// UNAVAILABLE without CUDA or a device.
Result<std::unique_ptr<Agent>> CreateCudaAgent(const ModelShape& shape, const KvConfig& config,
                                               FullPrecisionSource* source, const CudaAgentOptions& options = {});

}  // namespace specache
