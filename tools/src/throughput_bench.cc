#include "throughput_bench.h"

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "cuda_call.h"
#include "llama_kernels.h"
#include "offload_agent.h"
#include "run_support.h"
#include "specache/agent.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_topk.h"
#include "specache/device_probe.h"
#include "specache/gpu_engine.h"
#include "specache/gpu_llama.h"
#include "specache/in_memory_source.h"

namespace specache::run {
namespace {

using gpu::Cuda;
using gpu::GpuEngine;
using gpu::GpuLlama;

// /proc/meminfo or /proc/self/status field in bytes (their figures are kB); 0 when absent.
int64_t ProcBytes(const char* file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream s(line.substr(key.size() + 1));
      int64_t kb = 0;
      s >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

int64_t DeviceFree() {
  size_t free = 0, total = 0;
  return cudaMemGetInfo(&free, &total) == cudaSuccess ? static_cast<int64_t>(free) : 0;
}

template <typename T>
struct DeviceArray {
  T* p = nullptr;
  explicit DeviceArray(size_t n) {
    if (cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~DeviceArray() { cudaFree(p); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

// The host-to-device link's speed: the median of five 256 MiB copies from pinned host memory on
// `stream` (after one untimed), in bytes per second. Every row a mode fetches crosses this link
// once, whatever route moves it, so tok/s x fetched bytes per token can never exceed it.
Result<double> HostToDeviceBytesPerSecond(void* stream) {
  constexpr size_t kBytes = size_t{256} << 20;
  struct PinnedAndEvents {
    void* host = nullptr;
    cudaEvent_t a = nullptr, b = nullptr;
    ~PinnedAndEvents() {
      cudaFreeHost(host);
      if (a) cudaEventDestroy(a);
      if (b) cudaEventDestroy(b);
    }
  } m;
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaMallocHost(&m.host, kBytes), "the link probe's pinned buffer"));
  DeviceArray<uint8_t> device(kBytes);
  if (!device.p) return Status::ResourceExhausted("the link probe's device buffer");
  std::memset(m.host, 1, kBytes);  // touched, so that the copies do not time page faults
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreate(&m.a), "event"));
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventCreate(&m.b), "event"));
  const auto s = static_cast<cudaStream_t>(stream);
  std::vector<double> seconds;
  for (int i = 0; i < 6; ++i) {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventRecord(m.a, s), "event"));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(device.p, m.host, kBytes, cudaMemcpyHostToDevice, s), "link probe copy"));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventRecord(m.b, s), "event"));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(m.b), "link probe copy"));
    float ms = 0;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, m.a, m.b), "event time"));
    if (i > 0) seconds.push_back(ms / 1e3);
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  if (!(median > 0)) return Status::Internal("link probe: a copy timed at 0 ms");
  return double(kBytes) / median;
}

struct Run {
  int batch = 0;
  int64_t device_used = 0;  // device bytes this process holds (weights included), after the steps
  double tokens_per_s = 0, ms_step = 0;
  gpu::PhaseTimes phases;   // per step
  double fetched_bytes_per_token = 0;
  AgentStats stats;
  int64_t host_rss = 0;
  // The share of the source's resident slabs in huge pages after the steps (InMemorySource::mapping;
  // -1: unknown or nothing resident): a run whose pages got fewer may gather its rows slower.
  double host_huge_share = -1;
};

class Bench {
 public:
  // link_bytes_per_s: HostToDeviceBytesPerSecond, or 0 where it could not be measured.
  Bench(const ThroughputOptions& o, GpuLlama* model, int64_t baseline_free, double link_bytes_per_s)
      : o_(o), model_(model), baseline_free_(baseline_free), link_bytes_per_s_(link_bytes_per_s) {}

  int64_t Fp16BytesPerSequence(int context) const {
    const LlamaConfig& c = model_->config();
    return int64_t{context} * c.n_layers * c.n_kv_heads * HostRowBytes(HostRowFormat::kFp16, c.head_dim);
  }
  // The host RAM a sequence's full-precision rows take in `mode`'s row format (host-rows=int8: about half).
  int64_t HostBytesPerSequence(const std::string& mode, int context) const {
    const Result<KvConfig> k = Config(mode);
    const LlamaConfig& c = model_->config();
    return int64_t{context} * c.n_layers * c.n_kv_heads * HostRowBytes(k.ok() ? k->host_row_format : HostRowFormat::kFp16, c.head_dim);
  }

  Result<KvConfig> Config(const std::string& mode) const {
    // host-rows= alone changes only how the host stores the rows: the bench's own mode with it
    // (other options start from specache-run's defaults, OptionedModeConfig).
    if (const std::string rows = "/host-rows="; mode.find(rows) == BaseMode(mode).size() &&
                                                mode.find('/', BaseMode(mode).size() + 1) == std::string::npos) {
      SPECACHE_ASSIGN_OR_RETURN(KvConfig k, Config(BaseMode(mode)));
      SPECACHE_RETURN_IF_ERROR(SetHostRows(mode.substr(BaseMode(mode).size() + rows.size()), &k));
      return k;
    }
    if (BaseMode(mode) != mode) return OptionedModeConfig(o_, mode);
    KvConfig k;
    k.key_bits = k.value_bits = o_.bits;
    k.group_size = o_.group;
    k.residual_tokens = o_.residual;
    k.top_k = o_.topk;
    if (mode == "fp16") {
      k.mode = KvMode::kFull;
    } else if (mode == "full-offload") {
      k.mode = KvMode::kFull;
    } else {
      SPECACHE_ASSIGN_OR_RETURN(k.mode, ParseKvMode(mode));
      if (k.mode == KvMode::kFull) return Status::InvalidArgument("the full-KV mode is called fp16 here");
    }
    return k;
  }

