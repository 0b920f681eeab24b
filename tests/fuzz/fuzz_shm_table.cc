// Fuzz target: a page table read from shared memory (untrusted for the client).
#include <cstdint>
#include <cstring>
#include <vector>

#include "specache/shm_layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint64_t> aligned(size / 8 + 1);  // shared memory is page-aligned
  if (size > 0) std::memcpy(aligned.data(), data, size);
  const void* region = aligned.data();
  const auto table = specache::shm::ReadTable(region, size);
  if (!table.ok()) return 0;
  for (uint32_t i = 0; i < table->slot_count && i < 64; ++i) {
    (void)specache::shm::ValidateSlot(region, *table, i, /*check_refs=*/true);
  }
  return 0;
}
