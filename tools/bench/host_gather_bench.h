// specache-bench host-gather: the host half of the copy-engine fetch (page_row_gather.h), which
// copies the rows the device missed out of the source's pages into one buffer. Llama-3-8B-shaped
// sequences of 8K tokens fill an InMemorySource of --host-gib GiB (rows stored as --row-format); each (sequence, layer, KV head)
// wants 64 random rows, as one decode step's fetch with nothing reused. Timed twice in one run:
// slabs of base pages, then slabs asked for transparent huge pages (InMemorySource's huge_pages),
// and the ratio; each at every prefetch depth of --gather-ahead (rows a thread asks for ahead of
// its copy, GatherPageRows' prefetch_rows). Needs no GPU (it is the host's work; the GPU host is where it matters).
#pragma once

#include <vector>

#include "page_row_gather.h"
#include "specache/host_rows.h"

#include "bench_row.h"

namespace specache::bench {

struct HostGatherOptions {
  // The source's size in sequences of 8K tokens x 32 layers x 8 heads: 1 GiB each with fp16 rows
  // (512 B), 0.53 GiB with int8 rows (272 B).
  int host_gib = 8;
  int threads = 2;    // GatherPageRows' threads
  int repeats = 7;
  std::vector<int> ahead = {specache::GatherOptions{}.prefetch_rows};  // prefetch depths to time, in this order
  // How the source stores its rows (SequenceLayout::row_format): fp16 512 bytes, int8 272.
  HostRowFormat row_format = HostRowFormat::kFp16;
  bool streaming_stores = specache::GatherOptions{}.streaming_stores;  // GatherOptions::streaming_stores
};

// Prints a table; false when a source could not be built.
bool RunHostGatherSuite(const HostGatherOptions& options, std::vector<BenchRow>* rows);

}  // namespace specache::bench
