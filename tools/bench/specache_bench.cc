// specache-bench: figures for the agent (CPU backend everywhere; gather and step on a GPU).
//
//   specache-bench [SUITE] [OPTIONS]     SUITE: memory, quantize, attention, all (the default),
//                                        gather, contend, step, attend, layers, prefill, reuse
//   specache-bench SUITE --help          the options of one suite (--tokens, --head-dim, --repeats,
//                                        --host-gib, --batches, --fetch-blocks, --trace,
//                                        --row-bytes, --json: where they apply)
//   specache-bench --version
//
// memory     replica bytes / fp16 bytes after streaming N tokens through one real HeadReplica,
//            for G in {32, 64}, B in {1, 2, 4}, R in {64, 128}; checks the 1-bit, G=32, R=64
//            target (<= 0.14 at 32K tokens).
// quantize   key-group and value-token quantization throughput per bit width (fp16 input GB/s).
// attention  one decode step over one KV head (GQA group of 4) with k substituted rows:
//            context tokens/s per bit width, the ratio to the 16-bit replica in the same run, and
//            the cost of the speculative second row (2 rows vs 1).
// gather     (CUDA builds, on a GPU) the zero-copy gather of one layer's top-k rows for B sequences
//            from pages spread over --host-gib GiB of registered host memory, vs a contiguous
//            pinned H2D copy of the same bytes and vs a CPU gather + one copy (gather_bench.h).
// contend    (CUDA builds, on one or more GPUs) each GPU's gather of --batches (first value,
//            default 32) sequences' top-k rows at --tokens context (default 32768), and a contiguous
//            H2D copy, alone and on every GPU at once from one host page pool (contention_bench.h).
// step       (CUDA builds, on a GPU) a 32-layer decode step with Llama-3-8B shapes through the CUDA
//            agent, with and without the speculative fetch, for --batches (default 1,8,16,32) at
//            --tokens context (default 8192) (step_bench.h).
// attend     (CUDA builds, on a GPU) one layer's decode attention and top-k (also with the adaptive
//            budget) at Llama-3-8B shapes, 1- and 2-bit, bytes read against the HBM bandwidth of a
//            device copy (step_bench.h).
// layers     (CUDA builds, on a GPU) the model's work outside attention, alone and beside the
//            fetch's SM slots (step_bench.h).
// prefill    (CUDA builds, on a GPU) one layer's prompt attention (cuda::AttendPrefill) at
//            Llama-3-8B shapes for --batches prompts of --tokens, in TFLOPS against a cuBLAS fp16
//            GEMM measured in the same run (step_bench.h).
// reuse      bytes fetched per decode token with and without the resident rows, replayed from a
//            selection trace of a real decode (--trace; specache-run generate --selection-trace)
//            (reuse_bench.h).
// Timings are medians of --repeats runs after one warm-up. The machine is noisy: read ratios.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_stats.h"
#include "command_line.h"
#include "output_paths.h"
#include "progress.h"
#include "specache/agent.h"
#include "specache/cpu_attention.h"
#include "specache/device_probe.h"
#include "specache/head_replica.h"
#include "specache/quantizer.h"
#include "specache/version.h"
#include "host_gather_bench.h"
#include "reuse_bench.h"
#ifdef SPECACHE_BENCH_CUDA
#include "contention_bench.h"
#include "gather_bench.h"
#include "step_bench.h"
#endif

