// Label `gpu`: needs a device; skips where there is none, fails there under SPECACHE_REQUIRE_GPU.
#include "specache/device_probe.h"

#include <gtest/gtest.h>

#include "testing/cuda_device.h"

namespace specache {
namespace {

TEST(DeviceProbeTest, ReportsTheDevice) {
  SPECACHE_REQUIRE_CUDA_DEVICE();
  auto info = ProbeCudaDevice();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_GE(info->device_count, 1);
  EXPECT_FALSE(info->name.empty());
  EXPECT_GE(info->compute_major, 8);  // the project builds for sm_80 and sm_90
  EXPECT_GT(info->total_memory_bytes, int64_t{1} << 30);
  EXPECT_GT(info->multiprocessors, 0);
}

}  // namespace
}  // namespace specache
