// Label `gpu`: the CUDA agent against the CPU agent on the tiny random model, driven like an engine
// (prefill, pre-decode, two-row steps, prefetch per layer): same tokens, logits within float
// rounding, the same rows selected (the CUDA agent fed the CPU's tokens; its own choices the CPU's
// but at near-ties: GenerateOnBoth); and with k covering the context, specache equals full.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "specache/agent.h"
#include "specache/device_probe.h"
#include "specache/host_tensor_agent.h"
#include "specache/in_memory_source.h"
#include "testing/cuda_device.h"
#include "testing/drive_batch.h"
#include "testing/forwarding_source.h"
#include "testing/pageless_source.h"
#include "testing/tiny_model.h"

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace specache {
namespace {

std::vector<int> Prompt(int n) {
  std::mt19937 rng(321);
  std::vector<int> p(n);
  for (auto& t : p) t = static_cast<int>(rng() % 96);
  return p;
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// The CPU agent and the CUDA agent (behind host tensors), each over its own in-memory source,
// driven through the same ragged batch with the same random rows (testing::DriveBatch).
struct RaggedPair {
  InMemorySource cpu_source, gpu_source;
  testing::PagelessSource gpu_pageless;  // the CUDA agent's source on the staged path
  std::unique_ptr<Agent> cpu, gpu;
  std::vector<float> want, got;  // every output of the CPU and of the CUDA agent, in order
  double worst = 0;              // max |got - want|
};

// The union rule of the ragged batches' tests: 2 bits, 24 primary rows and 12 of the real row's,
// the whole row cache attended.
KvConfig RaggedUnion(bool real_next) {
  KvConfig c;
  c.key_bits = c.value_bits = 2;
  c.top_k = 24;
  c.select = SelectFrom::kUnion;
  c.top_k_real = 12;
  c.attend_resident = true;
  c.real_next = real_next;
  return c;
}

// Fills *p (a failure to make or drive an agent, outputs of different lengths, or a NaN output
// where the other agent's is a number, is the error). `edit_queries`: testing::DriveBatch's, on both.
Status DriveRaggedOnBoth(const ModelShape& shape, const KvConfig& c, const std::vector<int32_t>& prompts, uint32_t seed,
                         RaggedPair* p,
                         const std::function<void(int, int, std::vector<float>*)>& edit_queries = {}) {
  SPECACHE_ASSIGN_OR_RETURN(p->cpu, CreateCpuAgent(shape, c, &p->cpu_source));
  SPECACHE_ASSIGN_OR_RETURN(auto gpu, CreateCudaAgent(shape, c, &p->gpu_source, {1024}));
  SPECACHE_ASSIGN_OR_RETURN(p->gpu, WrapHostTensors(std::move(gpu)));
  SPECACHE_ASSIGN_OR_RETURN(p->want, testing::DriveBatch(p->cpu.get(), prompts, 40, std::mt19937(seed), {}, edit_queries));
  SPECACHE_ASSIGN_OR_RETURN(p->got, testing::DriveBatch(p->gpu.get(), prompts, 40, std::mt19937(seed), {}, edit_queries));
  if (p->got.size() != p->want.size()) return Status::Internal("the two agents gave outputs of different lengths");
  for (size_t i = 0; i < p->want.size(); ++i) {
    if (std::isnan(p->got[i]) != std::isnan(p->want[i])) {
      return Status::Internal("output " + std::to_string(i) + " is NaN on one agent only");
    }
    if (!std::isnan(p->want[i])) p->worst = std::max(p->worst, double(std::fabs(p->got[i] - p->want[i])));
  }
  return Status::Ok();
}

// The CPU agent and the CUDA agent (behind host tensors) generating from one prompt of the tiny
// model, each over its own source.
struct GenerationPair {
  InMemorySource cpu_source, gpu_source;
  std::unique_ptr<Agent> cpu, gpu;
  testing::GenerationTrace want, got;  // the CPU's and the CUDA agent's
};

// max |got - want| over the logits of the steps both traces have.
double WorstLogitDifference(const testing::GenerationTrace& want, const testing::GenerationTrace& got) {
  double worst = 0;
  for (size_t t = 0; t < want.logits.size() && t < got.logits.size(); ++t) {
    for (size_t i = 0; i < want.logits[t].size(); ++i) {
      worst = std::max(worst, double(std::fabs(got.logits[t][i] - want.logits[t][i])));
    }
  }
  return worst;
}

// The two agents' logits differ by float rounding (up to ~4e-4 on this model; tests allow 1e-3),
// so a greedy choice whose two best logits lie closer than this may go either way.
constexpr float kNearTie = 2e-3f;

// The CPU agent generates `steps` tokens; the CUDA agent generates with the CPU's tokens and
// speculative tokens as its inputs (teacher forcing), so that both see the same inputs at every
// step and what the caller compares (logits, rows selected, statistics) stays comparable. The CUDA
// agent's own choices must be the CPU's, except where the CPU's two best logits were a near-tie
// (printed); any other difference is the error.
Result<std::unique_ptr<GenerationPair>> GenerateOnBoth(const testing::TinyModel& model, const KvConfig& c,
                                                       const std::vector<int>& prompt, int steps,
                                                       const std::string& name,
                                                       CudaAgentOptions options = {4096}) {
  auto p = std::make_unique<GenerationPair>();
  SPECACHE_ASSIGN_OR_RETURN(p->cpu, CreateCpuAgent(model.shape(), c, &p->cpu_source));
  SPECACHE_ASSIGN_OR_RETURN(auto gpu, CreateCudaAgent(model.shape(), c, &p->gpu_source, options));
  SPECACHE_ASSIGN_OR_RETURN(p->gpu, WrapHostTensors(std::move(gpu)));  // the tiny model's tensors are on the host
  SPECACHE_ASSIGN_OR_RETURN(p->want, model.Generate(p->cpu.get(), 1, prompt, steps));
  const testing::GenerationTrace& w = p->want;
  SPECACHE_ASSIGN_OR_RETURN(p->got, model.Generate(p->gpu.get(), 1, prompt, steps, &w.tokens,
                                                   w.speculative.empty() ? nullptr : &w.speculative));
  const testing::GenerationTrace& g = p->got;
  if (g.tokens.size() != w.tokens.size() || g.speculative.size() != w.speculative.size()) {
    return Status::Internal(name + ": traces of different lengths");
  }
  auto check = [&](const char* what, size_t i, int got, int want, float margin) -> Status {
    if (got == want) return Status::Ok();
    const std::string where = name + ": " + what + " " + std::to_string(i) + " is " + std::to_string(got) +
                              " on the GPU, " + std::to_string(want) + " on the CPU, whose two best logits are " +
                              std::to_string(margin) + " apart";
    if (!(margin < kNearTie)) return Status::Internal(where);
    std::printf("%s: a near-tie\n", where.c_str());
    return Status::Ok();
  };
  for (size_t i = 0; i < w.tokens.size(); ++i) {
    SPECACHE_RETURN_IF_ERROR(check("token", i, g.tokens[i], w.tokens[i], testing::TopTwoMargin(w.logits[i])));
  }
  for (size_t i = 0; i < w.speculative.size(); ++i) {
    SPECACHE_RETURN_IF_ERROR(check("speculative token", i, g.speculative[i], w.speculative[i], w.speculative_margins[i]));
  }
  return p;
}

// Every (sequence, layer, KV head) of the batch selected the same rows on both agents.
void ExpectSameSelections(const Agent& gpu, const Agent& cpu, const ModelShape& shape, size_t n_sequences,
                          const std::string& name) {
  for (size_t s = 0; s < n_sequences; ++s) {
    for (int l = 0; l < shape.n_layers; ++l) {
      for (int h = 0; h < shape.n_kv_heads; ++h) {
        const SequenceId id = static_cast<SequenceId>(10 + s);
        EXPECT_EQ(*gpu.SelectedTokens(id, l, h), *cpu.SelectedTokens(id, l, h)) << name << ": sequence " << id;
      }
    }
  }
}
#endif

TEST(CudaAgentTest, SameTokensAndLogitsAsTheCpuAgentInEveryMode) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const testing::TinyModel model({});
  const std::vector<int> prompt = Prompt(300);
  const int steps = 24;
  struct Mode {
    KvMode mode;
    int bits, k;
  } modes[] = {{KvMode::kFull, 16, 0},      {KvMode::kKivi, 1, 0},          {KvMode::kKivi, 2, 0},
               {KvMode::kSpeCache, 1, 16},  {KvMode::kSpeCache, 2, 16},     {KvMode::kSpeCache, 1, 4096},
               {KvMode::kSpeCacheNonSpec, 1, 16}};
  std::vector<int> full_tokens;
  for (const Mode& m : modes) {
    KvConfig c;
    c.mode = m.mode;
    c.key_bits = c.value_bits = m.bits;
    c.top_k = m.k;
    const std::string name = std::string(KvModeName(m.mode)) + " " + std::to_string(m.bits) + "bit k=" + std::to_string(m.k);
    auto pair = GenerateOnBoth(model, c, prompt, steps, name);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    Agent& gpu_host = *(*pair)->gpu;
    const auto& cpu = (*pair)->cpu;
    const testing::GenerationTrace* want = &(*pair)->want;
    const testing::GenerationTrace* got = &(*pair)->got;
    const double worst = WorstLogitDifference(*want, *got);
    EXPECT_LT(worst, 1e-3) << name;
    const AgentStats a = cpu->stats(), b = gpu_host.stats();
    EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
    EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
    EXPECT_EQ(b.device_bytes, a.device_bytes) << name;
    EXPECT_GE(b.device_bytes_reserved, b.device_bytes) << name;  // replicas sized for capacity_tokens
    EXPECT_EQ(b.full_precision_bytes, a.full_precision_bytes) << name;
    for (int l = 0; l < model.shape().n_layers; ++l) {
      EXPECT_EQ(*gpu_host.SelectedTokens(1, l, 0), *cpu->SelectedTokens(1, l, 0)) << name << " layer " << l;
    }
    std::printf("%-28s max |logit diff| %.2e, %lld rows fetched, %lld reused\n", name.c_str(), worst,
                static_cast<long long>(b.rows_fetched), static_cast<long long>(b.rows_reused));
    if (m.mode == KvMode::kFull) full_tokens = got->tokens;
    if (m.mode == KvMode::kSpeCache && m.k >= 4096) {
      EXPECT_EQ(got->tokens, full_tokens) << "k covers the context";
    }
  }
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// A device-tensor driver's inputs: random rows drawn as the host drivers draw them (the same
// normal draws in the same order), each uploaded on `stream` into memory of its own, freed with
// the object; and one layer's decode tensors.
class DeviceDraws {
 public:
  struct Layer {
    float *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
    size_t out_floats = 0;
  };
  DeviceDraws(const ModelShape& m, std::mt19937 rng, cudaStream_t stream) : m_(m), rng_(rng), stream_(stream) {}
  ~DeviceDraws() {
    for (void* p : allocations_) cudaFree(p);
  }
  DeviceDraws(const DeviceDraws&) = delete;
  DeviceDraws& operator=(const DeviceDraws&) = delete;

  static Status Cuda(cudaError_t e, const char* what) {
    return e == cudaSuccess ? Status::Ok() : Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
  }
  // Every layer's q, k and v for n rows (drawn q, k, v a layer, as testing::DriveBatch and
  // DriveChangingBatches draw them) and a zeroed out (not drawn).
  Status Layers(size_t n, std::vector<Layer>* layers) {
    for (int l = 0; l < m_.n_layers; ++l) {
      Layer x;
      SPECACHE_RETURN_IF_ERROR(Upload(Random(n * m_.n_q_heads * m_.head_dim, 1.0f), &x.q));
      SPECACHE_RETURN_IF_ERROR(Upload(Random(n * m_.n_kv_heads * m_.head_dim, 2.0f), &x.k));
      SPECACHE_RETURN_IF_ERROR(Upload(Random(n * m_.n_kv_heads * m_.head_dim, 1.0f), &x.v));
      x.out_floats = n * m_.n_q_heads * m_.head_dim;
      SPECACHE_RETURN_IF_ERROR(Upload(std::vector<float>(x.out_floats), &x.out));
      layers->push_back(x);
    }
    return Status::Ok();
  }
  // The layers' outputs, in order, appended to *outputs (synchronous).
  static Status Download(const std::vector<Layer>& layers, std::vector<float>* outputs) {
    for (const Layer& x : layers) {
      const size_t at = outputs->size();
      outputs->resize(at + x.out_floats);
      SPECACHE_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(outputs->data() + at, x.out, x.out_floats * sizeof(float), cudaMemcpyDeviceToHost), "download"));
    }
    return Status::Ok();
  }

 private:
  std::vector<float> Random(size_t n, float scale) {
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng_);
    return v;
  }
  // On `stream`, so that the agent's work queued there after it sees it (a plain cudaMemcpy runs on
  // the legacy stream, which a non-blocking stream does not follow). From pageable memory the call
  // returns once the host bytes are staged: the temporary may go.
  Status Upload(const std::vector<float>& host, float** device) {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMalloc(device, std::max<size_t>(host.size(), 1) * sizeof(float)), "cudaMalloc"));
    allocations_.push_back(*device);
    return Cuda(cudaMemcpyAsync(*device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream_),
                "upload");
  }
  const ModelShape& m_;
  std::mt19937 rng_;
  cudaStream_t stream_;
  std::vector<void*> allocations_;
};

