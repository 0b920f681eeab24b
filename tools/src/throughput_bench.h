// specache-run bench: decode throughput of the whole model on the GPU at a fixed GPU memory
// budget, per KV mode (the paper's throughput table). Random weights of a named shape
// (llama3-8b or smollm2), every sequence filled with `context` tokens of random K/V (a store-only
// prefill: the decode step is what is measured), then greedy decode steps of the whole model
// (GpuLlama + the agent) with only tokens crossing to the host.
//
// For each mode the largest batch whose weights + KV state + workspace fit the budget is found
// from two probe runs (1 and 4 sequences, or 2 when 4 do not fit: the device memory this process
// holds, measured with cudaMemGetInfo, gives the fixed part and the part per sequence), capped by
// the host RAM the full-precision KV needs (MemAvailable), then run and measured again (a batch
// that exceeds the budget is shrunk and run again).
//
// Modes: fp16 (the CUDA agent in `full`: the whole fp16 KV on the GPU; PyTorch SDPA's step at the
// same batch is run next to it by tools/bench/fp16_baseline.py when --sdpa-script is given),
// kivi, specache, specache-nonspec (the --bits/--group/--residual/--topk options; the paper's row
// selection: k rows, only they attended; written "specache/OPTION/..." specache-run's generation
// defaults (run_support.h: the union, the row cache attended) with the options after '/') and
// full-offload (offload_agent.h: every row fetched from host RAM each step).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "specache/kv_config.h"
#include "specache/status.h"

namespace specache::run {

struct ThroughputOptions {
  std::string shape = "llama3-8b";      // llama3-8b or smollm2
  std::vector<int> contexts{32768};     // tokens per sequence before decoding
  uint64_t gpu_budget_bytes = uint64_t{48} << 30;
  // Run in this order: the first runs on the freshest host (after fp16 and PyTorch, specache's
  // rows ran with the host stalled in one H200 run), so specache comes first.
  std::vector<std::string> modes{"specache", "fp16", "kivi", "specache-nonspec", "full-offload"};
  int bits = 1, group = 32, residual = 64, topk = 64;
  int steps = 8;                        // timed decode steps (after 2 warm-up steps)
  int max_batch = 512;
  double host_ram_fraction = 0.8;       // of MemAvailable at start, for the full-precision KV
  std::string sdpa_script;              // tools/bench/fp16_baseline.py; empty: no SDPA row
  std::string python = "python3";
  std::string fetch_overlap = "from-selection";  // CudaAgentOptions::fetch_overlap (FetchOverlapName)
  // CudaAgentOptions::fetch_via (FetchViaName): the copy engine here, where it measured faster
  // (agent.h); the library's default stays SM loads, which takes no host threads.
  std::string fetch_via = "copy-engine";
  int fetch_threads = 0;                         // CudaAgentOptions::fetch_threads; 0: the agent's default
  // CudaAgentOptions::fetch_copy_piece_bytes in KiB; -1: the agent's default, 0: one copy a layer.
  int fetch_copy_piece_kb = -1;
  // CudaAgentOptions::fetch_sm_share; < 0: the agent's default (0). At 48 GB on the H200 the
  // whole model's step waited ~8-12 ms for the host's gather at 8K (98 sequences); with 0.3 of
  // each layer's sequences by SM loads that wait was ~0.2 ms and tok/s +18-23% (two A/B pairs),
  // specache-run's own rule +12%; at 32K (no wait) it was 5% slower.
  double fetch_sm_share = -1;
  // CudaAgentOptions::fetch_streaming_stores: "streaming", "cached", or empty (the agent's default).
  std::string fetch_gather_stores;
  // CudaAgentOptions::fetch_gather_spin_us (0: the agent's default, OpenMP's threads).
  int fetch_gather_spin_us = 0;
  // CudaAgentOptions::selection_on_own_stream: "own", "compute", or empty (the agent's default).
  std::string selection_stream;
  int plan_threads = 0;                          // CudaAgentOptions::plan_threads; 0: the agent's default
  // The host pages' slabs asked for transparent huge pages (InMemorySource's huge_pages).
  bool host_huge_pages = true;
  int fetch_blocks = 0;                          // CudaAgentOptions::fetch_blocks; 0: the agent's default
  std::string replica_layout = "mma";            // mma or natural: CudaAgentOptions::mma_codes
  // One more decode step of each measured run (after the warm-ups, untimed) between
  // cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off`; with `prefill`,
  // the prefill too (timed: its time under a profiler is not the figure).
  bool profile_step = false;
  // "BxT": after the decode rows, the whole model's prefill of B prompts of T random tokens in
  // specache mode (GpuEngine::Prefill: embedding, GEMMs, the agent's prefill attention, quantizing
  // and page writes), next to PyTorch's fp16 prefill (SDPA + cuBLAS) when --sdpa-script is given.
  // Empty: none.
  std::string prefill;
  // GpuEngine::set_host_delay_us of every decode step: a probe of whether the host's pace sets
  // the step's (the step grows by n_layers x this when it does). 0: none.
  int host_delay_us = 0;
  bool host_delay_before_projections = false;  // the delay before each layer's products instead
  // The timed steps queued a step ahead (GpuEngine::QueueGreedyStep): the host queues the next
  // step while the GPU runs this one, instead of waiting for its tokens first (GpuEngine::Step).
  // The phase split's steps are timed one at a time either way. On an H100 (int8 rows, 48 GB):
  // +6.5% tokens/s at 32 x 8K; within 1-3% at 8, 99 and 176 x 8K, 8 and 46 x 32K and 382 x 2K, one
  // or two runs a side (gpu_agent/bench_results/step_ahead_topk_h100_r40.txt).
  bool step_ahead = true;
  // GpuLlama::SetDecodeGraphs: the model's decode calls replayed from CUDA graphs (as an engine's).
  bool model_graphs = true;
  // GpuLlama::SetTimedGemms: each product shape's kernel timed and chosen (model_gemm.h), or
  // cuBLAS's default for all.
  bool timed_gemms = false;
};

// Runs every (context, mode); one JSON object per row (see the .cc for the fields), a table on
// stderr. A mode that fails gets a row with batch 0 and the error in "note". UNAVAILABLE without
// CUDA or a device.
Result<std::vector<nlohmann::json>> RunThroughputBench(const ThroughputOptions& options);

// The options' checks, made before anything is probed or measured (also in a build without
// CUDA, throughput_options.cc): --prefill's BxT (batch 0 when not given), the modes and their
// selection options, --shape. INVALID_ARGUMENT names the option.
struct PrefillShape {
  int batch = 0, tokens = 0;
};
Result<PrefillShape> CheckThroughputOptions(const ThroughputOptions& options);
// A mode's name without the selection options after it ("specache/select=union" -> "specache").
std::string BaseMode(const std::string& mode);
// The config of a mode written with specache-run's options after '/' (run_support.h's syntax):
// specache-run's generation defaults (the union, the row cache attended) with this command's
// bits, group, residual and topk, then the options.
Result<KvConfig> OptionedModeConfig(const ThroughputOptions& options, const std::string& mode);

}  // namespace specache::run
