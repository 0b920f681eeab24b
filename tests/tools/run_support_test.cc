// specache-run's option parsing shared by its commands: byte counts (--gpu-mem-budget), mode specs
// with per-mode selection options, and labels that name what differs from the defaults.
#include "run_support.h"

#include <gtest/gtest.h>

namespace specache::run {
namespace {

TEST(ParseBytesTest, AcceptsDecimalAndBinaryUnits) {
  EXPECT_EQ(*ParseBytes("48GB"), 48'000'000'000u);
  EXPECT_EQ(*ParseBytes("48GiB"), uint64_t{48} << 30);
  EXPECT_EQ(*ParseBytes("512MiB"), uint64_t{512} << 20);
  EXPECT_EQ(*ParseBytes("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(*ParseBytes("48e9"), 48'000'000'000u);
  EXPECT_EQ(*ParseBytes("51539607552"), 51'539'607'552u);
}

TEST(ParseBytesTest, RefusesUnknownUnitsAndNonPositiveSizes) {
  EXPECT_EQ(ParseBytes("48TB").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("many").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("0").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseBytes("-1GB").status().code(), StatusCode::kInvalidArgument);
}

TEST(RunSupportTest, ModeSpecsTakeSelectionOptionsAfterSlashes) {
  const KvOptions defaults;
  auto plain = ToConfig(defaults, "specache:1");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->select, SelectFrom::kUnion);
  EXPECT_EQ(plain->extra_rows(), 96);
  EXPECT_TRUE(plain->real_next);
  EXPECT_TRUE(plain->attend_resident);
  EXPECT_EQ(plain->cache_rows(), kDefaultCachedRows);
  EXPECT_EQ(ModeLabel(*plain), "specache-1bit");
  // The default cache grows with the selection past it (twice the rows selected), and an explicit
  // size is kept.
  EXPECT_EQ(ToConfig(defaults, "specache:1/topk=600")->cache_rows(), 2 * (600 + 96));
  EXPECT_EQ(ToConfig(defaults, "specache:1/cached-rows=256")->cache_rows(), 256);
  EXPECT_EQ(ModeLabel(*ToConfig(defaults, "specache:1/cached-rows=256")), "specache-1bit+cache256");
  EXPECT_EQ(ToConfig(defaults, "kivi:1")->cached_rows, 0) << "no row cache without fetched rows";

  auto paper = ToConfig(defaults, "specache:1/select=spec/no-resident/topk=64");
  ASSERT_TRUE(paper.ok()) << paper.status().ToString();
  EXPECT_EQ(paper->select, SelectFrom::kSpeculative);
  EXPECT_FALSE(paper->attend_resident);
  EXPECT_EQ(paper->extra_rows(), 0);
  EXPECT_EQ(paper->cache_rows(), kDefaultCachedRows);
  EXPECT_EQ(ModeLabel(*paper), "specache-1bit+spec+no-resident");

  auto other =
      ToConfig(defaults, "specache:2/topk-real=16/no-next/mass=0.9/k-min=8/k-max=96/cached-rows=300/reduction=max");
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  EXPECT_EQ(other->key_bits, 2);
  EXPECT_EQ(other->extra_rows(), 16);
  EXPECT_FALSE(other->real_next);
  EXPECT_DOUBLE_EQ(other->mass, 0.9);
  EXPECT_EQ(other->k_min, 8);
  EXPECT_EQ(other->k_max, 96);
  EXPECT_EQ(other->cache_rows(), 300);
  EXPECT_EQ(other->reduction, GroupReduction::kMax);
  EXPECT_EQ(ModeLabel(*other), "specache-2bit+union16+no-next+mass0.9k8-96+cache300+max");
  EXPECT_EQ(ToConfig(defaults, "specache:1/reduction=median").status().code(), StatusCode::kInvalidArgument);

  auto oracle = ToConfig(defaults, "specache-oracle:1/no-resident");
  ASSERT_TRUE(oracle.ok());
  EXPECT_EQ(oracle->mode, KvMode::kSpeCacheOracle);
  EXPECT_EQ(ModeLabel(*oracle), "specache-oracle-1bit+no-resident");
  EXPECT_EQ(ModeLabel(*ToConfig(defaults, "kivi:1")), "kivi-1bit");
}

// --seed-rows applies to specache only: full and kivi (and the reference a fidelity run builds with
// kv = full) take the same options without a row cache to seed.
TEST(RunSupportTest, SeedRowsGoToSpeCacheModesOnly) {
  KvOptions o;
  o.seed_rows = 512;
  EXPECT_EQ(ToConfig(o, "specache:1")->seed_rows, 512);
  EXPECT_EQ(ModeLabel(*ToConfig(o, "specache:1")), "specache-1bit+seed512");
  for (const char* mode : {"full", "kivi:1", "specache-nonspec:1", "specache-oracle:1"}) {
    auto c = ToConfig(o, mode);
    ASSERT_TRUE(c.ok()) << mode << ": " << c.status().ToString();
    EXPECT_EQ(c->seed_rows, 0) << mode;
    EXPECT_TRUE(ValidateKvConfig(*c, {2, 4, 2, 64}).ok()) << mode;
  }
  EXPECT_EQ(ToConfig(KvOptions{}, "specache:1/seed=64")->seed_rows, 64);
  // specache-run seeds 1024 rows unless told otherwise; a label names only a count other than that.
  EXPECT_EQ(ToConfig(KvOptions{}, "specache:1")->seed_rows, 1024);
  EXPECT_EQ(ModeLabel(*ToConfig(KvOptions{}, "specache:1")), "specache-1bit");
  EXPECT_EQ(ModeLabel(*ToConfig(KvOptions{}, "specache:1/seed=0")), "specache-1bit+seed0");
}

// host-rows= (and --host-rows): int8 stores the rows in host memory as int8 (KvConfig::
// host_row_format), e4m3 rounds the fp16 rows (KvConfig::round_host_rows); only fetching modes.
TEST(RunSupportTest, HostRowsAreAModeOption) {
  EXPECT_EQ(ToConfig(KvOptions{}, "specache:1")->round_host_rows, HostRowRounding::kNone);
  EXPECT_EQ(ToConfig(KvOptions{}, "specache:1")->host_row_format, HostRowFormat::kFp16);
  auto int8 = ToConfig(KvOptions{}, "specache:1/host-rows=int8");
  ASSERT_TRUE(int8.ok()) << int8.status().ToString();
  EXPECT_EQ(int8->host_row_format, HostRowFormat::kInt8);
  EXPECT_EQ(int8->round_host_rows, HostRowRounding::kNone);
  EXPECT_EQ(ModeLabel(*int8), "specache-1bit+host-int8");
  KvOptions o;
  o.host_rows = "e4m3";
  EXPECT_EQ(ToConfig(o, "specache:1")->round_host_rows, HostRowRounding::kE4m3);
  EXPECT_EQ(ToConfig(o, "specache:1")->host_row_format, HostRowFormat::kFp16);
  EXPECT_EQ(ModeLabel(*ToConfig(o, "specache:1")), "specache-1bit+host-e4m3");
  EXPECT_EQ(ToConfig(o, "specache:1/host-rows=none")->round_host_rows, HostRowRounding::kNone);
  for (const char* mode : {"full", "kivi:1"}) EXPECT_EQ(ToConfig(o, mode)->round_host_rows, HostRowRounding::kNone) << mode;
  o.host_rows = "int8";
  for (const char* mode : {"full", "kivi:1"}) EXPECT_EQ(ToConfig(o, mode)->host_row_format, HostRowFormat::kFp16) << mode;
  const auto bad = ToConfig(KvOptions{}, "specache:1/host-rows=fp8");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("none, int8, e4m3, int4 or int4-g16"), std::string::npos) << bad.status().ToString();
}

TEST(RunSupportTest, BadModeOptionsAreNamed) {
  const KvOptions defaults;
  for (const char* spec : {"specache:1/sellect=spec", "specache:1/topk=many", "specache:1/mass=lots",
                           "specache:1/resident=yes"}) {
    auto c = ToConfig(defaults, spec);
    ASSERT_FALSE(c.ok()) << spec;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << spec;
  }
  EXPECT_NE(ToConfig(defaults, "specache:1/select=both").status().message().find("spec, real or union"),
            std::string::npos);
}

}  // namespace
}  // namespace specache::run
