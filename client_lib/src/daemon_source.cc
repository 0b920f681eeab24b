#include "specache/daemon_source.h"

#include <cstring>

namespace specache::client {

DaemonSource::DaemonSource(Session* session, uint32_t page_tokens, uint32_t capacity_tokens)
    : session_(session), page_tokens_(page_tokens), capacity_tokens_(capacity_tokens) {}

DaemonSource::~DaemonSource() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, s] : sequences_) {
    if (!s->kept) (void)session_->Release(s->daemon_id);  // best effort
  }
}

Result<DaemonSource::Sequence*> DaemonSource::Find(SequenceId sequence) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(sequence) + " is not in the source");
  return it->second.get();
}

Result<uint64_t> DaemonSource::DaemonSequence(SequenceId sequence) const {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  return s->daemon_id;
}

Status DaemonSource::CreateSequence(SequenceId sequence, const SequenceLayout& layout) {
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
  // Sized once: other heads read entries while one extends, so the vectors never reallocate.
  s->pages.assign(layout.n_layers, std::vector<uint8_t*>((capacity_tokens_ + page_tokens_ - 1) / page_tokens_, nullptr));
  std::lock_guard<std::mutex> lock(mu_);
  sequences_[sequence] = std::move(s);
  return Status::Ok();
}

Status DaemonSource::ReleaseSequence(SequenceId sequence) {
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

Result<uint64_t> DaemonSource::Keep(SequenceId sequence) {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_RETURN_IF_ERROR(session_->Keep(s->daemon_id));
  std::lock_guard<std::mutex> lock(mu_);
  s->kept = true;
  return s->daemon_id;
}

Status DaemonSource::EnsurePages(Sequence* s, int32_t tokens) {
  const uint32_t need = (static_cast<uint32_t>(tokens) + page_tokens_ - 1) / page_tokens_;
  if (s->published_pages.load(std::memory_order_acquire) >= need) return Status::Ok();
  std::lock_guard<std::mutex> lock(s->extend_mu);
  if (s->published_pages.load(std::memory_order_acquire) >= need) return Status::Ok();  // another head extended
  // One RPC makes the page for every layer; ask for the whole page so the next tokens need none.
  const uint32_t want_tokens = std::min<uint32_t>(need * page_tokens_, capacity_tokens_);
  if (static_cast<uint32_t>(tokens) > capacity_tokens_) {
    return Status::OutOfRange("sequence capacity is " + std::to_string(capacity_tokens_) + " tokens");
  }
  SPECACHE_ASSIGN_OR_RETURN(uint32_t pages, session_->Extend(s->daemon_id, want_tokens));
  const uint32_t have = s->published_pages.load(std::memory_order_relaxed);
  for (int l = 0; l < s->layout.n_layers; ++l) {
    for (uint32_t p = have; p < pages && p < s->pages[l].size(); ++p) {
      SPECACHE_ASSIGN_OR_RETURN(s->pages[l][p], session_->PageData(s->daemon_id, l, p));
    }
  }
  s->published_pages.store(pages, std::memory_order_release);
  return Status::Ok();
}

uint8_t* DaemonSource::RowAddress(const Sequence& s, int layer, int kv_head, int32_t token) const {
  // Page layout [kv_head][token][K|V][head_dim] fp16.
  const uint64_t row_bytes = static_cast<uint64_t>(s.layout.row_bytes());
  const uint32_t page = static_cast<uint32_t>(token) / page_tokens_, in_page = static_cast<uint32_t>(token) % page_tokens_;
  return s.pages[layer][page] + (uint64_t{static_cast<uint32_t>(kv_head)} * page_tokens_ + in_page) * row_bytes;
}

Status DaemonSource::CheckNextRows(const char* what, const std::atomic<int32_t>& length, int32_t first_token,
                                   int32_t n) {
  if (n < 0) return Status::InvalidArgument("negative row count");
  if (first_token != length.load()) {
    return Status::FailedPrecondition(std::string(what) + " at token " + std::to_string(first_token) +
                                      " but the length is " + std::to_string(length.load()));
  }
  return Status::Ok();
}

Result<std::atomic<int32_t>*> DaemonSource::LengthOf(Sequence* s, int layer, int kv_head) const {
  if (layer < 0 || layer >= s->layout.n_layers || kv_head < 0 || kv_head >= s->layout.n_kv_heads) {
    return Status::OutOfRange("layer/head outside the sequence layout");
  }
  return &s->lengths[static_cast<size_t>(layer) * s->layout.n_kv_heads + kv_head];
}

Status DaemonSource::AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                                int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * length, LengthOf(s, layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(CheckNextRows("append", *length, first_token, n));
  SPECACHE_RETURN_IF_ERROR(EnsurePages(s, first_token + n));
  const size_t row_bytes = static_cast<size_t>(s->layout.row_bytes());
  for (int32_t i = 0; i < n; ++i) {
    std::memcpy(RowAddress(*s, layer, kv_head, first_token + i), rows + i * row_bytes / sizeof(Half), row_bytes);
  }
  length->store(first_token + n, std::memory_order_release);
  return Status::Ok();
}

std::vector<HostRegion> DaemonSource::host_regions() const {
  std::vector<HostRegion> regions;
  for (uint32_t i = 0; i < session_->chunk_count(); ++i) regions.push_back({session_->chunk_data(i), session_->chunk_bytes()});
  return regions;
}

Status DaemonSource::HostPages(SequenceId sequence, int layer, int32_t tokens, std::vector<uint8_t*>* pages) {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_RETURN_IF_ERROR(LengthOf(s, layer, 0).status());
  if (tokens < 0) return Status::InvalidArgument("negative token count");
  SPECACHE_RETURN_IF_ERROR(EnsurePages(s, tokens));
  const auto& all = s->pages[layer];
  pages->assign(all.begin(), all.begin() + (static_cast<uint32_t>(tokens) + page_tokens_ - 1) / page_tokens_);
  return Status::Ok();
}

Status DaemonSource::CommitRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * length, LengthOf(s, layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(CheckNextRows("commit", *length, first_token, n));
  if (uint64_t{s->published_pages.load(std::memory_order_acquire)} * page_tokens_ < uint64_t(first_token) + n) {
    return Status::FailedPrecondition("commit beyond the sequence's pages (call HostPages first)");
  }
  length->store(first_token + n, std::memory_order_release);
  return Status::Ok();
}

Status DaemonSource::ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                              Half* out) const {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length_of, LengthOf(s, layer, kv_head));
  const int32_t length = length_of->load(std::memory_order_acquire);
  const size_t row_bytes = static_cast<size_t>(s->layout.row_bytes());
  for (int32_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= length) return Status::OutOfRange("token " + std::to_string(tokens[i]) + " not written");
    std::memcpy(out + i * row_bytes / sizeof(Half), RowAddress(*s, layer, kv_head, tokens[i]), row_bytes);
  }
  return Status::Ok();
}

Result<int32_t> DaemonSource::Length(SequenceId sequence, int layer, int kv_head) const {
  SPECACHE_ASSIGN_OR_RETURN(Sequence * s, Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, LengthOf(s, layer, kv_head));
  return length->load();
}

int64_t DaemonSource::stored_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t bytes = 0;
  for (const auto& [id, s] : sequences_) {
    for (const auto& l : s->lengths) bytes += int64_t{l.load()} * s->layout.row_bytes();
  }
  return bytes;
}

}  // namespace specache::client
