// The per-sequence bookkeeping both full-precision sources keep, whichever daemon holds the pages
// (DaemonSource: this host's, mapped; RemoteSource: another host's, over UCX): the agent's
// sequence ids and the daemon's behind them, each sequence's layout, its per-(layer, head)
// lengths, how many pages per layer the daemon has made, and the checks every call makes against
// them. The sources keep only what differs: where rows are written to and read from.
//
// SessionT is Session or RemoteSession: both have CreateSequence(PageLayoutSpec), Extend(id,
// tokens), Release(id) and Keep(id) with the same contracts. EntryT is RegisteredSequence or a
// type derived from it, constructed as EntryT(layout, max_pages_per_layer) before the sequence
// is visible to any other call.
//
// Create, Release and Keep make a daemon call outside the registry's lock. Two Creates of one id
// at once: the id is reserved before the call, so the second gets ALREADY_EXISTS (before, both
// succeeded and the first daemon sequence leaked). Keep and Release of one sequence at once: Keep
// holds the entry (shared) and its keep lock across its call, and Release decides under that lock,
// so the sequence ends kept or released, never a write to a freed entry or a "kept" one that
// Release freed in the daemon.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "specache/client.h"
#include "specache/full_precision_source.h"

namespace specache::client {

struct RegisteredSequence {
  RegisteredSequence(const SequenceLayout& l, uint32_t /*max_pages_per_layer*/)
      : layout(l), lengths(static_cast<size_t>(l.n_layers) * l.n_kv_heads) {}

  uint64_t daemon_id = 0;
  SequenceLayout layout;
  std::vector<std::atomic<int32_t>> lengths;  // [layer * n_kv_heads + head]
  std::mutex extend_mu;                       // one Extend at a time; the others wait and re-check
  std::atomic<uint32_t> pages{0};             // pages per layer made and usable by readers
  std::mutex keep_mu;                         // Keep's call and Release's decision, one at a time
  bool kept = false;                          // left in the daemon on release (guarded by keep_mu)
};

template <typename SessionT, typename EntryT = RegisteredSequence>
class SequenceRegistry {
 public:
  SequenceRegistry(SessionT* session, uint32_t page_tokens, uint32_t capacity_tokens)
      : session_(session), page_tokens_(page_tokens), capacity_tokens_(capacity_tokens) {}

