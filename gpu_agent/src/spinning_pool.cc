#include "spinning_pool.h"

#include <algorithm>

namespace specache {
namespace {

// The CPU's hint that the thread is spinning (fewer of the sibling hyperthread's cycles taken).
inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

SpinningPool::SpinningPool(int threads, std::chrono::microseconds spin)
    : spin_(std::clamp(spin, std::chrono::microseconds(0), std::chrono::microseconds(std::chrono::hours(1)))) {
  try {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
  } catch (...) {
    Stop();  // the threads started so far
    throw;
  }
}

SpinningPool::~SpinningPool() { Stop(); }

void SpinningPool::Stop() {
  stop_.store(true);
  // A thread between its check and its wait holds the mutex: it waits before this notifies.
  { std::lock_guard<std::mutex> lock(mutex_); }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void SpinningPool::TakeItems() {
  for (int i = next_.fetch_add(1, std::memory_order_relaxed); i < n_; i = next_.fetch_add(1, std::memory_order_relaxed)) {
    (*fn_)(i);
  }
}

void SpinningPool::Run(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  fn_ = &fn;
  n_ = n;
  next_.store(0, std::memory_order_relaxed);
  checked_in_.store(0, std::memory_order_relaxed);
  // Sequentially consistent, as sleeping_'s load after it and a thread's increment of sleeping_
  // before it reads the generation: either that thread sees this loop, or this call sees it
  // asleep and wakes it (under the mutex, which the thread holds from its increment to its wait).
  generation_.fetch_add(1);
  if (sleeping_.load() > 0) {
    // A thread counted as sleeping holds the mutex until it waits: taking it here orders the
    // notify after that wait (the woken threads then find the mutex free).
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
  TakeItems();
  const int others = static_cast<int>(workers_.size());
  // The others finish their last items, or wake and check in; a thread of theirs descheduled
  // meanwhile gets this core back after a while.
  for (uint32_t polls = 1; checked_in_.load(std::memory_order_acquire) < others; ++polls) {
    if ((polls & 1023) == 0) {
      std::this_thread::yield();
    } else {
      Pause();
    }
  }
}

void SpinningPool::Work() {
  uint64_t seen = 0;
  for (;;) {
    const auto deadline = std::chrono::steady_clock::now() + spin_;
    uint64_t now_generation = generation_.load();
    for (uint32_t polls = 0; now_generation == seen && !stop_.load(std::memory_order_relaxed); ++polls) {
      Pause();
      if ((polls & 63) == 63 && std::chrono::steady_clock::now() >= deadline) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.fetch_add(1);
        sleeps_.fetch_add(1, std::memory_order_relaxed);
        wake_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
        sleeping_.fetch_sub(1);
      }
      now_generation = generation_.load();
    }
    if (now_generation == seen) return;  // stopped
    seen = now_generation;
    TakeItems();
    checked_in_.fetch_add(1, std::memory_order_release);  // the items' writes before the caller's return
  }
}

}  // namespace specache
