#include "specache/daemon_source.h"

#include "sequence_registry.h"
#include "specache/shm_layout.h"

namespace specache::client {

// The agent's sources (full_precision_source.h, host_rows.h) and the daemon's pages
// (shm_layout.h) write the same geometry down apart; this source reads the daemon's pages with
// the agent's, and the client passes the agent's row format to the daemon as its number.
template <HostRowFormat kFormat, uint32_t kDaemonFormat>
constexpr bool SameGeometry() {
  constexpr SequenceLayout agent{1, 8, 128, kFormat};
  return static_cast<uint32_t>(kFormat) == kDaemonFormat &&
         agent.row_bytes() == static_cast<int64_t>(shm::RowBytes(kDaemonFormat, 128)) &&
         PageRowOffset(3, 5, 64, agent.row_bytes()) == static_cast<int64_t>(shm::RowOffsetInPage(kDaemonFormat, 3, 5, 64, 128));
}
static_assert(SameGeometry<HostRowFormat::kFp16, shm::kRowFp16>() && SameGeometry<HostRowFormat::kInt8, shm::kRowInt8>());

// A sequence whose pages are in this process's mapped chunks: [layer][page] addresses, entries
// below `pages` set. Sized once for the whole capacity: other heads read entries while one
// extends, so the vectors never reallocate.
struct MappedSequence : RegisteredSequence {
  MappedSequence(const SequenceLayout& l, uint32_t max_pages_per_layer)
      : RegisteredSequence(l, max_pages_per_layer),
        page_data(static_cast<size_t>(l.n_layers), std::vector<uint8_t*>(max_pages_per_layer, nullptr)) {}
  std::vector<std::vector<uint8_t*>> page_data;
};

class DaemonSource::HeldSession {
 public:
  explicit HeldSession(Session* session) : session_(session) {}
  Result<uint64_t> CreateSequence(const PageLayoutSpec& spec) {
    SPECACHE_ASSIGN_OR_RETURN(const uint64_t id, session_->CreateSequence(spec));
    session_->Hold(id);
    return id;
  }
  Status Release(uint64_t sequence) { return session_->ReleaseHeld(sequence); }
  Status Keep(uint64_t sequence) { return session_->KeepHeld(sequence); }
  Result<uint32_t> Extend(uint64_t sequence, uint32_t tokens) { return session_->Extend(sequence, tokens); }
  Result<uint8_t*> PageData(uint64_t sequence, uint32_t layer, uint32_t page) const {
    return session_->PageData(sequence, layer, page);
  }

