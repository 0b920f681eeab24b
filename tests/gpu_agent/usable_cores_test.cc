// UsableCores: the cores a thread may run on (its affinity), capped by its cgroup's CPU quota;
// CgroupCpuLimit read from made-up cgroup trees (v2's cpu.max, v1's cfs files, a hybrid host's
// both), the tightest of a cgroup and its ancestors, a container's path of which only the root is
// mounted, v1 directories named otherwise than their line, and no quota or nonsense.
#include "usable_cores.h"

#ifdef __linux__
#include <sched.h>
#endif

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace specache {
namespace {

namespace fs = std::filesystem;

// A made-up /proc/self/cgroup and cgroup mount in a directory of its own.
class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("usable_cores_test_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "mount");
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const fs::path& relative, const std::string& text) {
    const fs::path p = root_ / relative;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  int Limit() { return CgroupCpuLimit((root_ / "self_cgroup").string(), (root_ / "mount").string()); }
  fs::path root_;
};

TEST_F(CgroupTree, V2QuotaRoundsUpToWholeCores) {
  Write("self_cgroup", "0::/system.slice/specached.service\n");
  Write("mount/system.slice/specached.service/cpu.max", "250000 100000\n");
  EXPECT_EQ(Limit(), 3);
  Write("mount/system.slice/specached.service/cpu.max", "50000 100000\n");
  EXPECT_EQ(Limit(), 1);  // half a core still runs one thread
}

TEST_F(CgroupTree, V2TheTightestOfTheCgroupAndItsAncestors) {
  Write("self_cgroup", "0::/kubepods/pod1/c1\n");
  Write("mount/kubepods/pod1/c1/cpu.max", "max 100000\n");
  Write("mount/kubepods/pod1/cpu.max", "400000 100000\n");
  Write("mount/kubepods/cpu.max", "1600000 100000\n");
  EXPECT_EQ(Limit(), 4);
  Write("mount/kubepods/pod1/c1/cpu.max", "200000 100000\n");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, V2AContainersPathWithOnlyTheRootMounted) {
  Write("self_cgroup", "0::/docker/0123abcd\n");  // the host's path; the container sees its own root
  Write("mount/cpu.max", "150000 100000\n");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, V1QuotaUnderTheCpuControllersDirectory) {
  Write("self_cgroup", "12:memory:/a\n4:cpu,cpuacct:/a/b\n1:name=systemd:/a/b\n");
  Write("mount/cpu,cpuacct/a/b/cpu.cfs_quota_us", "-1\n");
  Write("mount/cpu,cpuacct/a/b/cpu.cfs_period_us", "100000\n");
  Write("mount/cpu,cpuacct/a/cpu.cfs_quota_us", "300000\n");
  Write("mount/cpu,cpuacct/a/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Limit(), 3);
}

TEST_F(CgroupTree, NoQuotaNoFilesOrNonsenseIsNoLimit) {
  EXPECT_EQ(Limit(), 0);  // no /proc/self/cgroup
  Write("self_cgroup", "0::/x\n");
  EXPECT_EQ(Limit(), 0);  // no cpu.max anywhere
  Write("mount/x/cpu.max", "max 100000\n");
  EXPECT_EQ(Limit(), 0);
  Write("mount/x/cpu.max", "garbage\n");
  EXPECT_EQ(Limit(), 0);
  Write("mount/x/cpu.max", "100000 0\n");
  EXPECT_EQ(Limit(), 0);
  Write("mount/x/cpu.max", "max\n");
  EXPECT_EQ(Limit(), 0);
  Write("mount/x/cpu.max", "300000 100000\n");
  EXPECT_EQ(Limit(), 3);
  Write("self_cgroup", "not a cgroup line\n");  // the same quota, named by no line
  EXPECT_EQ(Limit(), 0);
}

TEST_F(CgroupTree, V2PathsWithTrailingSlashesAndHugeQuotas) {
  Write("self_cgroup", "0::/a/b/\n");
  Write("mount/a/cpu.max", "99999999999999 1\n");
  EXPECT_EQ(Limit(), 1 << 20);  // clamped, not wrapped
  Write("mount/a/b/cpu.max", "100001 100000\n");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, AHybridHostsV2UnderUnifiedAndItsV1Cpu) {
  Write("self_cgroup", "1:cpu:/svc\n0::/svc\n");
  Write("mount/unified/svc/cpu.max", "600000 100000\n");
  EXPECT_EQ(Limit(), 6);
  Write("mount/cpu/svc/cpu.cfs_quota_us", "200000\n");
  Write("mount/cpu/svc/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, V1ControllersListedInAnotherOrderThanTheirDirectory) {
  Write("self_cgroup", "3:cpuacct,cpu:/job\n");
  Write("mount/cpu,cpuacct/job/cpu.cfs_quota_us", "400000\n");
  Write("mount/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Limit(), 4);
}

#ifdef __linux__
// The cores counted are those the thread may run on: one, once its affinity is one CPU.
TEST(UsableCoresTest, FollowTheThreadsAffinity) {
  const int all = UsableCores();
  EXPECT_GE(all, 1);
  int pinned = 0;
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    if (sched_getaffinity(0, sizeof(one), &one) != 0) return;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &one)) continue;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      break;
    }
    if (sched_setaffinity(0, sizeof(one), &one) == 0) pinned = UsableCores();
  }).join();
  EXPECT_EQ(pinned, 1);
  EXPECT_EQ(UsableCores(), all);  // the test's own thread as it was
}
#endif

}  // namespace
}  // namespace specache