  // Prefills `batch` sequences of `context` random K/V tokens, then decodes: `steps` timed steps
  // and as many with phase timing (none of either for a probe, which runs one step).
  Result<Run> RunMode(const std::string& mode, int batch, int context, bool probe) {
    const LlamaConfig& c = model_->config();
    const ModelShape shape = model_->shape();
    SPECACHE_ASSIGN_OR_RETURN(KvConfig config, Config(mode));
    const int warm = probe ? 1 : 2, steps = probe ? 0 : o_.steps;
    const int capacity = context + 2 * (warm + steps) + 8;
    // The full precision in process memory, in large slabs (each is registered with the GPU).
    auto source = std::make_unique<InMemorySource>(64, size_t{256} << 20, o_.host_huge_pages);
    std::unique_ptr<Agent> agent;
    if (mode == "full-offload") {
      SPECACHE_ASSIGN_OR_RETURN(agent, gpu::CreateOffloadAgent(shape, {capacity, model_->stream()}));
    } else {
      CudaAgentOptions options;
      options.capacity_tokens = capacity;
      options.stream = model_->stream();
      SPECACHE_ASSIGN_OR_RETURN(options.fetch_overlap, ParseFetchOverlap(o_.fetch_overlap));
      SPECACHE_ASSIGN_OR_RETURN(options.fetch_via, ParseFetchVia(o_.fetch_via));
      if (o_.fetch_threads > 0) options.fetch_threads = o_.fetch_threads;
      if (o_.fetch_copy_piece_kb >= 0) options.fetch_copy_piece_bytes = int64_t{o_.fetch_copy_piece_kb} << 10;
      if (o_.fetch_sm_share >= 0) options.fetch_sm_share = o_.fetch_sm_share;
      if (!o_.fetch_gather_stores.empty()) options.fetch_streaming_stores = o_.fetch_gather_stores == "streaming";
      if (o_.fetch_gather_spin_us > 0) options.fetch_gather_spin_us = o_.fetch_gather_spin_us;
      if (!o_.selection_stream.empty()) options.selection_on_own_stream = o_.selection_stream == "own";
      if (o_.plan_threads > 0) options.plan_threads = o_.plan_threads;
      if (o_.fetch_blocks > 0) options.fetch_blocks = o_.fetch_blocks;
      options.mma_codes = o_.replica_layout != "natural";
      SPECACHE_ASSIGN_OR_RETURN(agent, CreateCudaAgent(shape, config, source.get(), options));
    }
    std::vector<SequenceId> ids;
    for (int s = 0; s < batch; ++s) {
      ids.push_back(static_cast<SequenceId>(s + 1));
      SPECACHE_RETURN_IF_ERROR(agent->AddSequence(ids.back()));
    }
    {  // store-only prefill of random K/V, a sequence at a time
      const size_t kv = size_t(context) * c.n_kv_heads * c.head_dim;
      // Random queries too where the row cache is seeded at prefill (KvConfig::seed_rows needs them).
      const size_t qn = config.seed_rows > 0 ? size_t(context) * c.n_heads * c.head_dim : 0;
      DeviceArray<float> k(kv), v(kv), q(qn);
      if (!k.p || !v.p || (qn && !q.p)) return Status::ResourceExhausted("prefill buffers");
      const int32_t offsets[] = {0, context};
      for (int l = 0; l < c.n_layers; ++l) {
        for (int s = 0; s < batch; ++s) {
          gpu::Fill(k.p, int64_t(kv), 1000u + 97u * l + 7919u * s, 2.0f, model_->stream());
          gpu::Fill(v.p, int64_t(kv), 2000u + 89u * l + 7919u * s, 1.0f, model_->stream());
          if (qn) gpu::Fill(q.p, int64_t(qn), 3000u + 83u * l + 7919u * s, 1.0f, model_->stream());
          PrefillBatch b{std::span<const SequenceId>(&ids[s], 1), offsets, qn ? q.p : nullptr, k.p, v.p, nullptr};
          SPECACHE_RETURN_IF_ERROR(agent->PrefillLayer(l, b));
        }
      }
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(model_->stream())), "prefill"));
    }
    GpuEngine engine(model_, agent.get());
    engine.set_host_delay_us(o_.host_delay_us, o_.host_delay_before_projections);
    std::vector<int32_t> lengths(batch, context), tokens(batch);
    for (int s = 0; s < batch; ++s) tokens[s] = static_cast<int32_t>((7919u * (s + 1)) % uint32_t(c.vocab));
    SPECACHE_RETURN_IF_ERROR(engine.Start(ids, lengths, tokens));
    for (int i = 0; i < warm; ++i) {
      SPECACHE_ASSIGN_OR_RETURN(tokens, engine.Step(tokens));
    }
    if (o_.profile_step && !probe) {  // ThroughputOptions::profile_step
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "before the profiled step"));
      cudaProfilerStart();
      auto profiled = engine.Step(tokens);
      cudaDeviceSynchronize();
      cudaProfilerStop();
      SPECACHE_ASSIGN_OR_RETURN(tokens, std::move(profiled));
    }
    Run run;
    run.batch = batch;
    if (steps > 0) {
      const AgentStats before = agent->stats();
      const auto start = std::chrono::steady_clock::now();
      if (o_.step_ahead) {  // each step but the first queued while the one before runs, fed its tokens
        SPECACHE_RETURN_IF_ERROR(engine.QueueStep(tokens));
        for (int i = 0; i < steps; ++i) {
          if (i + 1 < steps) SPECACHE_RETURN_IF_ERROR(engine.QueueGreedyStep());
          SPECACHE_ASSIGN_OR_RETURN(tokens, engine.FinishStep());
        }
      } else {
        for (int i = 0; i < steps; ++i) {
          SPECACHE_ASSIGN_OR_RETURN(tokens, engine.Step(tokens));
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const AgentStats after = agent->stats();
      run.ms_step = 1e3 * seconds / steps;
      run.tokens_per_s = double(batch) * steps / seconds;
      run.fetched_bytes_per_token = double(after.bytes_fetched - before.bytes_fetched) / (double(batch) * steps);
      engine.set_phase_timing(true);
      for (int i = 0; i < steps; ++i) {
        SPECACHE_ASSIGN_OR_RETURN(tokens, engine.Step(tokens));
      }
      const gpu::PhaseTimes& p = engine.phase_times();
      run.phases.gemm_ms = p.gemm_ms / p.steps;
      run.phases.edges_ms = p.edges_ms / p.steps;
      run.phases.attention_ms = p.attention_ms / p.steps;
      run.phases.fetch_wait_ms = p.fetch_wait_ms / p.steps;
      run.phases.enqueue_host_ms = p.enqueue_host_ms / p.steps;
      run.phases.agent_host_ms = p.agent_host_ms / p.steps;
      run.phases.steps = p.steps;
    }
    run.stats = agent->stats();
    // Reported for specache rows only (their fetch gathers from these pages); the walk of the pages
    // (~10 ms per GiB of base pages) is skipped for the other modes.
    if (config.mode == KvMode::kSpeCache) run.host_huge_share = source->mapping().huge_share();
    run.device_used = baseline_free_ - DeviceFree();
    run.host_rss = ProcBytes("/proc/self/status", "VmRSS");
    return run;
  }

  // Milliseconds per step of the top-k alone: one SelectTopKBatch per layer over batch x KV-head
  // segments of `context` candidates (random scores), as the speculative modes run it.
  Result<double> TopKMs(int batch, int context) {
    const LlamaConfig& c = model_->config();
    const int group = c.n_heads / c.n_kv_heads, segments = batch * c.n_kv_heads;
    DeviceArray<float> probs(size_t(segments) * group * context), scratch(size_t(segments) * context);
    DeviceArray<int32_t> selected(size_t(segments) * o_.topk);
    if (!probs.p || !scratch.p || !selected.p) return Status::ResourceExhausted("top-k buffers");
    void* s = model_->stream();
    gpu::Fill(probs.p, int64_t(segments) * group * context, 5, 1.0f, s);
    std::vector<cuda::TopKSegment> segs;
    for (int i = 0; i < segments; ++i) {
      segs.push_back({probs.p + size_t(i) * group * context, selected.p + size_t(i) * o_.topk,
                      scratch.p + size_t(i) * context, context, nullptr});
    }
    cuda::DecodePlan plan;  // as the agent's planner gives it
    auto layers = [&]() -> Status {
      for (int l = 0; l < c.n_layers; ++l) {
        SPECACHE_RETURN_IF_ERROR(
            cuda::SelectTopKBatch(segs.data(), segments, group, o_.topk, GroupReduction::kMean, s, nullptr, &plan));
      }
      return Status::Ok();
    };
    SPECACHE_RETURN_IF_ERROR(layers());  // warm-up
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    // The timed layers queue behind a 20 ms hold, so that the events time the GPU's work and not
    // the host's enqueue of it (unheld, one H200 call read 6.0 ms a step at 32K, another 3.3-3.9).
    gpu::Hold(20000, s);
    cudaEventRecord(a, static_cast<cudaStream_t>(s));
    const Status timed = layers();
    cudaEventRecord(b, static_cast<cudaStream_t>(s));
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    SPECACHE_RETURN_IF_ERROR(timed);
    return double{ms};
  }

  // PyTorch SDPA's fp16 step at this batch and context (tools/bench/fp16_baseline.py).
  nlohmann::json Sdpa(int batch, int context) {
    return Script("--batches " + std::to_string(batch) + " --contexts " + std::to_string(context) +
                      " --prefill '' --steps 10",
                  "fp16_decode");
  }
  // PyTorch's fp16 prefill of `batch` prompts of `tokens` (SDPA + cuBLAS, the same script).
  nlohmann::json SdpaPrefill(int batch, int tokens) {
    return Script("--contexts '' --prefill " + std::to_string(batch) + "x" + std::to_string(tokens), "fp16_prefill");
  }
  // The script's first JSON line of `suite`, or {"error": ...}.
  nlohmann::json Script(const std::string& args, const std::string& suite) {
    const std::string cmd = o_.python + " " + o_.sdpa_script + " " + args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return {{"error", "cannot run " + cmd}};
    std::string out;
    char buf[4096];
    while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    const int rc = pclose(p);
    std::istringstream lines(out);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.empty() || line[0] != '{') continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("suite", "") == suite) return j;
    }
    return {{"error", "exit status " + std::to_string(rc) + ": " + out.substr(out.size() > 400 ? out.size() - 400 : 0)}};
  }

  Result<nlohmann::json> Measure(const std::string& mode, int context, int64_t mem_available) {
    nlohmann::json j{{"context", context}, {"mode", mode}, {"budget_bytes", o_.gpu_budget_bytes}};
    const std::string base = BaseMode(mode);
    if (base != "fp16" && base != "full-offload") {
      j["bits"] = o_.bits;
      j["group"] = o_.group;
      j["residual"] = o_.residual;
      if (base != "kivi") j["topk"] = o_.topk;
    }
    const int64_t budget = static_cast<int64_t>(o_.gpu_budget_bytes);
    SPECACHE_ASSIGN_OR_RETURN(Run one, RunMode(mode, 1, context, true));
    if (one.device_used > budget) {
      j["batch"] = 0;
      j["note"] = "one sequence does not fit the budget";
      j["device_bytes_used"] = one.device_used;
      return j;
    }
    // The agent's block pool grows by slabs: a probe of 4 sequences spreads a slab's step over 3.
    int probe = 4;
    auto more = RunMode(mode, probe, context, true);
    if (!more.ok() || more->device_used > budget) {
      probe = 2;
      more = RunMode(mode, probe, context, true);
    }
    SPECACHE_RETURN_IF_ERROR(more.status());
    const int64_t per_sequence = std::max<int64_t>((more->device_used - one.device_used) / (probe - 1), 1);
    const int gpu_limit = static_cast<int>(std::min<int64_t>(1 + (budget - one.device_used) / per_sequence, 1 << 20));
    const int64_t host_per_sequence = HostBytesPerSequence(mode, context + 2 * (2 + o_.steps) + 8);
    const int64_t host_room = static_cast<int64_t>(o_.host_ram_fraction * double(mem_available)) -
                              ProcBytes("/proc/self/status", "VmRSS");
    const int host_limit = static_cast<int>(std::max<int64_t>(host_room / host_per_sequence, 0));
    int batch = std::min({gpu_limit, host_limit, o_.max_batch});
    j["device_bytes_fixed"] = one.device_used - per_sequence;
    j["device_bytes_per_sequence"] = per_sequence;
    j["batch_gpu_limit"] = gpu_limit;
    j["batch_host_ram_limit"] = host_limit;
    j["capped_by"] = batch == gpu_limit ? "gpu budget" : batch == host_limit ? "host RAM" : "--max-batch";
    if (batch < 1) {
      j["batch"] = 0;
      j["note"] = "no sequence fits the host RAM";
      return j;
    }
    Run run;
    for (int attempt = 0;; ++attempt) {
      auto r = RunMode(mode, batch, context, false);
      if (r.ok() && (r->device_used <= budget || batch == 1 || attempt == 3)) {
        run = *r;
        break;
      }
      if (!r.ok() && (r.status().code() != StatusCode::kResourceExhausted || batch == 1 || attempt == 3)) {
        return r.status().WithContext(mode + " at " + std::to_string(batch) + " x " + std::to_string(context));
      }
      // Over the budget (or out of memory): shrink by what the excess costs and run again.
      const int64_t excess = r.ok() ? r->device_used - budget : per_sequence;
      batch = std::max(1, batch - static_cast<int>((excess + per_sequence - 1) / per_sequence));
      j["capped_by"] = "gpu budget (measured)";
    }
    double topk_ms = 0;
    if (base == "specache" || base == "specache-nonspec") {
      SPECACHE_ASSIGN_OR_RETURN(topk_ms, TopKMs(run.batch, context));
    }
    const int64_t fp16_kv = Fp16BytesPerSequence(context) * run.batch;
    j["batch"] = run.batch;
    j["tokens_per_s"] = run.tokens_per_s;
    j["ms_step"] = run.ms_step;
    j["ms_gemm"] = run.phases.gemm_ms + run.phases.edges_ms;  // the table's column: all but attention
    j["ms_gemm_layers"] = run.phases.gemm_ms;
    j["ms_step_edges"] = run.phases.edges_ms;
    if (base == "specache") {  // the other modes fetch in step, or not at all
      j["fetch_overlap"] = o_.fetch_overlap, j["fetch_via"] = o_.fetch_via, j["replica_layout"] = o_.replica_layout;
      j["host_huge_pages"] = o_.host_huge_pages;
      j["host_huge_share"] = run.host_huge_share;
      j["selection_on_own_stream"] =
          o_.selection_stream.empty() ? CudaAgentOptions{}.selection_on_own_stream : o_.selection_stream == "own";
      if (o_.fetch_blocks > 0) j["fetch_blocks"] = o_.fetch_blocks;
      if (o_.fetch_via == "copy-engine") {  // the piece in effect, the agent's default included
        j["fetch_copy_piece_kb"] =
            o_.fetch_copy_piece_kb >= 0 ? int64_t{o_.fetch_copy_piece_kb} : CudaAgentOptions{}.fetch_copy_piece_bytes >> 10;
        j["fetch_sm_share"] = o_.fetch_sm_share >= 0 ? o_.fetch_sm_share : CudaAgentOptions{}.fetch_sm_share;
        j["fetch_streaming_stores"] = o_.fetch_gather_stores.empty() ? CudaAgentOptions{}.fetch_streaming_stores
                                                                     : o_.fetch_gather_stores == "streaming";
        j["fetch_gather_spin_us"] =
            o_.fetch_gather_spin_us > 0 ? o_.fetch_gather_spin_us : CudaAgentOptions{}.fetch_gather_spin_us;
        // The agent's thread waiting for the worker's gather, and the worker's own time (its waits
        // for the device's lists and for a free pinned buffer, its gather), per decode step
        // (warm-ups included); the gather's rate over the bytes it gathered (the SM share's not).
        const auto per_step = [&](int64_t ns) {
          return run.stats.steps > 0 ? static_cast<double>(ns) / 1e6 / run.stats.steps : 0.0;
        };
        j["ms_fetch_caller_wait"] = per_step(run.stats.fetch_caller_wait_ns);
        j["ms_fetch_list_wait"] = per_step(run.stats.fetch_host_list_wait_ns);
        j["ms_fetch_buffer_wait"] = per_step(run.stats.fetch_host_buffer_wait_ns);
        j["ms_fetch_gather"] = per_step(run.stats.fetch_host_gather_ns);
        j["fetch_gather_bytes_per_s"] =
            run.stats.fetch_host_gather_ns > 0
                ? static_cast<double>(run.stats.bytes_fetched) * (1.0 - j["fetch_sm_share"].get<double>()) /
                      (static_cast<double>(run.stats.fetch_host_gather_ns) * 1e-9)
                : 0.0;
      }
    }
    j["model_graphs"] = o_.model_graphs;
    j["step_ahead"] = o_.step_ahead;
    j["timed_gemms"] = o_.timed_gemms;
    if (o_.host_delay_us > 0) {  // a probe's row (ThroughputOptions::host_delay_us)
      j["host_delay_us"] = o_.host_delay_us;
      j["host_delay_before"] = o_.host_delay_before_projections ? "products" : "attention";
    }
    if (o_.plan_threads > 0 && base != "full-offload") j["plan_threads"] = o_.plan_threads;  // every CUDA agent's
    j["ms_attention"] = std::max(0.0, run.phases.attention_ms - topk_ms);
    j["ms_topk"] = topk_ms;
    j["ms_fetch_wait"] = run.phases.fetch_wait_ms;
    // The host's time to enqueue a step, and its part in the agent's calls (PhaseTimes): well
    // below ms_step, the GPU is the bound; near it, the host's work or its waits for the GPU.
    j["ms_enqueue_host"] = run.phases.enqueue_host_ms;
    j["ms_agent_host"] = run.phases.agent_host_ms;
    j["fetched_bytes_per_token"] = run.fetched_bytes_per_token;
    // The fetch's share of the host-to-device link, and the tok/s the link allows this mode at the
    // run's fetched bytes per token (its row cache's reuse included), whatever else gets faster.
    if (link_bytes_per_s_ > 0) {
      j["h2d_link_bytes_per_s"] = link_bytes_per_s_;
      if (run.fetched_bytes_per_token > 0) {
        j["fetch_link_bytes_per_s"] = run.tokens_per_s * run.fetched_bytes_per_token;
        j["fetch_link_bound_tokens_per_s"] = link_bytes_per_s_ / run.fetched_bytes_per_token;
      }
    }
    j["gpu_kv_bytes"] = run.stats.device_bytes_reserved;
    j["gpu_kv_bytes_in_use"] = run.stats.device_bytes;
    j["gpu_kv_pool_bytes"] = run.stats.device_pool_bytes;
    j["gpu_kv_pool_used_bytes"] = run.stats.device_pool_used_bytes;
    j["fp16_kv_bytes"] = fp16_kv;
    j["gpu_kv_ratio"] = double(run.stats.device_bytes_reserved) / double(fp16_kv);
    j["gpu_kv_ratio_in_use"] = double(run.stats.device_bytes) / double(fp16_kv);
    j["device_bytes_used"] = run.device_used;
    j["host_rss_bytes"] = run.host_rss;
    // The script has Llama-3-8B's shapes only.
    if (mode == "fp16" && !o_.sdpa_script.empty() && o_.shape == "llama3-8b") j["sdpa"] = Sdpa(run.batch, context);
    return j;
  }

  // The whole model's prefill of `batch` prompts of `tokens` random tokens in `mode` (a specache
  // mode): GpuEngine::Prefill's wall time (it returns once every prompt's first token is on the host).
  // With `sdpa`, PyTorch's fp16 prefill of the same shapes beside it (--sdpa-script).
  Result<nlohmann::json> Prefill(int batch, int tokens, const std::string& mode, bool sdpa) {
    const LlamaConfig& c = model_->config();
    SPECACHE_ASSIGN_OR_RETURN(KvConfig config, Config(mode));
    // The host pages exist and are registered with the GPU before the prefill, as a daemon's are
    // when an agent attaches (cudaHostRegister takes ~0.5 s per GB): timed apart, as ms_setup.
    const auto setup_start = std::chrono::steady_clock::now();
    auto source = std::make_unique<InMemorySource>(64, size_t{256} << 20, o_.host_huge_pages);
    source->Reserve({c.n_layers, c.n_kv_heads, c.head_dim}, batch, tokens + 8);
    CudaAgentOptions options;
    options.capacity_tokens = tokens + 8;
    options.stream = model_->stream();
    SPECACHE_ASSIGN_OR_RETURN(std::unique_ptr<Agent> agent, CreateCudaAgent(model_->shape(), config, source.get(), options));
    const double ms_setup =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - setup_start).count();
    GpuEngine engine(model_, agent.get());
    std::vector<SequenceId> ids;
    std::vector<std::vector<int32_t>> prompts(batch, std::vector<int32_t>(tokens));
    for (int s = 0; s < batch; ++s) {
      ids.push_back(static_cast<SequenceId>(s + 1));
      for (int i = 0; i < tokens; ++i) prompts[s][i] = static_cast<int32_t>((7919u * (s + 1) + 104729u * i) % uint32_t(c.vocab));
    }
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "before the prefill"));
    engine.set_phase_timing(true);
    if (o_.profile_step) cudaProfilerStart();  // ThroughputOptions::profile_step: the prefill too
    const auto start = std::chrono::steady_clock::now();
    const Status prefilled = engine.Prefill(ids, prompts).status();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (o_.profile_step) cudaProfilerStop();
    SPECACHE_RETURN_IF_ERROR(prefilled);
    const gpu::PhaseTimes& p = engine.phase_times();
    nlohmann::json j{{"suite", "prefill"}, {"mode", mode}, {"batch", batch}, {"tokens", tokens}, {"ms_prefill", ms},
                     {"ms_gemm", p.gemm_ms}, {"ms_agent", p.attention_ms}, {"ms_embed", p.edges_ms},
                     {"ms_setup", ms_setup}, {"timed_gemms", o_.timed_gemms}};
    if (sdpa && !o_.sdpa_script.empty() && o_.shape == "llama3-8b") j["sdpa"] = SdpaPrefill(batch, tokens);
    return j;
  }

 private:
  const ThroughputOptions& o_;
  GpuLlama* model_;
  int64_t baseline_free_;
  double link_bytes_per_s_;
};

