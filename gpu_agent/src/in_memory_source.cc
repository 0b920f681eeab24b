#include "specache/in_memory_source.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>

namespace specache {
namespace {

constexpr size_t kAlign = 4096;
constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

InMemorySource::InMemorySource(int32_t page_tokens, size_t slab_bytes, bool huge_pages)
    : page_tokens_(std::max<int32_t>(page_tokens, 1)), slab_bytes_(slab_bytes), huge_pages_(huge_pages) {}

InMemorySource::~InMemorySource() {
  for (const HostRegion& r : slabs_) std::free(r.base);
}

Status InMemorySource::CreateSequence(SequenceId sequence, const SequenceLayout& layout) {
  if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0) {
    return Status::InvalidArgument("sequence layout needs positive n_layers, n_kv_heads and head_dim");
  }
  SPECACHE_RETURN_IF_ERROR(CheckHostRowFormat(layout.row_format, layout.head_dim));
  if (page_tokens_ > kMaxPageTokens) {
    return Status::InvalidArgument("page_tokens " + std::to_string(page_tokens_) + ": at most " +
                                   std::to_string(kMaxPageTokens) + " (the daemon's pages' bound)");
  }
  std::unique_lock lock(mutex_);
  if (sequences_.count(sequence)) {
    return Status::AlreadyExists("sequence " + std::to_string(sequence) + " already exists");
  }
  auto seq = std::make_unique<Sequence>();
  seq->layout = layout;
  seq->page_bytes = PageBytes(layout);
  seq->pages.resize(layout.n_layers);
  seq->lengths.assign(static_cast<size_t>(layout.n_layers) * layout.n_kv_heads, 0);
  sequences_.emplace(sequence, std::move(seq));
  return Status::Ok();
}

Status InMemorySource::ReleaseSequence(SequenceId sequence) {
  std::unique_lock lock(mutex_);
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(sequence) + " does not exist");
  auto& free = free_pages_[it->second->page_bytes];
  for (const auto& layer : it->second->pages) free.insert(free.end(), layer.begin(), layer.end());
  sequences_.erase(it);
  return Status::Ok();
}

Result<InMemorySource::Sequence*> InMemorySource::Find(SequenceId sequence, int layer, int kv_head) const {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(sequence) + " does not exist");
  const SequenceLayout& l = it->second->layout;
  if (layer < 0 || layer >= l.n_layers || kv_head < 0 || kv_head >= l.n_kv_heads) {
    return Status::OutOfRange("layer " + std::to_string(layer) + " / kv head " + std::to_string(kv_head) +
                              " outside the layout (" + std::to_string(l.n_layers) + " layers, " +
                              std::to_string(l.n_kv_heads) + " kv heads)");
  }
  return it->second.get();
}

size_t InMemorySource::PageBytes(const SequenceLayout& layout) const {
  return static_cast<size_t>(layout.n_kv_heads) * page_tokens_ * static_cast<size_t>(layout.row_bytes());
}

void InMemorySource::AddSlabLocked(size_t page_bytes) {
  const size_t least = std::max(slab_bytes_, page_bytes);
  const size_t align = huge_pages_ && least >= kHugePage ? kHugePage : kAlign;
  // A slab size within an alignment of SIZE_MAX would round up to 0 bytes (no page, then a page
  // taken from an empty list): no memory holds it anyway.
  if (least > std::numeric_limits<size_t>::max() - (align - 1)) throw std::bad_alloc();
  const size_t bytes = (least + align - 1) / align * align;
  auto* slab = static_cast<uint8_t*>(std::aligned_alloc(align, bytes));
  if (slab == nullptr) throw std::bad_alloc();
  // Before any page is touched, so that the first touch faults in huge pages.
  if (align == kHugePage) (void)madvise(slab, bytes, MADV_HUGEPAGE);
  slabs_.push_back({slab, bytes});
  auto& free = free_pages_[page_bytes];
  for (size_t at = bytes / page_bytes; at-- > 0;) free.push_back(slab + at * page_bytes);
}

void InMemorySource::Reserve(const SequenceLayout& layout, int sequences, int32_t tokens) {
  const size_t page_bytes = PageBytes(layout);
  if (page_bytes == 0 || sequences <= 0 || tokens <= 0) return;
  const int64_t pages = PagesFor(tokens) * layout.n_layers * sequences;
  std::unique_lock lock(mutex_);
  while (static_cast<int64_t>(free_pages_[page_bytes].size()) < pages) AddSlabLocked(page_bytes);
}

void InMemorySource::GrowLocked(Sequence* seq, int32_t tokens) {
  const int64_t need = PagesFor(tokens);
  auto& free = free_pages_[seq->page_bytes];
  for (auto& layer : seq->pages) {
    while (static_cast<int64_t>(layer.size()) < need) {
      if (free.empty()) AddSlabLocked(seq->page_bytes);
      layer.push_back(free.back());
      free.pop_back();
    }
  }
}

Status InMemorySource::EnsurePages(Sequence* seq, int32_t tokens, std::shared_lock<std::shared_mutex>* lock) {
  if (int64_t{PagesOf(*seq)} * page_tokens_ >= tokens) return Status::Ok();
  // Growing changes the page lists other threads read: take the lock exclusively. The sequence
  // cannot go away meanwhile (its owner is the caller's agent, which is inside this call).
  lock->unlock();
  bool grown = true;
  {
    std::unique_lock exclusive(mutex_);
    try {
      GrowLocked(seq, tokens);
    } catch (const std::bad_alloc&) {
      grown = false;  // the shared lock is taken back below, once the exclusive one is let go
    }
  }
  lock->lock();
  return grown ? Status::Ok() : Status::ResourceExhausted("no host memory for another page");
}

