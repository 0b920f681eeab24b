// A FullPrecisionSource over an InMemorySource that offers no zero-copy pages: what a source whose
// rows are on another host (client_lib's RemoteSource) offers an agent, with the rows in this
// process. Its reads come in two halves as a remote source's do: StartReadRows checks the request
// and only records it, FinishReadRows copies the rows, so a caller that lets its token list or
// output go before the finish, or never finishes, is caught. Faults can be armed: after the next n
// reads (or appends) succeed, every later one fails, as with a daemon that stopped answering.
//
// Thread safety: as full_precision_source.h asks (the in-memory source locks; this adds a mutex
// for its read table and counters).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "forwarding_source.h"

namespace specache::testing {

class PagelessSource final : public ForwardingSource {
 public:
  explicit PagelessSource(int32_t page_tokens = 64) : ForwardingSource(/*zero_copy=*/false, page_tokens) {}

  Status AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                    int32_t n) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (appends_left_ == 0) return Status::Unavailable("the source stopped taking rows");
      if (appends_left_ > 0) --appends_left_;
    }
    return ForwardingSource::AppendRows(sequence, layer, kv_head, first_token, rows, n);
  }
  Result<uint64_t> StartReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                                 Half* out) override {
    SPECACHE_ASSIGN_OR_RETURN(const int32_t length, Length(sequence, layer, kv_head));
    if (std::any_of(tokens, tokens + n, [&](int32_t t) { return t < 0 || t >= length; })) {
      return Status::OutOfRange("a token is not written yet");
    }
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t handle = next_handle_++;
    reads_[handle] = {sequence, layer, kv_head, tokens, n, out};
    max_in_flight_ = std::max(max_in_flight_, static_cast<int>(reads_.size()));
    ++reads_started_;
    return handle;
  }
  Status FinishReadRows(uint64_t handle) override {
    Read r;
    bool fail = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = reads_.find(handle);
      if (it == reads_.end()) return Status::Internal("no such read in flight");
      r = it->second;
      reads_.erase(it);
      if (reads_left_ == 0) fail = true;
      if (reads_left_ > 0) --reads_left_;
    }
    if (fail) return Status::DeadlineExceeded("the source did not answer in time");
    return ReadRows(r.sequence, r.layer, r.kv_head, r.tokens, r.n, r.out);
  }

  // After `n` more reads (appends) succeed, the later ones fail; -1: none fails.
  void FailReadsAfter(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    reads_left_ = n;
  }
  void FailAppendsAfter(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    appends_left_ = n;
  }
  // Reads started and not finished now; the most at once so far; all started so far.
  int in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(reads_.size());
  }
  int max_in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return max_in_flight_;
  }
  int64_t reads_started() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reads_started_;
  }

 private:
  struct Read {
    SequenceId sequence = 0;
    int layer = 0, kv_head = 0;
    const int32_t* tokens = nullptr;
    int32_t n = 0;
    Half* out = nullptr;
  };
  mutable std::mutex mu_;
  std::map<uint64_t, Read> reads_;
  uint64_t next_handle_ = 1;
  int max_in_flight_ = 0;
  int64_t reads_started_ = 0;
  int64_t reads_left_ = -1, appends_left_ = -1;
};

}  // namespace specache::testing
