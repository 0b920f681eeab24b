// The host half of the CUDA agent's copy-engine fetch: the wanted rows are numbered 0 .. n - 1,
// each once, a task's in slot order one after another, skipped slots get -1, negative codes
// (rows the device has in its cache) are their own ranks, and each row is copied from its page of
// an InMemorySource (the layout the device reads) into its rank, on one thread or several
// (OpenMP's, or a SpinningPool's), into an output aligned for the streaming stores and one that is
// not (the plain copy), writing nothing around the rows. And how many threads a host of N cores
// gives the gather.
#include "page_row_gather.h"

#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "specache/cuda_fetch.h"
#include "specache/in_memory_source.h"
#include "spinning_pool.h"

namespace specache {
namespace {

using cuda::kNoToken;
constexpr int kHeadDim = 8, kKvHeads = 3, kPageTokens = 16, kTokens = 100;
constexpr size_t kRow = 2 * kHeadDim;

// Element e of row t of (layer, head): (layer * 3 + head) * 128 + t (exact in fp16).
float Value(int layer, int head, int token) { return float((layer * kKvHeads + head) * 128 + token); }

TEST(PageRowGatherTest, EveryRowOnceATasksRowsTogetherAndRowsFromTheirPages) {
  InMemorySource source(kPageTokens);
  ASSERT_TRUE(source.CreateSequence(5, {2, kKvHeads, kHeadDim}).ok());
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < kKvHeads; ++h) {
      std::vector<Half> rows(kTokens * kRow);
      for (int t = 0; t < kTokens; ++t) {
        for (size_t e = 0; e < kRow; ++e) rows[t * kRow + e] = FloatToHalf(Value(l, h, t));
      }
      ASSERT_TRUE(source.AppendRows(5, l, h, 0, rows.data(), kTokens).ok());
    }
  }
  std::vector<uint8_t*> pages[2];
  for (int l = 0; l < 2; ++l) ASSERT_TRUE(source.HostPages(5, l, kTokens, &pages[l]).ok());

