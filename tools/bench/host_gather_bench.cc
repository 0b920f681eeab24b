#include "host_gather_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "bench_stats.h"
#include "page_row_gather.h"
#include "specache/in_memory_source.h"

namespace specache::bench {
namespace {

constexpr int kLayers = 32, kKvHeads = 8, kHeadDim = 128, kTokens = 8192, kPageTokens = 64, kTopK = 64;
constexpr int64_t kRowBytes = 2 * kHeadDim * static_cast<int64_t>(sizeof(Half));

struct Measured {
  double gbps = 0;
  int64_t rows = 0;
  double huge_share = -1;  // of the source's resident slabs (InMemorySource::mapping)
  bool ok = false;
};

Measured Measure(const HostGatherOptions& o, bool huge_pages) {
  Measured m;
  const SequenceLayout layout{kLayers, kKvHeads, kHeadDim};
  const int sequences = std::max(1, o.host_gib);  // 1 GiB each
  InMemorySource source(kPageTokens, size_t{256} << 20, huge_pages);
  source.Reserve(layout, sequences, kTokens);
  const std::vector<Half> rows(size_t(kTokens) * 2 * kHeadDim, FloatToHalf(0.5f));
  std::vector<std::vector<uint8_t*>> pages(size_t(sequences) * kLayers);
  for (int s = 0; s < sequences; ++s) {
    if (!source.CreateSequence(s, layout).ok()) return m;
    for (int l = 0; l < kLayers; ++l) {
      for (int h = 0; h < kKvHeads; ++h) {
        if (!source.AppendRows(s, l, h, 0, rows.data(), kTokens).ok()) return m;
      }
      if (!source.HostPages(s, l, kTokens, &pages[size_t(s) * kLayers + l]).ok()) return m;
    }
  }
  m.huge_share = source.mapping().huge_share();
  std::mt19937 rng(5);
  const size_t n_tasks = size_t(sequences) * kLayers * kKvHeads;
  std::vector<std::vector<int32_t>> wanted(n_tasks), rank(n_tasks);
  std::vector<PageGatherTask> tasks;
  for (size_t i = 0; i < n_tasks; ++i) {
    const size_t s = i / (kLayers * kKvHeads), l = i / kKvHeads % kLayers;
    std::vector<int32_t>& w = wanted[i];
    while (w.size() < size_t(kTopK)) {
      const int32_t t = static_cast<int32_t>(rng() % kTokens);
      if (std::find(w.begin(), w.end(), t) == w.end()) w.push_back(t);
    }
    std::sort(w.begin(), w.end());
    rank[i].resize(kTopK);
    tasks.push_back({pages[s * kLayers + l].data(), static_cast<int>(i % kKvHeads), w.data(), kTopK, rank[i].data()});
  }
  std::vector<uint8_t> out(n_tasks * kTopK * kRowBytes);
  std::vector<double> seconds;
  for (int r = 0; r < o.repeats + 1; ++r) {  // the first warms the buffer
    const auto t0 = std::chrono::steady_clock::now();
    m.rows = GatherPageRows(tasks, kPageTokens, kRowBytes, -1, out.data(), o.threads);
    if (r > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // The rows are the source's: every byte of them is 0.5 in fp16.
  const Half want = FloatToHalf(0.5f);
  for (size_t i = 0; i < out.size(); i += sizeof(Half)) {
    Half h;
    std::memcpy(&h, &out[i], sizeof(h));
    if (h != want) return m;
  }
  m.gbps = double(m.rows) * kRowBytes / Median(seconds) / 1e9;
  m.ok = true;
  return m;
}

}  // namespace

bool RunHostGatherSuite(const HostGatherOptions& o, std::vector<BenchRow>* rows) {
  std::printf("\nhost-gather: GatherPageRows (the copy-engine fetch's host half), %d threads, 64 random rows of 512 B "
              "per (sequence, layer, KV head) of %d sequences of 8K tokens (%d GiB of pages), median of %d\n",
              o.threads, std::max(1, o.host_gib), std::max(1, o.host_gib), o.repeats);
  std::printf("%-12s %10s %10s %12s\n", "host pages", "rows", "GB/s", "huge share");
  double base = 0;
  for (bool huge : {false, true}) {
    const Measured m = Measure(o, huge);
    if (!m.ok) {
      std::printf("host-gather: the source (%s pages) could not be built or read back\n", huge ? "huge" : "base");
      return false;
    }
    const std::string share = m.huge_share < 0 ? "unknown" : std::to_string(int(100 * m.huge_share + 0.5)) + "%";
    std::printf("%-12s %10lld %10.2f %12s\n", huge ? "huge (THP)" : "base", static_cast<long long>(m.rows), m.gbps,
                share.c_str());
    if (!huge) base = m.gbps;
    rows->push_back({huge ? "huge_pages" : "base_pages",
                     {{"gbps", m.gbps}, {"rows", double(m.rows)}, {"huge_share", m.huge_share},
                      {"threads", double(o.threads)}, {"host_gib", double(std::max(1, o.host_gib))}}});
    if (huge) std::printf("huge / base: %.2fx\n", base > 0 ? m.gbps / base : 0.0);
  }
  return true;
}

}  // namespace specache::bench
