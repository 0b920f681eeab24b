#include "attached_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "specache/chunk_mapping.h"

namespace specache::client {

// A sequence's geometry (client.h) is the daemon's pages' (shm_layout.h): here, beside the mapped
// pages that follow it.
uint64_t PageLayoutSpec::row_bytes() const { return shm::RowBytes(row_format, head_dim); }
uint64_t PageLayoutSpec::page_bytes() const { return shm::PageBytes(row_format, n_kv_heads, page_tokens, head_dim); }
namespace {

// A descriptor the daemon passed: at least `bytes` long and sealed against shrinking.
Status CheckSealedFile(int fd, uint64_t bytes, const char* what) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    return Status::DataLoss(std::string("attach: the ") + what + " is smaller than the daemon says");
  }
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return Status::DataLoss(std::string("attach: the ") + what + " is not sealed against shrinking");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<AttachedPages>> AttachedPages::Map(const attach::AttachReply& reply, std::span<const int> fds,
                                                          uint32_t expected_chunks) {
  if (fds.size() != size_t{expected_chunks} + 1) return Status::DataLoss("attach: chunk count differs from OpenSession's");
  if (reply.table_bytes == 0) return Status::DataLoss("attach: a page table of zero bytes");
  if (expected_chunks > 0 && reply.chunk_bytes == 0) return Status::DataLoss("attach: chunks of zero bytes");
  SPECACHE_RETURN_IF_ERROR(CheckSealedFile(fds[0], reply.table_bytes, "page table"));
  for (size_t i = 1; i < fds.size(); ++i) SPECACHE_RETURN_IF_ERROR(CheckSealedFile(fds[i], reply.chunk_bytes, "chunk"));
  std::unique_ptr<AttachedPages> p(new AttachedPages());
  void* t = mmap(nullptr, reply.table_bytes, PROT_READ, MAP_SHARED, fds[0], 0);
  if (t == MAP_FAILED) return Status::ResourceExhausted("mmap page table: " + std::string(std::strerror(errno)));
  p->table_ = static_cast<const uint8_t*>(t);
  p->table_bytes_ = reply.table_bytes;
  SPECACHE_ASSIGN_OR_RETURN(p->counts_, shm::ReadTable(p->table_, p->table_bytes_));
  if (p->counts_.chunk_count != expected_chunks || p->counts_.chunk_bytes != reply.chunk_bytes) {
    return Status::DataLoss("page table header disagrees with the attach reply");
  }
  p->refs_ = shm::Refs(p->table_, p->counts_.slot_count);
  p->chunk_bytes_ = reply.chunk_bytes;
  p->chunks_.reserve(expected_chunks);
  for (size_t i = 1; i < fds.size(); ++i) {
    void* c = MapChunk(fds[i], p->chunk_bytes_, /*huge=*/true);  // as the daemon maps it (chunk_mapping.h)
    if (c == MAP_FAILED) return Status::ResourceExhausted("mmap chunk: " + std::string(std::strerror(errno)));
    p->chunks_.push_back(static_cast<uint8_t*>(c));
  }
  return p;
}

AttachedPages::~AttachedPages() {
  for (uint8_t* c : chunks_) munmap(c, chunk_bytes_);
  if (table_) munmap(const_cast<uint8_t*>(table_), table_bytes_);
}

Status AttachedPages::AddSlot(uint64_t sequence, uint32_t slot, const PageLayoutSpec& want) {
  if (slot >= counts_.slot_count) return Status::DataLoss("daemon gave a bad table slot");
  // The slot's fields read once and checked together (the copy alone is used: SlotView).
  SPECACHE_ASSIGN_OR_RETURN(const shm::SlotFields s, shm::ReadSlot(table_, counts_, slot, true));
  const SlotView v{slot, s.n_layers, s.page_tokens, s.pages_capacity_per_layer, s.first_ref, s.page_bytes};
  const uint32_t want_capacity =
      want.page_tokens ? static_cast<uint32_t>((uint64_t{want.capacity_tokens} + want.page_tokens - 1) / want.page_tokens)
                       : 0;
  if (s.sequence_id != sequence || v.n_layers != want.n_layers || s.n_kv_heads != want.n_kv_heads ||
      s.head_dim != want.head_dim || v.page_tokens != want.page_tokens || v.capacity != want_capacity ||
      s.row_format != want.row_format || v.page_bytes != want.page_bytes()) {
    return Status::DataLoss("the daemon's page table slot " + std::to_string(slot) + " does not describe sequence " +
                            std::to_string(sequence) + " with the layout asked for");
  }
  std::lock_guard<std::mutex> lock(mu_);
  slots_[sequence] = v;
  return Status::Ok();
}

void AttachedPages::Forget(uint64_t sequence) {
  std::lock_guard<std::mutex> lock(mu_);
  slots_.erase(sequence);
}

Result<AttachedPages::SlotView> AttachedPages::SlotOf(uint64_t sequence) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(sequence);
  if (it == slots_.end()) return Status::NotFound("sequence " + std::to_string(sequence) + " is not in this session");
  return it->second;
}

uint32_t AttachedPages::LivePages(const SlotView& v) const {
  return std::min(shm::Slots(table_)[v.slot].pages_per_layer.load(std::memory_order_acquire), v.capacity);
}

Status AttachedPages::Recheck(const SlotView& v) const { return shm::ValidateSlot(table_, counts_, v.slot, true); }

Result<uint8_t*> AttachedPages::PageData(uint64_t sequence, uint32_t layer, uint32_t page) const {
  SPECACHE_ASSIGN_OR_RETURN(const SlotView v, SlotOf(sequence));
  const shm::SequenceSlot& s = shm::Slots(table_)[v.slot];
  if (s.state.load(std::memory_order_acquire) != shm::kSlotLive || s.sequence_id != sequence) {
    return Status::NotFound("sequence " + std::to_string(sequence) + " is no longer in the page table");
  }
  if (layer >= v.n_layers) return Status::OutOfRange("layer " + std::to_string(layer));
  if (page >= LivePages(v)) return Status::OutOfRange("page " + std::to_string(page) + " not mapped yet (Extend first)");
  // Inside the table: AddSlot checked first_ref + n_layers x capacity against its refs. The ref
  // read once (the daemon rewrites it when the sequence is released and its refs reused), checked,
  // then used as read.
  const shm::PageRef& shared = refs_[size_t{v.first_ref} + size_t{layer} * v.capacity + page];
  const uint32_t chunk = shm::ReadOnce(shared.chunk);
  const uint64_t offset = shm::ReadOnce(shared.offset);
  if (chunk >= chunks_.size() || offset > chunk_bytes_ || chunk_bytes_ - offset < v.page_bytes) {
    return Status::DataLoss("page table entry outside the chunks");
  }
  return chunks_[chunk] + offset;
}

}  // namespace specache::client
