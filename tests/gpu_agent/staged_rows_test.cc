// The host half of the CUDA agent's staged data path: only the rows the device lacks are read,
// into their slots; every head's read is in flight before any is finished; an error finishes every
// started read and names the sequence; copies back to back merge; rows interleave into [K|V].
#include "staged_rows.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cuda_fetch.h"
#include "testing/pageless_source.h"

namespace specache {
namespace {

using cuda::kNoToken;
constexpr int kHeadDim = 8;
constexpr size_t kRow = 2 * kHeadDim;

// Sequence 3, 2 layers x 2 heads x 40 tokens; every element of row t of (layer, head) is
// (layer * 2 + head) * 64 + t (exact in fp16).
void Fill(FullPrecisionSource* source) {
  ASSERT_TRUE(source->CreateSequence(3, {2, 2, kHeadDim}).ok());
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      std::vector<Half> rows(40 * kRow);
      for (int t = 0; t < 40; ++t) {
        for (size_t e = 0; e < kRow; ++e) rows[t * kRow + e] = FloatToHalf(float((l * 2 + h) * 64 + t));
      }
      ASSERT_TRUE(source->AppendRows(3, l, h, 0, rows.data(), 40).ok());
    }
  }
}

bool IsRow(const Half* row, int layer, int head, int token) {
  for (size_t e = 0; e < kRow; ++e) {
    if (HalfToFloat(row[e]) != float((layer * 2 + head) * 64 + token)) return false;
  }
  return true;
}

TEST(StagedRowsTest, ReadsOnlyTheTokensNotResidentIntoTheirSlots) {
  testing::PagelessSource source;
  Fill(&source);
  const int32_t selected[] = {2, 5, 9, 31, kNoToken};
  const int32_t resident[] = {1, 5, 31, kNoToken, kNoToken};
  std::vector<Half> rows(5 * kRow, FloatToHalf(-7));
  const StagedHeadRows head{3, 1, 1, selected, 5, resident, 5, rows.data()};
  auto read = ReadMissingRows(&source, {&head, 1}, kHeadDim);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, 2);
  EXPECT_TRUE(IsRow(rows.data() + 0 * kRow, 1, 1, 2));
  EXPECT_TRUE(IsRow(rows.data() + 2 * kRow, 1, 1, 9));
  for (int slot : {1, 3, 4}) {  // resident tokens and the padding are left alone
    EXPECT_EQ(HalfToFloat(rows[slot * kRow]), -7.0f) << "slot " << slot;
  }
}

TEST(StagedRowsTest, WithoutResidentRowsEverySelectedRowLandsInPlace) {
  testing::PagelessSource source;
  Fill(&source);
  const int32_t selected[] = {0, 7, 39};
  std::vector<Half> rows(3 * kRow);
  const StagedHeadRows head{3, 0, 1, selected, 3, nullptr, 0, rows.data()};
  auto read = ReadMissingRows(&source, {&head, 1}, kHeadDim);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, 3);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(IsRow(rows.data() + i * kRow, 0, 1, selected[i])) << i;
}

TEST(StagedRowsTest, EveryHeadsReadIsInFlightBeforeAnyIsFinished) {
  testing::PagelessSource source;
  Fill(&source);
  const int32_t selected[] = {3, 4, 20};
  std::vector<Half> rows(4 * 3 * kRow);
  std::vector<StagedHeadRows> heads;
  for (int i = 0; i < 4; ++i) heads.push_back({3, i / 2, i % 2, selected, 3, nullptr, 0, rows.data() + i * 3 * kRow});
  auto read = ReadMissingRows(&source, heads, kHeadDim);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(*read, 12);
  EXPECT_EQ(source.max_in_flight(), 4);
  EXPECT_EQ(source.in_flight(), 0);
  for (int i = 0; i < 4; ++i) {
    for (int r = 0; r < 3; ++r) EXPECT_TRUE(IsRow(rows.data() + (i * 3 + r) * kRow, i / 2, i % 2, selected[r]));
  }
}