namespace specache {
namespace {

struct Options {
  std::string suite = "all";
  int tokens = 32768;
  int head_dim = 128;
  int repeats = 7;
  int host_gib = 16;
  std::string host_pages = "base";  // gather: what backs the host pages (bench::HostPageBacking)
  int gather_threads = 12;          // host-gather: GatherPageRows' threads (the agent's copy-engine default)
  std::vector<int> gather_ahead = {specache::GatherOptions{}.prefetch_rows};  // host-gather: prefetch depths (rows) to time
  std::string gather_row_format = "fp16";  // host-gather: how the source stores its rows
  // host-gather: "streaming" (GatherOptions::streaming_stores) or "cached"; the default, the agent's.
  std::string gather_stores = specache::GatherOptions{}.streaming_stores ? "streaming" : "cached";
  bool tokens_given = false;
  int fetch_blocks = 0;  // step: 0 = the agent's default
  std::vector<std::string> fetch_overlap;  // step: CudaAgentOptions::fetch_overlap per row (empty: the default)
  std::vector<std::string> fetch_via;      // step: CudaAgentOptions::fetch_via per row (empty: the default)
  int fetch_threads = 0;                   // step: CudaAgentOptions::fetch_threads (0: the default)
  int fetch_copy_piece_kb = -1;            // step: CudaAgentOptions::fetch_copy_piece_bytes / 1024 (-1: the default)
  std::vector<double> fetch_sm_share;      // step: CudaAgentOptions::fetch_sm_share, a row each (empty: the default)
  std::vector<std::string> fetch_gather_stores;  // step: StepOptions::fetch_gather_stores
  std::string selection_stream = "own";    // step: StepOptions::selection_on_own_stream ("own" or "compute")
  std::string page_writes = "selection";   // step: StepOptions::page_writes_after_selection ("selection" or "compute")
  std::string start_prefetch = "after-layer";  // step: StepOptions::prefetch_after_layer ("after-layer" or "after-attention")
  bool host_huge_pages = true;             // step: the host pages' slabs ask for transparent huge pages
  std::vector<std::string> step_kv;  // step: replicas timed (empty: the suite's default)
  std::string replica_layout = "mma";  // step: mma or natural (StepOptions::mma_codes)
  bool profile_step = false;         // step: StepOptions::profile_step
  double fresh_inputs = 1.0;         // step: StepOptions::fresh_inputs
  bool profile_no_fetch = false;     // step: StepOptions::profile_no_fetch
  bool no_model_graphs = false;      // step: !StepOptions::model_graphs
  int plan_threads = 0;              // step: CudaAgentOptions::plan_threads (0: the default)
  int attend_rows = -1;              // attend: StepOptions::attend_rows
  int attend_free_slots = 0;         // attend: StepOptions::attend_free_slots
  bool attend_random_rows = false;   // attend: StepOptions::attend_random_rows
  uint32_t attend_rows_seed = 1000;  // attend: StepOptions::attend_rows_seed
  std::vector<std::string> attend_unit_plans;  // attend: StepOptions::attend_unit_plans
  std::vector<std::string> attend_codes_l2;    // attend: StepOptions::attend_codes_l2
  std::vector<int> attend_topk_parts;          // attend: StepOptions::attend_topk_parts
  std::string trace_path;  // reuse: specache-run generate --selection-trace
  int row_bytes = 256;     // reuse: bytes of one row
  std::vector<int> batches;  // step: sequences per step (empty: the suite's default)
  std::string json_path;
};

struct Row {  // one JSON record
  std::string suite, name;
  std::vector<std::pair<std::string, double>> values;
};

double MedianSeconds(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return bench::Median(std::move(t));
}

std::vector<Half> RandomHalves(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<Half> out(n);
  for (auto& h : out) h = FloatToHalf(dist(rng));
  return out;
}

HeadReplica Filled(int tokens, int head_dim, int bits, int group, int residual, const std::vector<Half>& kv) {
  HeadReplica r({head_dim, bits, bits, group, residual});
  r.Append(kv.data(), kv.data() + static_cast<size_t>(tokens) * head_dim, tokens);
  return r;
}

bool Memory(const Options& o, std::vector<Row>* rows) {
  std::printf("\n== memory: replica bytes / fp16 bytes, %d tokens, head_dim %d ==\n", o.tokens, o.head_dim);
  std::printf("%-6s %-6s %-6s %14s %14s %8s\n", "bits", "G", "R", "replica_B", "fp16_B", "ratio");
  const auto kv = RandomHalves(2 * static_cast<size_t>(o.tokens) * o.head_dim, 1);
  const double fp16 = 2.0 * o.tokens * o.head_dim * 2;
  bool target_met = true;
  for (int residual : {64, 128}) {
    for (int group : {32, 64}) {
      if (residual % group || o.head_dim % group) continue;
      for (int bits : {1, 2, 4}) {
        const HeadReplica r = Filled(o.tokens, o.head_dim, bits, group, residual, kv);
        const double ratio = r.device_bytes() / fp16;
        std::printf("%-6d %-6d %-6d %14lld %14.0f %8.4f\n", bits, group, residual,
                    static_cast<long long>(r.device_bytes()), fp16, ratio);
        rows->push_back({"memory", "b" + std::to_string(bits) + "_g" + std::to_string(group) + "_r" +
                                       std::to_string(residual),
                         {{"bits", bits}, {"group", group}, {"residual", residual}, {"tokens", o.tokens},
                          {"replica_bytes", double(r.device_bytes())}, {"fp16_bytes", fp16}, {"ratio", ratio}}});
        if (bits == 1 && group == 32 && residual == 64) {
          target_met = ratio <= 0.14;
          std::printf("       target 1-bit G=32 R=64: ratio %.4f <= 0.14 -> %s\n", ratio, target_met ? "met" : "NOT met");
        }
      }
    }
  }
  return target_met;
}

void Quantize(const Options& o, std::vector<Row>* rows) {
  std::printf("\n== quantize: fp16 input GB/s, head_dim %d, G=32 ==\n", o.head_dim);
  std::printf("%-6s %14s %14s\n", "bits", "keys_GBps", "values_GBps");
  const int group = 32, n_groups = 512;
  const auto x = RandomHalves(static_cast<size_t>(n_groups) * group * o.head_dim, 2);
  const double bytes = static_cast<double>(x.size()) * 2;
  for (int bits : {1, 2, 4}) {
    std::vector<uint32_t> codes(static_cast<size_t>(o.head_dim) * WordsPerGroup(group, bits));
    std::vector<Half> scale(o.head_dim), zero(o.head_dim);
    const double tk = MedianSeconds(o.repeats, [&] {
      for (int g = 0; g < n_groups; ++g) {
        QuantizeKeyGroup(x.data() + static_cast<size_t>(g) * group * o.head_dim, group, o.head_dim, bits, codes.data(),
                         scale.data(), zero.data());
      }
    });
    const double tv = MedianSeconds(o.repeats, [&] {
      for (int t = 0; t < n_groups * group; ++t) {
        QuantizeValueToken(x.data() + static_cast<size_t>(t) * o.head_dim, o.head_dim, group, bits, codes.data(),
                           scale.data(), zero.data());
      }
    });
    std::printf("%-6d %14.2f %14.2f\n", bits, bytes / tk / 1e9, bytes / tv / 1e9);
    rows->push_back({"quantize", "b" + std::to_string(bits),
                     {{"bits", bits}, {"keys_gbps", bytes / tk / 1e9}, {"values_gbps", bytes / tv / 1e9}}});
  }
}

void Attention(const Options& o, std::vector<Row>* rows) {
  const int tokens = std::min(o.tokens, 8192), heads = 4, k = 64;
  std::printf("\n== attention: one KV head, %d tokens, head_dim %d, GQA %d, k=%d substituted ==\n", tokens, o.head_dim,
              heads, k);
  std::printf("%-6s %12s %14s %12s %14s\n", "bits", "ms_1row", "Mtok_per_s", "vs_16bit", "2rows/1row");
  const auto kv = RandomHalves(2 * static_cast<size_t>(tokens) * o.head_dim, 3);
  const auto fresh = RandomHalves(4 * static_cast<size_t>(o.head_dim), 4);
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 0.5f);
  std::vector<float> q(2 * heads * o.head_dim), out(q.size());
  for (auto& x : q) x = dist(rng);
  double t16 = 0;
  for (int bits : {16, 4, 2, 1}) {
    const HeadReplica r = Filled(tokens, o.head_dim, bits, 32, 64, kv);
    std::vector<int32_t> sub_tokens(k);
    for (int i = 0; i < k; ++i) sub_tokens[i] = i * (r.quantized_keys() / k);
    std::vector<Half> sub_rows(static_cast<size_t>(k) * 2 * o.head_dim);
    // Rows as the source returns them: [K | V] of each token (kv holds all keys, then all values).
    for (int i = 0; i < k; ++i) {
      Half* row = sub_rows.data() + static_cast<size_t>(i) * 2 * o.head_dim;
      std::memcpy(row, kv.data() + static_cast<size_t>(sub_tokens[i]) * o.head_dim, o.head_dim * sizeof(Half));
      std::memcpy(row + o.head_dim, kv.data() + (static_cast<size_t>(tokens) + sub_tokens[i]) * o.head_dim,
                  o.head_dim * sizeof(Half));
    }
    cpu::SubstitutedRows sub{sub_tokens.data(), sub_rows.data(), k};
    cpu::AttentionWorkspace ws;
    std::vector<float> probs(static_cast<size_t>(heads) * r.quantized_keys());
    const float scale = 1.0f / std::sqrt(float(o.head_dim));
    auto step = [&](int n_rows) {
      return MedianSeconds(o.repeats, [&] {
        cpu::AttendDecodeRows(r, sub, q.data(), fresh.data(), fresh.data() + 2 * o.head_dim, n_rows, heads, scale,
                              out.data(), n_rows - 1, r.quantized_keys(), probs.data(), &ws);
      });
    };
    const double t1 = step(1), t2 = step(2);
    if (bits == 16) t16 = t1;
    std::printf("%-6d %12.3f %14.2f %12.3f %14.3f\n", bits, t1 * 1e3, tokens / t1 / 1e6, t16 / t1, t2 / t1);
    rows->push_back({"attention", "b" + std::to_string(bits),
                     {{"bits", bits}, {"tokens", tokens}, {"ms_1row", t1 * 1e3}, {"ms_2rows", t2 * 1e3},
                      {"speedup_vs_16bit", t16 / t1}, {"two_row_cost", t2 / t1}}});
  }
  std::printf("       (vs_16bit > 1: faster than the fp16 replica; the CPU decodes the low-bit cache to floats\n"
              "        first, so low bits save memory here, not time. 2rows/1row: cost of the speculative row.)\n");
}

bool WriteJson(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream f(path);
  f << "{\"results\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    f << "  {\"suite\": \"" << rows[i].suite << "\", \"name\": \"" << rows[i].name << "\"";
    for (const auto& [key, value] : rows[i].values) f << ", \"" << key << "\": " << value;
    f << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
  }
  f << "]}\n";
  if (!f.flush()) {
    std::fprintf(stderr, "specache-bench: could not write %s\n", path.c_str());
    return false;
  }
  std::printf("\nwrote %s\n", path.c_str());
  return true;
}

// The suites as subcommands, each with the options that apply to it; with none, "all".
struct Suite {
  const char* name;
  const char* help;
  bool tokens, head_dim, repeats, host_gib, batches, fetch_blocks, trace;
};
constexpr Suite kSuites[] = {
    {"memory", "replica bytes / fp16 bytes after N tokens; checks the 1-bit G=32 R=64 target (<= 0.14 at 32K)",
     true, true, false, false, false, false, false},
    {"quantize", "key-group and value-token quantization throughput per bit width", false, true, true, false, false,
     false, false},
    {"attention", "one CPU decode step over one KV head with k substituted rows, per bit width", true, true, true,
     false, false, false, false},
    {"all", "memory, quantize and attention (the default)", true, true, true, false, false, false, false},
    {"gather", "(GPU) zero-copy gather of one layer's top-k rows vs a contiguous copy", false, false, true, true,
     false, false, false},
    {"contend", "(GPU) the gather on every GPU alone and all at once", true, false, true, true, true, false, false},
    {"step", "(GPU) a 32-layer decode step of the CUDA agent, with and without the speculative fetch", true, false,
     false, false, true, true, false},
    {"attend", "(GPU) one layer's decode attention and top-k against the HBM bandwidth", true, false, false, false,
     true, true, false},
    {"layers", "(GPU) the model's work outside attention per step, alone and beside the fetch's SM slots", false, false,
     false, false, true, false, false},
    {"prefill", "(GPU) one layer's prompt attention against the cuBLAS fp16 GEMM rate", true, false, false, false, true,
     false, false},
    {"reuse", "bytes fetched per token with and without the row cache, from a selection trace", false, false, false,
     false, false, false, true},
    {"host-gather", "the copy-engine fetch's host gather over base and transparent huge pages (no GPU needed)", false,
     false, true, true, false, false, false},
};

// Adds `suite`'s options to `cmd`, bound to `o`.
void AddSuiteOptions(CLI::App* cmd, const Suite& suite, Options* o) {
  const auto positive = CLI::PositiveNumber;
  if (suite.tokens) {
    cmd->add_option_function<int>("--tokens", [o](int n) { o->tokens = n, o->tokens_given = true; },
                                  "context tokens (default: 32768; step, attend and prefill 8192)")
        ->check(positive);
  }
  if (suite.head_dim) {
    cmd->add_option("--head-dim", o->head_dim, "head dimension (a multiple of 32)")
        ->capture_default_str()
        ->check(CLI::Validator(
            [](std::string& v) {
              const int d = std::atoi(v.c_str());
              return d > 0 && d % 32 == 0 ? std::string() : "the head dimension must be a positive multiple of 32";
            },
            "MULTIPLE OF 32"));
  }
  if (suite.repeats) cmd->add_option("--repeats", o->repeats, "timed runs after one warm-up")->capture_default_str()->check(positive);
  if (suite.host_gib) {
    cmd->add_option("--host-gib", o->host_gib, "registered host memory the pages spread over (GiB)")
        ->capture_default_str()
        ->check(positive);
  }
  if (std::string_view(suite.name) == "host-gather") {
    cmd->add_option("--gather-threads", o->gather_threads, "threads of the gather (the agent's copy-engine fetch: 12)")
        ->capture_default_str()
        ->check(positive);
    cmd->add_option("--gather-ahead", o->gather_ahead,
                    "rows a gather thread prefetches ahead of its copy, a row each, e.g. 4,8,16 (default: the agent's, 4)")
        ->delimiter(',')
        ->check(CLI::Range(0, 256));
    cmd->add_option("--row-format", o->gather_row_format,
                    "how the source stores its rows: fp16 (512 bytes) or int8 (272, --kv ...-int8, host-rows=int8)")
        ->capture_default_str()
        ->check(CLI::IsMember({"fp16", "int8"}));
    cmd->add_option("--gather-stores", o->gather_stores,
                    "how the gather writes its output: cached (plain stores, the agent's default) or streaming "
                    "(non-temporal stores)")
        ->capture_default_str()
        ->check(CLI::IsMember({"cached", "streaming"}));
  }
  if (std::string_view(suite.name) == "gather") {
    cmd->add_option("--host-pages", o->host_pages,
                    "what backs the host pages: base (memfd, 4 KiB pages, as the daemon's), thp-shmem (memfd with "
                    "MADV_HUGEPAGE) or thp-anon (anonymous memory with MADV_HUGEPAGE); the run reports the share "
                    "the kernel mapped by 2 MiB pages")
        ->capture_default_str()
        ->check(CLI::IsMember({"base", "thp-shmem", "thp-anon"}));
  }
  if (suite.batches) {
    cmd->add_option("--batches", o->batches, "sequences per step, e.g. 1,8,16,32 (contend: the first)")
        ->delimiter(',')
        ->check(positive);
  }
  if (suite.fetch_blocks) {
    cmd->add_option("--fetch-blocks", o->fetch_blocks, "fetch kernel blocks (default: the agent's)")->check(positive);
  }
  if (std::string_view(suite.name) == "step") {
    cmd->add_option("--fetch-overlap", o->fetch_overlap,
                    "when each layer's fetch is queued, a row each: from-selection (default), beside-next-attention, "
                    "within-next-attention")
        ->delimiter(',')
        ->check(CLI::IsMember(FetchOverlapNames()));
    cmd->add_option("--fetch-via", o->fetch_via,
                    "how the fetch's rows move, a row each: sm-loads, copy-engine (default: the agent's, copy-engine)")
        ->delimiter(',')
        ->check(CLI::IsMember(FetchViaNames()));
    cmd->add_option("--fetch-copy-piece-kb", o->fetch_copy_piece_kb,
                    "KiB of the copy-engine rows' copies (0: one copy a layer; default: the agent's)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--fetch-sm-share", o->fetch_sm_share,
                    "share of each layer's fetched sequences the copy-engine route leaves to SM loads, a row each "
                    "(default: the agent's, 0)")
        ->delimiter(',')
        ->check(CLI::Range(0.0, 1.0));
    cmd->add_option("--plan-threads", o->plan_threads,
                    "host threads that build a layer's attention items (default: the agent's, 1)")
        ->check(CLI::PositiveNumber);
    cmd->add_option("--fetch-gather-stores", o->fetch_gather_stores,
                    "how the copy-engine rows' host gather writes the pinned buffer, a row each: cached (plain "
                    "stores, left in the CPU's caches for the copy engine; the agent's default), streaming "
                    "(non-temporal stores; rows suffixed _streaming)")
        ->delimiter(',')
        ->check(CLI::IsMember({"streaming", "cached"}));
    cmd->add_option("--selection-stream", o->selection_stream,
                    "where each layer's top-k runs: own (a stream of its own, beside the model's kernels after the "
                    "attention; the agent's default) or compute (in order on the model's stream; rows suffixed "
                    "_ordered_topk)")
        ->capture_default_str()
        ->check(CLI::IsMember({"own", "compute"}));
    cmd->add_option("--page-writes", o->page_writes,
                    "where each layer's new rows are written into the host pages: selection (after the layer's "
                    "top-k on its stream, beside the model's kernels; the agent's default, with --selection-stream "
                    "own) or compute (in order on the model's stream; rows suffixed _ordered_writes)")
        ->capture_default_str()
        ->check(CLI::IsMember({"selection", "compute"}));
    cmd->add_option("--start-prefetch", o->start_prefetch,
                    "when the bench calls each layer's StartPrefetch: after-layer (once the layer's output "
                    "projection and MLP are queued, so the host's fetch planning never delays them; as specache-run "
                    "does) or after-attention (right after DecodeLayer; rows suffixed _prefetch_early)")
        ->capture_default_str()
        ->check(CLI::IsMember({"after-layer", "after-attention"}));
    cmd->add_option("--fetch-threads", o->fetch_threads,
                    "host threads of the copy-engine rows (default: the agent's; it takes at most the cores less two)")
        ->check(positive);
    cmd->add_flag("--host-huge-pages,!--no-host-huge-pages", o->host_huge_pages,
                  "ask for transparent huge pages for the host pages the fetch gathers from (default on)");
    cmd->add_option("--replica-layout", o->replica_layout,
                    "mma: 1-bit replicas in the lean decode path's layout (the agent's default); natural: the "
                    "previous layout and kernel (rows suffixed _natural)")
        ->capture_default_str()
        ->check(CLI::IsMember({"mma", "natural"}));
  }
  if (std::string_view(suite.name) == "attend") {
    cmd->add_option("--attend-rows", o->attend_rows,
                    "substituted (full-precision) rows per KV head, spread over the context (default: k, 64; 0: "
                    "none, as a step with nothing resident; specache-run's default selection attends its whole row "
                    "cache, 1024 rows)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--free-slots", o->attend_free_slots,
                    "CTA slots the attention's plan leaves free, as the agent's leaves its fetch_blocks (32) in "
                    "specache mode (default 0: none)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--unit-plans", o->attend_unit_plans,
                    "more timings of the lean path's attention (1m), its work split forced: CHUNK/ORDER, e.g. "
                    "16/last,32/shared (CHUNK 32-token blocks a bulk unit, 0: the plan's; ORDER chosen, shared, "
                    "first, last: where the tail units run)")
        ->delimiter(',');
    cmd->add_option("--codes-l2", o->attend_codes_l2,
                    "more timings of the lean path's attention (1m), its L2 policy forced: normal, first (the "
                    "codes' copies evict-first, the scores evict-last), e.g. normal,first; the plan chooses first "
                    "while a layer's code groups are at most 4x the L2")
        ->delimiter(',')
        ->check(CLI::IsMember({"normal", "first"}));
    cmd->add_option("--topk-parts", o->attend_topk_parts,
                    "more timings of the top-k, its segments cut into parts of these many tokens (multiples of 256 "
                    "in [512, 8192]) instead of the cut it chooses, e.g. 2048,4096,8192")
        ->delimiter(',');
    cmd->add_flag("--random-rows", o->attend_random_rows,
                  "the substituted rows at random places, as a step's top-k picks them (default: spread evenly)");
    cmd->add_option("--rows-seed", o->attend_rows_seed,
                    "with --random-rows: the draw's seed (item i's rows from seed + i; default 1000)");
  }
  if (std::string_view(suite.name) == "step") {
    cmd->add_option("--fresh-inputs", o->fresh_inputs,
                    "the share of the sequences given a fresh random input each decode step, in turn (default 1: "
                    "all, the row cache's worst case); the others repeat their input and select nearly the same "
                    "rows (rows suffixed _freshP)")
        ->check(CLI::Range(0.01, 1.0));
    cmd->add_flag("--profile-step", o->profile_step,
                  "one more untimed decode step of each run with the fetch, between cudaProfilerStart and "
                  "cudaProfilerStop (for ncu --profile-from-start off)");
    cmd->add_flag("--profile-no-fetch", o->profile_no_fetch,
                  "with --profile-step: profile the runs without the fetch instead");
    cmd->add_flag("--no-model-graphs", o->no_model_graphs,
                  "launch the model's products and small kernels one by one on every call instead of replaying "
                  "them from CUDA graphs (GpuLlama::SetDecodeGraphs)");
  }
  if (std::string_view(suite.name) == "step") {
    cmd->add_option("--kv", o->step_kv, "replicas to time, a row each: specache-1bit (default), specache-2bit, kivi-1bit; "
                    "specache-1bit-union: specache-run's default selection (union, 64 more rows from the real row, "
                    "their successors, every cached row attended); specache-1bit-union-noresident: without the "
                    "last; specache-1bit-resident: the paper's rule, every cached row attended; -int8 after a "
                    "specache name: the host's rows stored as int8")
        ->delimiter(',')
        ->check(CLI::IsMember({"specache-1bit", "specache-2bit", "kivi-1bit", "specache-1bit-union",
                              "specache-1bit-union-noresident", "specache-1bit-resident", "specache-1bit-int8",
                              "specache-1bit-union-int8"}));
  }
  if (suite.trace) {
    cmd->add_option("--trace", o->trace_path, "selection trace (specache-run generate --selection-trace)")->required();
    cmd->add_option("--row-bytes", o->row_bytes, "bytes of one row")->capture_default_str()->check(positive);
  }
  cmd->add_option("--json", o->json_path, "also write the figures to this file (checked before the run)");
}

}  // namespace
}  // namespace specache

