// UsableCores: the cores a thread may run on (its affinity), capped by its cgroup's CPU quota;
// CgroupCpuLimit read from made-up cgroup trees where a made-up mountinfo says they are (v2's
// cpu.max, v1's cfs files in the cpu controller's hierarchy, a hybrid host's both), the tightest of
// a cgroup and its ancestors, a container that sees only its part of the hierarchy, escaped mount
// points, and no quota or nonsense.
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

// A made-up /proc/self/cgroup, /proc/self/mountinfo and the mounts it names, in a directory of
// its own.
class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("usable_cores_test_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const fs::path& relative, const std::string& text) {
    const fs::path p = root_ / relative;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  // A mountinfo line: `hierarchy_root` of a cgroup file system mounted at root_/`point`.
  std::string Mount(const std::string& hierarchy_root, const std::string& point, const std::string& fstype,
                    const std::string& options) {
    return "40 30 0:50 " + hierarchy_root + " " + (root_ / point).string() + " rw,nosuid - " + fstype + " " + fstype +
           " " + options + "\n";
  }
  std::string V2(const std::string& point, const std::string& hierarchy_root = "/") {
    return Mount(hierarchy_root, point, "cgroup2", "rw,nsdelegate");
  }
  std::string V1(const std::string& point, const std::string& controllers, const std::string& hierarchy_root = "/") {
    return Mount(hierarchy_root, point, "cgroup", "rw," + controllers);
  }
  int Limit() { return CgroupCpuLimit((root_ / "self_cgroup").string(), (root_ / "mountinfo").string()); }
  fs::path root_;
};

TEST_F(CgroupTree, V2QuotaRoundsUpToWholeCores) {
  Write("mountinfo", "25 1 8:1 / / rw - ext4 /dev/sda1 rw\n" + V2("fs/cgroup"));
  Write("self_cgroup", "0::/system.slice/specached.service\n");
  Write("fs/cgroup/system.slice/specached.service/cpu.max", "250000 100000\n");
  EXPECT_EQ(Limit(), 3);
  Write("fs/cgroup/system.slice/specached.service/cpu.max", "50000 100000\n");
  EXPECT_EQ(Limit(), 1);  // half a core still runs one thread
}

TEST_F(CgroupTree, V2TheTightestOfTheCgroupAndItsAncestors) {
  Write("mountinfo", V2("fs/cgroup"));
  Write("self_cgroup", "0::/kubepods/pod1/c1\n");
  Write("fs/cgroup/kubepods/pod1/c1/cpu.max", "max 100000\n");
  Write("fs/cgroup/kubepods/pod1/cpu.max", "400000 100000\n");
  Write("fs/cgroup/kubepods/cpu.max", "1600000 100000\n");
  EXPECT_EQ(Limit(), 4);
  Write("fs/cgroup/kubepods/pod1/c1/cpu.max", "200000 100000\n");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, AContainerReadsFromTheRootItsMountShowsItUp) {
  // The container's mount shows the host's /docker/0123 as its root; its own cgroup is below.
  Write("mountinfo", V2("fs/cgroup", "/docker/0123"));
  Write("self_cgroup", "0::/docker/0123/app\n");
  Write("fs/cgroup/cpu.max", "150000 100000\n");
  EXPECT_EQ(Limit(), 2);
  Write("fs/cgroup/app/cpu.max", "100000 100000\n");
  EXPECT_EQ(Limit(), 1);
  Write("self_cgroup", "0::/elsewhere\n");  // outside the mounted part: its root is what is seen
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, V1QuotaInTheHierarchyWithTheCpuController) {
  Write("mountinfo", V1("fs/cgroup/memory", "memory") + V1("fs/cgroup/cpu,cpuacct", "cpu,cpuacct"));
  Write("self_cgroup", "12:memory:/a\n4:cpuacct,cpu:/a/b\n1:name=systemd:/a/b\n");
  Write("fs/cgroup/cpu,cpuacct/a/b/cpu.cfs_quota_us", "-1\n");
  Write("fs/cgroup/cpu,cpuacct/a/b/cpu.cfs_period_us", "100000\n");
  Write("fs/cgroup/cpu,cpuacct/a/cpu.cfs_quota_us", "300000\n");
  Write("fs/cgroup/cpu,cpuacct/a/cpu.cfs_period_us", "100000\n");
  Write("fs/cgroup/memory/a/cpu.cfs_quota_us", "100000\n");  // not the cpu hierarchy: not read
  Write("fs/cgroup/memory/a/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Limit(), 3);
}

TEST_F(CgroupTree, AHybridHostsV2WithoutCpuAndItsV1Cpu) {
  Write("mountinfo", V2("fs/cgroup/unified") + V1("fs/cgroup/cpu", "cpu"));
  Write("self_cgroup", "1:cpu:/svc\n0::/svc\n");
  EXPECT_EQ(Limit(), 0);
  Write("fs/cgroup/cpu/svc/cpu.cfs_quota_us", "200000\n");
  Write("fs/cgroup/cpu/svc/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, MountPointsWithEscapedSpaces) {
  fs::create_directories(root_ / "my mounts");
  std::string line = V2("my mounts/cg");
  line.replace(line.find("my mounts"), 9, "my\\040mounts");
  Write("mountinfo", line);
  Write("self_cgroup", "0::/x\n");
  Write("my mounts/cg/x/cpu.max", "700000 100000\n");
  EXPECT_EQ(Limit(), 7);
}

TEST_F(CgroupTree, V2PathsWithTrailingSlashesAndHugeQuotas) {
  Write("mountinfo", V2("fs/cgroup"));
  Write("self_cgroup", "0::/a/b/\n");
  Write("fs/cgroup/a/cpu.max", "99999999999999 1\n");
  EXPECT_EQ(Limit(), 1 << 20);  // clamped, not wrapped
  Write("fs/cgroup/a/b/cpu.max", "100001 100000\n");
  EXPECT_EQ(Limit(), 2);
}

TEST_F(CgroupTree, NoQuotaNoFilesOrNonsenseIsNoLimit) {
  EXPECT_EQ(Limit(), 0);  // neither file
  Write("self_cgroup", "0::/x\n");
  EXPECT_EQ(Limit(), 0);  // no mountinfo
  Write("mountinfo", V2("fs/cgroup"));
  EXPECT_EQ(Limit(), 0);  // no cpu.max anywhere
  for (const char* text : {"max 100000\n", "garbage\n", "100000 0\n", "max\n"}) {
    Write("fs/cgroup/x/cpu.max", text);
    EXPECT_EQ(Limit(), 0) << text;
  }
  Write("fs/cgroup/x/cpu.max", "300000 100000\n");
  EXPECT_EQ(Limit(), 3);
  Write("mountinfo", "not a mountinfo line\n");  // the same quota, its mount unnamed
  EXPECT_EQ(Limit(), 0);
  Write("mountinfo", V2("fs/cgroup"));
  Write("self_cgroup", "not a cgroup line\n");  // the same quota, named by no line
  EXPECT_EQ(Limit(), 0);
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