uint8_t* InMemorySource::RowAddress(const Sequence& seq, int layer, int kv_head, int32_t token) const {
  const int32_t page = token / page_tokens_, in_page = token % page_tokens_;
  return seq.pages[layer][page] + PageRowOffset(kv_head, in_page, page_tokens_, seq.layout.row_bytes());
}

Status InMemorySource::CheckAppend(const Sequence& seq, int layer, int kv_head, int32_t first_token, int32_t n) {
  if (n < 0) return Status::InvalidArgument("negative row count");
  const int32_t length = seq.lengths[static_cast<size_t>(layer) * seq.layout.n_kv_heads + kv_head];
  if (first_token != length) {
    return Status::FailedPrecondition("append at token " + std::to_string(first_token) + " but " +
                                      std::to_string(length) + " rows are written");
  }
  return Status::Ok();
}

Status InMemorySource::AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                                  int32_t n) {
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(Sequence * seq, Find(sequence, layer, kv_head));
  SPECACHE_RETURN_IF_ERROR(CheckAppend(*seq, layer, kv_head, first_token, n));
  SPECACHE_RETURN_IF_ERROR(EnsurePages(seq, first_token + n, &lock));
  const SequenceLayout& l = seq->layout;
  for (int32_t i = 0; i < n; ++i) {
    EncodeHostRows(l.row_format, rows + int64_t{i} * 2 * l.head_dim, 1, l.head_dim, RowAddress(*seq, layer, kv_head, first_token + i));
  }
  seq->lengths[static_cast<size_t>(layer) * seq->layout.n_kv_heads + kv_head] = first_token + n;
  return Status::Ok();
}

Status InMemorySource::ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                                Half* out) const {
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(const Sequence* seq, Find(sequence, layer, kv_head));
  const int32_t length = seq->lengths[static_cast<size_t>(layer) * seq->layout.n_kv_heads + kv_head];
  const SequenceLayout& l = seq->layout;
  for (int32_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= length) {
      return Status::OutOfRange("token " + std::to_string(tokens[i]) + " not written (length " +
                                std::to_string(length) + ")");
    }
    DecodeHostRows(l.row_format, RowAddress(*seq, layer, kv_head, tokens[i]), 1, l.head_dim, out + int64_t{i} * 2 * l.head_dim);
  }
  return Status::Ok();
}

Result<int32_t> InMemorySource::Length(SequenceId sequence, int layer, int kv_head) const {
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(const Sequence* seq, Find(sequence, layer, kv_head));
  return seq->lengths[static_cast<size_t>(layer) * seq->layout.n_kv_heads + kv_head];
}

int64_t InMemorySource::stored_bytes() const {
  std::shared_lock lock(mutex_);
  int64_t bytes = 0;
  for (const auto& [id, seq] : sequences_) {
    for (int32_t length : seq->lengths) bytes += int64_t{length} * seq->layout.row_bytes();
  }
  return bytes;
}

std::vector<HostRegion> InMemorySource::host_regions() const {
  std::shared_lock lock(mutex_);
  return slabs_;
}

HostMapping InMemorySource::mapping() const {
  std::vector<MemoryRange> ranges;
  for (const HostRegion& r : host_regions()) ranges.push_back({r.base, r.bytes});
  return MappedBytes(ranges);
}

Status InMemorySource::HostPages(SequenceId sequence, int layer, int32_t tokens, std::vector<uint8_t*>* pages) {
  if (tokens < 0) return Status::InvalidArgument("negative token count");
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(Sequence * seq, Find(sequence, layer, 0));
  SPECACHE_RETURN_IF_ERROR(EnsurePages(seq, tokens, &lock));
  const auto& all = seq->pages[layer];
  pages->assign(all.begin(), all.begin() + PagesFor(tokens));
  return Status::Ok();
}

Status InMemorySource::CommitHeadsLocked(Sequence* seq, int layer, int first_head, int heads, int32_t first_token,
                                         int32_t n) const {
  for (int h = first_head; h < first_head + heads; ++h) SPECACHE_RETURN_IF_ERROR(CheckAppend(*seq, layer, h, first_token, n));
  if (int64_t{PagesOf(*seq)} * page_tokens_ < int64_t{first_token} + n) {
    return Status::FailedPrecondition("commit beyond the sequence's pages (call HostPages first)");
  }
  int32_t* lengths = seq->lengths.data() + static_cast<size_t>(layer) * seq->layout.n_kv_heads;
  for (int h = first_head; h < first_head + heads; ++h) lengths[h] = first_token + n;
  return Status::Ok();
}

Status InMemorySource::CommitRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, int32_t n) {
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(Sequence * seq, Find(sequence, layer, kv_head));
  return CommitHeadsLocked(seq, layer, kv_head, 1, first_token, n);
}

Status InMemorySource::CommitLayerRows(SequenceId sequence, int layer, int n_kv_heads, int32_t first_token, int32_t n) {
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(Sequence * seq, Find(sequence, layer, 0));
  if (n_kv_heads != seq->layout.n_kv_heads) {
    return Status::InvalidArgument("commit of " + std::to_string(n_kv_heads) + " kv heads; the layout has " +
                                   std::to_string(seq->layout.n_kv_heads));
  }
  return CommitHeadsLocked(seq, layer, 0, n_kv_heads, first_token, n);
}

}  // namespace specache
