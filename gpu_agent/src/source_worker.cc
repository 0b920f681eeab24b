#include "source_worker.h"

#include <string>

namespace specache {

SourceWorker::SourceWorker(std::function<Status()> on_start)
    : thread_([this, start = std::move(on_start)]() mutable { Run(std::move(start)); }) {}

SourceWorker::~SourceWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  thread_.join();
}

void SourceWorker::Submit(int key, std::function<Status()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++unfinished_[key];
    queue_.emplace_back(key, std::move(job));
  }
  work_.notify_one();
}

Status SourceWorker::TakeErrorLocked(int key) {
  auto it = errors_.find(key);
  if (it == errors_.end()) return Status::Ok();
  Status s = std::move(it->second.first);
  if (it->second.more > 0) s = Status(s.code(), s.message() + " (and " + std::to_string(it->second.more) + " later failures)");
  errors_.erase(it);
  return s;
}

Status SourceWorker::Wait(int key) {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] {
    auto it = unfinished_.find(key);
    return it == unfinished_.end() || it->second == 0;
  });
  return TakeErrorLocked(key);
}

Status SourceWorker::TakeError(int key) {
  std::lock_guard<std::mutex> lock(mu_);
  return TakeErrorLocked(key);
}

void SourceWorker::WaitAll() {
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
}

void SourceWorker::Run(std::function<Status()> on_start) {
  const Status started = on_start ? on_start() : Status::Ok();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // Queued jobs run even after the destructor asked to stop: their owners wait for them.
    work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    auto [key, job] = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    lock.unlock();
    Status s = started.ok() ? job() : started.WithContext("the source worker's thread did not start");
    job = nullptr;  // what the job captured goes before its waiters wake
    lock.lock();
    --running_;
    if (!s.ok()) {
      auto [it, first] = errors_.try_emplace(key, Failure{std::move(s)});
      if (!first) ++it->second.more;
    }
    --unfinished_[key];
    done_.notify_all();
  }
}

}  // namespace specache
