// specache-bench contend: how the GPUs of one host share host memory and their PCIe links. Each
// GPU's fetch of one layer's top-k rows with the agent's kernel, cuda::FetchRows (device_fetch.h:
// page tables on the device, no resident rows, 2 blocks per SM), and, as the link's bound, a
// contiguous copy-engine H2D copy, is measured on that GPU alone, then on every GPU at once, from
// one pool of registered daemon-style host pages; each GPU reads its own sequences' pages. The
// rows named "gather" are that fetch (CUDA builds only).
#pragma once

#include <vector>

#include "bench_row.h"

namespace specache::bench {

struct ContendOptions {
  int host_gib = 16;     // host memory the pages are spread over
  int repeats = 20;      // samples per measurement (median)
  int batch = 32;        // sequences per GPU
  int context = 32768;   // tokens per sequence
  int launches = 8;      // back-to-back gathers (or copies) in one sample
};

// Prints a table; returns false when the suite could not run or a gather read wrong bytes.
bool RunContendSuite(const ContendOptions& options, std::vector<BenchRow>* rows);

}  // namespace specache::bench
