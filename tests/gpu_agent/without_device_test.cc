// Label `unit`: what the CUDA entry points do on a machine without a usable device (CI, the
// development machine, a build without CUDA): they return UNAVAILABLE, never crash, so an engine
// can fall back to the CPU agent. With a device present these skip: the `gpu` tests cover it.
#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "specache/agent.h"
#include "specache/cuda_attention.h"
#include "specache/cuda_fetch.h"
#include "specache/cuda_gather.h"
#include "specache/cuda_selection.h"
#include "specache/device_probe.h"
#include "specache/in_memory_source.h"

namespace specache {
namespace {

#define SKIP_IF_A_DEVICE_IS_PRESENT() \
  if (ProbeCudaDevice().ok()) GTEST_SKIP() << "a device is present: the gpu-labelled tests cover it"

// A configuration refused before the device is touched: with CUDA built, `code` and a message
// that says `says`; a build without CUDA has no CUDA agent at all (UNAVAILABLE).
void ExpectRefusedBeforeTheDevice(const Status& s, StatusCode code, const std::string& says) {
#ifdef SPECACHE_TEST_HAVE_CUDA
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_NE(s.message().find(says), std::string::npos) << s.ToString();
#else
  (void)code, (void)says;
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
#endif
}

TEST(WithoutDeviceTest, TheProbeIsUnavailableNotACrash) {
  SKIP_IF_A_DEVICE_IS_PRESENT();
  const auto info = ProbeCudaDevice();
  EXPECT_EQ(info.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(info.status().message().empty());
}

TEST(WithoutDeviceTest, CreatingACudaAgentIsUnavailable) {
  SKIP_IF_A_DEVICE_IS_PRESENT();
  InMemorySource source;
  EXPECT_EQ(CreateCudaAgent({2, 4, 2, 64}, KvConfig{}, &source).status().code(), StatusCode::kUnavailable);
}

// With or without a device: a configuration the CUDA kernels cannot hold is refused before the
// device is touched (a build without CUDA has no CUDA agent at all).
TEST(WithoutDeviceTest, ARowCacheAboveTheKernelsLimitIsInvalidEverywhere) {
  InMemorySource source;
  KvConfig config;
  config.cached_rows = cuda::kMaxCacheRows + 1;
  ExpectRefusedBeforeTheDevice(CreateCudaAgent({2, 4, 2, 64}, config, &source).status(), StatusCode::kInvalidArgument,
                               std::to_string(cuda::kMaxCacheRows));
}

// The union's merge (cuda_selection.h) holds up to kMaxMergedRows rows: a union that selects more
// is refused before the device is touched, as an adaptive budget whose k_max does.
TEST(WithoutDeviceTest, AUnionAboveTheMergesLimitIsInvalidEverywhere) {
  InMemorySource source;
  KvConfig config;
  config.select = SelectFrom::kUnion;
  config.top_k = 4096;
  config.top_k_real = cuda::kMaxMergedRows - 4096 + 1;
  config.cached_rows = cuda::kMaxMergedRows + 8;  // within the row cache's limit: the merge's is the one exceeded
  ExpectRefusedBeforeTheDevice(CreateCudaAgent({2, 4, 2, 64}, config, &source).status(), StatusCode::kInvalidArgument,
                               "merge takes up to " + std::to_string(cuda::kMaxMergedRows));
  config.top_k_real -= 1;  // exactly the limit: past the checks (then UNAVAILABLE here, or a device agent)
  const Status at_limit = CreateCudaAgent({2, 4, 2, 64}, config, &source).status();
  EXPECT_NE(at_limit.code(), StatusCode::kInvalidArgument) << at_limit.ToString();
}

// Rounded host rows (KvConfig::round_host_rows, a fidelity measure) are the CPU agent's only, and
// stored int8 rows need a head_dim the CUDA kernels take (a multiple of 16 up to 256): the CUDA
// agent says so before touching the device.
TEST(WithoutDeviceTest, HostRowsTheCudaAgentCannotServeAreRefusedEverywhere) {
  InMemorySource source;
  KvConfig config;
  config.round_host_rows = HostRowRounding::kInt8;
  ExpectRefusedBeforeTheDevice(CreateCudaAgent({2, 4, 2, 64}, config, &source).status(), StatusCode::kUnimplemented,
                               "CPU agent");
  config = KvConfig();
  config.host_row_format = HostRowFormat::kInt8;
  ExpectRefusedBeforeTheDevice(CreateCudaAgent({2, 4, 2, 288}, config, &source).status(), StatusCode::kInvalidArgument,
                               "256");
}

#ifdef SPECACHE_TEST_HAVE_CUDA
// Checked before any device work, so with or without a device: fp16 rows the kernels would read
// 16 bytes at a time from an address that is not 16-byte aligned (cuda_attention.h) are refused.
// The addresses are never read.
TEST(WithoutDeviceTest, MisalignedRowsAreRefusedBeforeAnyDeviceWork) {
  auto at = [](uintptr_t a) { return reinterpret_cast<const Half*>(a); };
  cuda::DeviceDecodeItem base;
  base.replica.head_dim = 64;
  base.rows.new_keys = base.rows.new_values = at(0x10000);
  cuda::DecodePlan plan;
  for (int field = 0; field < 6; ++field) {
    cuda::DeviceDecodeItem it = base;
    switch (field) {
      case 0: it.rows.new_values = at(0x10008); break;
      case 1: it.rows.new_keys = at(0x10002); break;
      case 2: it.replica.residual_keys = at(0x20004); break;
      case 3: it.replica.window_values = at(0x20008); break;
      case 4: it.rows.sub_rows = at(0x30002); break;
      default: it.rows.kv_stride = 68; break;  // 136 bytes between rows
    }
    const Status s = cuda::AttendDecodeBatch(&it, 1, nullptr, &plan);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "field " << field << ": " << s.ToString();
    EXPECT_NE(s.message().find("16-byte aligned"), std::string::npos) << s.ToString();
  }
}
#endif

TEST(WithoutDeviceTest, RegisteringHostMemoryIsUnavailable) {
  SKIP_IF_A_DEVICE_IS_PRESENT();
  int x = 0;
  EXPECT_EQ(cuda::RegisterHostMemory(&x, sizeof x).status().code(), StatusCode::kUnavailable);
}

// The merge refuses lists longer than it holds before it launches anything (with or without a
// device: nothing is read through the null pointers).
TEST(WithoutDeviceTest, AMergeAboveItsLimitIsRefusedBeforeAnyLaunch) {
  cuda::MergeTask task;
  task.na = cuda::kMaxMergedRows / 2;
  task.nb = cuda::kMaxMergedRows / 2 + 1;
  EXPECT_EQ(cuda::MergeSelections(&task, 1, nullptr, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(WithoutDeviceTest, FetchingRowsIsUnavailable) {
  SKIP_IF_A_DEVICE_IS_PRESENT();
  // One task, so that a launch is tried (a call with no tasks launches nothing and succeeds).
  cuda::FetchTask task;
  task.n_selected = 1;
  EXPECT_EQ(cuda::FetchRows(&task, 1, 64, HostRowFormat::kFp16, 64, 1, nullptr, nullptr).code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace specache
