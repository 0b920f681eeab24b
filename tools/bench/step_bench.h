// specache-bench step: one decode step of a 32-layer stack with Llama-3-8B shapes (32 query heads,
// 8 KV heads, head_dim 128, hidden 4096, FFN 14336: specache-run's GPU model, gpu_llama.h, with
// random fp16 weights; cuBLAS GEMMs) through the real CUDA agent in specache mode (1-bit replica, k=64,
// pages in registered host memory), with the speculative fetch and with the fetch switched off
// (CudaAgentOptions::fetch = false), measured in the same run. The ratio says what the fetch
// costs once it overlaps the later layers (CUDA builds only).
#pragma once

#include <string>
#include <vector>

#include "bench_row.h"
#include "specache/agent.h"

namespace specache::bench {

struct StepOptions {
  std::vector<int> batches{1, 8, 16, 32};  // sequences per step, at `context` tokens each
  int context = 8192;
  int steps = 10;                           // timed steps (after warm-ups)
  // The share of the batch's sequences given a fresh random input each decode step (in turn, a
  // window moving by its length); the others repeat their last input, so their queries select
  // nearly the same rows and the row cache reuses them. 1 (the default): every input fresh, the
  // row cache's worst case (random data: ~5% of the rows reused); a real model reuses far more
  // (docs/performance.md: 71-93% with the default row cache), 0.25 here reused 64% at 32 x 8K.
  double fresh_inputs = 1.0;
  int fetch_blocks = 0;                     // CudaAgentOptions::fetch_blocks; 0: the agent's default
  // CudaAgentOptions::fetch_overlap, a row each (FetchOverlapName).
  std::vector<std::string> fetch_overlap{"from-selection"};
  // CudaAgentOptions::fetch_via, a row each per overlap (FetchViaName; copy-engine ignores the
  // overlap, so it runs once, with the first). Empty: the agent's default.
  std::vector<std::string> fetch_via;
  int fetch_threads = 0;  // CudaAgentOptions::fetch_threads of the copy-engine rows; 0: the agent's default
  int fetch_copy_piece_kb = -1;  // CudaAgentOptions::fetch_copy_piece_bytes / 1024 of those rows; -1: the default
  // CudaAgentOptions::fetch_sm_share of the copy-engine rows, a row each (suffixed _smS when S > 0).
  // Empty: the agent's default.
  std::vector<double> fetch_sm_share;
  // CudaAgentOptions::fetch_streaming_stores of the copy-engine rows, a row each per SM share
  // ("streaming", "cached"; the kind that is not the agent's default suffixes its rows:
  // _streaming). Empty: the agent's default.
  std::vector<std::string> fetch_gather_stores;
  // CudaAgentOptions::mma_codes: 1-bit replicas in the lean decode path's layout (rows named as
  // before) or not (rows suffixed _natural), for the A/B of the two attention kernels.
  bool mma_codes = true;
  // Replicas timed, each a row per batch: specache-1bit, specache-2bit, kivi-1bit (no rows
  // fetched: the low-bit attention alone), specache-1bit-union (specache-run's default selection).
  std::vector<std::string> kv{"specache-1bit"};
  // One more decode step of each run with the fetch (after the warm-ups, before the timed steps,
  // untimed) between cudaProfilerStart and cudaProfilerStop: `ncu --profile-from-start off`
  // then profiles exactly one step's kernels, whatever the prefill and the agent's creation launched.
  bool profile_step = false;
  bool profile_no_fetch = false;  // the profiled step in the runs without the fetch instead
  int plan_threads = 0;  // CudaAgentOptions::plan_threads of every run; 0: the agent's default
  // The model's decode graphs (GpuLlama::SetDecodeGraphs): its products and small kernels replayed
  // from CUDA graphs, as an engine's decode runs them; off: launched one by one on every call.
  bool model_graphs = true;
  // attend: substituted rows per KV head, spread evenly over the context; -1: k (64); 0: none (the
  // attention of a step with nothing resident). specache-run's default selection attends every row
  // of its row cache (1024 rows once the cache is full).
  int attend_rows = -1;
  // attend: CTA slots the attention's plan leaves free (DecodePlan::set_free_slots), as the agent's
  // does for the fetch in specache mode (its fetch_blocks, 32); 0: none, the plan of a bare call.
  int attend_free_slots = 0;
  // attend: the substituted rows drawn at random (distinct, ascending, a seed per item), as a
  // step's top-k picks them, instead of spread one per stride (which balances the units).
  bool attend_random_rows = false;
  // attend: the random rows' draw (item i's generator seeded with rows_seed + i): the same draw in
  // every run of one seed; other seeds tell a plan's systematic effects from the draw's.
  uint32_t attend_rows_seed = 1000;
  // attend: more timings of the lean path's (1m) attention, each with its work split forced
  // (cuda::DecodePlan::force_units): "CHUNK/ORDER", CHUNK 32-token blocks per bulk unit (0: the
  // plan's), ORDER chosen, shared, first or last (the tail units' place among the warps).
  std::vector<std::string> attend_unit_plans;
  // attend: more timings of the lean path's (1m) attention, each with its L2 policy forced
  // (cuda::DecodePlan::force_codes_l2): "normal" or "first" (the codes' copies evict-first, the
  // scores evict-last; the caller checks the names), against the plan's chosen one.
  std::vector<std::string> attend_codes_l2;
  // attend: more timings of the top-k, each with its segments cut into parts of this many tokens
  // (cuda::DecodePlan::force_topk_part_tokens) instead of its chosen cut.
  std::vector<int> attend_topk_parts;
  // CudaAgentOptions::selection_on_own_stream of every run (the step bench's rows are suffixed
  // _ordered_topk when false).
  bool selection_on_own_stream = CudaAgentOptions{}.selection_on_own_stream;
  // CudaAgentOptions::page_writes_after_selection of every run (rows suffixed _ordered_writes when
  // false).
  bool page_writes_after_selection = CudaAgentOptions{}.page_writes_after_selection;
  // Each layer's StartPrefetch called once the rest of the layer (output projection, MLP) is
  // queued, as specache-run's engine does, or right after DecodeLayer (rows suffixed
  // _prefetch_early).
  bool prefetch_after_layer = true;
  // The host pages' slabs ask for transparent huge pages (InMemorySource's default), or not: the
  // copy-engine fetch's host gather walks random rows over them.
  bool host_huge_pages = true;
};


// Prints a table; false when the suite could not run (no CUDA build or no device).
bool RunStepSuite(const StepOptions& options, std::vector<BenchRow>* rows);

// specache-bench attend: one layer's decode attention (cuda::AttendDecodeBatch, real + speculative
// row, k substituted rows per KV head) and top-k (cuda::SelectTopKBatch) for B sequences x 8 KV
// heads x GQA 4 at `context` tokens, for 1- and 2-bit replicas. Reports the bytes the attention
// must read (codes, scales, zeros, residual and window, substituted rows) over its time, against
// the HBM bandwidth of a device-to-device copy measured in the same run (read + write bytes).
bool RunAttendSuite(const StepOptions& options, std::vector<BenchRow>* rows);

// specache-bench prefill: one layer's prompt attention (cuda::AttendPrefill: every KV head of a
// prompt of `context` tokens in one call, as the agent runs it) for B prompts, in TFLOPS of the
// causal half, against a cuBLAS fp16 GEMM with fp32 accumulation measured in the same run.
bool RunPrefillSuite(const StepOptions& options, std::vector<BenchRow>* rows);

// specache-bench layers: the model's work outside attention (GpuLlama's ProjectQkv and
// FinishLayer over 32 layers of Llama-3-8B shapes) for `batches` rows each, alone and beside a
// kernel that holds as many SM slots as the agent's fetch has blocks (CudaAgentOptions::fetch_blocks):
// what running the fetch beside the GEMMs costs them.
bool RunLayersSuite(const StepOptions& options, std::vector<BenchRow>* rows);

}  // namespace specache::bench
