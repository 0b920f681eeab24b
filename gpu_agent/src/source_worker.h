// One thread that runs an agent's calls into a source without zero-copy pages (the staged data
// path of the CUDA agent: cuda/staged_fetch.h, cuda/staged_commit.h), so that the thread which
// enqueues the engine's layers never waits for a read or a write to reach the source.
//
// - Jobs run one at a time, in the order they were submitted. Each has a key: a layer's fetch
//   uses the layer, the commits of new rows kCommitKey, a call that waits at once kCallerKey.
//   Running every read and write of the source on this one thread keeps the source's rule that
//   calls on one (sequence, layer, head) are serialised, and orders each read after the appends
//   submitted before it (a fetch may select a row appended in the same step).
// - Wait(key) blocks until every job of that key submitted so far has run, then returns the first
//   error among them that was not reported yet (and forgets it), saying how many more of the key's
//   jobs failed after it; TakeError(key) returns it without waiting. A failed job does not stop
//   the jobs after it.
// - The destructor runs every job still queued, then joins the thread: everything a job uses must
//   outlive the worker (its owner declares it last, so that it goes first).
//
// Thread safety: Submit, Wait, WaitAll and TakeError may be called from any thread, but not from a
// job (Wait from a job would wait for itself).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "specache/status.h"

namespace specache {

class SourceWorker {
 public:
  static constexpr int kCommitKey = -1;
  static constexpr int kCallerKey = -2;  // jobs whose caller waits for them at once

  // `on_start` runs first on the worker thread (the CUDA agent selects its device there); if it
  // fails, no job runs: each fails with its error.
  explicit SourceWorker(std::function<Status()> on_start = {});
  ~SourceWorker();
  SourceWorker(const SourceWorker&) = delete;
  SourceWorker& operator=(const SourceWorker&) = delete;

  void Submit(int key, std::function<Status()> job);
  // Waits for the key's jobs submitted so far; their first unreported error, or OK.
  Status Wait(int key);
  // The key's first unreported error among the jobs that have run, without waiting.
  Status TakeError(int key);
  // Waits until every job submitted so far has run; their errors stay for Wait / TakeError.
  void WaitAll();

 private:
  void Run(std::function<Status()> on_start);
  // Caller holds mu_.
  Status TakeErrorLocked(int key);

  std::mutex mu_;
  std::condition_variable work_, done_;
  std::deque<std::pair<int, std::function<Status()>>> queue_;
  std::map<int, int> unfinished_;  // [key] jobs queued or running
  struct Failure {
    Status first;
    int64_t more = 0;  // failures after `first`, not reported on their own
  };
  std::map<int, Failure> errors_;  // [key] unreported
  int running_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace specache