// DriveChangingBatches (below) for a CUDA agent given device tensors, as an engine drives it: the
// same steps and rows (the same random draws in the same order), every input on the device
// before the first step, the calls queued on `stream` with no host wait between them (the
// caches' spares change hands between sequences, layers and streams as the batch changes, and
// nothing on the host orders them), the outputs copied back at the end. Each step decodes its
// layers in `layer_order` (empty: 0, 1, ...; the agent takes them in any order, agent.h).
Result<std::vector<float>> DriveChangingOnDevice(Agent* agent, const std::vector<int32_t>& prompts,
                                                 const std::vector<std::vector<size_t>>& steps, std::mt19937 rng,
                                                 cudaStream_t stream, std::vector<int> layer_order = {}) {
  const ModelShape& m = agent->shape();
  DeviceDraws draws(m, rng, stream);
  std::vector<SequenceId> ids;
  std::vector<int32_t> offsets;
  SPECACHE_RETURN_IF_ERROR(testing::AddSequences(agent, prompts, &ids, &offsets));
  std::vector<DeviceDraws::Layer> prefill;
  SPECACHE_RETURN_IF_ERROR(draws.Layers(static_cast<size_t>(offsets.back()), &prefill));
  struct Step {
    StepKind kind;
    std::vector<SequenceId> ids;
    std::vector<DeviceDraws::Layer> layers;
  };
  std::vector<Step> plan;
  if (const int rows = agent->RowsPerSequence(StepKind::kPreDecode); rows > 0) {
    plan.push_back({StepKind::kPreDecode, ids, {}});
    SPECACHE_RETURN_IF_ERROR(draws.Layers(ids.size() * rows, &plan.back().layers));
  }
  for (const std::vector<size_t>& members : steps) {
    plan.push_back({StepKind::kDecode, {}, {}});
    for (size_t i : members) plan.back().ids.push_back(ids[i]);
    SPECACHE_RETURN_IF_ERROR(
        draws.Layers(plan.back().ids.size() * agent->RowsPerSequence(StepKind::kDecode), &plan.back().layers));
  }
  for (int l = 0; l < m.n_layers; ++l) {
    const DeviceDraws::Layer& x = prefill[l];
    SPECACHE_RETURN_IF_ERROR(agent->PrefillLayer(l, PrefillBatch{ids, offsets, x.q, x.k, x.v, nullptr}));
  }
  SPECACHE_RETURN_IF_ERROR(DeviceDraws::Cuda(cudaStreamSynchronize(stream), "prefill"));
  if (layer_order.empty()) {
    for (int l = 0; l < m.n_layers; ++l) layer_order.push_back(l);
  }
  for (const Step& step : plan) {
    SPECACHE_RETURN_IF_ERROR(agent->BeginStep(step.kind, step.ids));
    for (int l : layer_order) {
      const DeviceDraws::Layer& x = step.layers[l];
      SPECACHE_RETURN_IF_ERROR(agent->WaitPrefetch(l));
      SPECACHE_RETURN_IF_ERROR(agent->DecodeLayer(l, {x.q, x.k, x.v, x.out}));
      SPECACHE_RETURN_IF_ERROR(agent->StartPrefetch(l));
    }
    SPECACHE_RETURN_IF_ERROR(agent->EndStep());
  }
  SPECACHE_RETURN_IF_ERROR(DeviceDraws::Cuda(cudaStreamSynchronize(stream), "decode"));
  std::vector<float> outputs;
  for (const Step& step : plan) SPECACHE_RETURN_IF_ERROR(DeviceDraws::Download(step.layers, &outputs));
  return outputs;
}

