#include "reuse_bench.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace specache::bench {
namespace {

using Selection = std::vector<int32_t>;
// [step] -> selections of every (layer, head), in trace order.
using Trace = std::vector<std::vector<std::pair<std::pair<int, int>, Selection>>>;

bool ReadTrace(const std::string& path, Trace* trace) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    int64_t step;
    int layer, head;
    size_t n;
    if (!(fields >> step >> layer >> head >> n) || step < 0) return false;
    Selection s(n);
    for (auto& t : s) if (!(fields >> t)) return false;
    if (static_cast<size_t>(step) >= trace->size()) trace->resize(step + 1);
    (*trace)[step].push_back({{layer, head}, std::move(s)});
  }
  return !trace->empty();
}

// Rows selected over the decode steps (the first selection, the pre-decode's, is a cold fetch
// for every policy and is left out).
int64_t Selected(const Trace& trace) {
  int64_t n = 0;
  for (size_t step = 1; step < trace.size(); ++step) {
    for (const auto& entry : trace[step]) n += static_cast<int64_t>(entry.second.size());
  }
  return n;
}

// Rows fetched over the decode steps by a device cache of `capacity` rows per (layer, head) that
// keeps the most recently selected ones: a step's rows are all resident after it, and older rows
// fill what room is left. capacity = k is the agent's policy (the previous selection only).
int64_t Replay(const Trace& trace, size_t capacity) {
  std::map<std::pair<int, int>, std::unordered_map<int32_t, int64_t>> cache;  // row -> last step selected
  int64_t fetched = 0;
  for (size_t step = 0; step < trace.size(); ++step) {
    for (const auto& [key, rows] : trace[step]) {
      auto& c = cache[key];
      for (int32_t t : rows) {
        if (step > 0 && !c.count(t)) ++fetched;
        c[t] = static_cast<int64_t>(step);
      }
      if (c.size() > capacity) {  // evict the least recently selected, never this step's rows
        std::vector<std::pair<int64_t, int32_t>> by_age;
        for (const auto& [t, when] : c) by_age.push_back({when, t});
        std::sort(by_age.begin(), by_age.end());
        const size_t excess = c.size() - capacity;
        for (size_t i = 0; i < excess && by_age[i].first < static_cast<int64_t>(step); ++i) c.erase(by_age[i].second);
      }
    }
  }
  return fetched;
}

}  // namespace

bool RunReuseSuite(const ReuseOptions& o, std::vector<BenchRow>* rows) {
  Trace trace;
  if (!ReadTrace(o.trace_path, &trace)) {
    std::printf("reuse: cannot read a selection trace from '%s' (specache-run generate --selection-trace)\n",
                o.trace_path.c_str());
    return false;
  }
  size_t k = 0;
  for (const auto& step : trace) for (const auto& [key, s] : step) k = std::max(k, s.size());
  const int64_t decode_steps = static_cast<int64_t>(trace.size()) - 1;
  if (decode_steps <= 0 || k == 0) {
    std::printf("reuse: the trace holds no decode step\n");
    return false;
  }
  std::printf("\n== reuse: %lld decode steps, k=%zu, %d-byte rows (%s) ==\n", static_cast<long long>(decode_steps), k,
              o.row_bytes, o.trace_path.c_str());
  std::printf("%-28s %14s %16s %12s\n", "policy", "rows_fetched", "KB_per_token", "vs_naive");
  const int64_t selected = Selected(trace);
  const double naive = static_cast<double>(selected) * o.row_bytes / decode_steps;
  auto report = [&](const std::string& name, size_t capacity, int64_t fetched) {
    const double bytes = static_cast<double>(fetched) * o.row_bytes / decode_steps;
    std::printf("%-28s %14lld %16.1f %12.3f\n", name.c_str(), static_cast<long long>(fetched), bytes / 1024,
                bytes / naive);
    rows->push_back({name,
                     {{"capacity_rows", static_cast<double>(capacity)},
                      {"rows_fetched", static_cast<double>(fetched)},
                      {"bytes_per_token", bytes},
                      {"ratio_to_naive", bytes / naive}}});
  };
  report("naive (no reuse)", 0, selected);
  report("previous selection only", k, Replay(trace, k));
  for (int m : o.cache_multiples) {
    report("recent " + std::to_string(m) + "k rows" + (m == 2 ? " (default)" : ""), m * k, Replay(trace, m * k));
  }
  std::printf("       goal: <= 0.4 of naive. 'recent Ck' keeps the C*k most recently selected rows per (layer,\n"
              "       head) on the device (KvConfig::cached_rows; the default is 2k); 'previous selection only'\n"
              "       is cached_rows = k.\n");
  return true;
}

}  // namespace specache::bench