std::string Gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", bytes / 1e9);
  return buf;
}

void PrintRow(const nlohmann::json& j, double fp16_tokens) {
  if (j.value("batch", 0) == 0) {
    std::fprintf(stderr, "%6d %-17s %s\n", j["context"].get<int>(), j["mode"].get<std::string>().c_str(),
                 j.value("note", "").c_str());
    return;
  }
  const double tok = j["tokens_per_s"].get<double>();
  char ratio[16] = "      -";  // no fp16 step measured before this row (--kv without fp16, or after it)
  if (fp16_tokens > 0) std::snprintf(ratio, sizeof(ratio), "%6.2fx", tok / fp16_tokens);
  std::fprintf(stderr, "%6d %-17s %6d %-12s %9.0f %7s %8.2f %7.2f %7.2f %7.2f %7.2f %10.1f %7.3f %7s %7s\n",
               j["context"].get<int>(), j["mode"].get<std::string>().c_str(), j["batch"].get<int>(),
               j["capped_by"].get<std::string>().substr(0, 12).c_str(), tok, ratio,
               j["ms_step"].get<double>(), j["ms_gemm"].get<double>(), j["ms_attention"].get<double>(),
               j["ms_topk"].get<double>(), j["ms_fetch_wait"].get<double>(),
               j["fetched_bytes_per_token"].get<double>() / 1e3, j["gpu_kv_ratio"].get<double>(),
               Gb(j["device_bytes_used"].get<double>()).c_str(), Gb(j["host_rss_bytes"].get<double>()).c_str());
  if (j.contains("ms_enqueue_host")) {
    std::fprintf(stderr, "%6s %-17s host: %.2f ms to enqueue a step, %.2f of them in the agent's calls", "", "",
                 j["ms_enqueue_host"].get<double>(), j["ms_agent_host"].get<double>());
    if (j.contains("fetch_sm_share")) {  // the copy-engine fetch: the wait for its worker's gather, its SM share
      std::fprintf(stderr, " (%.2f waiting for the fetch's gather; SM share %.2f", j["ms_fetch_caller_wait"].get<double>(),
                   j["fetch_sm_share"].get<double>());
      if (j.contains("ms_fetch_gather")) {  // the worker's own time a step
        std::fprintf(stderr, "; its worker: list wait %.2f, buffer wait %.2f, gather %.2f ms (~%.1f GB/s)",
                     j["ms_fetch_list_wait"].get<double>(), j["ms_fetch_buffer_wait"].get<double>(),
                     j["ms_fetch_gather"].get<double>(), j["fetch_gather_bytes_per_s"].get<double>() / 1e9);
      }
      const double huge = j.value("host_huge_share", -1.0);
      if (huge >= 0) std::fprintf(stderr, "; host pages %.0f%% in huge pages", 100 * huge);
      if (j.contains("fetch_streaming_stores")) {
        std::fprintf(stderr, "; gather's stores %s", j["fetch_streaming_stores"].get<bool>() ? "streaming" : "cached");
      }
      if (j.value("fetch_gather_spin_us", 0) > 0) {
        std::fprintf(stderr, "; gather's own threads, %d us of spin", j["fetch_gather_spin_us"].get<int>());
      } else {
        const char* policy = std::getenv("OMP_WAIT_POLICY");
        std::fprintf(stderr, "; gather's OpenMP threads, OMP_WAIT_POLICY %s", policy ? policy : "unset");
      }
      std::fprintf(stderr, ")");
    }
    if (j.contains("selection_on_own_stream") && !j["selection_on_own_stream"].get<bool>()) {
      std::fprintf(stderr, "; the top-k in order on the model's stream");
    }
    std::fprintf(stderr, "\n");
  }
  if (j.contains("fetch_link_bound_tokens_per_s")) {
    const double link = j["h2d_link_bytes_per_s"].get<double>(), used = j["fetch_link_bytes_per_s"].get<double>();
    const double bound = j["fetch_link_bound_tokens_per_s"].get<double>();
    std::fprintf(stderr, "%6s %-17s link: the fetch moves %.1f GB/s, %.0f%% of the %.1f GB/s H2D copy measured in this run; "
                 "at these bytes per token the link alone allows %.0f tok/s",
                 "", "", used / 1e9, 100 * used / link, link / 1e9, bound);
    if (fp16_tokens > 0) std::fprintf(stderr, " (%.2fx fp16)", bound / fp16_tokens);
    std::fprintf(stderr, "\n");
  }
  if (j.contains("sdpa")) {
    const nlohmann::json& s = j["sdpa"];
    if (s.contains("tokens_per_s")) {
      std::fprintf(stderr, "%6s %-17s %6d %-12s %9.0f %6.2fx %8.2f %7.2f %7.2f   (PyTorch SDPA + cuBLAS, same batch)\n",
                   "", "fp16 (SDPA)", s["batch"].get<int>(), "", s["tokens_per_s"].get<double>(),
                   s["tokens_per_s"].get<double>() / fp16_tokens, s["ms_step"].get<double>(),
                   s["ms_gemms_step"].get<double>(), s["ms_attention_step"].get<double>());
    } else {
      std::fprintf(stderr, "%6s %-17s SDPA run failed: %s\n", "", "fp16 (SDPA)", s.dump().c_str());
    }
  }
}

}  // namespace