// testing::DriveBatch for a CUDA agent given device tensors: DriveChangingOnDevice with every
// sequence in every step (testing::DriveBatch draws as DriveChangingBatches does). Host waits
// between layers would hide an ordering error between the agent's streams; here nothing does.
Result<std::vector<float>> DriveBatchOnDevice(Agent* agent, const std::vector<int32_t>& prompts, int steps,
                                              std::mt19937 rng, cudaStream_t stream, std::vector<int> layer_order = {}) {
  std::vector<size_t> all(prompts.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return DriveChangingOnDevice(agent, prompts, std::vector<std::vector<size_t>>(static_cast<size_t>(steps), all), rng,
                               stream, std::move(layer_order));
}
#endif

// Each fetch overlap, and the copy-engine route, on device tensors and a stream of the test's
// own, with no host wait between the calls (DriveBatchOnDevice), against the CPU agent driven
// through the same rows: if a fetch were queued after the attention that reads its rows, or
// joined on the wrong layer, the outputs would part. 70 steps: every prompt's residual fills
// during the run (at decode steps 41, 50, 63 and 62), and a selection may then name the row
// written to the pages in that same step, which the fetch must read after the write: with this
// seed the 1-token prompt's does (its first selection, step 62, names its newest row in 2 of its
// 6 layer and KV-head pairs, by the CPU agent).
// When the overlapped fetch is queued, and how its rows move (CudaAgentOptions).
// The copy engine also with half, and all, of each layer's sequences left to SM loads on a
// stream of their own (fetch_sm_share), and with the selection in order on the compute stream
// (selection_on_own_stream false; its ordering is stricter than the own stream's, so the other
// routes are not repeated with it), and with its host gather on the agent's own spinning pool
// (fetch_gather_spin_us) instead of OpenMP's threads. Every route with the selection on its own
// stream writes the pages there after the top-k (page_writes_after_selection, the default: the
// fetch that reads the row just written, and the next layer's attention, must wait for them) but
// one, which writes them in order on the compute stream.
struct FetchRoute {
  FetchOverlap overlap;
  FetchVia via;
  double sm_share = 0;
  bool own_selection_stream = true;  // CudaAgentOptions::selection_on_own_stream
  bool writes_after_selection = true;       // CudaAgentOptions::page_writes_after_selection
  int gather_spin_us = 0;                   // CudaAgentOptions::fetch_gather_spin_us
  std::string Name() const {
    return std::string(FetchOverlapName(overlap)) + (via == FetchVia::kSmLoads ? "" : " " + std::string(FetchViaName(via))) +
           (sm_share > 0 ? " sm share " + std::to_string(sm_share).substr(0, 4) : "") +
           (own_selection_stream ? "" : " selection on the compute stream") +
           (writes_after_selection ? "" : " page writes on the compute stream") +
           (gather_spin_us > 0 ? " gather on a spinning pool" : "");
  }
  void Apply(CudaAgentOptions* options) const {
    options->fetch_overlap = overlap;
    options->fetch_via = via;
    options->fetch_sm_share = sm_share;
    options->selection_on_own_stream = own_selection_stream;
    options->page_writes_after_selection = writes_after_selection;
    options->fetch_gather_spin_us = gather_spin_us;
  }
};
constexpr FetchRoute kFetchRoutes[] = {{FetchOverlap::kFromSelection, FetchVia::kSmLoads},
                                       {FetchOverlap::kBesideNextAttention, FetchVia::kSmLoads},
                                       {FetchOverlap::kWithinNextAttention, FetchVia::kSmLoads},
                                       {FetchOverlap::kFromSelection, FetchVia::kCopyEngine},
                                       {FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 0.5},
                                       {FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 1.0},
                                       {FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 0.0, false},
                                       {FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 0.0, true, false},
                                       {FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 0.0, true, true, 500}};

#ifdef SPECACHE_TEST_HAVE_CUDA
// A CUDA agent on `route` and a non-blocking stream (its source, pages and all, and the stream its
// own), driven by `drive(agent, stream)` (a device-tensor driver), against the CPU agent that gave
// `want`: outputs within float rounding, the same counts and selections. Returns the CUDA agent's
// stats for the route's own checks.
template <typename Drive>
Result<AgentStats> MatchOnDevice(const ModelShape& shape, const KvConfig& c, const FetchRoute& route, const Agent& cpu,
                                 const std::vector<float>& want, size_t n_sequences, Drive&& drive) {
  const std::string name = route.Name();
  cudaStream_t stream = nullptr;
  SPECACHE_RETURN_IF_ERROR(DeviceDraws::Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  struct Destroy {
    cudaStream_t s;
    ~Destroy() { cudaStreamDestroy(s); }  // after the agent (declared below) is gone
  } destroy{stream};
  InMemorySource gpu_source;
  CudaAgentOptions options{1024};
  options.stream = stream;
  route.Apply(&options);
  SPECACHE_ASSIGN_OR_RETURN(std::unique_ptr<Agent> gpu, CreateCudaAgent(shape, c, &gpu_source, options));
  SPECACHE_ASSIGN_OR_RETURN(const std::vector<float> got, drive(gpu.get(), stream));
  if (got.size() != want.size()) return Status::Internal(name + ": outputs of another length than the CPU agent's");
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, double(std::fabs(got[i] - want[i])));
  EXPECT_LT(worst, 1e-3) << name;
  const AgentStats a = cpu.stats(), b = gpu->stats();
  EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
  EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
  EXPECT_EQ(b.rows_reused, a.rows_reused) << name;
  ExpectSameSelections(*gpu, cpu, shape, n_sequences, name);
  std::printf("%-36s max |out diff| %.2e, %lld rows fetched, %lld reused\n", name.c_str(), worst,
              static_cast<long long>(b.rows_fetched), static_cast<long long>(b.rows_reused));
  return b;
}
#endif

#ifdef SPECACHE_TEST_HAVE_CUDA
// The device-tensor driver's ragged batch (3 layers, 2 KV heads, prompts of 150, 333, 64 and 1
// tokens, 70 steps) in `c` on each of `routes` (MatchOnDevice), against the CPU agent of the same
// config; check(route, stats) adds a route's own checks. The CUDA agent decodes each step's layers
// in `layer_order` (empty: in order), the CPU agent in order.
template <typename Check>
void MatchBatchOnDeviceTensors(const KvConfig& c, std::span<const FetchRoute> routes, Check&& check,
                               const std::vector<int>& layer_order = {}) {
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  InMemorySource cpu_source;
  auto cpu = CreateCpuAgent(shape, c, &cpu_source);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  auto want = testing::DriveBatch(cpu->get(), prompts, 70, std::mt19937(77));
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  for (const FetchRoute& route : routes) {
    auto b = MatchOnDevice(shape, c, route, **cpu, *want, prompts.size(), [&](Agent* gpu, cudaStream_t stream) {
      return DriveBatchOnDevice(gpu, prompts, 70, std::mt19937(77), stream, layer_order);
    });
    ASSERT_TRUE(b.ok()) << route.Name() << ": " << b.status().ToString();
    check(route, *b, shape);
  }
}
#endif

TEST(CudaAgentTest, EveryFetchOverlapOnDeviceTensorsMatchesTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  KvConfig c;
  c.key_bits = c.value_bits = 2;
  c.top_k = 24;
  MatchBatchOnDeviceTensors(c, kFetchRoutes, [](const FetchRoute& route, const AgentStats& b, const ModelShape&) {
    if (route.via == FetchVia::kCopyEngine) {  // the SM share took every sequence, or left the host some
      // (3 sequences are fetched, 4 from step 62: 0.5 of them is 2 by SM loads, 1-2 gathered)
      if (route.sm_share >= 1.0) {
        EXPECT_EQ(b.fetch_host_gather_ns, 0) << route.Name() << ": the host gathered rows";
      } else {
        EXPECT_GT(b.fetch_host_gather_ns, 0) << route.Name() << ": the host gathered nothing";
      }
    }
  });
#endif
}

// Layers decoded out of order (even ones first: two layers of one parity in a row), with the page
// writes after the top-k on the selection's stream (the default route) and with every other
// route: the planner's two buffers of new rows are taken in turn, never one the pending writes
// still read, so the outputs, counts and selections are the CPU agent's, which decodes in order.
TEST(CudaAgentTest, LayersDecodedOutOfOrderMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  KvConfig c;
  c.key_bits = c.value_bits = 2;
  c.top_k = 24;
  MatchBatchOnDeviceTensors(c, kFetchRoutes, [](const FetchRoute&, const AgentStats&, const ModelShape&) {}, {0, 2, 1});
#endif
}

// int8 host rows (KvConfig::host_row_format): the CUDA agent's pages hold what the CPU agent's do
// (its page writes encode as the host does), and on every route its rows come back as the CPU
// agent's (SM loads decode from the pages, the copy engine moves the stored rows and the cache
// update decodes them): the same outputs within float rounding, counts and selections.
TEST(CudaAgentTest, Int8HostRowsOnEveryRouteMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  KvConfig c;
  c.key_bits = c.value_bits = 2;
  c.top_k = 24;
  c.host_row_format = HostRowFormat::kInt8;
  const FetchRoute routes[] = {{FetchOverlap::kFromSelection, FetchVia::kSmLoads},
                               {FetchOverlap::kFromSelection, FetchVia::kCopyEngine},
                               {FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 0.5}};
  MatchBatchOnDeviceTensors(c, routes, [](const FetchRoute& route, const AgentStats& b, const ModelShape& shape) {
    // The bytes a fetched row moves are the stored ones.
    EXPECT_EQ(b.bytes_fetched, b.rows_fetched * HostRowBytes(HostRowFormat::kInt8, shape.head_dim)) << route.Name();
  });
#endif
}

// Wherever the speculative fetch is queued (CudaAgentOptions::fetch_overlap), and whichever route
// its rows take (fetch_via), the rows and the results are the same: the paper's rule, the union
// rule with every cached row attended, and the adaptive budget (whose padding no route may fetch).
// This
// catches a deferred fetch that is never queued, queued for the wrong layer, or planned wrongly;
// not an ordering error between the streams: the tiny model's agent (WrapHostTensors) copies
// each layer's output to the host, which waits for the compute stream, and uses the rows a whole
// step later.
TEST(CudaAgentTest, EveryFetchOverlapMatchesTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const testing::TinyModel model({});
  const std::vector<int> prompt = Prompt(300);
  for (const char* rule : {"spec", "union", "adaptive union"}) {
    KvConfig c;
    c.top_k = 16;
    if (rule != std::string("spec")) {
      c.select = SelectFrom::kUnion;
      c.real_next = true;
      c.attend_resident = true;
    }
    if (rule == std::string("adaptive union")) c.mass = 0.8, c.k_min = 4, c.k_max = 32;
    for (const FetchRoute& route : kFetchRoutes) {
      CudaAgentOptions options{4096};
      route.Apply(&options);
      const std::string name = std::string(rule) + " " + route.Name();
      auto pair = GenerateOnBoth(model, c, prompt, 24, name, options);
      ASSERT_TRUE(pair.ok()) << pair.status().ToString();
      EXPECT_LT(WorstLogitDifference((*pair)->want, (*pair)->got), 1e-3) << name;
      const AgentStats a = (*pair)->cpu->stats(), b = (*pair)->gpu->stats();
      EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
      EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
      EXPECT_EQ(b.rows_reused, a.rows_reused) << name;
      for (int l = 0; l < model.shape().n_layers; ++l) {
        for (int h = 0; h < model.shape().n_kv_heads; ++h) {
          EXPECT_EQ(*(*pair)->gpu->SelectedTokens(1, l, h), *(*pair)->cpu->SelectedTokens(1, l, h))
              << name << " layer " << l << " KV head " << h;
        }
      }
    }
  }
#endif
}

// The selection options (selection.h): the CUDA agent follows the CPU agent's rule in each, for
// one sequence on the tiny model and for a ragged batch: same tokens, logits within float rounding,
// the same rows selected and fetched, the adaptive budget included.
TEST(CudaAgentTest, SelectionRulesMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const testing::TinyModel model({});
  const std::vector<int> prompt = Prompt(300);
  struct Rule {
    const char* name;
    KvMode mode;
    SelectFrom select;
    int k, k_real;
    bool resident;
    bool next = false;
    double mass = 0;  // the adaptive budget, k_min = 4 and k_max = k
  } rules[] = {
      {"spec resident", KvMode::kSpeCache, SelectFrom::kSpeculative, 16, 0, true},
      {"real", KvMode::kSpeCache, SelectFrom::kReal, 16, 0, false},
      {"real next resident", KvMode::kSpeCache, SelectFrom::kReal, 16, 0, true, true},
      {"union", KvMode::kSpeCache, SelectFrom::kUnion, 16, 8, false},
      {"union resident", KvMode::kSpeCache, SelectFrom::kUnion, 16, 16, true},
      {"union next", KvMode::kSpeCache, SelectFrom::kUnion, 16, 8, true, true},
      {"union k covers", KvMode::kSpeCache, SelectFrom::kUnion, 200, 200, true},
      {"nonspec resident", KvMode::kSpeCacheNonSpec, SelectFrom::kSpeculative, 16, 0, true},
      {"oracle", KvMode::kSpeCacheOracle, SelectFrom::kSpeculative, 16, 0, false},
      {"oracle resident", KvMode::kSpeCacheOracle, SelectFrom::kSpeculative, 16, 0, true},
      {"adaptive 0.5", KvMode::kSpeCache, SelectFrom::kSpeculative, 48, 0, false, false, 0.5},
      {"adaptive 0.9 resident", KvMode::kSpeCache, SelectFrom::kSpeculative, 48, 0, true, false, 0.9},
      {"adaptive real next", KvMode::kSpeCache, SelectFrom::kReal, 32, 0, false, true, 0.8},
      {"adaptive nonspec", KvMode::kSpeCacheNonSpec, SelectFrom::kSpeculative, 48, 0, false, false, 0.9},
      {"adaptive oracle", KvMode::kSpeCacheOracle, SelectFrom::kSpeculative, 48, 0, true, false, 0.7},
      {"adaptive union", KvMode::kSpeCache, SelectFrom::kUnion, 32, 8, false, false, 0.6},
      {"adaptive union next", KvMode::kSpeCache, SelectFrom::kUnion, 48, 16, true, true, 0.9},
  };
  for (const Rule& rule : rules) {
    KvConfig c;
    c.mode = rule.mode;
    c.top_k = rule.k;
    c.select = rule.select;
    c.top_k_real = rule.k_real;
    c.attend_resident = rule.resident;
    c.real_next = rule.next;
    if (rule.mass > 0) {
      c.mass = rule.mass;
      c.k_min = 4;
      c.k_max = rule.k;
    }
    auto pair = GenerateOnBoth(model, c, prompt, 24, rule.name);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    const auto& cpu = (*pair)->cpu;
    const auto& wrapped = (*pair)->gpu;
    const testing::GenerationTrace* want = &(*pair)->want;
    const testing::GenerationTrace* got = &(*pair)->got;
    const double worst = WorstLogitDifference(*want, *got);
    // The adaptive budget cuts where a running sum of probabilities reaches mass x their total.
    // The rule is the same on both backends (CudaTopKTest.AdaptiveBudgetEqualsTheCpuRule: equal
    // rows from equal scores), but the scores are not equal here: the GPU's attention rounds
    // differently from the CPU's, so a cut that lands within rounding of the goal may take one row
    // more or less on one head of one step (H200: 1 row of 1183 at mass 0.5, logits 2.7e-3 apart).
    // Such a rule may differ by a row or two; every other rule must be exact.
    const bool cut_by_mass = rule.mass > 0;
    const int64_t rows_slack = cut_by_mass ? 2 : 0;
    int heads_slack = cut_by_mass ? 1 : 0;
    EXPECT_LT(worst, cut_by_mass ? 5e-3 : 1e-3) << rule.name;
    const AgentStats a = cpu->stats(), b = wrapped->stats();
    EXPECT_LE(std::llabs(b.rows_selected - a.rows_selected), rows_slack) << rule.name;
    EXPECT_LE(std::llabs(b.rows_fetched - a.rows_fetched), rows_slack) << rule.name;
    EXPECT_LE(std::llabs(b.rows_reused - a.rows_reused), rows_slack) << rule.name;
    for (int l = 0; l < model.shape().n_layers; ++l) {
      for (int h = 0; h < model.shape().n_kv_heads; ++h) {
        if (*wrapped->SelectedTokens(1, l, h) == *cpu->SelectedTokens(1, l, h)) continue;
        EXPECT_GT(heads_slack--, 0) << rule.name << " layer " << l << " KV head " << h << ": selections differ";
      }
    }
    std::printf("%-18s max |logit diff| %.2e, %lld rows selected, %lld fetched\n", rule.name, worst,
                static_cast<long long>(b.rows_selected), static_cast<long long>(b.rows_fetched));
  }
  // A ragged batch with union + resident: per-sequence selections of different sizes in one launch.
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  RaggedPair pair;
  const Status driven = DriveRaggedOnBoth(shape, RaggedUnion(true), prompts, 78, &pair);
  ASSERT_TRUE(driven.ok()) << driven.ToString();
  EXPECT_LT(pair.worst, 1e-3);
  EXPECT_EQ(pair.gpu->stats().rows_fetched, pair.cpu->stats().rows_fetched);
  ExpectSameSelections(*pair.gpu, *pair.cpu, shape, prompts.size(), "union");
  KvConfig adaptive;  // beyond what the budget's kernels hold
  adaptive.mass = 0.9;
  adaptive.k_min = 8;
  adaptive.k_max = 5000;
  InMemorySource source;
  EXPECT_EQ(CreateCudaAgent(shape, adaptive, &source, {1024}).status().code(), StatusCode::kInvalidArgument);
#endif
}

// A real row of NaN (a model that overflowed): its attention gives NaN on both agents, and the
// union rule's extra rows, all tied at -inf with the primary ones, are the CPU's (selection.h: the
// primary ones among the real row's best dropped, not replaced, and no place of the list left
// holding an older step's token). Twice in the run, on two sequences of a ragged batch, for the
// next step's fetch and for the last selection; with and without the successor's credit and the
// adaptive budget.
TEST(CudaAgentTest, ARealRowOfNanSelectsTheCpuAgentsRows) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  const int rows = 2;  // per sequence in a decode step: the real row first
  auto nan_real_rows = [&](int step, int, std::vector<float>* q) {
    if (step != 20 && step != 39) return;
    const size_t row = size_t(shape.n_q_heads) * shape.head_dim;
    for (size_t s : {size_t{0}, size_t{1}}) {
      std::fill_n(q->begin() + static_cast<std::ptrdiff_t>(s * rows * row), row, std::nanf(""));
    }
  };
  for (int variant = 0; variant < 3; ++variant) {
    KvConfig c = RaggedUnion(variant > 0);
    if (variant == 2) c.mass = 0.5, c.k_min = 4, c.k_max = 24;
    const std::string name = "variant " + std::to_string(variant);
    RaggedPair pair;
    const Status driven = DriveRaggedOnBoth(shape, c, prompts, 81, &pair, nan_real_rows);
    ASSERT_TRUE(driven.ok()) << name << ": " << driven.ToString();
    EXPECT_EQ(std::count_if(pair.want.begin(), pair.want.end(), [](float x) { return std::isnan(x); }),
              int64_t{2} * 2 * shape.n_layers * shape.n_q_heads * shape.head_dim)
        << name << ": the real rows of NaN, and only they, give NaN";
    EXPECT_LT(pair.worst, 1e-3) << name;
    ExpectSameSelections(*pair.gpu, *pair.cpu, shape, prompts.size(), name);
    // The rows counted are the tokens selected (a padded selection's places are not): selected =
    // fetched + reused on both.
    const AgentStats a = pair.cpu->stats(), b = pair.gpu->stats();
    EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
    EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
    EXPECT_EQ(b.rows_reused, a.rows_reused) << name;
    EXPECT_EQ(b.rows_selected, b.rows_fetched + b.rows_reused) << name;
  }
#endif
}

