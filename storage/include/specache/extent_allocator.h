// First-fit allocator of [offset, offset + length) extents inside a range, merging on free.
// Used for pages inside a chunk and for page-ref ranges inside a page table.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace specache {

class ExtentAllocator {
 public:
  explicit ExtentAllocator(uint64_t size) : size_(size) {
    if (size > 0) free_[0] = size;
  }
  // The lowest offset with `length` free units, or nullopt.
  std::optional<uint64_t> Allocate(uint64_t length);
  // Returns an extent given by Allocate (double frees and foreign extents are ignored: false).
  bool Free(uint64_t offset, uint64_t length);
  uint64_t free_units() const;
  uint64_t size() const { return size_; }

 private:
  uint64_t size_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, disjoint, non-adjacent
};

}  // namespace specache
