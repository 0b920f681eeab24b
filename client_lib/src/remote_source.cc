#include "specache/remote_source.h"

namespace specache::client {

RemoteSource::RemoteSource(RemoteSession* session, uint32_t page_tokens, uint32_t capacity_tokens)
    : session_(session), page_tokens_(page_tokens), capacity_tokens_(capacity_tokens) {}

RemoteSource::~RemoteSource() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, s] : sequences_) {
    if (!s->kept) (void)session_->Release(s->daemon_id);  // best effort: the session's end frees it anyway
  }
}

Result<RemoteSource::Sequence*> RemoteSource::Find(SequenceId sequence) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(sequence) + " is not in the source");
  return it->second.get();
}

Result<uint64_t> RemoteSource::DaemonSequence(SequenceId sequence) const {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  return s->daemon_id;
}

Result<uint64_t> RemoteSource::Keep(SequenceId sequence) {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_RETURN_IF_ERROR(session_->Keep(s->daemon_id));
  std::lock_guard<std::mutex> lock(mu_);
  s->kept = true;
  return s->daemon_id;
}

Status RemoteSource::CreateSequence(SequenceId sequence, const SequenceLayout& layout) {
  if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0) {
    return Status::InvalidArgument("sequence layout needs positive dimensions");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sequences_.count(sequence)) return Status::AlreadyExists("sequence " + std::to_string(sequence));
  }
  PageLayoutSpec spec{static_cast<uint32_t>(layout.n_layers), static_cast<uint32_t>(layout.n_kv_heads),
                      static_cast<uint32_t>(layout.head_dim), page_tokens_, capacity_tokens_};
  SPECACHE_ASSIGN_OR_RETURN(uint64_t id, session_->CreateSequence(spec));
  auto s = std::make_unique<Sequence>();
  s->daemon_id = id;
  s->layout = layout;
  s->lengths = std::vector<std::atomic<int32_t>>(static_cast<size_t>(layout.n_layers) * layout.n_kv_heads);
  std::lock_guard<std::mutex> lock(mu_);
  sequences_[sequence] = std::move(s);
  return Status::Ok();
}

Status RemoteSource::ReleaseSequence(SequenceId sequence) {
  std::unique_ptr<Sequence> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sequences_.find(sequence);
    if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(sequence));
    s = std::move(it->second);
    sequences_.erase(it);
  }
  return s->kept ? Status::Ok() : session_->Release(s->daemon_id);
}

Result<std::atomic<int32_t>*> RemoteSource::LengthOf(Sequence* s, int layer, int kv_head) const {
  if (layer < 0 || layer >= s->layout.n_layers || kv_head < 0 || kv_head >= s->layout.n_kv_heads) {
    return Status::OutOfRange("layer/head outside the sequence layout");
  }
  return &s->lengths[static_cast<size_t>(layer) * s->layout.n_kv_heads + kv_head];
}

Status RemoteSource::EnsurePages(Sequence* s, int32_t tokens) {
  if (static_cast<uint32_t>(tokens) > capacity_tokens_) {
    return Status::OutOfRange("sequence capacity is " + std::to_string(capacity_tokens_) + " tokens");
  }
  const uint32_t need = (static_cast<uint32_t>(tokens) + page_tokens_ - 1) / page_tokens_;
  if (s->pages.load(std::memory_order_acquire) >= need) return Status::Ok();
  std::lock_guard<std::mutex> lock(s->extend_mu);
  if (s->pages.load(std::memory_order_acquire) >= need) return Status::Ok();  // another head extended
  // Whole pages: the next tokens of this page need no call.
  SPECACHE_ASSIGN_OR_RETURN(uint32_t pages,
                            session_->Extend(s->daemon_id, std::min<uint32_t>(need * page_tokens_, capacity_tokens_)));
  s->pages.store(pages, std::memory_order_release);
  return Status::Ok();
}

Status RemoteSource::AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                                int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * length, LengthOf(s, layer, kv_head));
  if (n < 0) return Status::InvalidArgument("negative row count");
  if (first_token != length->load()) {
    return Status::FailedPrecondition("append at token " + std::to_string(first_token) + " but the length is " +
                                      std::to_string(length->load()));
  }
  SPECACHE_RETURN_IF_ERROR(EnsurePages(s, first_token + n));
  SPECACHE_RETURN_IF_ERROR(session_->WriteRows(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                                               static_cast<uint32_t>(first_token), rows,
                                               static_cast<size_t>(n) * static_cast<size_t>(s->layout.row_bytes())));
  length->store(first_token + n, std::memory_order_release);
  return Status::Ok();
}

Status RemoteSource::ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                              Half* out) const {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length_of, LengthOf(s, layer, kv_head));
  const int32_t length = length_of->load(std::memory_order_acquire);
  for (int32_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= length) return Status::OutOfRange("token " + std::to_string(tokens[i]) + " not written");
  }
  return session_->ReadRows(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                            std::span<const int32_t>(tokens, static_cast<size_t>(n)), out);
}

Result<uint64_t> RemoteSource::StartReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens,
                                             int32_t n, Half* out) {
  if (session_->options().method != FetchMethod::kServerGather) {
    SPECACHE_RETURN_IF_ERROR(ReadRows(sequence, layer, kv_head, tokens, n, out));
    return uint64_t{0};  // request ids start at 1: 0 is "already read"
  }
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length_of, LengthOf(s, layer, kv_head));
  const int32_t length = length_of->load(std::memory_order_acquire);
  for (int32_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= length) return Status::OutOfRange("token " + std::to_string(tokens[i]) + " not written");
  }
  return session_->StartRead(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                             std::span<const int32_t>(tokens, static_cast<size_t>(n)), out);
}

Status RemoteSource::FinishReadRows(uint64_t read) { return read == 0 ? Status::Ok() : session_->WaitRead(read); }

Result<int32_t> RemoteSource::Length(SequenceId sequence, int layer, int kv_head) const {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, LengthOf(s, layer, kv_head));
  return length->load();
}

int64_t RemoteSource::stored_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t bytes = 0;
  for (const auto& [id, s] : sequences_) {
    for (const auto& l : s->lengths) bytes += int64_t{l.load()} * s->layout.row_bytes();
  }
  return bytes;
}

}  // namespace specache::client
