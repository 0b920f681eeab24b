// Threads for a caller that runs many short parallel loops in a row, each a few hundred
// microseconds to a few milliseconds apart (the copy-engine fetch's gather: one loop a decode
// layer, on the fetch's worker thread), and must not depend on the process's OpenMP wait policy:
// specache-run sets OMP_WAIT_POLICY=passive for its CPU engine (tools/src/blas_runtime.h), under
// which OpenMP's threads sleep between two loops and are woken for each.
//
// - Run(n, fn) calls fn(i) once for each i in [0, n), on the calling thread and the pool's
//   threads (an item at a time, taken in order by whichever thread is free: items of very
//   different lengths balance), and returns when every call has returned; what the calls wrote is
//   then visible to the caller. fn must not throw (the gather's copies do not).
// - Between two loops each pool thread spins for `spin` (at most an hour; polling, with the
//   CPU's pause hint) before it sleeps; a loop that comes within that time starts without waking
//   any thread. A sleeping thread is woken by the next Run, which waits for it to check in
//   before it returns (every thread takes part in every loop, if only to find no item left).
// - One caller at a time (Run is not reentrant, and fn must not call Run). The destructor wakes
//   and joins the threads; no Run may be in progress.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace specache {

class SpinningPool {
 public:
  // `threads` counts the caller: threads - 1 pool threads (none for 1 or less).
  SpinningPool(int threads, std::chrono::microseconds spin);
  ~SpinningPool();
  SpinningPool(const SpinningPool&) = delete;
  SpinningPool& operator=(const SpinningPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  void Run(int n, const std::function<void(int)>& fn);

  // For tests: how many times the pool's threads went to sleep since the pool was made.
  int64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }

 private:
  void Work();
  // Stops and joins the pool's threads (the destructor; a constructor that failed partway).
  void Stop();
  // Takes items of the current loop until none is left.
  void TakeItems();

  const std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  // The current loop: set by Run before it publishes `generation_` (release), read by the pool's
  // threads after they see it change (acquire).
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
  std::atomic<int> next_{0};            // the next item to take
  std::atomic<int> checked_in_{0};      // pool threads done with the current loop
  std::atomic<uint64_t> generation_{0};  // loops started; a change tells the threads to work
  std::atomic<int> sleeping_{0};        // pool threads asleep (or about to sleep) on wake_
  std::atomic<int64_t> sleeps_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace specache
