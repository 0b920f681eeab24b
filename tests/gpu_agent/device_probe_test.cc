// Label `gpu`: needs a device; skips cleanly where there is none (CI, the development machine).
#include "specache/device_probe.h"

#include <gtest/gtest.h>

namespace specache {
namespace {

TEST(DeviceProbeTest, ReportsADeviceOrSkips) {
  auto info = ProbeCudaDevice();
  if (!info.ok()) GTEST_SKIP() << "no usable CUDA device: " << info.status().ToString();
  EXPECT_GE(info->device_count, 1);
  EXPECT_FALSE(info->name.empty());
  EXPECT_GE(info->compute_major, 8);  // the project builds for sm_80 and sm_90
  EXPECT_GT(info->total_memory_bytes, int64_t{1} << 30);
  EXPECT_GT(info->multiprocessors, 0);
}

TEST(DeviceProbeTest, NoDeviceIsUnavailableNotACrash) {
  auto info = ProbeCudaDevice();
  if (info.ok()) GTEST_SKIP() << "a device is present";
  EXPECT_EQ(info.status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace specache
