#include "specache/extent_allocator.h"

namespace specache {

std::optional<uint64_t> ExtentAllocator::Allocate(uint64_t length) {
  if (length == 0) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < length) continue;
    const uint64_t offset = it->first, rest = it->second - length;
    free_.erase(it);
    if (rest > 0) free_[offset + length] = rest;
    return offset;
  }
  return std::nullopt;
}

bool ExtentAllocator::Free(uint64_t offset, uint64_t length) {
  if (length == 0 || offset > size_ || size_ - offset < length) return false;
  // Reject overlap with a free extent (a double free).
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first < offset + length) return false;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > offset) return false;
  }
  uint64_t start = offset, len = length;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == offset + length) {
    len += next->second;
    free_.erase(next);
  }
  free_[start] = len;
  return true;
}

uint64_t ExtentAllocator::free_units() const {
  uint64_t n = 0;
  for (const auto& [offset, length] : free_) n += length;
  return n;
}

}  // namespace specache
