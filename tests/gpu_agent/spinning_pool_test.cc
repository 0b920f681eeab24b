// The gather's own threads (spinning_pool.h): every item of every loop runs once and its writes
// are seen by the caller when Run returns, loops of any size (none, fewer items than threads, many
// more) back to back; threads that spun out sleep and are woken by the next loop; a pool of one
// thread runs the loop on the caller; a pool goes while its threads sleep or spin.
#include "spinning_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace specache {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

// Runs loops of the given sizes in a row on `pool`, each item adding its loop's number to its own
// cell (plain ints: written by one thread, read by the caller after Run), and checks every cell.
void ExpectEveryItemOnce(SpinningPool& pool, const std::vector<int>& sizes) {
  for (size_t loop = 0; loop < sizes.size(); ++loop) {
    const int n = sizes[loop];
    std::vector<int> cells(static_cast<size_t>(n), 0);
    std::atomic<int> calls{0};
    pool.Run(n, [&](int i) {
      cells[static_cast<size_t>(i)] += static_cast<int>(loop) + 1;
      calls.fetch_add(1, std::memory_order_relaxed);
    });
    ASSERT_EQ(calls.load(), n) << "loop " << loop;
    for (int i = 0; i < n; ++i) ASSERT_EQ(cells[static_cast<size_t>(i)], static_cast<int>(loop) + 1) << "loop " << loop;
  }
}

TEST(SpinningPoolTest, EveryItemOfEveryLoopRunsOnceAndIsSeenByTheCaller) {
  SpinningPool pool(3, microseconds(500));
  EXPECT_EQ(pool.threads(), 3);
  std::vector<int> sizes;
  for (int i = 0; i < 300; ++i) sizes.push_back(i % 7 == 0 ? 0 : i % 5 == 0 ? 1 : (i * 37) % 200);
  ExpectEveryItemOnce(pool, sizes);
}

TEST(SpinningPoolTest, ItemsOfDifferentLengthsAreSharedByTheThreads) {
  SpinningPool pool(3, milliseconds(50));
  std::vector<std::thread::id> ran_on(200);
  pool.Run(200, [&](int i) {
    std::this_thread::sleep_for(microseconds(i % 4 == 0 ? 2000 : 500));
    ran_on[static_cast<size_t>(i)] = std::this_thread::get_id();
  });
  std::vector<std::thread::id> distinct;
  for (const auto& id : ran_on) {
    if (std::find(distinct.begin(), distinct.end(), id) == distinct.end()) distinct.push_back(id);
  }
  // The caller and both pool threads took items: each item sleeps, so no thread can take them all.
  EXPECT_EQ(distinct.size(), 3u);
}

TEST(SpinningPoolTest, ThreadsThatSpunOutSleepAndTheNextLoopWakesThem) {
  SpinningPool pool(3, microseconds(200));
  ExpectEveryItemOnce(pool, {10});
  // Well past the spin: the pool threads went to sleep twice or more (polled, not assumed; under
  // load a thread may spin out before the first loop too, and count that sleep).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (pool.sleeps() < 2 && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(milliseconds(1));
  ASSERT_GE(pool.sleeps(), 2);
  // Loops after a sleep each: every thread is woken and takes part.
  for (int round = 0; round < 20; ++round) {
    std::this_thread::sleep_for(milliseconds(2));
    ExpectEveryItemOnce(pool, {1, 50, 0, 7});
  }
}

TEST(SpinningPoolTest, LoopsWithinTheSpinStartWithoutWakingAnyThread) {
  SpinningPool pool(2, std::chrono::seconds(30));  // one pool thread, which spins for the whole test
  ExpectEveryItemOnce(pool, {5, 100, 3, 0, 40, 1, 64});
  EXPECT_EQ(pool.sleeps(), 0);
}

TEST(SpinningPoolTest, APoolOfOneThreadRunsTheLoopOnTheCaller) {
  for (int threads : {1, 0, -3}) {
    SpinningPool pool(threads, microseconds(100));
    EXPECT_EQ(pool.threads(), 1);
    std::vector<std::thread::id> ran_on;
    pool.Run(5, [&](int) { ran_on.push_back(std::this_thread::get_id()); });
    ASSERT_EQ(ran_on.size(), 5u);
    for (const auto& id : ran_on) EXPECT_EQ(id, std::this_thread::get_id());
  }
}

TEST(SpinningPoolTest, APoolGoesWhileItsThreadsSleepOrSpin) {
  {
    SpinningPool sleeping(4, microseconds(50));
    ExpectEveryItemOnce(sleeping, {20});
    std::this_thread::sleep_for(milliseconds(20));
  }
  {
    SpinningPool spinning(4, std::chrono::seconds(30));
    ExpectEveryItemOnce(spinning, {20});
  }
  SpinningPool never_used(4, microseconds(50));
}

}  // namespace
}  // namespace specache
