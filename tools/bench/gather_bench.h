// specache-bench gather: the CUDA agent's fetch kernel, cuda::FetchRows (device_fetch.h), reading
// one layer's top-k rows of B sequences from daemon-style host pages through per-sequence page
// tables, at the agent's default block count and at 2 blocks per SM (or max_blocks); against a
// contiguous pinned H2D copy of the same bytes and a CPU gather plus one copy, measured in the same
// run. Every fetched row is checked against its host row (CUDA builds only).
#pragma once

#include <vector>

#include "bench_row.h"
#include "host_pages.h"

namespace specache::bench {

struct GatherOptions {
  int host_gib = 16;    // host memory the pages are spread over
  int repeats = 20;
  int max_blocks = 0;   // the wide launch's blocks; 0: 2 per SM
  HostPageBacking backing = HostPageBacking::kBase;  // what backs the host pages
};

using GatherRow = BenchRow;

// Prints a table; returns false when the suite could not run (no CUDA build or no device).
bool RunGatherSuite(const GatherOptions& options, std::vector<GatherRow>* rows);

}  // namespace specache::bench