// The adaptive budget over a ragged batch (one sequence of one token, others across pages): each
// (sequence, layer, KV head) keeps the CPU agent's rows, their number varying from head to head,
// and the stats count the rows kept.
TEST(CudaAgentTest, AdaptiveBudgetMatchesTheCpuAgentOnARaggedBatch) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  for (int variant = 0; variant < 3; ++variant) {
    KvConfig c;
    c.key_bits = c.value_bits = 2;
    c.mass = 0.3;
    c.k_min = 3;
    c.k_max = 40;
    c.attend_resident = variant > 0;
    if (variant == 2) {  // union: the real row's best 12 others, credited with their successors
      c.select = SelectFrom::kUnion;
      c.top_k_real = 12;
      c.real_next = true;
    }
    const std::string name = DescribeKvConfig(c);
    RaggedPair pair;
    const Status driven = DriveRaggedOnBoth(shape, c, prompts, 79, &pair);
    ASSERT_TRUE(driven.ok()) << name << ": " << driven.ToString();
    EXPECT_LT(pair.worst, 1e-3) << name;
    const AgentStats a = pair.cpu->stats(), b = pair.gpu->stats();
    EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
    EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
    EXPECT_EQ(b.rows_reused, a.rows_reused) << name;
    EXPECT_EQ(b.device_bytes, a.device_bytes) << name;
    std::set<size_t> sizes;
    for (size_t s = 0; s < prompts.size(); ++s) {
      for (int l = 0; l < shape.n_layers; ++l) {
        for (int h = 0; h < shape.n_kv_heads; ++h) {
          const SequenceId id = static_cast<SequenceId>(10 + s);
          const auto mine = pair.gpu->SelectedTokens(id, l, h);
          ASSERT_TRUE(mine.ok());
          EXPECT_EQ(*mine, *pair.cpu->SelectedTokens(id, l, h)) << name << ": sequence " << id << " layer " << l << " head " << h;
          sizes.insert(mine->size());
        }
      }
    }
    // Somewhere the cut fell strictly inside the bounds.
    EXPECT_TRUE(std::any_of(sizes.begin(), sizes.end(), [&](size_t n) { return n > 3 && n < 40; })) << name;
    std::printf("%s: %lld rows selected over %lld steps, max |diff| %.2e\n", name.c_str(),
                static_cast<long long>(b.rows_selected), static_cast<long long>(b.steps), pair.worst);
  }
