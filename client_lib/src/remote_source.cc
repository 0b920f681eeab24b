#include "specache/remote_source.h"

#include <algorithm>

#include "sequence_registry.h"
#include "specache/remote_protocol.h"

namespace specache::client {

struct RemoteSource::Registry : SequenceRegistry<RemoteSession> {
  using SequenceRegistry::SequenceRegistry;
};

RemoteSource::RemoteSource(RemoteSession* session, uint32_t page_tokens, uint32_t capacity_tokens)
    : session_(session), registry_(std::make_unique<RemoteSource::Registry>(session, page_tokens, capacity_tokens)) {}

RemoteSource::~RemoteSource() = default;

Result<uint64_t> RemoteSource::DaemonSequence(SequenceId sequence) const { return registry_->DaemonSequence(sequence); }

Result<uint64_t> RemoteSource::Keep(SequenceId sequence) { return registry_->Keep(sequence); }

Status RemoteSource::CreateSequence(SequenceId sequence, const SequenceLayout& layout) {
  return registry_->Create(sequence, layout);
}

Status RemoteSource::ReleaseSequence(SequenceId sequence) { return registry_->Release(sequence); }

Status RemoteSource::AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                                int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(RegisteredSequence * s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * length, Registry::LengthOf(s, layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckNextRows("append", *length, first_token, n));
  SPECACHE_RETURN_IF_ERROR(registry_->EnsurePages(s, first_token + n));
  // In requests of at most kMaxRowsPerRequest rows (a long prompt's prefill is more).
  const size_t row_halves = static_cast<size_t>(s->layout.row_bytes()) / sizeof(Half);
  for (int32_t done = 0; done < n;) {
    const int32_t part = std::min<int32_t>(n - done, static_cast<int32_t>(remote::kMaxRowsPerRequest));
    SPECACHE_RETURN_IF_ERROR(session_->WriteRows(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                                                 static_cast<uint32_t>(first_token + done), rows + size_t(done) * row_halves,
                                                 static_cast<size_t>(part) * static_cast<size_t>(s->layout.row_bytes())));
    done += part;
  }
  length->store(first_token + n, std::memory_order_release);
  return Status::Ok();
}

Status RemoteSource::ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                              Half* out) const {
  SPECACHE_ASSIGN_OR_RETURN(RegisteredSequence * s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, Registry::LengthOf(s, layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckWritten(*length, tokens, n));
  return session_->ReadRows(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                            std::span<const int32_t>(tokens, static_cast<size_t>(n)), out);
}

Result<uint64_t> RemoteSource::StartReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens,
                                             int32_t n, Half* out) {
  if (session_->options().method != FetchMethod::kServerGather) {
    SPECACHE_RETURN_IF_ERROR(ReadRows(sequence, layer, kv_head, tokens, n, out));
    return uint64_t{0};  // request ids start at 1: 0 is "already read"
  }
  SPECACHE_ASSIGN_OR_RETURN(RegisteredSequence * s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, Registry::LengthOf(s, layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckWritten(*length, tokens, n));
  return session_->StartRead(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                             std::span<const int32_t>(tokens, static_cast<size_t>(n)), out);
}

Status RemoteSource::FinishReadRows(uint64_t read) { return read == 0 ? Status::Ok() : session_->WaitRead(read); }

Result<int32_t> RemoteSource::Length(SequenceId sequence, int layer, int kv_head) const {
  return registry_->Length(sequence, layer, kv_head);
}

int64_t RemoteSource::stored_bytes() const { return registry_->stored_bytes(); }

}  // namespace specache::client
