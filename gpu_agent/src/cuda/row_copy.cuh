// The row copies' grid-stride loop (CopyRows, cuda_tensors.h), for every kernel that copies rows:
// tensors.cu's own and the appends' copies fused with their value quantization (quantize.cu).
// Internal to the agent.
#pragma once

#include <algorithm>
#include <cstdint>

#include "specache/cuda_tensors.h"

namespace specache::cuda {

// Blocks of 256 threads for a grid-stride loop over `total` items: one block per 256, at most 1024.
inline int GridStrideBlocks(int64_t total) { return static_cast<int>(std::min<int64_t>(1024, (total + 255) / 256)); }

// Thread `thread` of `threads` copies every threads-th 16-byte piece of copies[0, count), each row
// pieces_per_row pieces.
__device__ inline void CopyRowPieces(const RowCopy* __restrict__ copies, int count, int pieces_per_row, int64_t thread,
                                     int64_t threads) {
  const int64_t total = static_cast<int64_t>(count) * pieces_per_row;
  for (int64_t i = thread; i < total; i += threads) {
    const RowCopy& c = copies[i / pieces_per_row];
    const int piece = static_cast<int>(i % pieces_per_row);
    static_cast<uint4*>(c.dst)[piece] = static_cast<const uint4*>(c.src)[piece];
  }
}

}  // namespace specache::cuda