#endif
}

// Several sequences of ragged lengths (page boundaries inside, one exactly one page) decoded
// together: the CUDA agent's batched kernels and in-place pages give the CPU agent's outputs,
// selections and counts; releasing a sequence frees its rows in the source.
TEST(CudaAgentTest, RaggedBatchesMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  for (KvMode mode : {KvMode::kSpeCache, KvMode::kSpeCacheNonSpec, KvMode::kKivi}) {
    KvConfig c;
    c.mode = mode;
    c.key_bits = c.value_bits = 2;
    c.top_k = mode == KvMode::kKivi ? 0 : 24;
    const std::string name(KvModeName(mode));
    RaggedPair pair;
    const Status driven = DriveRaggedOnBoth(shape, c, prompts, 77, &pair);
    ASSERT_TRUE(driven.ok()) << name << ": " << driven.ToString();
    EXPECT_LT(pair.worst, 1e-3) << name;
    const AgentStats a = pair.cpu->stats(), b = pair.gpu->stats();
    EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
    EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
    EXPECT_EQ(b.rows_reused, a.rows_reused) << name;
    EXPECT_EQ(b.full_precision_bytes, a.full_precision_bytes) << name;
    EXPECT_EQ(pair.gpu_source.stored_bytes(), pair.cpu_source.stored_bytes()) << name << ": rows committed to the source";
    ExpectSameSelections(*pair.gpu, *pair.cpu, shape, prompts.size(), name);
    // The rows the GPU wrote in place are the rows the CPU agent appended.
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      std::vector<int32_t> tokens(prompts[1] + 40);
      for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = static_cast<int32_t>(t);
      std::vector<Half> x(tokens.size() * 2 * shape.head_dim), y(x.size());
      ASSERT_TRUE(pair.cpu_source.ReadRows(11, 2, h, tokens.data(), static_cast<int32_t>(tokens.size()), x.data()).ok());
      ASSERT_TRUE(pair.gpu_source.ReadRows(11, 2, h, tokens.data(), static_cast<int32_t>(tokens.size()), y.data()).ok());
      EXPECT_EQ(x, y) << name << " head " << h;
    }
    ASSERT_TRUE(pair.gpu->ReleaseSequence(11).ok());
    EXPECT_EQ(pair.gpu_source.Length(11, 0, 0).status().code(), StatusCode::kNotFound);
    std::printf("%-16s max |out diff| %.2e, %lld rows fetched, %lld reused\n", name.c_str(), pair.worst,
                static_cast<long long>(b.rows_fetched), static_cast<long long>(b.rows_reused));
  }
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// testing::DriveBatch with a batch that changes from step to step: after the prefill and a
// pre-decode step of every prompt's sequence, one decode step per entry of `steps`, of the
// sequences it names (indices into `prompts`, ascending). Returns every output, in order.
Result<std::vector<float>> DriveChangingBatches(Agent* agent, const std::vector<int32_t>& prompts,
                                                const std::vector<std::vector<size_t>>& steps, std::mt19937 rng) {
  const ModelShape& m = agent->shape();
  std::vector<SequenceId> ids;
  std::vector<int32_t> offsets;
  SPECACHE_RETURN_IF_ERROR(testing::AddSequences(agent, prompts, &ids, &offsets));
  auto random = [&rng](size_t n, float scale) {
    std::normal_distribution<float> normal(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  std::vector<float> outputs;
  auto run_layers = [&](size_t n) -> Status {
    for (int l = 0; l < m.n_layers; ++l) {
      const auto q = random(n * m.n_q_heads * m.head_dim, 1.0f), k = random(n * m.n_kv_heads * m.head_dim, 2.0f),
                 v = random(n * m.n_kv_heads * m.head_dim, 1.0f);
      std::vector<float> out(n * m.n_q_heads * m.head_dim);
      SPECACHE_RETURN_IF_ERROR(agent->DecodeLayer(l, {q.data(), k.data(), v.data(), out.data()}));
      SPECACHE_RETURN_IF_ERROR(agent->StartPrefetch(l));
      outputs.insert(outputs.end(), out.begin(), out.end());
    }
    return agent->EndStep();
  };
  const size_t total = static_cast<size_t>(offsets.back());
  for (int l = 0; l < m.n_layers; ++l) {
    const auto q = random(total * m.n_q_heads * m.head_dim, 1.0f), k = random(total * m.n_kv_heads * m.head_dim, 2.0f),
               v = random(total * m.n_kv_heads * m.head_dim, 1.0f);
    SPECACHE_RETURN_IF_ERROR(agent->PrefillLayer(l, {ids, offsets, q.data(), k.data(), v.data(), nullptr}));
  }
  if (const int rows = agent->RowsPerSequence(StepKind::kPreDecode); rows > 0) {
    SPECACHE_RETURN_IF_ERROR(agent->BeginStep(StepKind::kPreDecode, ids));
    SPECACHE_RETURN_IF_ERROR(run_layers(ids.size() * rows));
  }
  for (const std::vector<size_t>& members : steps) {
    std::vector<SequenceId> step_ids;
    for (size_t i : members) step_ids.push_back(ids[i]);
    SPECACHE_RETURN_IF_ERROR(agent->BeginStep(StepKind::kDecode, step_ids));
    SPECACHE_RETURN_IF_ERROR(run_layers(step_ids.size() * agent->RowsPerSequence(StepKind::kDecode)));
  }
  return outputs;
}

// DriveChangingBatches on the CPU agent and the CUDA agent (behind host tensors) with the same
// random rows, each over its own source: the CUDA agent's with pages, or (`staged`) without.
Status DriveChangingOnBoth(const ModelShape& shape, const KvConfig& c, const CudaAgentOptions& options, bool staged,
                           const std::vector<int32_t>& prompts, const std::vector<std::vector<size_t>>& steps,
                           uint32_t seed, RaggedPair* p) {
  SPECACHE_ASSIGN_OR_RETURN(p->cpu, CreateCpuAgent(shape, c, &p->cpu_source));
  FullPrecisionSource* source = staged ? static_cast<FullPrecisionSource*>(&p->gpu_pageless) : &p->gpu_source;
  SPECACHE_ASSIGN_OR_RETURN(auto gpu, CreateCudaAgent(shape, c, source, options));
  SPECACHE_ASSIGN_OR_RETURN(p->gpu, WrapHostTensors(std::move(gpu)));
  SPECACHE_ASSIGN_OR_RETURN(p->want, DriveChangingBatches(p->cpu.get(), prompts, steps, std::mt19937(seed)));
  SPECACHE_ASSIGN_OR_RETURN(p->got, DriveChangingBatches(p->gpu.get(), prompts, steps, std::mt19937(seed)));
  if (p->got.size() != p->want.size()) return Status::Internal("the two agents gave outputs of different lengths");
  for (size_t i = 0; i < p->want.size(); ++i) p->worst = std::max(p->worst, double(std::fabs(p->got[i] - p->want[i])));
  return Status::Ok();
}

// The two agents of a pair gave the same outputs (within float rounding), counts and selections.
void ExpectSameRun(const RaggedPair& pair, const ModelShape& shape, size_t n_sequences, const std::string& name) {
  EXPECT_LT(pair.worst, 1e-3) << name;
  const AgentStats a = pair.cpu->stats(), b = pair.gpu->stats();
  EXPECT_EQ(b.rows_selected, a.rows_selected) << name;
  EXPECT_EQ(b.rows_fetched, a.rows_fetched) << name;
  EXPECT_EQ(b.rows_reused, a.rows_reused) << name;
  ExpectSameSelections(*pair.gpu, *pair.cpu, shape, n_sequences, name);
}
#endif

// The tests of changing batches: the union rule (2 bits, 24 + 8 rows) with 80 cached rows, more
// than two selections, so entries leave by their last use, and every cached row attended: a cache
// or a spare mixed up, or overwritten too early, changes the outputs and the hits.
KvConfig SparesChangingHandsConfig() {
  KvConfig c;
  c.key_bits = c.value_bits = 2;
  c.top_k = 24;
  c.select = SelectFrom::kUnion;
  c.top_k_real = 8;
  c.cached_rows = 80;
  c.attend_resident = true;
  return c;
}

// Sequences that leave the step and join it again (the engine's batch changes from step to step),
// locally in each fetch overlap and staged: every fetch takes its caches' update targets from one
// pool of spare caches shared by all (sequence, layer)s, so a cache's memory serves different
// sequences and layers over time. With every cached row attended (attend_resident), a cache mixed
// up between them, or overwritten while a fetch or an attention still reads it, would change the
// outputs and the hits.
TEST(CudaAgentTest, SequencesLeavingAndRejoiningTheStepMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64};
  const std::vector<std::vector<size_t>> steps{{0, 1, 2}, {1}, {0, 2}, {0, 1, 2}, {2},
                                               {0, 1}, {1, 2}, {0, 1, 2}, {0}, {0, 1, 2}};
  const KvConfig c = SparesChangingHandsConfig();
  struct Case {
    const char* name;
    bool staged;
    FetchOverlap overlap;
    FetchVia via = FetchVia::kSmLoads;
    double sm_share = 0;  // sequences change part (SM share / copy engine) as the batch changes
  } cases[] = {{"from selection", false, FetchOverlap::kFromSelection},
               {"beside next attention", false, FetchOverlap::kBesideNextAttention},
               {"within next attention", false, FetchOverlap::kWithinNextAttention},
               {"copy engine", false, FetchOverlap::kFromSelection, FetchVia::kCopyEngine},
               {"copy engine, sm share 0.4", false, FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 0.4},
               {"staged", true, FetchOverlap::kFromSelection}};
  for (const Case& cs : cases) {
    CudaAgentOptions options{1024};
    options.fetch_overlap = cs.overlap;
    options.fetch_via = cs.via;
    options.fetch_sm_share = cs.sm_share;
    RaggedPair pair;
    const Status driven = DriveChangingOnBoth(shape, c, options, cs.staged, prompts, steps, 91, &pair);
    ASSERT_TRUE(driven.ok()) << cs.name << ": " << driven.ToString();
    ExpectSameRun(pair, shape, prompts.size(), cs.name);
  }
#endif
}

// The same on device tensors, with no host wait between the steps (DriveChangingOnDevice), for the
// routes whose fetch runs on streams of their own: the SM loads, the copy engine, and the copy
// engine with an SM share (0.4 of 2-8 fetched sequences: 1-3 by SM loads, on a stream of their
// own with a pool of spare lists of their own; as the batch changes, a (sequence, layer) whose
// last fetch was one part's is fetched by the other, ordered only through the compute stream).
// A spare or a row cache written before its last reader ran would change the outputs or the
// hits; the CPU agent is the reference.
TEST(CudaAgentTest, ChangingBatchesOnDeviceTensorsMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 96, 210, 180, 260, 120, 300};
  const std::vector<std::vector<size_t>> steps{{0, 1, 2, 3, 4, 5, 6, 7}, {1, 3, 5, 7}, {0, 2, 4, 6, 7},
                                               {0, 1, 2, 3, 4, 5, 6, 7}, {2, 3, 4}, {0, 1, 5, 6, 7},
                                               {0, 1, 2, 3, 4, 5, 6, 7}, {6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}};
  const KvConfig c = SparesChangingHandsConfig();
  InMemorySource cpu_source;
  auto cpu = CreateCpuAgent(shape, c, &cpu_source);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  auto want = DriveChangingBatches(cpu->get(), prompts, steps, std::mt19937(97));
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  const FetchRoute routes[] = {{FetchOverlap::kFromSelection, FetchVia::kSmLoads},
                               {FetchOverlap::kFromSelection, FetchVia::kCopyEngine},
                               {FetchOverlap::kFromSelection, FetchVia::kCopyEngine, 0.4}};
  for (const FetchRoute& route : routes) {
    auto b = MatchOnDevice(shape, c, route, **cpu, *want, prompts.size(), [&](Agent* gpu, cudaStream_t stream) {
      return DriveChangingOnDevice(gpu, prompts, steps, std::mt19937(97), stream);
    });
    ASSERT_TRUE(b.ok()) << route.Name() << ": " << b.status().ToString();
  }
#endif
}

