#include "specache/host_mapping.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

namespace specache {

HostMapping MappedBytes(std::span<const MemoryRange> ranges) {
  std::ifstream f("/proc/self/smaps");
  if (!f) return {};
  // The mapping being read: its bytes inside the ranges, its resident and huge-page bytes so far.
  uint64_t overlap = 0, rss = 0, huge = 0;
  HostMapping total{0, 0};
  auto finish_mapping = [&] {
    total.resident += static_cast<int64_t>(std::min(overlap, rss));
    total.huge += static_cast<int64_t>(std::min(overlap, huge));
    overlap = rss = huge = 0;
  };
  auto kib_field = [](const char* line, const char* format, uint64_t* sum) {
    long long kib = 0;
    if (std::sscanf(line, format, &kib) != 1) return false;
    *sum += static_cast<uint64_t>(std::max(kib, 0LL)) * 1024;
    return true;
  };
  // Whole lines (a mapping's path may be long: a piece of one must not pass for a header).
  std::string text;
  while (std::getline(f, text)) {
    const char* line = text.c_str();
    unsigned long long start = 0, end = 0;
    char dash = 0;
    // A mapping's header line: "start-end perms offset dev inode [path]" (hex addresses).
    if (std::sscanf(line, "%llx%c%llx ", &start, &dash, &end) == 3 && dash == '-') {
      finish_mapping();
      for (const MemoryRange& r : ranges) {
        const uint64_t lo = reinterpret_cast<uintptr_t>(r.base), hi = lo + r.bytes;
        if (lo < end && start < hi) overlap += std::min<uint64_t>(hi, end) - std::max<uint64_t>(lo, start);
      }
      continue;
    }
    if (overlap == 0) continue;
    (void)(kib_field(line, "Rss: %lld kB", &rss) || kib_field(line, "AnonHugePages: %lld kB", &huge) ||
           kib_field(line, "ShmemPmdMapped: %lld kB", &huge) || kib_field(line, "FilePmdMapped: %lld kB", &huge));
  }
  finish_mapping();
  return total;
}

std::string TransparentHugePageSetting(std::string_view name) {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/" + std::string(name));
  std::string line;
  if (!f || !std::getline(f, line)) return "unknown";
  while (!line.empty() && (line.back() == ' ' || line.back() == '\n')) line.pop_back();
  return line;
}

std::string SettingInForce(std::string_view line) {
  const size_t open = line.find('['), close = line.find(']');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open) return std::string(line);
  return std::string(line.substr(open + 1, close - open - 1));
}

}  // namespace specache
