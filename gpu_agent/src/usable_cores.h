// How many cores this process's threads may keep busy, which sizes the CUDA agent's gather and
// planning threads (GatherThreadsFor, page_row_gather.h).
#pragma once

#include <string>

namespace specache {

// The cores the calling thread may run on (its CPU affinity, which taskset and cpusets narrow;
// else std::thread::hardware_concurrency), capped by the CPU quota of the process's cgroup (a
// container's `--cpus`, a systemd CPUQuota=: CgroupCpuLimit). 0 when neither count is known.
int UsableCores();

// The CPU quota of the process's cgroups as whole cores (quota / period, rounded up): the smallest
// over the cgroups that `self_cgroup` (the /proc/self/cgroup format) names and their ancestors,
// read where `mountinfo` (the /proc/self/mountinfo format) says their file systems are mounted
// (cgroup v2's cpu.max; v1's cpu.cfs_quota_us over cpu.cfs_period_us, in the hierarchy holding
// the cpu controller). A container that sees only its part of a hierarchy (the mount's root) reads
// from there up. 0: no quota, or nothing to read. Tests pass their own two files.
int CgroupCpuLimit(const std::string& self_cgroup = "/proc/self/cgroup",
                   const std::string& mountinfo = "/proc/self/mountinfo");

}  // namespace specache