// KvConfig::seed_rows: each (sequence, layer)'s row cache starts with the CPU agent's seeds, in
// the CPU agent's eviction order (seed_rows.h), on every fetch route: so through a batch that
// changes from step to step and overflows the caches (the seeds leave first, the least attended
// first) both agents reuse and fetch the same rows and, with every resident row attended (the
// seeds from the first step on), give the same outputs. Seeding changes what is fetched: the
// same run unseeded fetches more.
TEST(CudaAgentTest, RowCachesSeededAtPrefillMatchTheCpuAgent) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape{3, 8, 2, 64};
  const std::vector<int32_t> prompts{150, 333, 64, 1};
  const std::vector<std::vector<size_t>> steps{{0, 1, 2, 3}, {1, 3}, {0, 1, 2, 3}, {0, 2}, {0, 1, 2, 3}, {1}, {0, 1, 2, 3}};
  struct Case {
    const char* name;
    bool staged;
    FetchVia via;
    double sm_share = 0;
  } cases[] = {{"sm loads", false, FetchVia::kSmLoads},
               {"copy engine", false, FetchVia::kCopyEngine},
               {"copy engine, sm share 0.5", false, FetchVia::kCopyEngine, 0.5},
               {"staged", true, FetchVia::kSmLoads}};
  for (bool resident : {false, true}) {
    KvConfig c;
    c.top_k = 16;
    c.cached_rows = 40;
    c.seed_rows = 32;  // the first fetch's misses already push seeds out
    c.attend_resident = resident;
    KvConfig unseeded = c;
    unseeded.seed_rows = 0;
    InMemorySource plain_source;
    auto plain = CreateCpuAgent(shape, unseeded, &plain_source);
    ASSERT_TRUE(plain.ok()) << plain.status().ToString();
    ASSERT_TRUE(DriveChangingBatches(plain->get(), prompts, steps, std::mt19937(93)).ok());
    for (const Case& cs : cases) {
      const std::string name = std::string(cs.name) + (resident ? ", resident attended" : "");
      CudaAgentOptions options{1024};
      options.fetch_via = cs.via;
      options.fetch_sm_share = cs.sm_share;
      RaggedPair pair;
      const Status driven = DriveChangingOnBoth(shape, c, options, cs.staged, prompts, steps, 93, &pair);
      ASSERT_TRUE(driven.ok()) << name << ": " << driven.ToString();
      ExpectSameRun(pair, shape, prompts.size(), name);
      const AgentStats a = pair.cpu->stats(), b = pair.gpu->stats();
      EXPECT_EQ(b.device_bytes, a.device_bytes) << name;  // the caches' rows, the seeds' among them
      EXPECT_LT(b.rows_fetched, (*plain)->stats().rows_fetched) << name << ": seeding saved no fetch";
      std::printf("%-32s max |out diff| %.2e, %lld rows fetched (%lld unseeded), %lld reused\n", name.c_str(), pair.worst,
                  static_cast<long long>(b.rows_fetched), static_cast<long long>((*plain)->stats().rows_fetched),
                  static_cast<long long>(b.rows_reused));
    }
  }
  // Seeding needs the prompt's queries: a prefill without them is refused, nothing stored.
  KvConfig c;
  c.seed_rows = 8;
  InMemorySource source;
  auto gpu = CreateCudaAgent(shape, c, &source, {1024});
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  auto wrapped = WrapHostTensors(std::move(*gpu));
  ASSERT_TRUE(wrapped.ok());
  std::vector<float> k(size_t(100) * shape.n_kv_heads * shape.head_dim, 0.5f), v = k;
  const SequenceId ids[] = {1};
  const int32_t offsets[] = {0, 100};
  ASSERT_TRUE((*wrapped)->AddSequence(1).ok());
  EXPECT_EQ((*wrapped)->PrefillLayer(0, {ids, offsets, nullptr, k.data(), v.data(), nullptr}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(*(*wrapped)->SequenceLength(1), 0);
#endif
}

// A layer's items built on several host threads (CudaAgentOptions::plan_threads) give the same
// outputs, bit for bit, and the same selections as on one: 72 ragged sequences (16 or more a
// thread, so 4 threads plan), the union rule with its resident rows, the copy-engine fetch as
// the throughput bench runs it; batches that change from step to step. And fewer than one thread,
// or a fetch SM share outside [0, 1], is refused.
TEST(CudaAgentTest, ItemsPlannedOnSeveralThreadsEqualOneThread) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape{2, 8, 2, 64};
  std::vector<int32_t> prompts;
  for (int i = 0; i < 72; ++i) prompts.push_back(40 + (i * 37) % 230);
  std::vector<size_t> all(prompts.size()), some;
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  for (size_t i = 0; i < all.size(); i += 2) some.push_back(i);
  const std::vector<std::vector<size_t>> steps{all, all, some, all};
  KvConfig c;
  c.top_k = 24;
  c.select = SelectFrom::kUnion;
  c.top_k_real = 8;
  c.cached_rows = 80;
  c.attend_resident = true;
  std::vector<float> outputs[2];
  InMemorySource sources[2];  // outlive the agents, which release their sequences there
  std::unique_ptr<Agent> agents[2];
  for (int t = 0; t < 2; ++t) {
    CudaAgentOptions options{1024};
    options.fetch_via = FetchVia::kCopyEngine;
    options.plan_threads = t == 0 ? 1 : 4;
    auto device = CreateCudaAgent(shape, c, &sources[t], options);
    ASSERT_TRUE(device.ok()) << device.status().ToString();
    auto wrapped = WrapHostTensors(std::move(*device));
    ASSERT_TRUE(wrapped.ok()) << wrapped.status().ToString();
    agents[t] = std::move(*wrapped);
    auto got = DriveChangingBatches(agents[t].get(), prompts, steps, std::mt19937(93));
    ASSERT_TRUE(got.ok()) << "plan_threads " << options.plan_threads << ": " << got.status().ToString();
    outputs[t] = std::move(*got);
  }
  ASSERT_EQ(outputs[1].size(), outputs[0].size());
  EXPECT_TRUE(outputs[1] == outputs[0]) << "4 planning threads changed the outputs";
  const AgentStats a = agents[0]->stats(), b = agents[1]->stats();
  EXPECT_EQ(b.rows_selected, a.rows_selected);
  EXPECT_EQ(b.rows_fetched, a.rows_fetched);
  EXPECT_EQ(b.rows_reused, a.rows_reused);
  ExpectSameSelections(*agents[1], *agents[0], shape, prompts.size(), "plan threads");
  CudaAgentOptions none{1024};
  none.plan_threads = 0;
  InMemorySource source;
  EXPECT_EQ(CreateCudaAgent(shape, c, &source, none).status().code(), StatusCode::kInvalidArgument);
  for (double share : {-0.1, 1.5, std::nan("")}) {  // and a fetch share that is not one
    CudaAgentOptions bad{1024};
    bad.fetch_sm_share = share;
    EXPECT_EQ(CreateCudaAgent(shape, c, &source, bad).status().code(), StatusCode::kInvalidArgument) << share;
  }
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// The small model and 1-bit specache (k = 16) of the tests below that drive batches without a model.
constexpr ModelShape kSmallShape{3, 8, 2, 64};
KvConfig SmallOneBitConfig() {
  KvConfig c;
  c.mode = KvMode::kSpeCache;
  c.key_bits = c.value_bits = 1;
  c.top_k = 16;
  return c;
}
#endif

// A device pool too small for every sequence: the sequence that asks for blocks the pool no longer
// has is refused with RESOURCE_EXHAUSTED, before anything of it changed; the others decode on
// exactly as they would alone (outputs equal to the CPU agent's), and every block comes back.
TEST(CudaAgentTest, AnExhaustedDevicePoolRefusesOnlyTheSequenceThatAsked) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape = kSmallShape;
  const KvConfig c = SmallOneBitConfig();
  const int64_t block = 4096;  // 128 tokens of a 64-dim 1-bit head (the pool test checks the layout)
  const int replicas = shape.n_layers * shape.n_kv_heads;
  // The survivor: 200 prompt tokens + 40 steps (pre-decode appends nothing) = 2 blocks per
  // replica; 4 blocks to spare.
  CudaAgentOptions o;
  o.capacity_tokens = 1024;
  o.device_pool_bytes = (2 * replicas + 4) * block;
  InMemorySource cpu_source, gpu_source;
  auto cpu = CreateCpuAgent(shape, c, &cpu_source);
  auto gpu = CreateCudaAgent(shape, c, &gpu_source, o);
  ASSERT_TRUE(cpu.ok() && gpu.ok()) << gpu.status().ToString();
  auto wrapped = WrapHostTensors(std::move(gpu).value());
  ASSERT_TRUE(wrapped.ok());
  Agent& agent = **wrapped;
  EXPECT_EQ(agent.stats().device_pool_bytes, o.device_pool_bytes);

  // The intruder (id 99) asks between the survivor's prefill and its decode steps.
  std::mt19937 intruder_rng(5);
  auto intrude = [&]() -> Status {
    SPECACHE_RETURN_IF_ERROR(agent.AddSequence(99));
    const int32_t n = 100;
    std::vector<float> q(size_t(n) * shape.n_q_heads * shape.head_dim), k(size_t(n) * shape.n_kv_heads * shape.head_dim);
    std::normal_distribution<float> normal;
    for (float& x : q) x = normal(intruder_rng);
    for (float& x : k) x = normal(intruder_rng);
    const std::vector<SequenceId> ids{99};
    const std::vector<int32_t> offsets{0, n};
    const int64_t used = agent.stats().device_pool_used_bytes;
    const Status s = agent.PrefillLayer(0, {ids, offsets, q.data(), k.data(), k.data(), nullptr});
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
    EXPECT_NE(s.message().find("sequence 99"), std::string::npos) << s.ToString();
    EXPECT_EQ(agent.stats().device_pool_used_bytes, used) << "the refused sequence took nothing";
    EXPECT_EQ(*agent.SequenceLength(99), 0);
    return agent.ReleaseSequence(99);
  };
  auto want = testing::DriveBatch(cpu->get(), {200}, 40, std::mt19937(88));
  auto got = testing::DriveBatch(&agent, {200}, 40, std::mt19937(88), intrude);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), want->size());
  double worst = 0;
  for (size_t i = 0; i < want->size(); ++i) worst = std::max(worst, double(std::fabs((*got)[i] - (*want)[i])));
  EXPECT_LT(worst, 1e-3);
  EXPECT_EQ(agent.stats().device_pool_used_bytes, 2 * replicas * block);

  // A decode step that needs a block the pool does not have is refused at BeginStep, and the
  // agent stays usable: the survivor at 256 tokens needs a third block per replica.
  InMemorySource tight_source;
  auto tight = CreateCudaAgent(shape, c, &tight_source, [&] {
    CudaAgentOptions t = o;
    t.device_pool_bytes = 2 * replicas * block;
    return t;
  }());
  ASSERT_TRUE(tight.ok());
  auto tight_host = WrapHostTensors(std::move(tight).value());
  ASSERT_TRUE(tight_host.ok());
  auto filled = testing::DriveBatch(tight_host->get(), {256}, 0, std::mt19937(3));  // prefill and pre-decode only
  ASSERT_TRUE(filled.ok()) << filled.status().ToString();
  const std::vector<SequenceId> survivor{10};
  const Status refused = (*tight_host)->BeginStep(StepKind::kDecode, survivor);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
  EXPECT_EQ((*tight_host)->stats().device_pool_used_bytes, 2 * replicas * block);
  ASSERT_TRUE((*tight_host)->ReleaseSequence(10).ok());
  EXPECT_EQ((*tight_host)->stats().device_pool_used_bytes, 0);
  ASSERT_TRUE(agent.ReleaseSequence(10).ok());
  EXPECT_EQ(agent.stats().device_pool_used_bytes, 0);
