#include "step_bench.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cuda_profiler_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_stats.h"
#include "cuda/lowbit_decode.h"
#include "specache/agent.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_replica.h"
#include "specache/cuda_topk.h"
#include "specache/device_probe.h"
#include "specache/in_memory_source.h"
#include "llama_kernels.h"
#include "model_gemm.h"
#include "page_row_gather.h"
#include "usable_cores.h"
#include "specache/gpu_llama.h"

namespace specache::bench {
namespace {

using gpu::Fill;
using gpu::Hold;

constexpr int kLayers = 32, kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kTopK = 64, kVocab = 128256;
constexpr int kKv = kKvHeads * kHeadDim;

// A share as a row name's suffix: 0.25 -> "0.25", 0.5 -> "0.5", 1 -> "1".
std::string ShareName(double share) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", share);
  return text;
}

bool Ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::printf("step: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}
bool Ok(const Status& s, const char* what) {
  if (s.ok()) return true;
  std::printf("step: %s: %s\n", what, s.ToString().c_str());
  return false;
}

template <typename T>
struct DeviceArray {
  T* p = nullptr;
  explicit DeviceArray(size_t n) {
    if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~DeviceArray() { cudaFree(p); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};


// The "later layers": the model around the agent, Llama-3-8B-shaped with random weights
// (GpuLlama: norms, projections with RoPE, output projection, MLP), weight-bound like a real one.
struct Model {
  std::unique_ptr<gpu::GpuLlama> llama;
  cudaStream_t stream = nullptr;

  bool Init(int rows, bool graphs = true) {
    auto m = gpu::GpuLlama::Random(gpu::Llama3_8bConfig(), 1, /*tied_head=*/true);
    if (!Ok(m.status(), "model")) return false;
    llama = std::move(*m);
    llama->SetDecodeGraphs(graphs);
    stream = static_cast<cudaStream_t>(llama->stream());
    if (!Ok(llama->Reserve(rows), "model buffers")) return false;
    // Every row at position 0: the step's timing does not depend on the positions.
    return Ok(cudaMemsetAsync(llama->device_positions(), 0, sizeof(int32_t) * rows, stream), "positions") &&
           Ok(cudaStreamSynchronize(stream), "model");
  }
  float* q() const { return llama->q(); }
  float* k() const { return llama->k(); }
  float* v() const { return llama->v(); }
  float* out() const { return llama->attn(); }

  // A fresh input for a step (embeddings of random tokens): its queries select other rows than
  // the last step's.
  bool NewInput(uint32_t seed, int rows) { return NewInput(seed, rows, 0, rows); }
  // The same for `fresh` rows from row `first` on (wrapping past the last row); the other rows
  // keep the tokens of the last step, so their queries select nearly the rows they selected then.
  bool NewInput(uint32_t seed, int rows, int first, int fresh) {
    const int head = std::min(fresh, rows - first);
    if (head > 0) gpu::FillTokens(llama->device_tokens() + first, head, seed, kVocab, stream);
    if (fresh > head) gpu::FillTokens(llama->device_tokens(), fresh - head, seed ^ 0x9e3779b9u, kVocab, stream);
    return Ok(llama->Embed(llama->device_tokens(), rows), "embed");
  }
  bool Projections(int l, int rows) { return Ok(llama->ProjectQkv(l, rows, llama->device_positions()), "projections"); }
  bool Rest(int l, int rows) { return Ok(llama->FinishLayer(l, rows), "layer"); }
};

// Milliseconds per step of `step`, on the model's stream (events), after `warm` untimed steps.
// `before_timing` runs once the device is idle, just before the first timed step.
template <typename Fn>
double TimeSteps(Model& m, int warm, int steps, Fn step, const std::function<void()>& before_timing = {}) {
  for (int i = 0; i < warm; ++i) if (!step()) return -1;
  cudaDeviceSynchronize();
  if (before_timing) before_timing();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, m.stream);
  for (int i = 0; i < steps; ++i) if (!step()) return -1;
  cudaEventRecord(b, m.stream);
  cudaDeviceSynchronize();
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / steps;
}

struct AgentRun {
  double ms = -1;
  double bytes_per_step = 0, reused_fraction = 0;
  double device_bytes = 0, device_bytes_reserved = 0;  // AgentStats after the timed steps
  double pool_used = 0, pool_bytes = 0;                // of the reserved: the replica block pool
  double prefill_ms = 0;  // the agent's store-only prefill of every sequence, all layers (device time)
  double register_ms = 0;  // creating the agent, mostly registering the source's reserved pages (host time)
  // The copy-engine fetch's worker per timed step (AgentStats' fetch_host_*), ms.
  double list_wait_ms = 0, buffer_wait_ms = 0, gather_ms = 0, caller_wait_ms = 0;
  // The share of the source's resident slabs in huge pages after the timed steps
  // (InMemorySource::mapping; -1: unknown or not measured, runs without the fetch): runs whose
  // pages got fewer may gather slower.
  double host_huge_share = -1;
};

// One agent over `batch` fresh sequences of `context` random tokens: prefill, pre-decode, then
// timed decode steps with the model around it.
KvConfig StepKvConfig(std::string kv) {
  KvConfig config;
  // "-int8" last: the host's rows stored as int8 (KvConfig::host_row_format), half the bytes fetched.
  if (kv.ends_with("-int8")) {
    config.host_row_format = HostRowFormat::kInt8;
    kv.resize(kv.size() - 5);
  }
  config.mode = kv.rfind("kivi", 0) == 0 ? KvMode::kKivi : KvMode::kSpeCache;
  config.key_bits = config.value_bits = kv.find("2bit") != std::string::npos ? 2 : 1;
  config.top_k = kTopK;
  // specache-run's default selection (run_support.h): the union, 64 rows from the real row, their
  // successors, every cached row attended; "-noresident" without the last, "-resident" the paper's
  // rule with it.
  if (kv.find("-union") != std::string::npos) {
    config.select = SelectFrom::kUnion;
    config.top_k_real = 64;
    config.real_next = true;
    config.attend_resident = true;
  }
  if (kv.ends_with("-noresident")) config.attend_resident = false;
  if (kv.ends_with("-resident")) config.attend_resident = true;  // ("-noresident" does not end so)
  return config;
}

// The rows' suffix for StepOptions::fresh_inputs: none at 1 (every input fresh, the results'
// names before the option), else _freshP with P its percent.
std::string FreshSuffix(double fresh_inputs) {
  if (fresh_inputs >= 1.0) return "";
  return "_fresh" + std::to_string(static_cast<int>(std::lround(100 * fresh_inputs)));
}

// StepOptions::fresh_inputs as sequences of a batch: round(F x batch), at least one. The rows'
// suffix names the share asked (FreshSuffix); the JSON gives this count too.
int FreshSequences(double fresh_inputs, int batch) {
  return std::clamp(static_cast<int>(std::lround(fresh_inputs * batch)), 1, batch);
}

// One agent's run: `options` says what the run varies (fetch, its overlap and route, threads,
// blocks, the replica layout); the capacity and the stream are set here. `o` gives the context,
// the steps, the host pages' kind and the share of fresh inputs.
AgentRun RunAgent(Model& m, const std::string& kv, int batch, const StepOptions& o, CudaAgentOptions options,
                  bool profile_step = false) {
  const int context = o.context, steps = o.steps;
  const bool host_huge_pages = o.host_huge_pages;
  AgentRun run;
  const int warm = 3;
  InMemorySource source(64, size_t{1} << 30, host_huge_pages);
  const KvConfig config = StepKvConfig(kv);
  // The pages carved before the agent exists, as a daemon's pool exists before its engines: the
  // agent registers them (cudaHostRegister) at its creation, timed apart (ms_register), not inside
  // the timed prefill, where ~34 GB of new pages for 32 x 8K would be registered otherwise.
  source.Reserve({kLayers, kKvHeads, kHeadDim, config.host_row_format}, batch, context + warm + steps + 8);
  options.capacity_tokens = context + warm + steps + 8;
  options.stream = m.stream;
  const auto created = std::chrono::steady_clock::now();
  auto agent = CreateCudaAgent({kLayers, kQHeads, kKvHeads, kHeadDim}, config, &source, options);
  if (!Ok(agent.status(), "agent")) return run;
  run.register_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - created).count();
  std::vector<SequenceId> ids;
  for (int s = 0; s < batch; ++s) {
    ids.push_back(static_cast<SequenceId>(s + 1));
    if (!Ok((*agent)->AddSequence(ids.back()), "AddSequence")) return run;
  }
  {  // prefill: random K/V, all sequences of a layer at once, store-only (the engine attends)
    std::vector<int32_t> offsets;
    for (int s = 0; s <= batch; ++s) offsets.push_back(s * context);
    DeviceArray<float> k(size_t(batch) * context * kKv), v(size_t(batch) * context * kKv);
    if (!k.p || !v.p) return Ok(cudaErrorMemoryAllocation, "prefill buffers"), run;
    // Timed: the agent's share of a prefill (quantizing every layer's prompt into the replica and
    // writing its rows to the pages), the random fills excluded.
    cudaEvent_t a = nullptr, b = nullptr;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    float prefill_ms = 0;
    for (int l = 0; l < kLayers; ++l) {
      Fill(k.p, int64_t(batch) * context * kKv, 1000 + l, 2.0f, m.stream);
      Fill(v.p, int64_t(batch) * context * kKv, 2000 + l, 1.0f, m.stream);
      PrefillBatch pb{ids, offsets, nullptr, k.p, v.p, nullptr};
      cudaEventRecord(a, m.stream);
      const Status prefilled = (*agent)->PrefillLayer(l, pb);
      cudaEventRecord(b, m.stream);
      float ms = 0;
      if (!Ok(prefilled, "prefill") || !Ok(cudaEventSynchronize(b), "prefill") ||
          !Ok(cudaEventElapsedTime(&ms, a, b), "prefill timing")) {
        cudaEventDestroy(a), cudaEventDestroy(b);
        return run;
      }
      prefill_ms += ms;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    run.prefill_ms = prefill_ms;
  }
  uint32_t input_seed = 7;
  // StepOptions::fresh_inputs: the sequences given a fresh input, a window that moves on by its
  // own length each step (every sequence gets one in turn); every sequence in the pre-decode step.
  const int fresh_sequences = FreshSequences(o.fresh_inputs, batch);
  int first_fresh = 0;
  auto step = [&](StepKind kind) {
    const int per_sequence = (*agent)->RowsPerSequence(kind);
    const int rows = batch * per_sequence;
    if (!Ok((*agent)->BeginStep(kind, ids), "BeginStep")) return false;
    const bool all_fresh = kind != StepKind::kDecode || fresh_sequences == batch;
    if (!m.NewInput(++input_seed, rows, all_fresh ? 0 : first_fresh * per_sequence,
                    all_fresh ? rows : fresh_sequences * per_sequence)) {
      return false;
    }
    if (!all_fresh) first_fresh = (first_fresh + fresh_sequences) % batch;
    for (int l = 0; l < kLayers; ++l) {
      if (!m.Projections(l, rows)) return false;
      if (!Ok((*agent)->DecodeLayer(l, {m.q(), m.k(), m.v(), m.out()}), "DecodeLayer")) return false;
      if (!o.prefetch_after_layer && !Ok((*agent)->StartPrefetch(l), "StartPrefetch")) return false;
      if (!m.Rest(l, rows)) return false;
      if (o.prefetch_after_layer && !Ok((*agent)->StartPrefetch(l), "StartPrefetch")) return false;
    }
    return Ok((*agent)->EndStep(), "EndStep");
  };
  // The pre-decode step (one row, the first top-k) exists in specache mode only.
  if (config.mode == KvMode::kSpeCache && !step(StepKind::kPreDecode)) return run;
  for (int i = 0; i < warm; ++i) if (!step(StepKind::kDecode)) return run;
  if (profile_step) {  // StepOptions::profile_step
    cudaDeviceSynchronize();
    cudaProfilerStart();
    const bool stepped = step(StepKind::kDecode);
    cudaDeviceSynchronize();
    cudaProfilerStop();
    if (!stepped) return run;
  }
  const AgentStats before = (*agent)->stats();
  run.ms = TimeSteps(m, 0, steps, [&] { return step(StepKind::kDecode); });
  const AgentStats after = (*agent)->stats();
  run.bytes_per_step = static_cast<double>(after.bytes_fetched - before.bytes_fetched) / steps;
  run.device_bytes = static_cast<double>(after.device_bytes);
  run.device_bytes_reserved = static_cast<double>(after.device_bytes_reserved);
  run.pool_used = static_cast<double>(after.device_pool_used_bytes);
  run.pool_bytes = static_cast<double>(after.device_pool_bytes);
  const double selected = static_cast<double>(after.rows_selected - before.rows_selected);
  run.reused_fraction = selected > 0 ? (after.rows_reused - before.rows_reused) / selected : 0;
  auto per_step_ms = [&](int64_t after_ns, int64_t before_ns) { return (after_ns - before_ns) / 1e6 / steps; };
  run.list_wait_ms = per_step_ms(after.fetch_host_list_wait_ns, before.fetch_host_list_wait_ns);
  run.buffer_wait_ms = per_step_ms(after.fetch_host_buffer_wait_ns, before.fetch_host_buffer_wait_ns);
  run.gather_ms = per_step_ms(after.fetch_host_gather_ns, before.fetch_host_gather_ns);
  run.caller_wait_ms = per_step_ms(after.fetch_caller_wait_ns, before.fetch_caller_wait_ns);
  // Printed for the runs with the fetch only; the walk of the pages (~10 ms per GiB of base pages)
  // is skipped for the others.
  if (options.fetch) run.host_huge_share = source.mapping().huge_share();
  return run;
}

// Milliseconds of `fn` on `stream` (median of `reps` timed runs after 3 untimed ones).
template <typename Fn>
double MedianMs(cudaStream_t stream, int reps, Fn fn) {
  for (int i = 0; i < 3; ++i) if (!fn()) return -1;
  std::vector<double> ms;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < reps; ++i) {
    // The device waits behind a hold while the host queues the work, so the events time the
    // device's work, not the host's launch gaps (us_enqueue reports those).
    Hold(2000, stream);
    cudaEventRecord(a, stream);
    if (!fn()) break;
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return static_cast<int>(ms.size()) == reps ? Median(std::move(ms)) : -1;
}

// Where the tensor-core attention's tail units run, by name: --unit-plans' ORDER (chosen aside)
// and the attend rows' plan column.
struct TailOrderName {
  const char* name;
  cuda::DecodePlan::UnitOrder forced;  // as DecodePlan::force_units takes it
  cuda::TailOrder planned;             // as a plan holds it (LowBitSet::tail_order)
};
constexpr TailOrderName kTailOrderNames[] = {
    {"shared", cuda::DecodePlan::UnitOrder::kTailsShared, cuda::kTailsShared},
    {"first", cuda::DecodePlan::UnitOrder::kTailsFirst, cuda::kTailsFirst},
    {"last", cuda::DecodePlan::UnitOrder::kTailsLast, cuda::kTailsLast},
};

// The tensor-core attention's split for `items` under `plan`, as AttendDecodeBatch plans it
// (cuda::PlanArgsOf): bulk blocks a unit, the tails' order (cuda::TailOrder) and the lean path's
// L2 policy, with a line of text; chunk_blocks 0 when the items do not make one tensor-core set.
struct PlanChoice {
  int chunk_blocks = 0, tail_order = 0;
  bool codes_evict_first = false;
  std::string text;
};
PlanChoice ChosenPlan(const std::vector<cuda::DeviceDecodeItem>& items, const cuda::DecodePlan& plan) {
  std::vector<cuda::LowBitSet> sets;
  PlanChoice choice;
  if (!cuda::PlanLowBitDecode(items, cuda::PlanArgsOf(plan), &sets).ok() || sets.size() != 1) return choice;
  const cuda::LowBitSet& set = sets[0];
  const char* order = "?";
  for (const TailOrderName& n : kTailOrderNames) {
    if (n.planned == set.tail_order) order = n.name;
  }
  choice.chunk_blocks = set.chunk_blocks;
  choice.tail_order = set.tail_order;
  choice.codes_evict_first = set.codes_evict_first;
  choice.text = std::to_string(set.chunk_blocks) + "/" + order +
                (set.kernel_class >= cuda::kFirstLeanClass ? (set.codes_evict_first ? ", L2 first" : ", L2 normal") : "");
  return choice;
}

// Whether a CUDA device is usable; if not, says so for `suite`.
bool HaveDevice(const char* suite) {
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    cudaGetLastError();
    std::printf("%s: no usable CUDA device\n", suite);
    return false;
  }
  return true;
}

// A stream of `suite`'s own (the caller destroys it), or null, said, when there is no device.
cudaStream_t SuiteStream(const char* suite) {
  cudaStream_t stream = nullptr;
  if (!HaveDevice(suite) || !Ok(cudaStreamCreate(&stream), "stream")) return nullptr;
  return stream;
}

// Read + write GB/s of a 1 GiB device-to-device copy: the HBM bound of the roofline column.
double DeviceCopyGBps(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  DeviceArray<char> src(bytes), dst(bytes);
  if (!src.p || !dst.p) return -1;
  cudaMemsetAsync(src.p, 1, bytes, stream);
  const double ms = MedianMs(stream, 10, [&] {
    return Ok(cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice, stream), "copy");
  });
  return ms > 0 ? 2.0 * bytes / (ms * 1e-3) / 1e9 : -1;
}

// Bytes of a view's replica the attention reads (the kernels' inputs, each once).
double ReplicaReadBytes(const cuda::DeviceReplicaView& v) {
  const double d = v.head_dim, qk = v.quantized_keys, qv = v.quantized_values;
  const double key_bytes = qk * d * v.key_bits / 8 + qk / v.group_size * d * 4;
  const double value_bytes = qv * d * v.value_bits / 8 + qv * d / v.group_size * 4;
  return key_bytes + value_bytes + (v.length - qk) * d * 2 + (v.length - qv) * d * 2;
}

}  // namespace

