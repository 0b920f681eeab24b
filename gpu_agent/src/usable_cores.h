// How many cores this process's threads may keep busy, which sizes the CUDA agent's gather and
// planning threads (GatherThreadsFor, page_row_gather.h).
#pragma once

#include <string>

namespace specache {

// The cores the calling thread may run on (its CPU affinity, which taskset and cpusets narrow;
// else std::thread::hardware_concurrency), capped by the CPU quota of the process's cgroup (a
// container's `--cpus`, a systemd CPUQuota=: CgroupCpuLimit). 0 when neither count is known.
int UsableCores();

// The CPU quota of the cgroup that `self_cgroup` (the /proc/self/cgroup format) names, as whole
// cores (quota / period, rounded up), the smallest over that cgroup and its ancestors, read under
// `cgroup_root` (the cgroup file system's mount: cgroup v2's cpu.max there or under unified/, or
// v1's cpu.cfs_quota_us and cpu.cfs_period_us under the directory named for the cpu controller's
// line, or cpu/). 0: no quota, or no file to read (not seen: a mount elsewhere than these, which
// /proc/self/mountinfo would tell). Tests pass their own two paths.
int CgroupCpuLimit(const std::string& self_cgroup = "/proc/self/cgroup",
                   const std::string& cgroup_root = "/sys/fs/cgroup");

}  // namespace specache
