// specache-bench: figures for the agent (CPU backend everywhere; gather and step on a GPU).
//
//   specache-bench [memory|quantize|attention|all|gather|contend|step|attend|reuse] [--tokens N] [--head-dim D]
//                  [--repeats R] [--host-gib G] [--batches B1,B2,..] [--fetch-blocks N]
//                  [--trace FILE] [--row-bytes B] [--json FILE]
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
// attend     (CUDA builds, on a GPU) one layer's decode attention and top-k at Llama-3-8B shapes, 1-
//            and 2-bit, bytes read against the HBM bandwidth of a device copy (step_bench.h).
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
#include <vector>

#include "bench_stats.h"
#include "specache/cpu_attention.h"
#include "specache/device_probe.h"
#include "specache/head_replica.h"
#include "specache/quantizer.h"
#include "specache/version.h"
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
  bool tokens_given = false;
  int fetch_blocks = 0;  // step: 0 = the agent's default
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

void WriteJson(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream f(path);
  f << "{\"results\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    f << "  {\"suite\": \"" << rows[i].suite << "\", \"name\": \"" << rows[i].name << "\"";
    for (const auto& [key, value] : rows[i].values) f << ", \"" << key << "\": " << value;
    f << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
  }
  f << "]}\n";
  std::printf("\nwrote %s\n", path.c_str());
}

int Usage() {
  std::fprintf(stderr,
               "usage: specache-bench [memory|quantize|attention|all|gather|contend|step|attend|reuse] [--tokens N] [--head-dim D] "
               "[--repeats R] [--host-gib G] [--batches B1,B2,..] [--fetch-blocks N] [--trace FILE] [--row-bytes B] "
               "[--json FILE]\n       specache-bench --version\n");
  return 2;
}

}  // namespace
}  // namespace specache

int main(int argc, char** argv) {
  using namespace specache;
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next_int = [&](int* out) {
      if (i + 1 >= argc) return false;
      *out = std::atoi(argv[++i]);
      return *out > 0;
    };
    if (a == "--version") {
      std::printf("specache-bench %s\n", SPECACHE_VERSION);
      return 0;
    } else if (a == "--tokens") {
      if (!next_int(&o.tokens)) return Usage();
      o.tokens_given = true;
    } else if (a == "--head-dim") {
      if (!next_int(&o.head_dim) || o.head_dim % 32) return Usage();
    } else if (a == "--repeats") {
      if (!next_int(&o.repeats)) return Usage();
    } else if (a == "--host-gib") {
      if (!next_int(&o.host_gib)) return Usage();
    } else if (a == "--json") {
      if (i + 1 >= argc) return Usage();
      o.json_path = argv[++i];
    } else if (a == "--trace") {
      if (i + 1 >= argc) return Usage();
      o.trace_path = argv[++i];
    } else if (a == "--row-bytes") {
      if (!next_int(&o.row_bytes)) return Usage();
    } else if (a == "--fetch-blocks") {
      if (!next_int(&o.fetch_blocks)) return Usage();
    } else if (a == "--batches") {
      if (i + 1 >= argc) return Usage();
      o.batches.clear();
      for (std::string list = argv[++i]; !list.empty();) {
        const size_t comma = list.find(',');
        const int b = std::atoi(list.substr(0, comma).c_str());
        if (b <= 0) return Usage();
        o.batches.push_back(b);
        list = comma == std::string::npos ? "" : list.substr(comma + 1);
      }
    } else if (a == "memory" || a == "quantize" || a == "attention" || a == "all" || a == "gather" || a == "step" || a == "attend" ||
               a == "contend" || a == "reuse") {
      o.suite = a;
    } else {
      return Usage();
    }
  }
  auto device = ProbeCudaDevice();
  std::printf("specache-bench: %s\n", device.ok() ? ("GPU present: " + device->name).c_str()
                                                 : ("no GPU: " + device.status().message()).c_str());
  std::vector<Row> rows;
  bool ok = true;
  if (o.suite == "memory" || o.suite == "all") ok = Memory(o, &rows);
  if (o.suite == "quantize" || o.suite == "all") Quantize(o, &rows);
  if (o.suite == "attention" || o.suite == "all") Attention(o, &rows);
  if (o.suite == "reuse") {
    std::vector<bench::BenchRow> reuse;
    ok = bench::RunReuseSuite({o.trace_path, o.row_bytes, {2, 4}}, &reuse);
    for (auto& r : reuse) rows.push_back({"reuse", r.name, r.values});
  }
  if (o.suite == "gather" || o.suite == "contend" || o.suite == "step" || o.suite == "attend") {
#ifdef SPECACHE_BENCH_CUDA
    std::vector<bench::BenchRow> cuda_rows;
    if (o.suite == "gather") {
      ok = bench::RunGatherSuite({o.host_gib, std::max(o.repeats, 20), 0}, &cuda_rows);
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
      ok = o.suite == "step" ? bench::RunStepSuite(step, &cuda_rows) : bench::RunAttendSuite(step, &cuda_rows);
    }
    for (auto& r : cuda_rows) rows.push_back({o.suite, r.name, r.values});
#else
    std::printf("%s: this specache-bench was built without CUDA\n", o.suite.c_str());
    ok = false;
#endif
  }
  if (!o.json_path.empty()) WriteJson(o.json_path, rows);
  return ok ? 0 : 1;
}
