// Device helpers over ascending token lists (selections, row caches, substitutions): shared by
// the fetch, the row-cache update and the selection merges.
#pragma once

#include <cstdint>

namespace specache::cuda {

// Entries of the ascending list [0, n) below `token` (its place if it were inserted).
__device__ inline int32_t Below(const int32_t* list, int32_t n, int32_t token) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = (lo + hi) >> 1;
    if (list[mid] < token) lo = mid + 1; else hi = mid;
  }
  return lo;
}

}  // namespace specache::cuda
