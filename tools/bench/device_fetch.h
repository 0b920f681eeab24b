// One layer's fetch exactly as the CUDA agent issues it, for the gather and contend benchmarks:
// cuda::FetchRows (cuda_fetch.h) over one FetchTask per (sequence, KV head), each with its
// sequence's device page table and its selected tokens on the device. No row is resident (a cold
// fetch, the agent's worst case): every selected row is read from the host pages by the GPU.
// The output rows are packed [sequence][head][k][K|V], in the order of TopKRows::host_rows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "host_pages.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_fetch.h"
#include "specache/status.h"

namespace specache::bench {

class DeviceFetch {
 public:
  DeviceFetch() = default;
  DeviceFetch(const DeviceFetch&) = delete;
  DeviceFetch& operator=(const DeviceFetch&) = delete;
  ~DeviceFetch();

  // Uploads the page tables and selections of `rows` to the current device and builds the tasks.
  Status Create(const TopKRows& rows);
  // One FetchRows launch of every task on `stream`.
  Status Launch(int max_blocks, void* stream) const;
  // Zeroes the output rows (before a checked launch, so that stale rows cannot pass the check).
  Status ClearRows() const;
  // Output rows that differ from the host rows they were read from (after the stream is done).
  Result<int64_t> WrongRows(const TopKRows& rows) const;

  uint64_t rows() const { return static_cast<uint64_t>(tasks_.size()) * kTopK; }
  uint64_t bytes() const { return rows() * kRowBytes; }

 private:
  std::vector<cuda::FetchTask> tasks_;
  int32_t* d_tokens_ = nullptr;
  uint64_t* d_pages_ = nullptr;
  Half* d_rows_ = nullptr;
  mutable cuda::DecodePlan plan_{cuda::DecodePlan::SlotReads::kInPlace};  // the tasks, as the agent's fetch reads them
};

}  // namespace specache::bench