  // Sequences not kept are released in the daemon, best effort: the session's end frees them too.
  ~SequenceRegistry() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, s] : sequences_) {
      if (!s) continue;  // a Create still in its call (none may be at destruction)
      std::lock_guard<std::mutex> keep_lock(s->keep_mu);
      if (!s->kept) static_cast<void>(session_->Release(s->daemon_id));
    }
  }

  SequenceRegistry(const SequenceRegistry&) = delete;
  SequenceRegistry& operator=(const SequenceRegistry&) = delete;

  SessionT* session() const { return session_; }
  uint32_t page_tokens() const { return page_tokens_; }
  uint32_t capacity_tokens() const { return capacity_tokens_; }

  Status Create(SequenceId sequence, const SequenceLayout& layout) {
    if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0) {
      return Status::InvalidArgument("sequence layout needs positive dimensions");
    }
    SPECACHE_RETURN_IF_ERROR(CheckHostRowFormat(layout.row_format, layout.head_dim));
    if (page_tokens_ == 0) return Status::InvalidArgument("page_tokens 0: a page holds at least one token");
    {  // reserved (a null entry) until the daemon's answer: another Create of it is refused
      std::lock_guard<std::mutex> lock(mu_);
      if (!sequences_.emplace(sequence, nullptr).second) return Status::AlreadyExists("sequence " + std::to_string(sequence));
    }
    PageLayoutSpec spec{static_cast<uint32_t>(layout.n_layers), static_cast<uint32_t>(layout.n_kv_heads),
                        static_cast<uint32_t>(layout.head_dim), page_tokens_, capacity_tokens_,
                        static_cast<uint32_t>(layout.row_format)};
    const Result<uint64_t> id = session_->CreateSequence(spec);
    std::lock_guard<std::mutex> lock(mu_);
    if (!id.ok()) {
      sequences_.erase(sequence);
      return id.status();
    }
    // In 64 bits: capacity_tokens_ + page_tokens_ wraps in 32 (a daemon that takes such a layout
    // would leave the sequence's page lists empty); page_tokens_ >= 1 checked above.
    auto s = std::make_shared<EntryT>(layout, static_cast<uint32_t>((uint64_t{capacity_tokens_} + page_tokens_ - 1) / page_tokens_));
    s->daemon_id = *id;
    sequences_[sequence] = std::move(s);
    return Status::Ok();
  }

  // Forgets the sequence here and, unless it was kept, releases it in the daemon. When the daemon
  // does not confirm the release (unreachable, say), the sequence stays known here, so that the
  // caller may release it again.
  Status Release(SequenceId sequence) {
    std::shared_ptr<EntryT> s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sequences_.find(sequence);
      if (it == sequences_.end() || !it->second) return Status::NotFound("sequence " + std::to_string(sequence));
      s = std::move(it->second);
      sequences_.erase(it);
    }
    Status released;
    {
      std::lock_guard<std::mutex> keep_lock(s->keep_mu);  // after a Keep in its call: kept
      released = s->kept ? Status::Ok() : session_->Release(s->daemon_id);
    }
    if (!released.ok() && released.code() != StatusCode::kNotFound) {
      std::lock_guard<std::mutex> lock(mu_);
      sequences_.emplace(sequence, std::move(s));
    }
    return released;
  }

  Result<uint64_t> Keep(SequenceId sequence) {
    std::shared_ptr<EntryT> s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s = EntryLocked(sequence);
    }
    if (!s) return Status::NotFound("sequence " + std::to_string(sequence) + " is not in the source");
    std::lock_guard<std::mutex> keep_lock(s->keep_mu);
    {  // released meanwhile (its Release decided before this lock): not kept
      std::lock_guard<std::mutex> lock(mu_);
      if (EntryLocked(sequence) != s) return Status::NotFound("sequence " + std::to_string(sequence) + " was released");
    }
    SPECACHE_RETURN_IF_ERROR(session_->Keep(s->daemon_id));
    s->kept = true;
    return s->daemon_id;
  }

  // The sequence's entry, held: a Release meanwhile forgets it here but frees it only once the
  // caller is done with it (a source's call on another thread, a prefetch's read, say).
  Result<std::shared_ptr<EntryT>> Find(SequenceId sequence) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<EntryT> s = EntryLocked(sequence);
    if (!s) return Status::NotFound("sequence " + std::to_string(sequence) + " is not in the source");
    return s;
  }

  Result<uint64_t> DaemonSequence(SequenceId sequence) const {
    SPECACHE_ASSIGN_OR_RETURN(const auto s, Find(sequence));
    return s->daemon_id;
  }

  // The triple's length, after checking layer and head against the layout.
  static Result<std::atomic<int32_t>*> LengthOf(EntryT* s, int layer, int kv_head) {
    if (layer < 0 || layer >= s->layout.n_layers || kv_head < 0 || kv_head >= s->layout.n_kv_heads) {
      return Status::OutOfRange("layer/head outside the sequence layout");
    }
    return &s->lengths[static_cast<size_t>(layer) * s->layout.n_kv_heads + kv_head];
  }

  Result<int32_t> Length(SequenceId sequence, int layer, int kv_head) const {
    SPECACHE_ASSIGN_OR_RETURN(const auto s, Find(sequence));
    SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, LengthOf(s.get(), layer, kv_head));
    return length->load();
  }

  // Rows are added in order: n >= 0 rows starting at the current length (`what`: the caller).
  static Status CheckNextRows(const char* what, const std::atomic<int32_t>& length, int32_t first_token, int32_t n) {
    if (n < 0) return Status::InvalidArgument("negative row count");
    if (first_token != length.load()) {
      return Status::FailedPrecondition(std::string(what) + " at token " + std::to_string(first_token) +
                                        " but the length is " + std::to_string(length.load()));
    }
    return Status::Ok();
  }

  // Every token read is one already written.
  static Status CheckWritten(const std::atomic<int32_t>& length_of, const int32_t* tokens, int32_t n) {
    const int32_t length = length_of.load(std::memory_order_acquire);
    for (int32_t i = 0; i < n; ++i) {
      if (tokens[i] < 0 || tokens[i] >= length) return Status::OutOfRange("token " + std::to_string(tokens[i]) + " not written");
    }
    return Status::Ok();
  }

  // Makes the daemon hold pages for `tokens` tokens in every layer: one Extend for all layers,
  // asking for whole pages so that the page's next tokens need no call. `on_new_pages(s, have,
  // pages)` runs under the sequence's extend lock before the new count is published, for a source
  // that must learn about pages [have, pages) before readers may use them.
  template <typename OnNewPages>
  Status EnsurePages(EntryT* s, int32_t tokens, OnNewPages on_new_pages) {
    if (static_cast<uint32_t>(tokens) > capacity_tokens_) {
      return Status::OutOfRange("sequence capacity is " + std::to_string(capacity_tokens_) + " tokens");
    }
    const auto need = static_cast<uint32_t>((uint64_t{static_cast<uint32_t>(tokens)} + page_tokens_ - 1) / page_tokens_);
    if (s->pages.load(std::memory_order_acquire) >= need) return Status::Ok();
    std::lock_guard<std::mutex> lock(s->extend_mu);
    if (s->pages.load(std::memory_order_acquire) >= need) return Status::Ok();  // another head extended
    SPECACHE_ASSIGN_OR_RETURN(uint32_t pages,
                              session_->Extend(s->daemon_id, std::min<uint32_t>(need * page_tokens_, capacity_tokens_)));
    if (pages < need) {  // the daemon's answer, not what was asked: nothing may be written there
      return Status::DataLoss("the daemon mapped " + std::to_string(pages) + " pages per layer of sequence " +
                              std::to_string(s->daemon_id) + " where " + std::to_string(need) + " were asked for");
    }
    SPECACHE_RETURN_IF_ERROR(on_new_pages(*s, s->pages.load(std::memory_order_relaxed), pages));
    s->pages.store(pages, std::memory_order_release);
    return Status::Ok();
  }
  Status EnsurePages(EntryT* s, int32_t tokens) {
    return EnsurePages(s, tokens, [](EntryT&, uint32_t, uint32_t) { return Status::Ok(); });
  }

  // Bytes of the rows written so far, over all sequences.
  int64_t stored_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t bytes = 0;
    for (const auto& [id, s] : sequences_) {
      if (!s) continue;  // being created
      for (const auto& l : s->lengths) bytes += int64_t{l.load()} * s->layout.row_bytes();
    }
    return bytes;
  }

 private:
  // The sequence's entry, or null when it is unknown or still being created.
  std::shared_ptr<EntryT> EntryLocked(SequenceId sequence) const {
    auto it = sequences_.find(sequence);
    return it == sequences_.end() ? nullptr : it->second;
  }

  SessionT* const session_;
  const uint32_t page_tokens_, capacity_tokens_;
  mutable std::mutex mu_;
  // Null while its Create waits for the daemon. Shared, so that a Keep in its call holds the entry.
  std::map<SequenceId, std::shared_ptr<EntryT>> sequences_;
};

}  // namespace specache::client