 private:
  Session* session_;
};

struct DaemonSource::Registry : SequenceRegistry<DaemonSource::HeldSession, MappedSequence> {
  using SequenceRegistry::SequenceRegistry;
};

namespace {

uint8_t* RowAddress(const MappedSequence& s, uint32_t page_tokens, int layer, int kv_head, int32_t token) {
  const uint32_t page = static_cast<uint32_t>(token) / page_tokens, in_page = static_cast<uint32_t>(token) % page_tokens;
  return s.page_data[layer][page] + PageRowOffset(kv_head, static_cast<int32_t>(in_page),
                                                  static_cast<int32_t>(page_tokens), s.layout.row_bytes());
}

// The daemon's Extend makes the page for every layer; their addresses are looked up in the shared
// page table before readers may use them.
template <typename RegistryT>  // DaemonSource::Registry
Status EnsureMapped(RegistryT& registry, MappedSequence* s, int32_t tokens) {
  auto* session = registry.session();
  return registry.EnsurePages(s, tokens, [session](MappedSequence& m, uint32_t have, uint32_t pages) -> Status {
    for (int l = 0; l < m.layout.n_layers; ++l) {
      for (uint32_t p = have; p < pages && p < m.page_data[l].size(); ++p) {
        SPECACHE_ASSIGN_OR_RETURN(m.page_data[l][p], session->PageData(m.daemon_id, l, p));
      }
    }
    return Status::Ok();
  });
}

// Commits n rows at first_token to `heads` heads of one layer, whose lengths are lengths[0, heads):
// every head and the pages checked first, then all committed.
Status CommitHeads(const MappedSequence& s, uint32_t page_tokens, std::atomic<int32_t>* lengths, int heads,
                   int32_t first_token, int32_t n) {
  using Checks = SequenceRegistry<Session, MappedSequence>;  // (its static checks only)
  for (int h = 0; h < heads; ++h) SPECACHE_RETURN_IF_ERROR(Checks::CheckNextRows("commit", lengths[h], first_token, n));
  if (uint64_t{s.pages.load(std::memory_order_acquire)} * page_tokens < uint64_t(first_token) + n) {
    return Status::FailedPrecondition("commit beyond the sequence's pages (call HostPages first)");
  }
  for (int h = 0; h < heads; ++h) lengths[h].store(first_token + n, std::memory_order_release);
  return Status::Ok();
}

}  // namespace

DaemonSource::DaemonSource(Session* session, uint32_t page_tokens, uint32_t capacity_tokens)
    : session_(session),
      page_tokens_(page_tokens),
      held_(std::make_unique<HeldSession>(session)),
      registry_(std::make_unique<DaemonSource::Registry>(held_.get(), page_tokens, capacity_tokens)) {}

DaemonSource::~DaemonSource() = default;

Result<uint64_t> DaemonSource::DaemonSequence(SequenceId sequence) const { return registry_->DaemonSequence(sequence); }

Status DaemonSource::CreateSequence(SequenceId sequence, const SequenceLayout& layout) {
  return registry_->Create(sequence, layout);
}

Status DaemonSource::ReleaseSequence(SequenceId sequence) { return registry_->Release(sequence); }

Result<uint64_t> DaemonSource::Keep(SequenceId sequence) { return registry_->Keep(sequence); }

Status DaemonSource::AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                                int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * length, Registry::LengthOf(s.get(), layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckNextRows("append", *length, first_token, n));
  SPECACHE_RETURN_IF_ERROR(EnsureMapped(*registry_, s.get(), first_token + n));
  const SequenceLayout& l = s->layout;
  for (int32_t i = 0; i < n; ++i) {
    EncodeHostRows(l.row_format, rows + int64_t{i} * 2 * l.head_dim, 1, l.head_dim,
                   RowAddress(*s, page_tokens_, layer, kv_head, first_token + i));
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
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  SPECACHE_RETURN_IF_ERROR(Registry::LengthOf(s.get(), layer, 0).status());
  if (tokens < 0) return Status::InvalidArgument("negative token count");
  SPECACHE_RETURN_IF_ERROR(EnsureMapped(*registry_, s.get(), tokens));
  const auto& all = s->page_data[layer];
  pages->assign(all.begin(), all.begin() + (int64_t{tokens} + page_tokens_ - 1) / page_tokens_);  // tokens >= 0, mapped
  return Status::Ok();
}

Status DaemonSource::CommitRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * length, Registry::LengthOf(s.get(), layer, kv_head));
  return CommitHeads(*s, page_tokens_, length, 1, first_token, n);
}

Status DaemonSource::CommitLayerRows(SequenceId sequence, int layer, int n_kv_heads, int32_t first_token, int32_t n) {
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  if (n_kv_heads != s->layout.n_kv_heads) {
    return Status::InvalidArgument("commit of " + std::to_string(n_kv_heads) + " kv heads; the layout has " +
                                   std::to_string(s->layout.n_kv_heads));
  }
  SPECACHE_ASSIGN_OR_RETURN(std::atomic<int32_t> * lengths, Registry::LengthOf(s.get(), layer, 0));  // the layer's heads in a row
  return CommitHeads(*s, page_tokens_, lengths, n_kv_heads, first_token, n);
}

Status DaemonSource::ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                              Half* out) const {
  SPECACHE_ASSIGN_OR_RETURN(const auto s, registry_->Find(sequence));
  SPECACHE_ASSIGN_OR_RETURN(const std::atomic<int32_t>* length, Registry::LengthOf(s.get(), layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(Registry::CheckWritten(*length, tokens, n));
  const SequenceLayout& l = s->layout;
  for (int32_t i = 0; i < n; ++i) {
    DecodeHostRows(l.row_format, RowAddress(*s, page_tokens_, layer, kv_head, tokens[i]), 1, l.head_dim,
                   out + int64_t{i} * 2 * l.head_dim);
  }
  return Status::Ok();
}

Result<int32_t> DaemonSource::Length(SequenceId sequence, int layer, int kv_head) const {
  return registry_->Length(sequence, layer, kv_head);
}

int64_t DaemonSource::stored_bytes() const { return registry_->stored_bytes(); }

}  // namespace specache::client
