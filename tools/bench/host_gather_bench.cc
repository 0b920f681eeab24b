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

// The pages' layout: every sequence's, and the row size both the measurement and its table use.
SequenceLayout GatherLayout(HostRowFormat format) { return {kLayers, kKvHeads, kHeadDim, format}; }

struct Measured {
  std::vector<double> gbps;  // per depth of HostGatherOptions::ahead
  int64_t rows = 0;
  double huge_share = -1;  // of the source's resident slabs (InMemorySource::mapping)
  bool ok = false;
};

// One source (base or huge pages), the same rows gathered at each prefetch depth.
Measured Measure(const HostGatherOptions& o, bool huge_pages) {
  Measured m;
  const SequenceLayout layout = GatherLayout(o.row_format);
  const int64_t row_bytes = layout.row_bytes();
  const int sequences = std::max(1, o.host_gib);  // 1 GiB each (fp16 rows)
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
  std::vector<uint8_t> out(n_tasks * kTopK * static_cast<size_t>(row_bytes));
  // Every source row is the same: its stored bytes, which every gathered row must equal.
  std::vector<uint8_t> stored(static_cast<size_t>(row_bytes));
  EncodeHostRows(o.row_format, rows.data(), 1, kHeadDim, stored.data());
  for (const int ahead : o.ahead) {
    std::fill(out.begin(), out.end(), uint8_t{0});  // a depth's rows are its own
    std::vector<double> seconds;
    for (int r = 0; r < o.repeats + 1; ++r) {  // the first warms the buffer
      const auto t0 = std::chrono::steady_clock::now();
      m.rows = GatherPageRows(tasks, kPageTokens, row_bytes, -1, out.data(),
                              {.threads = o.threads, .prefetch_rows = ahead, .streaming_stores = o.streaming_stores});
      if (r > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    for (size_t i = 0; i < out.size(); i += stored.size()) {
      if (std::memcmp(&out[i], stored.data(), stored.size()) != 0) return m;
    }
    m.gbps.push_back(double(m.rows) * row_bytes / Median(seconds) / 1e9);
  }
  m.ok = true;
  return m;
}

}  // namespace

bool RunHostGatherSuite(const HostGatherOptions& o, std::vector<BenchRow>* rows) {
  const int64_t row_bytes = GatherLayout(o.row_format).row_bytes();
  std::printf("\nhost-gather: GatherPageRows (the copy-engine fetch's host half, %s stores), %d threads, 64 random rows of "
              "%lld B (%s) per (sequence, layer, KV head) of %d sequences of 8K tokens (%.1f GiB of pages), median of %d\n",
              o.streaming_stores ? "streaming" : "plain", o.threads, static_cast<long long>(row_bytes),
              std::string(HostRowFormatName(o.row_format)).c_str(), std::max(1, o.host_gib),
              std::max(1, o.host_gib) * double(row_bytes) / 512.0, o.repeats);
  std::printf("%-12s %6s %10s %10s %12s\n", "host pages", "ahead", "rows", "GB/s", "huge share");
  std::vector<double> base;
  for (bool huge : {false, true}) {
    const Measured m = Measure(o, huge);
    if (!m.ok) {
      std::printf("host-gather: the source (%s pages) could not be built or read back\n", huge ? "huge" : "base");
      return false;
    }
    const std::string share = m.huge_share < 0 ? "unknown" : std::to_string(int(100 * m.huge_share + 0.5)) + "%";
    for (size_t a = 0; a < o.ahead.size(); ++a) {
      std::printf("%-12s %6d %10lld %10.2f %12s", huge ? "huge (THP)" : "base", o.ahead[a], static_cast<long long>(m.rows),
                  m.gbps[a], share.c_str());
      if (huge && base[a] > 0) std::printf("   huge / base %.2fx", m.gbps[a] / base[a]);
      if (a > 0 && m.gbps[0] > 0) std::printf("   / ahead %d %.2fx", o.ahead[0], m.gbps[a] / m.gbps[0]);
      std::printf("\n");
      // A depth timed again (4,8,4) gets its position in the name, so that rows stay distinct.
      const bool repeated = std::count(o.ahead.begin(), o.ahead.end(), o.ahead[a]) > 1;
      rows->push_back({(huge ? "huge_pages_ahead_" : "base_pages_ahead_") + std::to_string(o.ahead[a]) +
                           (repeated ? "_at_" + std::to_string(a) : ""),
                       {{"gbps", m.gbps[a]}, {"rows", double(m.rows)}, {"huge_share", m.huge_share},
                        {"threads", double(o.threads)}, {"ahead", double(o.ahead[a])}, {"row_bytes", double(row_bytes)},
                        {"streaming_stores", o.streaming_stores ? 1.0 : 0.0},
                        {"host_gib", double(std::max(1, o.host_gib))}}});
    }
    if (!huge) base = m.gbps;
  }
  return true;
}

}  // namespace specache::bench
