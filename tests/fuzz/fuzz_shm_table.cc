// Fuzz target: a page table read from shared memory (untrusted for the client).
#include <cstdint>
#include <cstring>
#include <vector>

#include "specache/shm_layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint64_t> aligned(size / 8 + 1);  // shared memory is page-aligned
  if (size > 0) std::memcpy(aligned.data(), data, size);
  const void* region = aligned.data();
  if (!specache::shm::ValidateTable(region, size).ok()) return 0;
  const uint32_t slots = specache::shm::Header(region)->slot_count;
  for (uint32_t i = 0; i < slots && i < 64; ++i) {
    (void)specache::shm::ValidateSlot(region, i, /*check_refs=*/true);
  }
  return 0;
}
