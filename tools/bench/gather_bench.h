// specache-bench gather: the CUDA backend's zero-copy gather of top-k rows from daemon-style host
// pages, against a contiguous pinned H2D copy measured in the same run (CUDA builds only).
#pragma once

#include <vector>

#include "bench_row.h"

namespace specache::bench {

struct GatherOptions {
  int host_gib = 16;    // host memory the pages are spread over
  int repeats = 20;
  int max_blocks = 0;   // 0: 2 per SM
};

using GatherRow = BenchRow;

// Prints a table; returns false when the suite could not run (no CUDA build or no device).
bool RunGatherSuite(const GatherOptions& options, std::vector<GatherRow>* rows);

}  // namespace specache::bench