namespace {

// "CHUNK/ORDER" of --unit-plans (StepOptions::attend_unit_plans), or nothing when malformed.
std::optional<std::pair<int, cuda::DecodePlan::UnitOrder>> ParseUnitPlan(const std::string& spec) {
  using Order = cuda::DecodePlan::UnitOrder;
  const size_t slash = spec.find('/');
  if (slash == std::string::npos || slash == 0) return std::nullopt;
  int chunk = 0;
  const std::string digits = spec.substr(0, slash), order = spec.substr(slash + 1);
  if (digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  chunk = std::stoi(digits);
  if (order == "chosen") return std::pair{chunk, Order::kChosen};
  for (const TailOrderName& n : kTailOrderNames) {
    if (order == n.name) return std::pair{chunk, n.forced};
  }
  return std::nullopt;
}

}  // namespace

bool RunAttendSuite(const StepOptions& o, std::vector<BenchRow>* rows) {
  // Substituted rows per item: tokens below context - 128 (the quantized ones), one per stride.
  const int quantized = o.context - 128;
  if (quantized < 1) {
    std::fprintf(stderr, "attend: --tokens must be over 128 (the substituted rows lie below context - 128)\n");
    return false;
  }
  for (const std::string& spec : o.attend_unit_plans) {
    if (!ParseUnitPlan(spec)) {
      std::fprintf(stderr, "attend: --unit-plans: \"%s\" is not CHUNK/ORDER (ORDER chosen, shared, first, last)\n",
                   spec.c_str());
      return false;
    }
  }
  for (int part : o.attend_topk_parts) {
    if (!cuda::TopKPartTokensValid(part)) {  // refused here rather than after the suite's set-up
      std::fprintf(stderr, "attend: --topk-parts: %d is not a multiple of 256 in [%d, %d]\n", part,
                   cuda::kTopKMinPartTokens, cuda::kTopKMaxPartTokens);
      return false;
    }
  }
  cudaStream_t stream = SuiteStream("attend");
  if (!stream) return false;
  const double hbm = DeviceCopyGBps(stream);
  const int group = kQHeads / kKvHeads, n_rows = 2, queries = n_rows * group;
  const int n_sub = std::min({o.attend_rows >= 0 ? o.attend_rows : kTopK, o.context / 2, quantized});
  const std::string placed =
      o.attend_random_rows ? "at random, seed " + std::to_string(o.attend_rows_seed) : std::string("spread evenly");
  std::printf("\n== attend: one layer, %d KV heads x GQA %d, 2 rows, %d substituted rows (%s), context %d, %d CTA "
              "slots left free; HBM (d2d copy, read+write) %.0f GB/s ==\n",
              kKvHeads, group, n_sub, placed.c_str(), o.context, o.attend_free_slots, hbm);
  std::printf("%-6s %5s %12s %12s %12s %12s %12s %12s %11s %10s\n", "batch", "bits", "ms_attend", "us_enqueue", "ms_topk",
              "ms_topk_mass", "ms_topk_flat", "MB_read", "GBps", "of_HBM");
  bool ok = hbm > 0;
  // 1-bit twice: in the mma layout (the lean path, what the agent uses: "1m") and not (the
  // previous tensor-core kernel, for comparison).
  struct Variant {
    int bits;
    bool mma;
  };
  const Variant variants[] = {{1, true}, {1, false}, {2, false}};
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  for (int batch : o.batches) {
    for (const Variant& variant : variants) {
      const int bits = variant.bits;
      const std::string label = std::to_string(bits) + (variant.mma ? "m" : "");
      if (variant.mma && major < 8) continue;  // the lean path's mma needs sm_80+
      const int items = batch * kKvHeads;
      ReplicaParams params{kHeadDim, bits, bits, 32, 64};
      std::vector<std::unique_ptr<cuda::DeviceHeadReplica>> replicas;
      DeviceArray<Half> k(size_t(o.context) * kHeadDim), v(size_t(o.context) * kHeadDim);
      // (At least one element each: with no substituted rows the kernel reads none of them.)
      DeviceArray<Half> new_kv(size_t(n_rows) * kHeadDim), subs(std::max<size_t>(1, size_t(items) * n_sub * 2 * kHeadDim));
      DeviceArray<float> q(size_t(items) * queries * kHeadDim), out(size_t(items) * queries * kHeadDim);
      DeviceArray<float> probs(size_t(items) * group * o.context), stats(size_t(items) * group * 2);
      const int64_t topk_per = cuda::TopKScratchFloats(o.context, true);  // room for the budget's run sums
      DeviceArray<float> topk_scratch(size_t(items) * topk_per);
      DeviceArray<int32_t> sub_tokens(std::max<size_t>(1, size_t(items) * n_sub)), selected(size_t(items) * kTopK);
      const int64_t scratch_per = cuda::DecodeScratchFloats(o.context, n_rows, group, kHeadDim);
      DeviceArray<float> scratch(size_t(items) * scratch_per);
      if (!k.p || !v.p || !subs.p || !q.p || !out.p || !probs.p || !stats.p || !topk_scratch.p || !sub_tokens.p ||
          !selected.p || !scratch.p) {
        ok = Ok(cudaErrorMemoryAllocation, "attend buffers") && false;
        continue;
      }
      Fill(new_kv.p, int64_t(n_rows) * kHeadDim, 5, 1.0f, stream);
      Fill(subs.p, int64_t(items) * n_sub * 2 * kHeadDim, 6, 1.0f, stream);
      Fill(q.p, int64_t(items) * queries * kHeadDim, 7, 1.0f, stream);
      // Substituted rows: n_sub distinct tokens over the quantized ones (ascending), spread evenly
      // (row j in stride j's span, at an offset that varies with j and the item) or, with
      // attend_random_rows, drawn at random as a step's top-k picks them.
      std::vector<int32_t> tokens(size_t(items) * n_sub);
      const int32_t stride = quantized / std::max(n_sub, 1);  // >= 1
      for (int i = 0; i < items; ++i) {
        int32_t* mine = tokens.data() + size_t(i) * n_sub;
        if (o.attend_random_rows) {
          std::mt19937 rng(o.attend_rows_seed + static_cast<uint32_t>(i));
          std::vector<int32_t> all(static_cast<size_t>(quantized));
          std::iota(all.begin(), all.end(), 0);
          for (int j = 0; j < n_sub; ++j) {  // a partial Fisher-Yates shuffle: n_sub distinct tokens
            std::swap(all[j], all[j + rng() % (all.size() - j)]);
          }
          std::sort(all.begin(), all.begin() + n_sub);
          std::copy_n(all.begin(), n_sub, mine);
        } else {
          for (int j = 0; j < n_sub; ++j) mine[j] = j * stride + (j * 127 + i) % stride;
        }
      }
      cudaMemcpy(sub_tokens.p, tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice);
      std::vector<cuda::DeviceDecodeItem> batch_items;
      std::vector<cuda::TopKSegment> segments;
      double bytes = 0;
      for (int i = 0; i < items && ok; ++i) {
        auto rep = cuda::DeviceHeadReplica::Create(params, o.context + 8, stream, nullptr, variant.mma);
        if (!Ok(rep.status(), "replica")) { ok = false; break; }
        Fill(k.p, int64_t(o.context) * kHeadDim, 100 + i, 2.0f, stream);
        Fill(v.p, int64_t(o.context) * kHeadDim, 200 + i, 1.0f, stream);
        if (!Ok((*rep)->Append(k.p, v.p, o.context), "append")) { ok = false; break; }
        cuda::DeviceDecodeItem it;
        it.replica = (*rep)->view();
        cuda::DeviceDecodeRows& r = it.rows;
        r.sub_tokens = sub_tokens.p + size_t(i) * n_sub;
        r.sub_rows = subs.p + size_t(i) * n_sub * 2 * kHeadDim;
        r.n_sub = n_sub;
        r.q = q.p + size_t(i) * queries * kHeadDim;
        r.out = out.p + size_t(i) * queries * kHeadDim;
        r.new_keys = r.new_values = new_kv.p;
        r.n_rows = n_rows;
        r.n_heads = group;
        r.scale = 1.0f / std::sqrt(float(kHeadDim));
        r.probs_row = 1;
        r.n_candidates = it.replica.quantized_keys;
        r.probs = probs.p + size_t(i) * group * o.context;
        r.probs_stats = stats.p + size_t(i) * group * 2;
        r.scratch = scratch.p + size_t(i) * scratch_per;
        bytes += ReplicaReadBytes(it.replica) + double(n_sub) * 2 * kHeadDim * 2;
        batch_items.push_back(it);
        segments.push_back({r.probs, selected.p + size_t(i) * kTopK, topk_scratch.p + size_t(i) * topk_per,
                            r.n_candidates, r.probs_stats});
        replicas.push_back(std::move(*rep));
      }
      if (!ok || !Ok(cudaStreamSynchronize(stream), "replicas")) { ok = false; continue; }
      cuda::DecodePlan plan;
      plan.set_free_slots(o.attend_free_slots);
      const double attend_ms = MedianMs(stream, 20, [&] {
        return Ok(cuda::AttendDecodeBatch(batch_items.data(), items, stream, &plan), "attend");
      });
      // One layer's top-k over the segments' scores as they are now (`budget`: the adaptive one, or
      // null), median milliseconds.
      auto topk_ms_of = [&](const cuda::TopKBudget* budget, const char* what) {
        return MedianMs(stream, 20, [&] {
          return Ok(cuda::SelectTopKBatch(segments.data(), items, group, kTopK, GroupReduction::kMean, stream, budget,
                                          &plan),
                    what);
        });
      };
      const double topk_ms = topk_ms_of(nullptr, "top-k");
      // The adaptive budget over the same scores (k_max = k, mass 0.9, k_min 8): the top-k, its run
      // sums and the budget's own launch (cuda_topk.h).
      const cuda::TopKBudget budget{0.9f, 8, nullptr};
      const double budget_ms = topk_ms_of(&budget, "top-k with the budget");
      // The top-k over scores within 0.2% of each other, as of a head that attends evenly (every key
      // in the radix select's first bin): the probabilities overwritten by raw scores in
      // [-1e-3, 1e-3), normalised by the attention's statistics. The attention rewrites them below.
      Fill(probs.p, int64_t(items) * group * o.context, 9, 1e-3f, stream);
      const double flat_ms = topk_ms_of(nullptr, "top-k over flat scores");
      if (attend_ms < 0 || topk_ms < 0 || budget_ms < 0 || flat_ms < 0) { ok = false; continue; }
      // Host time to enqueue one layer's attention (the launches, not the kernels).
      const auto host_start = std::chrono::steady_clock::now();
      for (int i = 0; i < 20; ++i) ok = Ok(cuda::AttendDecodeBatch(batch_items.data(), items, stream, &plan), "attend") && ok;
      const double host_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host_start).count() / 20;
      cudaStreamSynchronize(stream);
      const double gbps = bytes / (attend_ms * 1e-3) / 1e9;
      // The split the plan chose for these items (PlanLowBitDecode with the launch's arguments): what
      // --unit-plans' forced splits stand against.
      const PlanChoice chosen = ChosenPlan(batch_items, plan);
      std::printf("%-6d %5s %12.4f %12.1f %12.4f %12.4f %12.4f %12.2f %11.0f %10.3f%s\n", batch, label.c_str(), attend_ms,
                  host_us, topk_ms, budget_ms, flat_ms, bytes / 1e6, gbps, gbps / hbm,
                  chosen.chunk_blocks > 0 ? ("  plan: " + chosen.text).c_str() : "");
      // The top-k with its cut forced, over the attention's scores (the loop above rewrote them
      // after the flat run), against the chosen cut's time above; the lean path's rows only.
      for (int part : variant.mma ? o.attend_topk_parts : std::vector<int>{}) {
        cuda::DecodePlan forced_plan;
        forced_plan.force_topk_part_tokens(part);
        const double ms = MedianMs(stream, 20, [&] {
          return Ok(cuda::SelectTopKBatch(segments.data(), items, group, kTopK, GroupReduction::kMean, stream, nullptr,
                                          &forced_plan),
                    "top-k (forced parts)");
        });
        if (ms < 0) { ok = false; continue; }
        std::printf("%-6d %5s %12s %12s %12.4f %12s %12s %12s %11s %10s  top-k parts of %d tokens (%.3fx the chosen cut's)\n",
                    batch, label.c_str(), "", "", ms, "", "", "", "", "", part, ms / topk_ms);
        rows->push_back({"b" + std::to_string(batch) + "_bits" + label + "_ctx" + std::to_string(o.context) +
                             "_topk_parts_" + std::to_string(part),
                         {{"batch", batch}, {"context", o.context}, {"topk_part_tokens", part}, {"ms_topk_layer", ms},
                          {"over_chosen", ms / topk_ms}}});
      }
      rows->push_back({"b" + std::to_string(batch) + "_bits" + label + "_ctx" + std::to_string(o.context),
                       {{"batch", batch}, {"bits", bits}, {"mma_codes", variant.mma ? 1 : 0}, {"context", o.context},
                        {"ms_attend_layer", attend_ms},
                        {"ms_topk_layer", topk_ms}, {"ms_topk_mass_layer", budget_ms}, {"ms_topk_flat_layer", flat_ms}, {"us_enqueue", host_us}, {"bytes_read", bytes}, {"gbps", gbps}, {"hbm_gbps", hbm},
                        {"fraction_of_hbm", gbps / hbm}, {"free_slots", o.attend_free_slots},
                        {"random_rows", o.attend_random_rows ? 1 : 0}, {"rows_seed", o.attend_rows_seed},
                        {"plan_chunk_blocks", chosen.chunk_blocks}, {"plan_tail_order", chosen.tail_order},
                        {"plan_codes_evict_first", chosen.codes_evict_first ? 1 : 0}}});
      // The lean path again under a forced plan (`forced_plan`, its free slots set here), against the
      // plan's own choice just above: a row printed with `what` and one JSON row named with `suffix`,
      // `fields` after the batch's. False when the attention failed (`failed`: its error's label).
      const auto time_forced = [&](cuda::DecodePlan& forced_plan, const char* failed, const std::string& what,
                                   const std::string& suffix, const std::vector<std::pair<std::string, double>>& fields) {
        forced_plan.set_free_slots(o.attend_free_slots);
        const double ms = MedianMs(stream, 20, [&] {
          return Ok(cuda::AttendDecodeBatch(batch_items.data(), items, stream, &forced_plan), failed);
        });
        if (ms < 0) return false;
        const double forced_gbps = bytes / (ms * 1e-3) / 1e9;
        std::printf("%-6d %5s %12.4f %12s %12s %12s %12s %12.2f %11.0f %10.3f  %s (%.3fx the plan's)\n", batch,
                    label.c_str(), ms, "", "", "", "", bytes / 1e6, forced_gbps, forced_gbps / hbm, what.c_str(),
                    ms / attend_ms);
        BenchRow row{"b" + std::to_string(batch) + "_bits" + label + "_ctx" + std::to_string(o.context) + suffix,
                     {{"batch", batch}, {"bits", bits}, {"mma_codes", 1}, {"context", o.context}}};
        row.values.insert(row.values.end(), fields.begin(), fields.end());
        row.values.insert(row.values.end(),
                          {{"ms_attend_layer", ms}, {"over_planned", ms / attend_ms},
                           {"gbps", forced_gbps}, {"fraction_of_hbm", forced_gbps / hbm},
                           {"free_slots", o.attend_free_slots}, {"random_rows", o.attend_random_rows ? 1 : 0},
                           {"rows_seed", o.attend_rows_seed}});
        rows->push_back(std::move(row));
        return true;
      };
      // Its work split forced.
      for (const std::string& spec : variant.mma ? o.attend_unit_plans : std::vector<std::string>{}) {
        const auto forced = ParseUnitPlan(spec);  // checked before the suite's first run
        cuda::DecodePlan forced_plan;
        forced_plan.force_units(forced->first, forced->second);
        ok = time_forced(forced_plan, "attend (forced units)", "units " + spec, "_units_" + spec,
                         {{"forced_chunk_blocks", forced_plan.forced_chunk_blocks()},
                          {"forced_order", static_cast<int>(forced->second)}}) &&  // DecodePlan::UnitOrder
             ok;
      }
      // Its L2 policy forced.
      for (const std::string& name : variant.mma ? o.attend_codes_l2 : std::vector<std::string>{}) {
        cuda::DecodePlan forced_plan;
        // The name is "first" or "normal" (specache-bench's option checks it, as --fetch-gather-stores's).
        forced_plan.force_codes_l2(name == "first" ? cuda::DecodePlan::CodesL2::kEvictFirst
                                                   : cuda::DecodePlan::CodesL2::kNormal);
        ok = time_forced(forced_plan, "attend (forced L2 policy)", "codes L2 " + name, "_codes_l2_" + name,
                         {{"codes_l2_evict_first", name == "first" ? 1 : 0}}) &&
             ok;
      }
    }
  }
  std::printf("       per layer; x32 layers for a step. of_HBM = GBps / HBM (goal >= 0.5 for B >= 8).\n");
  cudaStreamDestroy(stream);
  return ok;
}

