#include "specache/remote_source.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "sequence_registry.h"
#include "specache/remote_protocol.h"

namespace specache::client {

struct RemoteSource::Registry : SequenceRegistry<RemoteSession> {
  using SequenceRegistry::SequenceRegistry;
};

// A read lands the stored rows at the front of the caller's fp16 buffer; rows of another format
// than fp16 are decoded there in place once they are all in (DecodeHostRows).
struct RemoteSource::PendingReads {
  struct Read {
    Half* out;
    int32_t n;
    SequenceLayout layout;
  };
  std::mutex mu;
  std::unordered_map<uint64_t, Read> reads;  // by the session's read id
};

namespace {

void DecodeLanded(const SequenceLayout& l, Half* out, int32_t n) {
  if (l.row_format != HostRowFormat::kFp16) DecodeHostRows(l.row_format, reinterpret_cast<const uint8_t*>(out), n, l.head_dim, out);
}

}  // namespace

RemoteSource::RemoteSource(RemoteSession* session, uint32_t page_tokens, uint32_t capacity_tokens)
    : session_(session),
      registry_(std::make_unique<RemoteSource::Registry>(session, page_tokens, capacity_tokens)),
      pending_(std::make_unique<PendingReads>()) {}

RemoteSource::~RemoteSource() = default;

Result<uint64_t> RemoteSource::DaemonSequence(SequenceId sequence) const { return registry_->DaemonSequence(sequence); }

Result<uint64_t> RemoteSource::Keep(SequenceId sequence) { return registry_->Keep(sequence); }

Status RemoteSource::CreateSequence(SequenceId sequence, const SequenceLayout& layout) {
  return registry_->Create(sequence, layout);
}

Status RemoteSource::ReleaseSequence(SequenceId sequence) { return registry_->Release(sequence); }

Status RemoteSource::AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                                int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * length, Registry::LengthOf(s.get(), layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckNextRows("append", *length, first_token, n));
  SPECACHE_RETURN_IF_ERROR(registry_->EnsurePages(s.get(), first_token + n));
  // In requests of at most kMaxRowsPerRequest rows (a long prompt's prefill is more), each
  // stored in the sequence's row format first (fp16 rows go as they are).
  const SequenceLayout& l = s->layout;
  const int64_t row_bytes = l.row_bytes();
  std::vector<uint8_t> stored;
  for (int32_t done = 0; done < n;) {
    const int32_t part = std::min<int32_t>(n - done, static_cast<int32_t>(remote::kMaxRowsPerRequest));
    const Half* from = rows + int64_t{done} * 2 * l.head_dim;
    const void* bytes = from;
    if (l.row_format != HostRowFormat::kFp16) {
      stored.resize(static_cast<size_t>(part * row_bytes));
      EncodeHostRows(l.row_format, from, part, l.head_dim, stored.data());
      bytes = stored.data();
    }
    SPECACHE_RETURN_IF_ERROR(session_->WriteRows(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                                                 static_cast<uint32_t>(first_token + done), bytes,
                                                 static_cast<size_t>(part * row_bytes)));
    done += part;
  }
  length->store(first_token + n, std::memory_order_release);
  return Status::Ok();
}

Status RemoteSource::ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                              Half* out) const {
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, Registry::LengthOf(s.get(), layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckWritten(*length, tokens, n));
  SPECACHE_RETURN_IF_ERROR(session_->ReadRows(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                                              std::span<const int32_t>(tokens, static_cast<size_t>(n)), out));
  DecodeLanded(s->layout, out, n);
  return Status::Ok();
}

Result<uint64_t> RemoteSource::StartReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens,
                                             int32_t n, Half* out) {
  if (session_->options().method != FetchMethod::kServerGather) {
    SPECACHE_RETURN_IF_ERROR(ReadRows(sequence, layer, kv_head, tokens, n, out));
    return uint64_t{0};  // request ids start at 1: 0 is "already read"
  }
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, Registry::LengthOf(s.get(), layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckWritten(*length, tokens, n));
  SPECACHE_ASSIGN_OR_RETURN(const uint64_t read,
                            session_->StartRead(s->daemon_id, static_cast<uint32_t>(layer), static_cast<uint32_t>(kv_head),
                                                std::span<const int32_t>(tokens, static_cast<size_t>(n)), out));
  if (s->layout.row_format != HostRowFormat::kFp16) {
    std::lock_guard<std::mutex> lock(pending_->mu);
    pending_->reads[read] = {out, n, s->layout};
  }
  return read;
}

Status RemoteSource::FinishReadRows(uint64_t read) {
  if (read == 0) return Status::Ok();
  const Status done = session_->WaitRead(read);
  std::optional<PendingReads::Read> landed;
  {
    std::lock_guard<std::mutex> lock(pending_->mu);
    if (auto it = pending_->reads.find(read); it != pending_->reads.end()) {
      landed = it->second;
      pending_->reads.erase(it);
    }
  }
  if (done.ok() && landed) DecodeLanded(landed->layout, landed->out, landed->n);
  return done;
}

Result<int32_t> RemoteSource::Length(SequenceId sequence, int layer, int kv_head) const {
  return registry_->Length(sequence, layer, kv_head);
}

int64_t RemoteSource::stored_bytes() const { return registry_->stored_bytes(); }

}  // namespace specache::client
