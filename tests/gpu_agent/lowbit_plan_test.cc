// The tensor-core decode attention's plan (gpu_agent/src/cuda/lowbit_decode.h) on the host: it is
// made without a device (a device's SM count and occupancy only size the wave), so CI checks what
// the kernels rely on: every item's bulk blocks cut into whole units of chunk_blocks, none empty,
// its tail units counted, the items of a class in their set in order. The kernels' results over
// such plans are the gpu-labelled CudaAttentionTest.
#include <gtest/gtest.h>

#ifdef SPECACHE_TEST_HAVE_CUDA
#include <algorithm>
#include <random>
#include <vector>

#include "cuda/device_info.h"
#include "cuda/lowbit_decode.h"
#include "cuda/mma_codes.h"

namespace specache {
namespace {

// An item of `length` tokens whose keys are quantized in groups of 32 up to a residual of
// `residual` tokens and whose values keep a window of 64, with `rows` rows of 4 GQA heads.
cuda::DeviceDecodeItem Item(int32_t length, int32_t residual, bool mma, int head_dim = 128, int rows = 2) {
  cuda::DeviceDecodeItem it;
  it.replica.head_dim = head_dim;
  it.replica.group_size = 32;
  it.replica.key_bits = it.replica.value_bits = 1;
  it.replica.length = length;
  it.replica.quantized_keys = std::max(0, (length - residual) / 32 * 32);
  it.replica.quantized_values = std::max(0, length - 64);
  it.replica.mma_codes = mma ? 1 : 0;
  it.rows.n_rows = rows;
  it.rows.n_heads = 4;
  return it;
}

// Blocks of 32 tokens whose keys and values are both quantized: what the bulk units cover.
int32_t BulkBlocks(const cuda::DeviceDecodeItem& it) {
  return std::min(it.replica.quantized_keys, it.replica.quantized_values & ~31) / 32;
}

void ExpectUnitsCoverTheItems(const cuda::LowBitSet& set, const std::vector<cuda::DeviceDecodeItem>& want) {
  ASSERT_EQ(set.items.size(), want.size());
  ASSERT_EQ(set.unit_begin.size(), want.size() + 1);
  ASSERT_EQ(set.tail_begin.size(), want.size() + 1);
  ASSERT_GE(set.chunk_blocks, 2);
  ASSERT_GE(set.tail_units, 1);
  ASSERT_LE(set.tail_units, 4);
  EXPECT_EQ(set.unit_begin[0], 0);
  EXPECT_EQ(set.tail_begin[0], 0);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(set.items[i].replica.length, want[i].replica.length) << "item " << i << " moved out of order";
    const int32_t blocks = BulkBlocks(want[i]);
    const int32_t bulk_units = (blocks + set.chunk_blocks - 1) / set.chunk_blocks;
    const int32_t tails = set.tail_begin[i + 1] - set.tail_begin[i];
    const int32_t tail_blocks = (want[i].replica.length + want[i].rows.n_rows - blocks * 32 + 31) / 32;
    EXPECT_EQ(tails, std::min(tail_blocks, set.tail_units)) << "item " << i;
    EXPECT_EQ(set.unit_begin[i + 1] - set.unit_begin[i], bulk_units + tails) << "item " << i;
    // Whole units: the last one holds at least one block.
    if (bulk_units > 0) {
      EXPECT_GT(blocks, (bulk_units - 1) * set.chunk_blocks) << "item " << i;
    }
  }
}

TEST(LowBitPlanTest, RaggedBatchesAreCutIntoWholeUnits) {
  std::mt19937 rng(7);
  for (const bool mma : {true, false}) {
    for (const int n : {1, 8, 99, 792}) {
      std::vector<cuda::DeviceDecodeItem> items;
      std::uniform_int_distribution<int32_t> length(40, 33000);
      for (int i = 0; i < n; ++i) items.push_back(Item(length(rng), 1 + static_cast<int32_t>(rng() % 64), mma));
      for (const int free_slots : {0, 16}) {
        std::vector<cuda::LowBitSet> sets;
        ASSERT_TRUE(cuda::PlanLowBitDecode(items, {.free_slots = free_slots}, &sets).ok());
        ASSERT_EQ(sets.size(), 1u) << "one class";
        SCOPED_TRACE(std::string(mma ? "lean" : "natural") + " n=" + std::to_string(n));
        ExpectUnitsCoverTheItems(sets[0], items);
        // The lean path's units take at least 16 blocks (its chunk search starts there).
        if (mma) {
          EXPECT_GE(sets[0].chunk_blocks, 16);
        }
      }
    }
  }
}

TEST(LowBitPlanTest, EqualLengthsAndOneLongItemShareAPlan) {
  // 792 equal items (one length for the histogram) and the same with one item 4x as long: the
  // long one gets more units of the same chunk, the others are unchanged.
  std::vector<cuda::DeviceDecodeItem> items(792, Item(8192 + 2, 5, true));
  std::vector<cuda::LowBitSet> sets;
  ASSERT_TRUE(cuda::PlanLowBitDecode(items, {}, &sets).ok());
  ASSERT_EQ(sets.size(), 1u);
  ExpectUnitsCoverTheItems(sets[0], items);
  items[400] = Item(4 * 8192, 5, true);
  ASSERT_TRUE(cuda::PlanLowBitDecode(items, {}, &sets).ok());
  ExpectUnitsCoverTheItems(sets[0], items);
  const int32_t long_units = sets[0].unit_begin[401] - sets[0].unit_begin[400];
  const int32_t short_units = sets[0].unit_begin[1] - sets[0].unit_begin[0];
  EXPECT_GT(long_units, short_units);
}

TEST(LowBitPlanTest, ClassesGetSetsOfTheirOwnInOrder) {
  // Lean (mma codes) and natural items of head_dim 64 and 128, interleaved: a set per class, each
  // with its items in the order given.
  std::vector<cuda::DeviceDecodeItem> items;
  for (int i = 0; i < 40; ++i) items.push_back(Item(1000 + 97 * i, 17, i % 2 == 0, i % 4 < 2 ? 128 : 64));
  std::vector<cuda::LowBitSet> sets;
  ASSERT_TRUE(cuda::PlanLowBitDecode(items, {}, &sets).ok());
  ASSERT_EQ(sets.size(), 4u);
  for (int a = 0; a + 1 < static_cast<int>(sets.size()); ++a) EXPECT_LT(sets[a].kernel_class, sets[a + 1].kernel_class);
  for (const cuda::LowBitSet& set : sets) {
    std::vector<cuda::DeviceDecodeItem> want;
    for (const auto& it : items) {
      if (it.replica.mma_codes == set.items[0].replica.mma_codes && it.replica.head_dim == set.items[0].replica.head_dim) {
        want.push_back(it);
      }
    }
    ExpectUnitsCoverTheItems(set, want);
  }
}

TEST(LowBitPlanTest, AForcedSplitAndOrderAreKept) {
  // DecodePlan::force_units: the chunk and the order as given (a chunk below 2 taken as 2), the
  // units still cut whole; kChosen leaves each to the plan.
  std::mt19937 rng(11);
  for (const bool mma : {true, false}) {
    std::vector<cuda::DeviceDecodeItem> items;
    std::uniform_int_distribution<int32_t> length(40, 9000);
    for (int i = 0; i < 99; ++i) items.push_back(Item(length(rng), 1 + static_cast<int32_t>(rng() % 64), mma));
    using Order = cuda::DecodePlan::UnitOrder;
    const std::pair<Order, cuda::TailOrder> orders[] = {{Order::kTailsShared, cuda::kTailsShared},
                                                        {Order::kTailsFirst, cuda::kTailsFirst},
                                                        {Order::kTailsLast, cuda::kTailsLast}};
    int32_t most_blocks = 2;
    for (const auto& it : items) most_blocks = std::max(most_blocks, BulkBlocks(it));
    // Past the longest item's blocks a chunk is taken as those blocks (one unit an item).
    for (const int chunk : {1, 2, 24, 300, 1 << 30}) {
      for (const auto& [forced, want] : orders) {
        std::vector<cuda::LowBitSet> sets;
        ASSERT_TRUE(cuda::PlanLowBitDecode(items, {.forced_chunk_blocks = chunk, .forced_order = forced}, &sets).ok());
        ASSERT_EQ(sets.size(), 1u);
        SCOPED_TRACE(std::string(mma ? "lean" : "natural") + " chunk=" + std::to_string(chunk));
        EXPECT_EQ(sets[0].chunk_blocks, std::clamp(chunk, 2, most_blocks));
        EXPECT_EQ(sets[0].tail_order, want);
        ExpectUnitsCoverTheItems(sets[0], items);
      }
    }
    std::vector<cuda::LowBitSet> chosen, chunk_only;
    ASSERT_TRUE(cuda::PlanLowBitDecode(items, {}, &chosen).ok());
    ASSERT_TRUE(cuda::PlanLowBitDecode(items, {.forced_chunk_blocks = 24}, &chunk_only).ok());
    EXPECT_EQ(chunk_only[0].chunk_blocks, 24);
    EXPECT_EQ(chunk_only[0].tail_order, chosen[0].tail_order) << "a forced chunk alone leaves the order to the plan";
  }
}

TEST(LowBitPlanTest, TheLeanPathsTailsGoLast) {
  // The lean path's order (PlanSet): never sharing the wave, the tails last, with few substituted
  // rows (the paper's 64 at 8K) as with many (a 1024-row cache at 8K). The general kernels keep
  // their own rule: with the whole GPU free they share the wave.
  for (const int n : {32, 99}) {
    for (const int32_t sub : {0, 64, 507, 508, 1024}) {
      std::vector<cuda::DeviceDecodeItem> items(size_t(n) * 8, Item(8192 + 2, 5, true));
      for (auto& it : items) it.rows.n_sub = sub;
      for (const int free_slots : {0, 32}) {
        std::vector<cuda::LowBitSet> sets;
        ASSERT_TRUE(cuda::PlanLowBitDecode(items, {.free_slots = free_slots}, &sets).ok());
        ASSERT_EQ(sets.size(), 1u);
        SCOPED_TRACE("n=" + std::to_string(n) + " rows=" + std::to_string(sub));
        ExpectUnitsCoverTheItems(sets[0], items);
        // 254 bulk blocks an item (8128 tokens): 508 rows are one in 16 of them.
        ASSERT_EQ(BulkBlocks(items[0]), 254);
        EXPECT_EQ(sets[0].tail_order, cuda::kTailsLast);
      }
    }
  }
  std::vector<cuda::DeviceDecodeItem> natural(99 * 8, Item(8192 + 2, 5, false));
  for (auto& it : natural) it.rows.n_sub = 1024;
  std::vector<cuda::LowBitSet> sets;
  ASSERT_TRUE(cuda::PlanLowBitDecode(natural, {}, &sets).ok());
  EXPECT_NE(sets[0].tail_order, cuda::kTailsLast) << "only the lean path puts the tails last";
}

TEST(LowBitPlanTest, TheLeanPathsL2PolicyFollowsItsCodeBytes) {
  // LowBitSet::codes_evict_first (DecodePlan::CodesL2): chosen, a lean set copies its code groups
  // evict-first while they are at most kCodesEvictFirstL2Multiple times the L2, counted as each
  // item's bulk blocks times its group bytes, and normal copies for an unknown L2 (0); forced, as
  // forced; never for the other classes. The policy changes nothing else of the plan.
  using L2 = cuda::DecodePlan::CodesL2;
  std::vector<cuda::DeviceDecodeItem> small(32 * 8, Item(8192 + 2, 5, true)), large(176 * 8, Item(8192 + 2, 5, true));
  for (auto* items : {&small, &large}) {
    for (auto& it : *items) it.replica.layout.group_bytes = cuda::MmaGroupBytes(128);
  }
  auto evict_first = [](const std::vector<cuda::DeviceDecodeItem>& items, int64_t l2_bytes, L2 forced) {
    std::vector<cuda::LowBitSet> sets;
    EXPECT_TRUE(cuda::PlanLowBitDecode(items, {.l2_bytes = l2_bytes, .forced_codes_l2 = forced}, &sets).ok());
    EXPECT_EQ(sets.size(), 1u);
    return !sets.empty() && sets[0].codes_evict_first;
  };
  constexpr int64_t kL2 = int64_t{50} << 20;  // an H100's or an H200's
  const int64_t small_bytes = int64_t{32 * 8} * BulkBlocks(small[0]) * cuda::MmaGroupBytes(128);  // ~133 MB
  ASSERT_LE(small_bytes, cuda::kCodesEvictFirstL2Multiple * kL2);
  ASSERT_GT(int64_t{176 * 8} * BulkBlocks(large[0]) * cuda::MmaGroupBytes(128), cuda::kCodesEvictFirstL2Multiple * kL2);
  EXPECT_TRUE(evict_first(small, kL2, L2::kChosen)) << "32 x 8K";
  EXPECT_FALSE(evict_first(large, kL2, L2::kChosen)) << "176 x 8K";
  // The bound itself: the small set's bytes are exactly the multiple of an L2 a quarter of them.
  ASSERT_EQ(small_bytes % cuda::kCodesEvictFirstL2Multiple, 0);
  EXPECT_TRUE(evict_first(small, small_bytes / cuda::kCodesEvictFirstL2Multiple, L2::kChosen)) << "at the bound";
  EXPECT_FALSE(evict_first(small, small_bytes / cuda::kCodesEvictFirstL2Multiple - 1, L2::kChosen))
      << "one byte of L2 below it";
  EXPECT_FALSE(evict_first(small, 0, L2::kChosen)) << "an unknown L2";
  EXPECT_TRUE(evict_first(large, kL2, L2::kEvictFirst)) << "forced evict-first";
  EXPECT_TRUE(evict_first(small, 0, L2::kEvictFirst)) << "forced evict-first, an unknown L2";
  EXPECT_FALSE(evict_first(small, kL2, L2::kNormal)) << "forced normal";
  // The rest of the plan as without the policy.
  std::vector<cuda::LowBitSet> with, without;
  ASSERT_TRUE(cuda::PlanLowBitDecode(small, {.l2_bytes = kL2}, &with).ok());
  ASSERT_TRUE(cuda::PlanLowBitDecode(small, {}, &without).ok());
  ASSERT_TRUE(with[0].codes_evict_first);
  ASSERT_FALSE(without[0].codes_evict_first);
  EXPECT_EQ(with[0].kernel_class, cuda::kFirstLeanClass + 1);
  EXPECT_EQ(with[0].kernel_class, without[0].kernel_class);
  EXPECT_EQ(with[0].chunk_blocks, without[0].chunk_blocks);
  EXPECT_EQ(with[0].tail_order, without[0].tail_order);
  EXPECT_EQ(with[0].unit_begin, without[0].unit_begin);
  EXPECT_EQ(with[0].tail_begin, without[0].tail_begin);
  // A set of the general kernels (their copies take no L2 policy), even when forced.
  const std::vector<cuda::DeviceDecodeItem> natural(8, Item(8192 + 2, 5, false));
  for (const L2 forced : {L2::kChosen, L2::kEvictFirst}) {
    std::vector<cuda::LowBitSet> sets;
    ASSERT_TRUE(cuda::PlanLowBitDecode(natural, {.l2_bytes = kL2, .forced_codes_l2 = forced}, &sets).ok());
    ASSERT_LT(sets[0].kernel_class, cuda::kFirstLeanClass);
    EXPECT_FALSE(sets[0].codes_evict_first);
  }
}

TEST(LowBitPlanTest, ALaunchPlansWithItsDecodePlansSlotsAndForces) {
  // PlanArgsOf: what AttendDecodeBatch (and specache-bench's print of the chosen split) plans with.
  using Order = cuda::DecodePlan::UnitOrder;
  using L2 = cuda::DecodePlan::CodesL2;
  cuda::DecodePlan plan;
  const cuda::LowBitPlanArgs chosen = cuda::PlanArgsOf(plan);
  EXPECT_EQ(chosen.free_slots, 0);
  EXPECT_EQ(chosen.forced_chunk_blocks, 0);
  EXPECT_EQ(chosen.forced_order, Order::kChosen);
  EXPECT_EQ(chosen.forced_codes_l2, L2::kChosen);
  EXPECT_EQ(chosen.l2_bytes, cuda::CurrentDeviceL2Bytes());  // 0 without a device
  plan.set_free_slots(32);
  plan.force_units(24, Order::kTailsFirst);
  plan.force_codes_l2(L2::kEvictFirst);
  const cuda::LowBitPlanArgs forced = cuda::PlanArgsOf(plan);
  EXPECT_EQ(forced.free_slots, 32);
  EXPECT_EQ(forced.forced_chunk_blocks, 24);
  EXPECT_EQ(forced.forced_order, Order::kTailsFirst);
  EXPECT_EQ(forced.forced_codes_l2, L2::kEvictFirst);
  // The same plan as the arguments spelt out.
  std::vector<cuda::DeviceDecodeItem> items(64, Item(8192 + 2, 5, true));
  for (auto& it : items) it.replica.layout.group_bytes = cuda::MmaGroupBytes(128);
  std::vector<cuda::LowBitSet> a, b;
  ASSERT_TRUE(cuda::PlanLowBitDecode(items, forced, &a).ok());
  ASSERT_TRUE(cuda::PlanLowBitDecode(items, {.free_slots = 32, .l2_bytes = forced.l2_bytes, .forced_chunk_blocks = 24,
                                             .forced_order = Order::kTailsFirst, .forced_codes_l2 = L2::kEvictFirst},
                                     &b)
                  .ok());
  EXPECT_EQ(a[0].chunk_blocks, 24);
  EXPECT_EQ(a[0].tail_order, cuda::kTailsFirst);
  EXPECT_TRUE(a[0].codes_evict_first);
  EXPECT_EQ(a[0].unit_begin, b[0].unit_begin);
}

TEST(LowBitPlanTest, EveryOrderRunsEachUnitOnceAndPadsToWholeCtas) {
  // UnitOfWarp, the kernel's map from a warp to its (item, unit), over random unit tables (items
  // with no bulk units, no tail units, or none at all among them): in each order every unit of
  // every item is run by exactly one warp of the launch's whole CTAs, and in the tails-first and
  // -last orders no CTA holds both a tail unit and a bulk unit.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    const int count = 1 + static_cast<int>(rng() % 9);
    std::vector<int32_t> unit_begin{0}, tail_begin{0};
    for (int i = 0; i < count; ++i) {
      const int32_t bulk = static_cast<int32_t>(rng() % 4 == 0 ? 0 : rng() % 7);
      const int32_t tails = static_cast<int32_t>(rng() % 5);
      unit_begin.push_back(unit_begin.back() + bulk + tails);
      tail_begin.push_back(tail_begin.back() + tails);
    }
    for (const int32_t order : {cuda::kTailsShared, cuda::kTailsFirst, cuda::kTailsLast}) {
      const int warps = cuda::LaunchWarps(unit_begin.back(), tail_begin.back(), order);
      const int ctas = (warps + cuda::kLowBitWarpsPerCta - 1) / cuda::kLowBitWarpsPerCta;
      std::vector<int> runs(static_cast<size_t>(unit_begin.back()), 0);
      for (int c = 0; c < ctas; ++c) {
        bool bulk_in_cta = false, tail_in_cta = false;
        for (int w = c * cuda::kLowBitWarpsPerCta; w < (c + 1) * cuda::kLowBitWarpsPerCta; ++w) {
          int item = -1, unit = -1;
          if (!cuda::UnitOfWarp(unit_begin.data(), tail_begin.data(), count, order, w, &item, &unit)) continue;
          ASSERT_GE(item, 0);
          ASSERT_LT(item, count);
          const int32_t units = unit_begin[item + 1] - unit_begin[item];
          const int32_t bulk = units - (tail_begin[item + 1] - tail_begin[item]);
          ASSERT_GE(unit, 0);
          ASSERT_LT(unit, units) << "order " << order << " warp " << w;
          ++runs[static_cast<size_t>(unit_begin[item] + unit)];
          (unit < bulk ? bulk_in_cta : tail_in_cta) = true;
        }
        if (order != cuda::kTailsShared) {
          EXPECT_FALSE(bulk_in_cta && tail_in_cta) << "order " << order << " CTA " << c;
        }
      }
      for (size_t i = 0; i < runs.size(); ++i) ASSERT_EQ(runs[i], 1) << "order " << order << " unit " << i;
    }
  }
}

}  // namespace
}  // namespace specache
#endif
