// specache-bench reuse's replay on a hand-made trace whose counts are known: the agent's policy
// (previous selection resident) and a larger recent-rows cache.
#include "reuse_bench.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace specache::bench {
namespace {

double Value(const BenchRow& row, const std::string& key) {
  for (const auto& [k, v] : row.values) {
    if (k == key) return v;
  }
  return -1;
}

TEST(ReuseBenchTest, ReplaysATraceWithKnownCounts) {
  const std::string path = ::testing::TempDir() + "/trace.txt";
  {
    // One (layer, head), k = 2. Step 0 (pre-decode, {1,2}) is a cold fetch for every policy.
    // Decode steps: {2,3} {3,4} {1,2} {5,6}: 8 rows selected.
    // Previous selection only: 1 new, 1 new, 2 new, 2 new -> 6 fetched.
    std::ofstream t(path);
    t << "0 0 0 2 1 2\n1 0 0 2 2 3\n2 0 0 2 3 4\n3 0 0 2 1 2\n4 0 0 2 5 6\n";
  }
  std::vector<BenchRow> rows;
  ASSERT_TRUE(RunReuseSuite({path, 100, {2}}, &rows));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(Value(rows[0], "rows_fetched"), 8);                       // naive
  EXPECT_EQ(Value(rows[1], "rows_fetched"), 6);                       // previous selection only
  EXPECT_DOUBLE_EQ(Value(rows[1], "ratio_to_naive"), 6.0 / 8.0);
  EXPECT_DOUBLE_EQ(Value(rows[1], "bytes_per_token"), 6.0 * 100 / 4);  // 4 decode steps
  // Capacity 4: after step 2 the cache is {1,2,3,4} (1 and 2 from steps 0-1, still among the 4
  // most recent), so step 3's {1,2} are hits: 3 + 4 fetched once each, then 5 and 6.
  EXPECT_EQ(Value(rows[2], "rows_fetched"), 4);
  std::remove(path.c_str());
}

TEST(ReuseBenchTest, AMissingTraceIsAnError) {
  std::vector<BenchRow> rows;
  EXPECT_FALSE(RunReuseSuite({"/nonexistent/trace", 256, {2}}, &rows));
}

}  // namespace
}  // namespace specache::bench