int main(int argc, char** argv) {
  using namespace specache;
  Options o;
  CLI::App app{"specache-bench: figures for the agent (CPU everywhere; gather, contend, step, attend, layers and prefill on "
               "a GPU).\n"
               "Timings are medians of --repeats runs after one warm-up; read ratios, the machine is noisy.",
               "specache-bench"};
  app.set_version_flag("--version", "specache-bench " SPECACHE_VERSION);
  app.require_subcommand(0, 1);
  // Without a subcommand the program runs "all", so that form takes the same options.
  AddSuiteOptions(&app, kSuites[3], &o);
  for (const Suite& suite : kSuites) {
    CLI::App* cmd = app.add_subcommand(suite.name, suite.help);
    AddSuiteOptions(cmd, suite, &o);
    cmd->callback([&o, name = suite.name] { o.suite = name; });
  }
  if (const int code = ParseCommandLine(app, argc, argv); code >= 0) return code;
  if (!o.json_path.empty()) {
    // Before any run: a long suite must not end in a file it cannot write.
    if (Status s = PrepareOutputFile(o.json_path); !s.ok()) {
      std::fprintf(stderr, "specache-bench: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto device = ProbeCudaDevice();
  std::printf("specache-bench: %s\n", device.ok() ? ("GPU present: " + device->name).c_str()
                                                 : ("no GPU: " + device.status().message()).c_str());
  std::vector<Row> rows;
  bool ok = true;
  if (o.suite == "all") {
    // Three suites of up to a minute each, their tables on stdout as they finish: a progress
    // line after each on a terminal, nothing in a log.
    Progress progress("specache-bench all:", 3, "suites", Progress::Style::kLines);
    ok = Memory(o, &rows);
    std::fflush(stdout);
    progress.Advance();
    Quantize(o, &rows);
    std::fflush(stdout);
    progress.Advance();
    Attention(o, &rows);
  }
  if (o.suite == "memory") ok = Memory(o, &rows);
  if (o.suite == "quantize") Quantize(o, &rows);
  if (o.suite == "attention") Attention(o, &rows);
  if (o.suite == "host-gather") {
    std::vector<bench::BenchRow> gathered;
    ok = bench::RunHostGatherSuite({o.host_gib, o.gather_threads, o.repeats, o.gather_ahead,
                                    *ParseHostRowFormat(o.gather_row_format), o.gather_stores == "streaming"},
                                   &gathered);
    for (auto& r : gathered) rows.push_back({"host-gather", r.name, r.values});
  }
  if (o.suite == "reuse") {
    std::vector<bench::BenchRow> reuse;
    ok = bench::RunReuseSuite({o.trace_path, o.row_bytes, {2, 4}}, &reuse);
    for (auto& r : reuse) rows.push_back({"reuse", r.name, r.values});
  }
  if (o.suite == "gather" || o.suite == "contend" || o.suite == "step" || o.suite == "attend" || o.suite == "layers" ||
      o.suite == "prefill") {
#ifdef SPECACHE_BENCH_CUDA
    std::vector<bench::BenchRow> cuda_rows;
    if (o.suite == "gather") {
      bench::GatherOptions gather{o.host_gib, std::max(o.repeats, 20), 0};
      bench::ParseHostPageBacking(o.host_pages, &gather.backing);  // checked by the option
      ok = bench::RunGatherSuite(gather, &cuda_rows);
    } else if (o.suite == "contend") {
      bench::ContendOptions contend;
      contend.host_gib = o.host_gib;
      contend.repeats = std::max(o.repeats, 20);
      if (!o.batches.empty()) contend.batch = o.batches.front();
      if (o.tokens_given) contend.context = o.tokens;
      ok = bench::RunContendSuite(contend, &cuda_rows);
    } else {
      bench::StepOptions step;
      if (!o.batches.empty()) step.batches = o.batches;
      if (o.tokens_given) step.context = o.tokens;
      step.fetch_blocks = o.fetch_blocks;
      if (!o.fetch_overlap.empty()) step.fetch_overlap = o.fetch_overlap;
      if (!o.fetch_via.empty()) step.fetch_via = o.fetch_via;
      step.fetch_threads = o.fetch_threads;
      step.fetch_copy_piece_kb = o.fetch_copy_piece_kb;
      step.fetch_sm_share = o.fetch_sm_share;
      step.fetch_gather_stores = o.fetch_gather_stores;
      step.selection_on_own_stream = o.selection_stream == "own";
      step.page_writes_after_selection = o.page_writes == "selection";
      step.prefetch_after_layer = o.start_prefetch == "after-layer";
      step.host_huge_pages = o.host_huge_pages;
      step.mma_codes = o.replica_layout != "natural";
      if (!o.step_kv.empty()) step.kv = o.step_kv;
      step.profile_step = o.profile_step;
      step.fresh_inputs = o.fresh_inputs;
      step.profile_no_fetch = o.profile_no_fetch;
      step.model_graphs = !o.no_model_graphs;
      step.plan_threads = o.plan_threads;
      step.attend_rows = o.attend_rows;
      step.attend_free_slots = o.attend_free_slots;
      step.attend_random_rows = o.attend_random_rows;
      step.attend_rows_seed = o.attend_rows_seed;
      step.attend_unit_plans = o.attend_unit_plans;
      step.attend_codes_l2 = o.attend_codes_l2;
      step.attend_topk_parts = o.attend_topk_parts;
      ok = o.suite == "step"      ? bench::RunStepSuite(step, &cuda_rows)
           : o.suite == "layers"  ? bench::RunLayersSuite(step, &cuda_rows)
           : o.suite == "prefill" ? bench::RunPrefillSuite(step, &cuda_rows)
                                  : bench::RunAttendSuite(step, &cuda_rows);
    }
    for (auto& r : cuda_rows) rows.push_back({o.suite, r.name, r.values});
#else
    std::printf("%s: this specache-bench was built without CUDA\n", o.suite.c_str());
    ok = false;
#endif
  }
  if (!o.json_path.empty() && !WriteJson(o.json_path, rows)) ok = false;
  return ok ? 0 : 1;
}
