// Mapping a pool chunk (a memfd of the daemon's, chunk_pool.h) read-write: the daemon's own
// mapping and each client's. The fetch reads random rows across the chunks, so both sides ask for
// transparent huge pages: a 2 MiB boundary and MADV_HUGEPAGE. The daemon's pre-fault then
// allocates 2 MiB pages where the host's shmem_enabled allows it ("advise" or "always"), and a
// client's aligned, advised mapping maps them whole (one TLB entry per 2 MiB). Elsewhere the
// pages are base pages, as without.
#pragma once

#include <cstdint>

namespace specache {

constexpr uint64_t kHugePageBytes = uint64_t{2} << 20;

// mmap(MAP_SHARED, PROT_READ | PROT_WRITE) of `bytes` of `fd` from offset 0. With `huge` (and
// bytes >= kHugePageBytes) at a 2 MiB boundary and advised MADV_HUGEPAGE (a hint: its failure is
// not an error). Returns MAP_FAILED with errno set on failure; munmap(result, bytes) releases it.
void* MapChunk(int fd, uint64_t bytes, bool huge);

}  // namespace specache