#endif
}

// A CUDA agent dropped with sequences still registered releases them in the source once its
// streams and its fetch's worker are done with their pages: the rows are freed and another agent
// over the same source adds the same ids (the CPU agent's AgentTest.ADroppedAgent... alike).
TEST(CudaAgentTest, ADroppedAgentReleasesItsSequencesInTheSource) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  InMemorySource source;
  {
    auto gpu = CreateCudaAgent(kSmallShape, SmallOneBitConfig(), &source, CudaAgentOptions{});
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    auto agent = WrapHostTensors(std::move(gpu).value());
    ASSERT_TRUE(agent.ok());
    auto driven = testing::DriveBatch(agent->get(), {200, 90}, 3, std::mt19937(21));  // ids 10 and 11
    ASSERT_TRUE(driven.ok()) << driven.status().ToString();
    EXPECT_GT(source.stored_bytes(), 0);
  }
  EXPECT_EQ(source.stored_bytes(), 0);
  for (SequenceId id : {10, 11}) EXPECT_EQ(source.Length(id, 0, 0).status().code(), StatusCode::kNotFound);
  auto again = CreateCudaAgent(kSmallShape, SmallOneBitConfig(), &source, CudaAgentOptions{});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  for (SequenceId id : {10, 11}) EXPECT_TRUE((*again)->AddSequence(id).ok());
