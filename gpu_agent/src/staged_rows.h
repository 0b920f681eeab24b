// The host half of moving full-precision rows between the device and a source without zero-copy
// pages (full_precision_source.h), for the CUDA agent's staged data path (cuda/staged_fetch.h,
// cuda/staged_commit.h). Nothing here touches a device, so it is tested without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "specache/full_precision_source.h"
#include "specache/half.h"
#include "specache/status.h"

namespace specache {

// One (sequence, layer, KV head) of a staged fetch, in host memory.
struct StagedHeadRows {
  SequenceId sequence = 0;
  int layer = 0;
  int kv_head = 0;
  // [n_selected] ascending: the rows wanted. It may end in kNoToken entries (the adaptive budget's
  // padding, cuda_fetch.h): no rows.
  const int32_t* selected = nullptr;
  int32_t n_selected = 0;
  // [n_resident] ascending, may end in kNoToken: tokens whose rows are on the device already (the
  // row cache), which the device copies itself. Null when none are.
  const int32_t* resident = nullptr;
  int32_t n_resident = 0;
  // [n_selected][2][head_dim]: the row of each selected token that is not resident is written at
  // its slot; the other slots are left as they are.
  Half* rows = nullptr;
};

// Reads from `source` the rows of the selected tokens that are not resident into their slots:
// StartReadRows for every head first, then FinishReadRows for each, so that the reads of all the
// heads are in flight together. Returns how many rows were read.
//
// Errors: the first error of either half, with the sequence, layer and head as context. Every read
// that started is finished before returning, also after an error, so nothing writes into `rows`
// (or reads the token lists) once this returns; after an error the slots are unspecified.
Result<int64_t> ReadMissingRows(FullPrecisionSource* source, std::span<const StagedHeadRows> heads, int head_dim);

// One copy of `bytes` bytes from src to dst.
struct CopyRun {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};
// Appends a copy to *runs, extending the last run instead when this copy continues it in both
// source and destination, so that rows laid out back to back go in one copy. `same_allocations`
// says that dst and src lie in the same allocations as the last run's: only then may it extend.
// Two allocations can lie back to back by chance (cudaMalloc carves them out of one region), and a
// cudaMemcpy that spans two of them fails with cudaErrorInvalidValue.
void AddCopy(std::vector<CopyRun>* runs, void* dst, const void* src, size_t bytes, bool same_allocations);

// Interleaves n rows given as separate K and V planes ([n][head_dim] each) into [n][2][head_dim],
// the row layout of full_precision_source.h.
void InterleaveRows(const Half* keys, const Half* values, int32_t n, int head_dim, Half* rows);

}  // namespace specache