  std::mt19937 rng(3);
  struct Want {
    int layer, head;
    std::vector<int32_t> tokens;  // kNoToken: skipped; below 0: a code passed through
  };
  std::vector<Want> wants;
  for (int i = 0; i < 40; ++i) {
    Want w{i % 2, static_cast<int>(rng() % kKvHeads), {}};
    const int n = i % 9 == 0 ? 0 : 1 + static_cast<int>(rng() % 20);
    for (int j = 0; j < n; ++j) {
      const uint32_t kind = rng() % 4;
      w.tokens.push_back(kind == 0   ? kNoToken
                         : kind == 1 ? -2 - static_cast<int32_t>(rng() % 50)
                                     : static_cast<int32_t>(rng() % kTokens));
    }
    wants.push_back(std::move(w));
  }
  // (threads, output offset, rows prefetched ahead, streaming stores, a SpinningPool's threads
  // instead of OpenMP's): the depth, the stores and the threads change how the rows move, never
  // which rows land where. Offset 2 leaves the output unaligned for 16-byte stores (the plain copy
  // even with streaming asked for). Which stores ran cannot be seen from the rows: this checks
  // that each kind copies them right.
  struct Round {
    int threads, offset, ahead;
    bool streaming, pool;
  };
  const int ahead_default = GatherOptions{}.prefetch_rows;
  for (const auto& [threads, offset, ahead, streaming, use_pool] :
       {Round{1, 0, ahead_default, false, false}, Round{4, 0, ahead_default, false, false},
        Round{4, 2, ahead_default, true, false}, Round{2, 0, 0, false, false}, Round{3, 0, 64, false, false},
        Round{4, 0, ahead_default, true, false}, Round{3, 0, ahead_default, false, true},
        Round{3, 2, ahead_default, true, true}}) {
    SpinningPool pool(use_pool ? threads : 1, std::chrono::microseconds(200));
    std::vector<std::vector<int32_t>> ranks(wants.size());
    std::vector<PageGatherTask> tasks;
    size_t most = 0;
    for (size_t i = 0; i < wants.size(); ++i) {
      ranks[i].assign(wants[i].tokens.size(), 12345);
      tasks.push_back({pages[wants[i].layer].data(), wants[i].head, wants[i].tokens.data(),
                       static_cast<int32_t>(wants[i].tokens.size()), ranks[i].data()});
      most += wants[i].tokens.size();
    }
    alignas(16) static uint8_t buffer[64 << 10];
    ASSERT_LE(offset + most * kRow * sizeof(Half), sizeof(buffer));
    std::memset(buffer, 0xff, sizeof(buffer));  // no row left from the last round (0xffff is a NaN)
    uint8_t* out = buffer + offset;
    auto row_value = [&](size_t at) {
      Half h;
      std::memcpy(&h, out + at * sizeof(Half), sizeof(h));
      return HalfToFloat(h);
    };
    const int64_t n = GatherPageRows(tasks, kPageTokens, static_cast<int64_t>(kRow * sizeof(Half)), kNoToken, out,
                                     {.threads = threads,
                                      .prefetch_rows = ahead,
                                      .streaming_stores = streaming,
                                      .pool = use_pool ? &pool : nullptr});
    const std::string round = "threads " + std::to_string(threads) + " offset " + std::to_string(offset) + " ahead " +
                              std::to_string(ahead) + " streaming " + std::to_string(streaming) + " pool " +
                              std::to_string(use_pool);
    int32_t rows = 0;
    std::vector<int> ranked(most, 0);  // [rank] slots given it
    for (size_t i = 0; i < wants.size(); ++i) {
      int32_t previous = -1;  // the task's last row's rank
      for (size_t j = 0; j < wants[i].tokens.size(); ++j) {
        const int32_t token = wants[i].tokens[j];
        if (token == kNoToken || token < 0) {
          EXPECT_EQ(ranks[i][j], token == kNoToken ? -1 : token) << round << " task " << i << " slot " << j;
          continue;
        }
        const int32_t rank = ranks[i][j];
        ASSERT_GE(rank, 0) << round << " task " << i << " slot " << j;
        ASSERT_LT(static_cast<size_t>(rank), most) << round << " task " << i << " slot " << j;
        if (previous >= 0) {
          EXPECT_EQ(rank, previous + 1) << round << " task " << i << " slot " << j;
        }
        previous = rank;
        ++ranked[static_cast<size_t>(rank)];
        for (size_t e = 0; e < kRow; ++e) {
          ASSERT_EQ(row_value(rank * kRow + e), Value(wants[i].layer, wants[i].head, token))
              << round << " task " << i << " slot " << j;
        }
        ++rows;
      }
    }
    EXPECT_EQ(n, rows) << round;
    // The ranks number the rows 0 .. n - 1, each once, and nothing is written around them.
    for (int32_t r = 0; r < rows; ++r) EXPECT_EQ(ranked[static_cast<size_t>(r)], 1) << round << " rank " << r;
    for (int at = 0; at < offset; ++at) ASSERT_EQ(buffer[at], 0xff) << round << " byte " << at << " before the rows";
    for (size_t at = offset + rows * kRow * sizeof(Half); at < sizeof(buffer); ++at) {
      ASSERT_EQ(buffer[at], 0xff) << round << " byte " << at << " after the rows";
    }
  }
}

// The gather leaves two of the host's cores to the agent's thread and the driver: 16 threads on a
// 16-core host starved them (GatherThreadsFor's comment has the figures).
TEST(PageRowGatherTest, TheGatherLeavesTwoCoresAndKeepsOneThread) {
  EXPECT_EQ(GatherThreadsFor(12, 16), 12);
  EXPECT_EQ(GatherThreadsFor(16, 16), 14);
  EXPECT_EQ(GatherThreadsFor(12, 8), 6);
  EXPECT_EQ(GatherThreadsFor(12, 2), 1);
  EXPECT_EQ(GatherThreadsFor(12, 1), 1);
  EXPECT_EQ(GatherThreadsFor(0, 16), 1);
  EXPECT_EQ(GatherThreadsFor(12, 0), 12);  // cores not known: as asked
}


}  // namespace
}  // namespace specache
