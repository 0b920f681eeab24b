#include "usable_cores.h"

#ifdef __linux__
#include <sched.h>
#endif

#include <algorithm>
#include <fstream>
#include <sstream>
#include <thread>

namespace specache {
namespace {

// Whole cores of a quota of `quota` microseconds every `period`; 0 for none (or nonsense).
int CoresOf(long long quota, long long period) {
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>(std::clamp<long long>(quota / period + (quota % period != 0), 1, 1 << 20));
}

// The smaller of two limits where 0 is none.
int Tighter(int a, int b) { return a == 0 ? b : b == 0 ? a : std::min(a, b); }

// v2: "max 100000" (none) or "200000 100000".
int V2Limit(const std::string& dir) {
  std::ifstream in(dir + "/cpu.max");
  std::string quota;
  long long period = 0;
  if (!(in >> quota >> period) || quota == "max") return 0;
  try {
    return CoresOf(std::stoll(quota), period);
  } catch (const std::exception&) {
    return 0;
  }
}

// v1: cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us.
int V1Limit(const std::string& dir) {
  std::ifstream q(dir + "/cpu.cfs_quota_us"), p(dir + "/cpu.cfs_period_us");
  long long quota = 0, period = 0;
  if (!(q >> quota) || !(p >> period)) return 0;
  return CoresOf(quota, period);
}

// The limit of the cgroup at `path` under `mount` and of each of its ancestors: inside a
// container the path may name the host's hierarchy, of which only the root is mounted.
template <typename Read>
int LimitUpFrom(const std::string& mount, std::string path, Read read) {
  int limit = 0;
  while (true) {
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    limit = Tighter(limit, read(path == "/" || path.empty() ? mount : mount + path));
    if (path == "/" || path.empty()) return limit;
    const size_t slash = path.rfind('/');
    path = slash == std::string::npos || slash == 0 ? "/" : path.substr(0, slash);
  }
}

}  // namespace

int CgroupCpuLimit(const std::string& self_cgroup, const std::string& cgroup_root) {
  std::ifstream in(self_cgroup);
  std::string line;
  int limit = 0;
  while (std::getline(in, line)) {
    // "hierarchy-id:controllers:path"; v2's line is "0::path".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (id == "0" && controllers.empty()) {  // v2 at the root, or under unified/ on a hybrid host
      limit = Tighter(limit, LimitUpFrom(cgroup_root, path, V2Limit));
      limit = Tighter(limit, LimitUpFrom(cgroup_root + "/unified", path, V2Limit));
      continue;
    }
    std::stringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name != "cpu") continue;
      // The hierarchy's directory is named for its controllers, in the order the kernel lists
      // them or not (cpuacct,cpu in the file, cpu,cpuacct mounted); `cpu` is the usual link to it.
      for (const std::string& dir : {controllers, std::string("cpu"), std::string("cpu,cpuacct")}) {
        limit = Tighter(limit, LimitUpFrom(cgroup_root + "/" + dir, path, V1Limit));
      }
      break;
    }
  }
  return limit;
}

int UsableCores() {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
#endif
  return Tighter(cores, CgroupCpuLimit());
}

}  // namespace specache
