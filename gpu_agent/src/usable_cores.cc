#include "usable_cores.h"

#ifdef __linux__
#include <sched.h>
#endif

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

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

// The limit of the cgroup at `path` (within its mount, "/" the mount's root) and of each of its
// ancestors up to that root, under the mount point `mount`.
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

// A cgroup file system's mount (/proc/self/mountinfo): v2, or a v1 hierarchy with the cpu
// controller.
struct CgroupMount {
  std::string point;  // where it is mounted
  std::string root;   // the hierarchy's directory mounted there ("/" unless a container's view)
  bool v2 = false;
};

// mountinfo's octal escapes (a space is \040) undone.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isdigit(static_cast<unsigned char>(s[i + 2])) && std::isdigit(static_cast<unsigned char>(s[i + 3]))) {
      out += static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

bool ListsCpu(const std::string& comma_separated) {
  std::stringstream names(comma_separated);
  for (std::string name; std::getline(names, name, ',');) {
    if (name == "cpu") return true;
  }
  return false;
}

// "id parent major:minor root mount-point options [optional fields] - fstype source super-options".
std::vector<CgroupMount> CgroupMounts(const std::string& mountinfo) {
  std::ifstream in(mountinfo);
  std::vector<CgroupMount> mounts;
  for (std::string line; std::getline(in, line);) {
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream before(line.substr(0, dash)), after(line.substr(dash + 3));
    std::string id, parent, device, root, point, fstype, source, options;
    if (!(before >> id >> parent >> device >> root >> point) || !(after >> fstype >> source >> options)) continue;
    if (fstype == "cgroup2" || (fstype == "cgroup" && ListsCpu(options))) {
      mounts.push_back({Unescape(point), Unescape(root), fstype == "cgroup2"});
    }
  }
  return mounts;
}

// Where the cgroup at `path` of its hierarchy is within a mount of `root`: a container sees only
// its own part of the hierarchy (root), and a path outside it as that root.
std::string WithinMount(const std::string& path, const std::string& root) {
  if (root == "/" || root.empty()) return path;
  if (path.compare(0, root.size(), root) == 0 && (path.size() == root.size() || path[root.size()] == '/')) {
    return path.size() == root.size() ? "/" : path.substr(root.size());
  }
  return "/";
}

}  // namespace

int CgroupCpuLimit(const std::string& self_cgroup, const std::string& mountinfo) {
  const std::vector<CgroupMount> mounts = CgroupMounts(mountinfo);
  std::ifstream in(self_cgroup);
  std::string line;
  int limit = 0;
  while (std::getline(in, line)) {
    // "hierarchy-id:controllers:path"; v2's line is "0::path".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    const bool v2 = id == "0" && controllers.empty();
    if (!v2 && !ListsCpu(controllers)) continue;
    for (const CgroupMount& m : mounts) {
      if (m.v2 != v2) continue;
      const std::string within = WithinMount(path, m.root);
      limit = Tighter(limit, v2 ? LimitUpFrom(m.point, within, V2Limit) : LimitUpFrom(m.point, within, V1Limit));
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
