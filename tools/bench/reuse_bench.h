// specache-bench reuse: full-precision bytes fetched per decode token with and without reuse of
// resident rows, replayed from a selection trace recorded on a real decode
// (specache-run generate --selection-trace FILE, on SmolLM2 by default). It replays the agents'
// row cache (row_cache.h) at several capacities: k (only the previous selection stays) and
// multiples of k (the C*k most recently selected rows per (layer, KV head) stay; the agents'
// default is 2k). Needs no GPU: the numbers are counts of rows.
#pragma once

#include <string>
#include <vector>

#include "bench_row.h"

namespace specache::bench {

struct ReuseOptions {
  std::string trace_path;
  int row_bytes = 256;  // bytes of one full-precision row ([K|V] fp16; SmolLM2: head_dim 64)
  std::vector<int> cache_multiples{2, 4};  // C = multiple x k
};

// Prints a table; false when the trace cannot be read.
bool RunReuseSuite(const ReuseOptions& options, std::vector<BenchRow>* rows);

}  // namespace specache::bench
