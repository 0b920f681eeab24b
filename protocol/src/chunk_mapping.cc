#include "specache/chunk_mapping.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>

namespace specache {

void* MapChunk(int fd, uint64_t bytes, bool huge) {
  if (!huge || bytes < kHugePageBytes) return mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  // A reservation one huge page longer, the chunk mapped over it at its first 2 MiB boundary,
  // the rest given back.
  const uint64_t span = bytes + kHugePageBytes;
  auto* reserved = static_cast<uint8_t*>(mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (reserved == MAP_FAILED) return MAP_FAILED;
  auto* at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(reserved) + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
  void* p = mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    munmap(reserved, span);
    errno = err;
    return MAP_FAILED;
  }
  if (at > reserved) munmap(reserved, static_cast<size_t>(at - reserved));
  if (reserved + span > at + bytes) munmap(at + bytes, static_cast<size_t>(reserved + span - (at + bytes)));
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // a hint: base pages where the kernel declines
  return p;
}

}  // namespace specache
