// The worker thread of the CUDA agent's staged data path: jobs in order, Wait per key with the
// key's first error reported once, queued jobs run before the destructor returns.
#include "source_worker.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace specache {
namespace {

TEST(SourceWorkerTest, JobsRunOneAtATimeInTheOrderSubmitted) {
  std::vector<int> order;  // written by the worker only; read after WaitAll
  std::atomic<int> running{0}, most{0};
  SourceWorker worker;
  for (int i = 0; i < 50; ++i) {
    worker.Submit(i % 3, [&, i] {
      most = std::max(most.load(), ++running);
      order.push_back(i);
      --running;
      return Status::Ok();
    });
  }
  worker.WaitAll();
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
  EXPECT_EQ(most.load(), 1);
}

TEST(SourceWorkerTest, WaitReturnsOnceTheKeysJobsRanWithTheirFirstErrorReportedOnce) {
  SourceWorker worker;
  std::atomic<bool> slow_done{false};
  worker.Submit(0, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    slow_done = true;
    return Status::DeadlineExceeded("first");
  });
  worker.Submit(1, [] { return Status::Ok(); });
  worker.Submit(0, [] { return Status::Unavailable("second"); });
  const Status s = worker.Wait(0);
  EXPECT_TRUE(slow_done.load());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("first (and 1 later failures)"), std::string::npos) << s.ToString();
  EXPECT_TRUE(worker.Wait(0).ok()) << "an error is reported once";
  EXPECT_TRUE(worker.Wait(1).ok());
  EXPECT_TRUE(worker.Wait(7).ok()) << "a key without jobs does not wait";
}

TEST(SourceWorkerTest, TakeErrorDoesNotWaitAndWaitAllKeepsErrors) {
  SourceWorker worker;
  std::atomic<bool> release{false};
  worker.Submit(SourceWorker::kCommitKey, [&] {
    while (!release) std::this_thread::yield();
    return Status::Unavailable("append failed");
  });
  EXPECT_TRUE(worker.TakeError(SourceWorker::kCommitKey).ok()) << "the job has not run yet";
  release = true;
  worker.WaitAll();
  EXPECT_EQ(worker.TakeError(SourceWorker::kCommitKey).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(worker.TakeError(SourceWorker::kCommitKey).ok());
}

TEST(SourceWorkerTest, DestructorRunsEveryQueuedJobAndOnStartRunsFirstOnTheWorker) {
  std::atomic<int> ran{0};
  std::thread::id started_on, ran_on;
  {
    SourceWorker worker([&] {
      started_on = std::this_thread::get_id();
      return Status::Ok();
    });
    for (int i = 0; i < 100; ++i) {
      worker.Submit(i, [&] {
        ran_on = std::this_thread::get_id();
        ++ran;
        return Status::Ok();
      });
    }
  }
  EXPECT_EQ(ran.load(), 100);
  EXPECT_EQ(started_on, ran_on);
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

// A worker whose start failed (the CUDA agent's: its device could not be selected) runs no job:
// each fails with the start's error, reported to its key's Wait.
TEST(SourceWorkerTest, AFailedStartFailsEveryJobWithItsError) {
  std::atomic<int> ran{0};
  SourceWorker worker([] { return Status::Unavailable("no device"); });
  for (int key : {0, 1, SourceWorker::kCommitKey}) {
    worker.Submit(key, [&] {
      ++ran;
      return Status::Ok();
    });
  }
  for (int key : {0, 1, SourceWorker::kCommitKey}) {
    const Status s = worker.Wait(key);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_NE(s.message().find("no device"), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(ran.load(), 0);
}

}  // namespace
}  // namespace specache