#endif
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// An in-memory source (zero-copy pages) that refuses every commit of one sequence's rows from a
// given token on, as a daemon would refuse a tenant over its quota; the rest it forwards.
class RefusingCommitsSource final : public testing::ForwardingSource {
 public:
  RefusingCommitsSource(SequenceId refused, int32_t from_token)
      : ForwardingSource(/*zero_copy=*/true), refused_(refused), from_token_(from_token) {}
  Status CommitRows(SequenceId id, int layer, int kv_head, int32_t first, int32_t n) override {
    if (Refuses(id, first)) return Status::ResourceExhausted("the tenant's quota is spent");
    return ForwardingSource::CommitRows(id, layer, kv_head, first, n);
  }
  Status CommitLayerRows(SequenceId id, int layer, int n_kv_heads, int32_t first, int32_t n) override {
    if (Refuses(id, first)) return Status::ResourceExhausted("the tenant's quota is spent");
    return ForwardingSource::CommitLayerRows(id, layer, n_kv_heads, first, n);
  }
  int64_t refused() const { return refused_count_; }

 private:
  bool Refuses(SequenceId id, int32_t first) {
    if (id != refused_ || first < from_token_) return false;
    ++refused_count_;
    return true;
  }
  const SequenceId refused_;
  const int32_t from_token_;
  std::atomic<int64_t> refused_count_{0};
};
#endif

// Commits the source refuses for one sequence of a batch: the next BeginStep reports the first
// (naming the rows and the sequence), stats() counts every one, the other sequence's rows are all
// committed, and once the refused sequence is released the agent steps on with the other.
TEST(CudaAgentTest, CommitsRefusedForOneSequenceAreReportedAndLeaveTheOthersWhole) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
#ifdef SPECACHE_TEST_HAVE_CUDA
  const ModelShape shape = kSmallShape;
  const KvConfig c = SmallOneBitConfig();
  // Sequence 11 (a 150-token prompt) has its prefill and first two decode rows committed.
  RefusingCommitsSource source(11, 152);
  auto created = CreateCudaAgent(shape, c, &source, {1024});
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto wrapped = WrapHostTensors(std::move(created).value());
  ASSERT_TRUE(wrapped.ok());
  Agent& agent = **wrapped;
  auto driven = testing::DriveBatch(&agent, {200, 150}, 12, std::mt19937(17));
  ASSERT_FALSE(driven.ok()) << "no step reported the refused commits";
  EXPECT_EQ(driven.status().code(), StatusCode::kResourceExhausted) << driven.status().ToString();
  EXPECT_NE(driven.status().message().find("rows 152..153 of sequence 11 at layer 0 not committed"), std::string::npos)
      << driven.status().ToString();
  EXPECT_NE(driven.status().message().find("the tenant's quota is spent"), std::string::npos) << driven.status().ToString();
  const AgentStats stats = agent.stats();  // commits every landed row first
  EXPECT_GT(source.refused(), 0);
  EXPECT_EQ(stats.commits_failed, source.refused());
  const int32_t whole = *agent.SequenceLength(10), refused_at = *agent.SequenceLength(11);
  EXPECT_GT(refused_at, 152);
  for (int l = 0; l < shape.n_layers; ++l) {
    for (int h = 0; h < shape.n_kv_heads; ++h) {
      EXPECT_EQ(*source.Length(10, l, h), whole) << "layer " << l << ", head " << h;
      EXPECT_EQ(*source.Length(11, l, h), 152) << "layer " << l << ", head " << h;
    }
  }
  ASSERT_TRUE(agent.ReleaseSequence(11).ok());
  const std::vector<SequenceId> rest{10};
  const Status next = agent.BeginStep(StepKind::kDecode, rest);
  EXPECT_TRUE(next.ok()) << "the refusal was reported again: " << next.ToString();
  if (next.ok()) agent.AbortStep();
  EXPECT_EQ(agent.stats().commits_failed, stats.commits_failed);
  ASSERT_TRUE(agent.ReleaseSequence(10).ok());
#endif
}

}  // namespace

}  // namespace specache