Result<std::vector<nlohmann::json>> RunThroughputBench(const ThroughputOptions& o) {
  SPECACHE_ASSIGN_OR_RETURN(const PrefillShape prefill, CheckThroughputOptions(o));
  const int prefill_batch = prefill.batch, prefill_tokens = prefill.tokens;
  SPECACHE_ASSIGN_OR_RETURN(CudaDeviceInfo device, ProbeCudaDevice());
  const LlamaConfig config = o.shape == "llama3-8b" ? gpu::Llama3_8bConfig() : gpu::SmolLm2Config();
  const int64_t mem_available = ProcBytes("/proc/meminfo", "MemAvailable");
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaFree(nullptr), "CUDA context"));
  const int64_t baseline_free = DeviceFree();
  SPECACHE_ASSIGN_OR_RETURN(auto model, GpuLlama::Random(config, 1, /*tied_head=*/o.shape == "smollm2"));
  model->SetDecodeGraphs(o.model_graphs);
  model->SetTimedGemms(o.timed_gemms);
  // Measured once, before any mode: a failure leaves the rows without their link figures.
  const Result<double> link = HostToDeviceBytesPerSecond(model->stream());
  if (!link.ok()) {
    (void)cudaGetLastError();  // a failed allocation leaves CUDA's last error set: the first mode would report it
    std::fprintf(stderr, "bench: the H2D link could not be measured: %s\n", link.status().ToString().c_str());
  }
  Bench bench(o, model.get(), baseline_free, link.ok() ? *link : 0.0);
  std::fprintf(stderr,
               "bench: %s shape, RANDOM weights (%.2f GB fp16), %s (%.0f GB), budget %.1f GB, host MemAvailable %.0f GB, "
               "%d timed steps%s, model graphs %s, GEMMs %s, H2D link %.1f GB/s%s\n",
               o.shape.c_str(), model->weight_bytes() / 1e9, device.name.c_str(), device.total_memory_bytes / 1e9,
               o.gpu_budget_bytes / 1e9, mem_available / 1e9, o.steps, o.step_ahead ? " (queued a step ahead)" : "",
               o.model_graphs ? "on" : "off",
               o.timed_gemms ? "timed per shape" : "cuBLAS default", link.ok() ? *link / 1e9 : 0.0,
               o.host_delay_us > 0 ? (", PROBE: the host waits " + std::to_string(o.host_delay_us) + " us before each layer's " +
                                      (o.host_delay_before_projections ? "products" : "attention"))
                                         .c_str()
                                   : "");
  std::fprintf(stderr, "%6s %-17s %6s %-12s %9s %7s %8s %7s %7s %7s %7s %10s %7s %7s %7s\n", "ctx", "mode", "batch",
               "capped_by", "tok/s", "vs_fp16", "ms_step", "gemm", "attn", "topk", "fetchw", "KB_fetch/t", "kv/fp16",
               "GPU_GB", "host_GB");
  std::vector<nlohmann::json> rows;
  for (int context : o.contexts) {
    double fp16_tokens = 0;
    std::string fp16_baseline;  // which fp16 step the ratios divide by ("agent" or "sdpa")
    const size_t first_row = rows.size();
    size_t baseline_row = SIZE_MAX;  // the fp16 row: the rows before it were printed without a ratio
    for (const std::string& mode : o.modes) {
      auto measured = bench.Measure(mode, context, mem_available);
      // A mode that cannot run (out of pinned host memory, say) is reported in its row; the
      // others still run.
      nlohmann::json j = measured.ok() ? *measured
                                       : nlohmann::json{{"context", context}, {"mode", mode}, {"batch", 0},
                                                        {"note", "failed: " + measured.status().ToString()}};
      j["shape"] = o.shape;
      j["weights"] = "random";
      j["device"] = device.name;
      j["host_mem_available_bytes"] = mem_available;
      j["weight_bytes"] = model->weight_bytes();
      if (mode == "fp16" && j.value("batch", 0) > 0) {
        // The ratios' baseline: the faster fp16 step of the batch. PyTorch SDPA's, when it ran, is
        // the strong one (the agent's own full mode attends on the CUDA cores, ~9x slower at 28 x 8K
        // on the H200).
        fp16_tokens = j["tokens_per_s"].get<double>();
        fp16_baseline = "agent";
        if (j.contains("sdpa") && j["sdpa"].contains("tokens_per_s") && j["sdpa"]["tokens_per_s"].get<double>() > fp16_tokens) {
          fp16_tokens = j["sdpa"]["tokens_per_s"].get<double>();
          fp16_baseline = "sdpa";
        }
        baseline_row = rows.size();
      }
      PrintRow(j, fp16_tokens);
      rows.push_back(std::move(j));
    }
    // The context's ratios, once fp16 ran; the rows measured before it (the modes run in --kv's
    // order: the first runs on the freshest host, so the table's scripts list specache first)
    // printed none, so theirs are printed here.
    std::string late;
    for (size_t i = first_row; fp16_tokens > 0 && i < rows.size(); ++i) {
      nlohmann::json& j = rows[i];
      if (!j.contains("tokens_per_s")) continue;
      j["speedup_vs_fp16"] = j["tokens_per_s"].get<double>() / fp16_tokens;
      j["fp16_baseline"] = fp16_baseline, j["fp16_baseline_tokens_per_s"] = fp16_tokens;
      if (j.contains("fetch_link_bound_tokens_per_s")) {
        j["fetch_link_bound_vs_fp16"] = j["fetch_link_bound_tokens_per_s"].get<double>() / fp16_tokens;
      }
      if (i >= baseline_row) continue;
      char one[160];
      std::snprintf(one, sizeof one, "%s%s %.2fx", late.empty() ? "" : ", ", j["mode"].get<std::string>().c_str(),
                    j["speedup_vs_fp16"].get<double>());
      late += one;
      if (j.contains("fetch_link_bound_vs_fp16")) {
        std::snprintf(one, sizeof one, " (the link allows %.2fx)", j["fetch_link_bound_vs_fp16"].get<double>());
        late += one;
      }
    }
    if (!late.empty()) {
      std::fprintf(stderr, "%6d vs fp16 (%s, measured after them): %s\n", context, fp16_baseline.c_str(), late.c_str());
    }
  }
  if (!o.prefill.empty()) {
    // Every specache mode of --kv (plain specache when none is), PyTorch's beside the first.
    std::vector<std::string> prefill_modes;
    for (const std::string& m : o.modes) {
      if (BaseMode(m) == "specache" && std::find(prefill_modes.begin(), prefill_modes.end(), m) == prefill_modes.end()) {
        prefill_modes.push_back(m);
      }
    }
    if (prefill_modes.empty()) prefill_modes.push_back("specache");
    const int batch = prefill_batch, tokens = prefill_tokens;
    for (const std::string& mode : prefill_modes) {
      auto measured = bench.Prefill(batch, tokens, mode, mode == prefill_modes.front());
      nlohmann::json j = measured.ok() ? *measured
                                       : nlohmann::json{{"suite", "prefill"}, {"mode", mode}, {"batch", batch},
                                                        {"tokens", tokens}, {"note", "failed: " + measured.status().ToString()}};
      j["shape"] = o.shape;
      j["weights"] = "random";
      j["device"] = device.name;
      if (j.contains("ms_prefill")) {
        std::fprintf(stderr, "prefill %d x %d (%s, the whole model): %.1f ms (GPU: gemm %.1f, agent %.1f)", batch, tokens,
                     mode.c_str(), j["ms_prefill"].get<double>(), j["ms_gemm"].get<double>(), j["ms_agent"].get<double>());
        if (j.contains("sdpa") && j["sdpa"].contains("ms_prefill")) {
          const double sdpa = j["sdpa"]["ms_prefill"].get<double>();
          std::fprintf(stderr, "; PyTorch fp16 (SDPA + cuBLAS): %.1f ms (%.2fx)", sdpa,
                       j["ms_prefill"].get<double>() / sdpa);
        }
        std::fprintf(stderr, "\n");
      } else {
        std::fprintf(stderr, "prefill %d x %d (%s): %s\n", batch, tokens, mode.c_str(), j.value("note", j.dump()).c_str());
      }
      rows.push_back(std::move(j));
    }
  }
  std::fprintf(stderr,
               "tok/s: decode tokens per second of the batch (random weights: the figures are speeds, not text). "
               "ms split per step (GPU time by CUDA events): gemm = norms, projections, MLP, LM head (JSON: ms_gemm_layers "
               "for the layers', ms_step_edges for the step's start and end: embedding, the agent's BeginStep/EndStep, "
               "LM head, argmax); attn = the agent's "
               "DecodeLayer less the top-k; topk = the top-k measured alone; fetchw = the stream waiting for prefetched "
               "rows. link (rows that fetch): the fetched bytes a second over the pinned host-to-device copy's speed, and the "
               "tok/s at which the fetch alone would fill the link (every fetched row crosses it once, by either route). "
               "kv/fp16 = GPU KV bytes held / fp16 KV bytes of the batch. vs_fp16 = tok/s over the faster fp16 "
               "step at the budget's fp16 batch: PyTorch SDPA's when --sdpa-script ran, else the agent's full mode "
               "(a weak baseline: its attention runs on the CUDA cores); -: no fp16 row measured before it (list fp16 first).\n");
  return rows;
}

}  // namespace specache::run