// TFLOPS of a cuBLAS GEMM of fp16 8192 x 8192 matrices with fp32 accumulation (the tensor cores'
// rate the prefill attention's mma can reach at best), or -1.
double GemmTflops(cudaStream_t stream) {
  constexpr int n = 8192;
  DeviceArray<Half> a(size_t(n) * n), b(size_t(n) * n), c(size_t(n) * n);
  cublasHandle_t h = nullptr;
  if (!a.p || !b.p || !c.p || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return -1;
  cublasSetStream(h, stream);
  Fill(a.p, int64_t(n) * n, 1, 1.0f, stream);
  Fill(b.p, int64_t(n) * n, 2, 1.0f, stream);
  const float one = 1.0f, zero = 0.0f;
  const double ms = MedianMs(stream, 10, [&] {
    return cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.p, CUDA_R_16F, n, b.p, CUDA_R_16F, n, &zero, c.p,
                        CUDA_R_16F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
  });
  cublasDestroy(h);
  return ms > 0 ? 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12 : -1;
}

bool RunPrefillSuite(const StepOptions& o, std::vector<BenchRow>* rows) {
  cudaStream_t stream = SuiteStream("prefill");
  if (!stream) return false;
  const double gemm = GemmTflops(stream);
  const int group = kQHeads / kKvHeads, n = o.context;
  std::printf("\n== prefill: one layer's prompt attention (cuda::AttendPrefill, %d KV heads x GQA %d, head_dim %d), "
              "%d tokens per prompt, a call per prompt; cuBLAS fp16 GEMM (fp32 accumulation) %.0f TFLOPS ==\n",
              kKvHeads, group, kHeadDim, n, gemm);
  std::printf("%-6s %8s %12s %10s %9s\n", "batch", "tokens", "ms_layer", "TFLOPS", "of_GEMM");
  // Causal: query i attends keys 0..i, d multiply-adds for the scores and d for the output each.
  const double flops_per_prompt = 2.0 * 2.0 * kQHeads * kHeadDim * (double(n) * (n + 1) / 2);
  bool ok = gemm > 0;
  DeviceArray<float> q(size_t(n) * kQHeads * kHeadDim), out(size_t(n) * kQHeads * kHeadDim);
  DeviceArray<Half> k(size_t(kKvHeads) * n * kHeadDim), v(size_t(kKvHeads) * n * kHeadDim);
  DeviceArray<float> scratch(static_cast<size_t>(cuda::PrefillScratchFloats(n, group)));
  if (!q.p || !out.p || !k.p || !v.p || !scratch.p) ok = Ok(cudaErrorMemoryAllocation, "prefill buffers") && false;
  if (ok) {
    Fill(q.p, int64_t(n) * kQHeads * kHeadDim, 7, 1.0f, stream);
    Fill(k.p, int64_t(kKvHeads) * n * kHeadDim, 8, 2.0f, stream);
    Fill(v.p, int64_t(kKvHeads) * n * kHeadDim, 9, 1.0f, stream);
  }
  for (int batch : o.batches) {
    if (!ok) break;
    // The agent calls it once per prompt (CudaAgent::PrefillLayer); the prompts here share
    // their tensors, which changes nothing the kernel does.
    const float scale = 1.0f / std::sqrt(float(kHeadDim));
    const double ms = MedianMs(stream, 5, [&] {
      for (int s = 0; s < batch; ++s) {
        if (!Ok(cuda::AttendPrefill(q.p, k.p, v.p, n, kKvHeads, group, kHeadDim, scale, out.p, scratch.p, stream),
                "prefill attention")) {
          return false;
        }
      }
      return true;
    });
    if (ms < 0) { ok = false; break; }
    const double tflops = batch * flops_per_prompt / (ms * 1e-3) / 1e12;
    std::printf("%-6d %8d %12.3f %10.1f %9.3f\n", batch, n, ms, tflops, tflops / gemm);
    rows->push_back({"b" + std::to_string(batch) + "_n" + std::to_string(n),
                     {{"batch", batch}, {"tokens", n}, {"ms_layer", ms}, {"tflops", tflops}, {"gemm_tflops", gemm},
                      {"fraction_of_gemm", tflops / gemm}}});
  }
  std::printf("       per layer; x32 layers for the model. TFLOPS count the causal half only.\n");
  cudaStreamDestroy(stream);
  return ok;
}

bool RunStepSuite(const StepOptions& o, std::vector<BenchRow>* rows) {
  if (!HaveDevice("step")) return false;
  int max_batch = 1;
  for (int b : o.batches) max_batch = std::max(max_batch, b);
  Model m;
  if (!m.Init(2 * max_batch, o.model_graphs)) return false;
  std::printf("\n== step: 32 layers, Llama-3-8B attention shapes, k=%d, context %d, fetch blocks %s, model graphs %s, "
              "fresh inputs a step %.0f%% of the sequences ==\n",
              kTopK, o.context, o.fetch_blocks > 0 ? std::to_string(o.fetch_blocks).c_str() : "default",
              o.model_graphs ? "on" : "off", 100 * o.fresh_inputs);
  std::printf("%-36s %-6s %12s %12s %12s %9s %13s %11s %12s %10s %11s\n", "kv", "batch", "ms_layers", "ms_no_fetch",
              "ms_fetch", "ratio", "MB_per_step", "reused", "GBps_to_hide", "tok_per_s", "ms_prefill");
  bool ok = true;
  for (int batch : o.batches) {
    // The model's layers alone (projections + MLP at 2 rows per sequence): the time a fetch can hide
    // under, the same for every replica.
    const int rows2 = 2 * batch;
    uint32_t seed = 1;
    const double layers_ms = TimeSteps(m, 3, o.steps, [&] {
      if (!m.NewInput(++seed, rows2)) return false;
      for (int l = 0; l < kLayers; ++l) {
        if (!m.Projections(l, rows2) || !m.Rest(l, rows2)) return false;
      }
      return true;
    });
    if (layers_ms < 0) {
      ok = false;
      continue;
    }
    for (const std::string& kv : o.kv) {
      // kivi fetches nothing: one run is both columns, and one overlap.
      const bool fetches = StepKvConfig(kv).fetches_rows();
      CudaAgentOptions base;  // what every run of the row shares
      base.mma_codes = o.mma_codes;
      if (o.fetch_blocks > 0) base.fetch_blocks = o.fetch_blocks;
      if (o.plan_threads > 0) base.plan_threads = o.plan_threads;
      base.selection_on_own_stream = o.selection_on_own_stream;
      base.page_writes_after_selection = o.page_writes_after_selection;
      CudaAgentOptions no_fetch = base;
      no_fetch.fetch = false;
      const AgentRun without =
          RunAgent(m, kv, batch, o, no_fetch, o.profile_step && o.profile_no_fetch);
      if (without.ms < 0) {
        ok = false;
        continue;
      }
      const std::vector<std::string> overlaps =
          fetches && !o.fetch_overlap.empty()
              ? o.fetch_overlap
              : std::vector<std::string>{std::string(FetchOverlapName(FetchOverlap::kFromSelection))};
      // Each overlap with each route; the copy engine ignores the overlap, so it runs with the first
      // only, once per SM share.
      struct Route {
        std::string overlap, via;
        double sm_share;
        bool streaming_stores;
      };
      std::vector<Route> routes;
      const std::vector<double> shares =
          o.fetch_sm_share.empty() ? std::vector<double>{CudaAgentOptions{}.fetch_sm_share} : o.fetch_sm_share;
      std::vector<bool> stores;  // CudaAgentOptions::fetch_streaming_stores, a row each
      for (const std::string& s : o.fetch_gather_stores) stores.push_back(s == "streaming");
      if (stores.empty()) stores.push_back(CudaAgentOptions{}.fetch_streaming_stores);
      for (const std::string& name : overlaps) {
        const std::vector<std::string> vias =
            fetches && !o.fetch_via.empty() ? o.fetch_via
                                            : std::vector<std::string>{std::string(FetchViaName(CudaAgentOptions{}.fetch_via))};
        for (const std::string& via : vias) {
          if (via != FetchViaName(FetchVia::kCopyEngine)) {
            routes.push_back({name, via, 0.0, CudaAgentOptions{}.fetch_streaming_stores});
            continue;
          }
          if (name != overlaps.front()) continue;
          for (double share : shares) {
            for (bool streaming : stores) routes.push_back({name, via, share, streaming});
          }
        }
      }
      for (const auto& [name, via_name, sm_share, streaming_stores] : routes) {
        auto overlap = ParseFetchOverlap(name);
        if (!Ok(overlap.status(), "fetch overlap")) return false;
        auto via = ParseFetchVia(via_name);
        if (!Ok(via.status(), "fetch route")) return false;
        CudaAgentOptions fetch = base;
        fetch.fetch_overlap = *overlap;
        fetch.fetch_via = *via;
        if (o.fetch_threads > 0) fetch.fetch_threads = o.fetch_threads;
        if (o.fetch_copy_piece_kb >= 0) fetch.fetch_copy_piece_bytes = int64_t{o.fetch_copy_piece_kb} * 1024;
        fetch.fetch_sm_share = sm_share;
        fetch.fetch_streaming_stores = streaming_stores;
        const AgentRun with = fetches ? RunAgent(m, kv, batch, o, fetch,
                                                       o.profile_step && !o.profile_no_fetch)
                                              : without;
        if (with.ms < 0) {
          ok = false;
          continue;
        }
        // The default overlap and the SM loads keep the row names of earlier results (the copy
        // engine, the agent's default route since, is named). The gather's store kind is named when
        // it is not the agent's default: _streaming (the default before 2026-12-05, unnamed in
        // earlier results), _cached (were the default streaming).
        const std::string suffix = (*overlap == FetchOverlap::kFromSelection ? "" : "_" + name) +
                                   (*via == FetchVia::kSmLoads ? "" : "_" + via_name) +
                                   (sm_share > 0 ? "_sm" + ShareName(sm_share) : "") +
                                   (*via == FetchVia::kCopyEngine && streaming_stores != CudaAgentOptions{}.fetch_streaming_stores
                                        ? (streaming_stores ? "_streaming" : "_cached")
                                        : "") +
                                   (o.mma_codes ? "" : "_natural") +
                                   (o.selection_on_own_stream ? "" : "_ordered_topk") +
                                   (o.page_writes_after_selection ? "" : "_ordered_writes") +
                                   (o.prefetch_after_layer ? "" : "_prefetch_early") + FreshSuffix(o.fresh_inputs);
        const double ratio = with.ms / without.ms;
        const double fp16_kv = 2.0 * o.context * kLayers * kKvHeads * kHeadDim * sizeof(Half);
        const double hide_gbps = with.bytes_per_step / (layers_ms * 1e-3) / 1e9;
        std::printf("%-36s %-6d %12.3f %12.3f %12.3f %9.3f %13.2f %11.2f %12.1f %10.0f %11.1f\n",
                    (kv + suffix).c_str(), batch, layers_ms, without.ms, with.ms, ratio, with.bytes_per_step / 1e6,
                    with.reused_fraction, hide_gbps, batch / (with.ms * 1e-3), with.prefill_ms);
        if (*via == FetchVia::kCopyEngine) {  // with an SM share the host gathers only part of the bytes
          const double gathered = with.bytes_per_step * (1.0 - sm_share);
          std::printf("%-36s its worker, ms a step: list wait %.3f, buffer wait %.3f, gather %.3f (~%.1f GB/s); the "
                      "agent's thread waited %.3f for it; host pages in huge pages: %s\n",
                      "", with.list_wait_ms, with.buffer_wait_ms, with.gather_ms,
                      with.gather_ms > 0 ? gathered / (with.gather_ms * 1e-3) / 1e9 : 0.0, with.caller_wait_ms,
                      with.host_huge_share < 0 ? "unknown" : (std::to_string(int(100 * with.host_huge_share + 0.5)) + "%").c_str());
        }
        rows->push_back({kv + suffix + "_b" + std::to_string(batch) + "_ctx" + std::to_string(o.context),
                         {{"batch", batch},
                          {"context", o.context},
                          {"fetch_blocks", o.fetch_blocks > 0 ? o.fetch_blocks : CudaAgentOptions{}.fetch_blocks},
                          // Asked for, and what the agent runs (GatherThreadsFor: at most the cores less two).
                          {"fetch_threads_asked", *via == FetchVia::kCopyEngine ? fetch.fetch_threads : 0},
                          {"fetch_threads", *via == FetchVia::kCopyEngine
                                                ? GatherThreadsFor(fetch.fetch_threads, UsableCores()) : 0},
                          {"host_huge_pages", o.host_huge_pages ? 1 : 0},
                          {"host_huge_share", with.host_huge_share},
                          {"model_graphs", o.model_graphs ? 1 : 0},
                          {"fetch_copy_piece_bytes", *via == FetchVia::kCopyEngine ? fetch.fetch_copy_piece_bytes : 0},
                          {"fetch_sm_share", *via == FetchVia::kCopyEngine ? sm_share : 0.0},
                          {"fetch_streaming_stores", *via == FetchVia::kCopyEngine && streaming_stores ? 1 : 0},
                          {"selection_on_own_stream", o.selection_on_own_stream ? 1 : 0},
                          {"page_writes_after_selection", o.page_writes_after_selection ? 1 : 0},
                          {"prefetch_after_layer", o.prefetch_after_layer ? 1 : 0},
                          {"fresh_inputs", o.fresh_inputs},
                          {"fresh_sequences", FreshSequences(o.fresh_inputs, batch)},
                          {"ms_fetch_caller_wait", with.caller_wait_ms},
                          {"ms_layers_only", layers_ms},
                          {"ms_step_no_fetch", without.ms},
                          {"ms_step_fetch", with.ms},
                          {"ms_agent_prefill_store_only", with.prefill_ms},
                          {"ms_agent_create_register_pages", with.register_ms},
                          {"ratio", ratio},
                          {"bytes_fetched_per_step", with.bytes_per_step},
                          {"device_bytes_per_sequence", with.device_bytes / batch},
                          {"device_bytes_reserved_per_sequence", with.device_bytes_reserved / batch},
                          // The reservation's parts: the replica blocks a sequence holds (the pool's
                          // slack excluded) and its own buffers (key residual, value window, row
                          // buffers and cache, tables), next to its fp16 K/V at the same context.
                          {"device_blocks_per_sequence", with.pool_used / batch},
                          {"device_fixed_per_sequence", (with.device_bytes_reserved - with.pool_bytes) / batch},
                          {"fp16_kv_bytes_per_sequence", fp16_kv},
                          {"blocks_over_fp16_kv", with.pool_used / batch / fp16_kv},
                          {"reused_fraction", with.reused_fraction},
                          {"gbps_needed_to_hide_under_layers", hide_gbps},
                          {"ms_fetch_host_list_wait", with.list_wait_ms},
                          {"ms_fetch_host_buffer_wait", with.buffer_wait_ms},
                          {"ms_fetch_host_gather", with.gather_ms},
                          {"tokens_per_s", batch / (with.ms * 1e-3)}}});
      }
    }
  }
  std::printf("       ms_prefill: the agent's store-only prefill of the batch, all layers (quantize + page writes;\n"
              "       the engine's own prefill attention and GEMMs not included; the source's pages were reserved\n"
              "       and registered before, when the agent was created: ms_agent_create_register_pages in the JSON).\n");
  std::printf("       ratio = ms_fetch / ms_no_fetch (goal <= 1.05); GBps_to_hide = fetched bytes per step over the\n"
              "       layers' own time: above what the gather reaches (specache-bench gather), the fetch cannot hide.\n"
              "       Random data, by default a fresh input every step: selections barely repeat, so reuse (and\n"
              "       the hidden share of the fetch) is the worst case; with the default row cache a real model\n"
              "       fetched 0.065-0.29 of its selected rows (docs/performance.md, the throughput table).\n"
              "       --fresh-inputs F < 1 gives a fresh input to F of the sequences a step (in turn), the others\n"
              "       repeat theirs and select nearly the same rows (rows suffixed _freshP, P its percent).\n");
  return ok;
}

bool RunLayersSuite(const StepOptions& o, std::vector<BenchRow>* rows) {
  if (!ProbeCudaDevice().ok()) {
    std::printf("layers: no CUDA device\n");
    return false;
  }
  const int most = *std::max_element(o.batches.begin(), o.batches.end());
  Model m;
  cudaStream_t side = nullptr;
  if (!m.Init(most) ||
      !Ok(cudaMemsetAsync(m.out(), 0, sizeof(float) * size_t(most) * kQHeads * kHeadDim, m.stream), "attention output") ||
      !Ok(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "stream")) {
    return false;
  }
  // As the agent's speculative fetch would if it ran beside them: its default number of blocks.
  const int held = CudaAgentOptions{}.fetch_blocks;
  auto layers = [&](int r) {
    for (int l = 0; l < kLayers; ++l) {
      if (!m.Projections(l, r) || !m.Rest(l, r)) return false;
    }
    return true;
  };
  // The bound: the layers' weights read once a step at the rate of a device-to-device copy.
  const double copy_gbps = DeviceCopyGBps(m.stream);
  const double bound_ms =
      copy_gbps > 0 ? static_cast<double>(m.llama->layer_matrix_bytes()) / (copy_gbps * 1e9) * 1e3 : -1;
  std::printf("\nlayers: the model's work outside attention, %d layers of Llama-3-8B shapes (ms per step)\n", kLayers);
  std::printf("%6s %10s %12s %7s %10s %22s %7s\n", "rows", "alone", "timed_gemms", "ratio", "weights", "beside held SM slots",
              "ratio");
  bool ok = true;
  for (int r : o.batches) {
    m.llama->SetTimedGemms(false);
    const double alone = TimeSteps(m, 2, o.steps, [&] { return layers(r); });
    if (alone <= 0) {
      ok = false;
      break;
    }
    // The same with each product's kernel timed and chosen (the first warm-up step chooses).
    m.llama->SetTimedGemms(true);
    const double timed = TimeSteps(m, 2, o.steps, [&] { return layers(r); });
    m.llama->SetTimedGemms(false);
    // The hold starts first on its own stream and outlasts the timed steps (up to 3x slower); the
    // timing's last device wait is for its end.
    const double beside = timed > 0 ? TimeSteps(m, 2, o.steps, [&] { return layers(r); }, [&] {
      gpu::HoldSlots(static_cast<int>(1000 * (3 * alone * o.steps + 5)), held, side);
    }) : -1;
    ok = beside > 0 && Ok(cudaGetLastError(), "layers");
    if (!ok) break;
    std::printf("%6d %10.2f %12.2f %7.2f %10.2f %22.2f %7.2f\n", r, alone, timed, timed / alone, bound_ms, beside,
                beside / alone);
    rows->push_back({"rows_" + std::to_string(r),
                     {{"rows", r},
                      {"ms_layers", alone},
                      {"ms_layers_timed_gemms", timed},
                      {"ms_weights_at_copy_rate", bound_ms},
                      {"held_slots", held},
                      {"ms_layers_beside_held", beside}}});
  }
  std::printf("       weights: the layers' weights read once at the rate of a device-to-device copy (%.0f GB/s,\n"
              "       read + write): the products' bound at these batches. timed_gemms: each product shape's kernel\n"
              "       timed and chosen at its first call (cuBLAS's default or a cuBLASLt candidate, model_gemm.h).\n"
              "       held: %d blocks of 256 threads spinning on another stream, as the fetch's blocks (with cuBLAS's\n"
              "       default kernels, one CTA per SM in one wave: beside the held slots they need a second).\n",
              copy_gbps, held);
  std::printf("       the timed choice, per shape: rows x in -> out, default ms, chosen ms, cuBLASLt candidates timed\n");
  for (const gpu::ModelGemm::Chosen& g : m.llama->gemms().chosen()) {
    std::printf("       %4d x %5d -> %6d%s  default %.4f  chosen %.4f (%s)  candidates %d\n", g.n, g.in, g.out,
                g.accumulate ? " (+=)" : "     ", g.default_ms, g.chosen_ms, g.lt ? "cuBLASLt" : "default", g.candidates);
  }
  cudaStreamDestroy(side);
  return ok;
}

}  // namespace specache::bench
