#include "staged_rows.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "specache/cuda_fetch.h"

namespace specache {
namespace {

using cuda::kNoToken;

std::string Where(const StagedHeadRows& h) {
  return "fetching rows of sequence " + std::to_string(h.sequence) + " layer " + std::to_string(h.layer) + " head " +
         std::to_string(h.kv_head);
}

// A head's read in flight: its misses, where their rows land, and where those go.
struct HeadRead {
  std::vector<int32_t> missing;  // tokens, ascending
  std::vector<int32_t> slots;    // [missing] slot of each in the selection
  std::vector<Half> landed;      // [missing][2][head_dim], unless the rows land in place
  Half* out = nullptr;           // where the source writes
  uint64_t handle = 0;
  bool started = false;
};

}  // namespace

Result<int64_t> ReadMissingRows(FullPrecisionSource* source, std::span<const StagedHeadRows> heads, int head_dim) {
  const size_t row = 2 * static_cast<size_t>(head_dim);
  std::vector<HeadRead> reads(heads.size());
  int64_t total = 0;
  Status first_error;
  for (size_t i = 0; i < heads.size() && first_error.ok(); ++i) {
    const StagedHeadRows& h = heads[i];
    HeadRead& r = reads[i];
    const int32_t n_valid = static_cast<int32_t>(std::lower_bound(h.selected, h.selected + h.n_selected, kNoToken) - h.selected);
    const int32_t n_resident = h.resident ? static_cast<int32_t>(std::lower_bound(h.resident, h.resident + h.n_resident,
                                                                                  kNoToken) - h.resident)
                                          : 0;
    // Both lists ascend: one merge finds the tokens the device does not hold.
    int32_t c = 0;
    for (int32_t s = 0; s < n_valid; ++s) {
      while (c < n_resident && h.resident[c] < h.selected[s]) ++c;
      if (c < n_resident && h.resident[c] == h.selected[s]) continue;
      r.missing.push_back(h.selected[s]);
      r.slots.push_back(s);
    }
    if (r.missing.empty()) continue;
    total += static_cast<int64_t>(r.missing.size());
    if (r.slots.back() + 1 == static_cast<int32_t>(r.slots.size())) {
      r.out = h.rows;  // slots 0..m-1: the rows land in place
    } else {
      r.landed.resize(r.missing.size() * row);
      r.out = r.landed.data();
    }
    auto handle = source->StartReadRows(h.sequence, h.layer, h.kv_head, r.missing.data(),
                                        static_cast<int32_t>(r.missing.size()), r.out);
    if (!handle.ok()) {
      first_error = handle.status().WithContext(Where(h));
      break;
    }
    r.handle = *handle;
    r.started = true;
  }
  // Every started read is finished, after an error too: the source writes into r.out until then.
  for (size_t i = 0; i < heads.size(); ++i) {
    HeadRead& r = reads[i];
    if (!r.started) continue;
    const Status finished = source->FinishReadRows(r.handle);
    if (!finished.ok() && first_error.ok()) first_error = finished.WithContext(Where(heads[i]));
    if (!first_error.ok() || r.out == heads[i].rows) continue;
    for (size_t m = 0; m < r.missing.size(); ++m) {
      std::memcpy(heads[i].rows + static_cast<size_t>(r.slots[m]) * row, r.landed.data() + m * row, row * sizeof(Half));
    }
  }
  if (!first_error.ok()) return first_error;
  return total;
}

void AddCopy(std::vector<CopyRun>* runs, void* dst, const void* src, size_t bytes, bool same_allocations) {
  if (bytes == 0) return;
  if (same_allocations && !runs->empty()) {
    CopyRun& last = runs->back();
    if (static_cast<char*>(last.dst) + last.bytes == dst && static_cast<const char*>(last.src) + last.bytes == src) {
      last.bytes += bytes;
      return;
    }
  }
  runs->push_back({dst, src, bytes});
}

void InterleaveRows(const Half* keys, const Half* values, int32_t n, int head_dim, Half* rows) {
  const size_t d = static_cast<size_t>(head_dim);
  for (int32_t i = 0; i < n; ++i) {
    std::memcpy(rows + 2 * d * i, keys + d * i, d * sizeof(Half));
    std::memcpy(rows + 2 * d * i + d, values + d * i, d * sizeof(Half));
  }
}

}  // namespace specache
