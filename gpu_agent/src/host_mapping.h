// How the kernel maps some host memory now, and how much of it with huge pages: the check of
// what madvise(MADV_HUGEPAGE) was granted (a hint the kernel may decline, or break up later). The
// copy-engine gather is bound by its rows' random accesses, each a TLB miss on base pages; a run
// whose pages got fewer huge pages than another's may gather slower, so the benchmarks print it.
#pragma once

#include <cstdint>
#include <span>

#include "specache/full_precision_source.h"

namespace specache {

// The resident bytes (Rss) and huge-page bytes (AnonHugePages, ShmemPmdMapped, FilePmdMapped) in
// /proc/self/smaps of the mappings that overlap `regions`, each mapping's counted up to its
// overlap with them; both -1 when /proc/self/smaps cannot be read. Reads the whole smaps file
// (milliseconds in a large process): for reports, not for a data path.
HostMapping MappedBytes(std::span<const HostRegion> regions);

}  // namespace specache
