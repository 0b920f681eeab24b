// The rows an agent keeps on the device for one (sequence, layer, KV head) between steps, so
// that rows selected again are not fetched again. It holds the current selection plus the most
// recently selected other rows, up to a capacity (KvConfig::cache_rows()):
//   - a fetch of `selected` at fetch number `now` hits every selected token the cache holds and
//     fetches the rest;
//   - then every selected token is marked used at `now`, and if the cache is over capacity, the
//     entries used longest ago (ties: lower token first) leave, never this fetch's.
// With capacity k (= top_k) it keeps exactly the previous selection. This is the CPU reference
// both backends follow (the CUDA agent's cache update is tested against it), and the policy
// specache-bench reuse replays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace specache {

struct RowCacheEntries {
  std::vector<int32_t> tokens;  // ascending
  std::vector<int64_t> used;    // fetch number each token was last selected at
};

// hit[i]: whether selected[i] (ascending) is in `cache` before the update. Returns, for each
// token of the updated cache, where its row comes from: index into `selected` (>= 0) or
// -(1 + index into the old cache). `cache` is updated in place.
std::vector<int64_t> UpdateRowCache(RowCacheEntries* cache, const std::vector<int32_t>& selected, int64_t now,
                                    size_t capacity, std::vector<bool>* hit);

}  // namespace specache
