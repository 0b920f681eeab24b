// MappedBytes reads /proc/self/smaps: touched memory is resident, memory the kernel was told not
// to map with huge pages has none, memory advised for them counts whole 2 MiB pages and never
// more than the region, and an InMemorySource reports its slabs through it. Whether advised
// memory gets huge pages depends on the host (transparent_hugepage/enabled): the tests assert
// what holds on any.
#include "specache/host_mapping.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "specache/in_memory_source.h"

namespace specache {
namespace {

constexpr size_t kHuge = size_t{2} << 20;

// An anonymous mapping of `bytes` at a 2 MiB boundary (trimmed from a larger one), advised and
// touched; unmapped at the end of the test.
class AlignedMapping {
 public:
  AlignedMapping(size_t bytes, int advice) : bytes_(bytes) {
    raw_bytes_ = bytes + kHuge;
    raw_ = mmap(nullptr, raw_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw_ == MAP_FAILED) return;
    const uintptr_t at = (reinterpret_cast<uintptr_t>(raw_) + kHuge - 1) / kHuge * kHuge;
    base_ = reinterpret_cast<uint8_t*>(at);
    (void)madvise(base_, bytes_, advice);  // a hint; its failure leaves base pages
    std::memset(base_, 1, bytes_);
  }
  ~AlignedMapping() {
    if (raw_ != MAP_FAILED) munmap(raw_, raw_bytes_);
  }
  uint8_t* base() const { return base_; }
  bool ok() const { return raw_ != MAP_FAILED; }

 private:
  size_t bytes_, raw_bytes_ = 0;
  void* raw_ = MAP_FAILED;
  uint8_t* base_ = nullptr;
};

TEST(HostMappingTest, NoRegionsCountNothing) {
  const HostMapping m = MappedBytes({});
  EXPECT_EQ(m.resident, 0);
  EXPECT_EQ(m.huge, 0);
  EXPECT_EQ(m.huge_share(), -1.0) << "nothing resident: no share";
}

TEST(HostMappingTest, TouchedMemoryIsResidentAndAdvisedAgainstHugePagesHasNone) {
  AlignedMapping m(8 * kHuge, MADV_NOHUGEPAGE);
  ASSERT_TRUE(m.ok());
  const std::vector<MemoryRange> regions{{m.base(), 8 * kHuge}};
  const HostMapping mapped = MappedBytes(regions);
  EXPECT_EQ(mapped.resident, int64_t(8 * kHuge)) << "every page was written";
  EXPECT_EQ(mapped.huge, 0);
  EXPECT_EQ(mapped.huge_share(), 0.0);
}

TEST(HostMappingTest, AdvisedMemoryCountsWholeHugePagesWithinTheRegion) {
  AlignedMapping m(8 * kHuge, MADV_HUGEPAGE);
  ASSERT_TRUE(m.ok());
  const std::vector<MemoryRange> whole{{m.base(), 8 * kHuge}};
  const HostMapping mapped = MappedBytes(whole);
  EXPECT_EQ(mapped.resident, int64_t(8 * kHuge));
  EXPECT_GE(mapped.huge, 0);
  EXPECT_LE(mapped.huge, mapped.resident);
  EXPECT_EQ(mapped.huge % int64_t(kHuge), 0) << "huge pages come whole";
  // Half of the region: never more than that half.
  const std::vector<MemoryRange> half{{m.base(), 4 * kHuge}};
  const HostMapping in_half = MappedBytes(half);
  EXPECT_LE(in_half.resident, int64_t(4 * kHuge));
  EXPECT_LE(in_half.huge, std::min<int64_t>(mapped.huge, int64_t(4 * kHuge)));
}

TEST(HostMappingTest, TheSettingInForceIsTheBracketedChoice) {
  EXPECT_EQ(SettingInForce("always [madvise] never"), "madvise");
  EXPECT_EQ(SettingInForce("always within_size advise [never] deny force"), "never");
  EXPECT_EQ(SettingInForce("unknown"), "unknown");  // what an unreadable setting reads as
  EXPECT_EQ(SettingInForce("] broken ["), "] broken [");
  // This machine's own setting: a line with its choice bracketed, or "unknown".
  const std::string enabled = TransparentHugePageSetting("enabled");
  EXPECT_TRUE(enabled == "unknown" || SettingInForce(enabled) != enabled) << enabled;
  EXPECT_EQ(TransparentHugePageSetting("no_such_setting"), "unknown");
}

TEST(HostMappingTest, AnInMemorySourceReportsItsSlabs) {
  InMemorySource source(64, 4 * kHuge, /*huge_pages=*/true);
  const SequenceLayout layout{2, 2, 64};
  source.Reserve(layout, 4, 4096);  // 16 MiB of pages: slabs of 8 MiB, each 2 MiB-aligned and advised
  int64_t slabs = 0;
  for (const HostRegion& r : source.host_regions()) slabs += static_cast<int64_t>(r.bytes);
  ASSERT_GT(slabs, 0);
  // Every page written: the slabs are resident.
  std::vector<Half> rows(size_t(4096) * 2 * 64, FloatToHalf(1.0f));
  for (SequenceId s = 1; s <= 4; ++s) {
    ASSERT_TRUE(source.CreateSequence(s, layout).ok());
    for (int l = 0; l < 2; ++l)
      for (int h = 0; h < 2; ++h) ASSERT_TRUE(source.AppendRows(s, l, h, 0, rows.data(), 4096).ok());
  }
  const HostMapping mapped = source.mapping();
  EXPECT_GE(mapped.resident, int64_t(16) << 20);
  EXPECT_LE(mapped.resident, slabs);
  EXPECT_GE(mapped.huge, 0);
  EXPECT_LE(mapped.huge, mapped.resident);
}

}  // namespace
}  // namespace specache
