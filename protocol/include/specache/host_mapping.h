// How the kernel maps some host memory now, and how much of it with huge pages: the check of
// what madvise(MADV_HUGEPAGE) was granted (a hint the kernel may decline, or break up later).
// The daemon's pool chunks and an in-process source's slabs ask for huge pages because the fetch
// reads random rows across them (each a TLB miss on base pages); this says whether they got them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace specache {

struct MemoryRange {
  const void* base = nullptr;
  size_t bytes = 0;
};

// Bytes in memory, and of them the bytes mapped by huge pages; -1 each where unknown.
struct HostMapping {
  int64_t resident = -1;
  int64_t huge = -1;
  // huge / resident, or -1 when unknown or nothing is resident.
  double huge_share() const { return resident > 0 && huge >= 0 ? double(huge) / double(resident) : -1.0; }
};

// The resident bytes (Rss) and huge-page bytes (AnonHugePages, ShmemPmdMapped, FilePmdMapped) in
// /proc/self/smaps of the mappings that overlap `ranges`, each mapping's counted up to its overlap
// with them; both -1 when /proc/self/smaps cannot be read. Reading smaps makes the kernel walk
// every page of the process's mappings (~10 ms per GiB of base pages): for a report now and then,
// not for a loop or a data path.
HostMapping MappedBytes(std::span<const MemoryRange> ranges);

// A transparent-huge-page setting of the kernel, /sys/kernel/mm/transparent_hugepage/<name>
// ("enabled", "shmem_enabled", "defrag"): its line as the kernel writes it, the choice in force
// bracketed ("always [madvise] never"), or "unknown" where it cannot be read.
std::string TransparentHugePageSetting(std::string_view name);
// The bracketed choice of such a line ("madvise" of "always [madvise] never"); a line without
// one as it is ("unknown").
std::string SettingInForce(std::string_view line);

}  // namespace specache