TEST(StagedRowsTest, AFailedFinishStillFinishesEveryReadAndNamesTheSequence) {
  testing::PagelessSource source;
  Fill(&source);
  const int32_t selected[] = {3, 4};
  std::vector<Half> rows(4 * 2 * kRow);
  std::vector<StagedHeadRows> heads;
  for (int i = 0; i < 4; ++i) heads.push_back({3, i / 2, i % 2, selected, 2, nullptr, 0, rows.data() + i * 2 * kRow});
  source.FailReadsAfter(1);
  auto read = ReadMissingRows(&source, heads, kHeadDim);
  EXPECT_EQ(read.status().code(), StatusCode::kDeadlineExceeded) << read.status().ToString();
  EXPECT_NE(read.status().message().find("sequence 3"), std::string::npos) << read.status().ToString();
  EXPECT_EQ(source.in_flight(), 0);
}

TEST(StagedRowsTest, AFailedStartFinishesTheReadsAlreadyStarted) {
  testing::PagelessSource source;
  Fill(&source);
  const int32_t good[] = {1}, unwritten[] = {40};
  std::vector<Half> rows(3 * kRow);
  const StagedHeadRows heads[] = {{3, 0, 0, good, 1, nullptr, 0, rows.data()},
                                  {3, 0, 1, unwritten, 1, nullptr, 0, rows.data() + kRow},
                                  {3, 1, 0, good, 1, nullptr, 0, rows.data() + 2 * kRow}};
  auto read = ReadMissingRows(&source, heads, kHeadDim);
  EXPECT_EQ(read.status().code(), StatusCode::kOutOfRange) << read.status().ToString();
  EXPECT_EQ(source.in_flight(), 0);
  EXPECT_EQ(source.reads_started(), 1) << "nothing starts after the failure";
}

TEST(StagedRowsTest, CopiesBackToBackInTheSameAllocationsMergeAndOthersDoNot) {
  std::vector<char> src(100), dst(100);
  std::vector<CopyRun> runs;
  AddCopy(&runs, dst.data(), src.data(), 10, true);
  AddCopy(&runs, dst.data() + 10, src.data() + 10, 5, true);  // continues both
  AddCopy(&runs, dst.data() + 15, src.data() + 40, 5, true);  // the source jumps
  AddCopy(&runs, dst.data() + 50, src.data() + 45, 5, true);  // the destination jumps
  AddCopy(&runs, dst.data() + 55, src.data() + 50, 0, true);  // nothing
  AddCopy(&runs, dst.data() + 55, src.data() + 50, 5, false);  // continues both, other allocations
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].bytes, 15u);
  EXPECT_EQ(runs[1].src, src.data() + 40);
  EXPECT_EQ(runs[2].dst, dst.data() + 50);
  EXPECT_EQ(runs[2].bytes, 5u) << "a copy may not span two allocations that lie back to back";
  EXPECT_EQ(runs[3].dst, dst.data() + 55);
}

TEST(StagedRowsTest, InterleavesKeyAndValuePlanesIntoRows) {
  std::vector<Half> k(2 * kHeadDim), v(2 * kHeadDim), rows(2 * kRow);
  for (int i = 0; i < 2 * kHeadDim; ++i) k[i] = FloatToHalf(float(i)), v[i] = FloatToHalf(float(100 + i));
  InterleaveRows(k.data(), v.data(), 2, kHeadDim, rows.data());
  for (int r = 0; r < 2; ++r) {
    for (int e = 0; e < kHeadDim; ++e) {
      EXPECT_EQ(HalfToFloat(rows[r * kRow + e]), float(r * kHeadDim + e));
      EXPECT_EQ(HalfToFloat(rows[r * kRow + kHeadDim + e]), float(100 + r * kHeadDim + e));
    }
  }
}

}  // namespace
}  // namespace specache
