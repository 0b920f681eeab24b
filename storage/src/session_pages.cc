#include "specache/session_pages.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace specache {
namespace {

constexpr uint64_t kUnit = 4096;  // page placement granularity inside a chunk

uint64_t Units(uint64_t bytes) { return (bytes + kUnit - 1) / kUnit; }

}  // namespace

Status ValidatePageLayout(const PageLayout& l, uint64_t chunk_bytes) {
  auto bad = [](const std::string& what) { return Status::InvalidArgument("sequence layout: " + what); };
  if (l.n_layers == 0 || l.n_layers > 1024) return bad("n_layers must be in [1, 1024]");
  if (l.n_kv_heads == 0 || l.n_kv_heads > 1024) return bad("n_kv_heads must be in [1, 1024]");
  if (l.head_dim == 0 || l.head_dim > 1024 || l.head_dim % 8 != 0) return bad("head_dim must be a multiple of 8 in [8, 1024]");
  if (l.page_tokens == 0 || l.page_tokens > 65536) return bad("page_tokens must be in [1, 65536]");
  if (l.capacity_tokens == 0 || l.capacity_tokens > (1u << 24)) return bad("capacity_tokens must be in [1, 16M]");
  if (!shm::KnownRowFormat(l.row_format)) return bad("row format (dtype) must be 0 (fp16) or 1 (int8)");
  if (l.page_bytes() > chunk_bytes) {
    return bad("a page of " + std::to_string(l.page_bytes()) + " bytes does not fit a chunk of " +
               std::to_string(chunk_bytes));
  }
  return Status::Ok();
}

Result<std::unique_ptr<SessionPages>> SessionPages::Create(uint64_t session_id, ChunkPool* pool,
                                                           std::vector<uint32_t> chunks, const Limits& limits) {
  std::unique_ptr<SessionPages> s(new SessionPages());
  s->pool_ = pool;
  s->chunks_ = std::move(chunks);
  for (size_t i = 0; i < s->chunks_.size(); ++i) s->chunk_space_.emplace_back(pool->chunk_bytes() / kUnit);
  s->refs_ = ExtentAllocator(limits.max_page_refs);
  s->slot_used_.assign(limits.max_sequences, false);
  s->table_bytes_ = (shm::TableBytes(limits.max_sequences, limits.max_page_refs) + kUnit - 1) / kUnit * kUnit;

  s->table_fd_ = memfd_create("specache-table", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (s->table_fd_ < 0) return Status::ResourceExhausted(std::string("memfd_create table: ") + std::strerror(errno));
  if (ftruncate(s->table_fd_, static_cast<off_t>(s->table_bytes_)) != 0) {
    return Status::ResourceExhausted(std::string("ftruncate table: ") + std::strerror(errno));
  }
  void* p = mmap(nullptr, s->table_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, s->table_fd_, 0);
  if (p == MAP_FAILED) return Status::ResourceExhausted(std::string("mmap table: ") + std::strerror(errno));
  s->table_ = static_cast<uint8_t*>(p);
  // Clients may map the table, but not for writing (existing daemon mapping stays writable). A
  // kernel without F_SEAL_FUTURE_WRITE (before 5.1) refuses the three together: then at least its
  // size is sealed (clients check that before they map it); the table stays writable by its own
  // session's client, which is all it could spoil.
  if (fcntl(s->table_fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE) != 0) {
    if (fcntl(s->table_fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
      return Status::Unavailable(std::string("sealing the page table: ") + std::strerror(errno));
    }
    s->write_sealed_ = false;
  }

  auto* h = new (s->table_) shm::TableHeader{};
  h->magic = shm::kTableMagic;
  h->version = shm::kTableVersion;
  h->header_bytes = sizeof(shm::TableHeader);
  h->slot_bytes = sizeof(shm::SequenceSlot);
  h->slot_count = limits.max_sequences;
  h->ref_count = limits.max_page_refs;
  h->total_bytes = s->table_bytes_;
  h->session_id = session_id;
  h->chunk_bytes = pool->chunk_bytes();
  h->chunk_count = static_cast<uint32_t>(s->chunks_.size());
  h->generation.store(1, std::memory_order_release);
  return s;
}

SessionPages::~SessionPages() {
  if (table_) munmap(table_, table_bytes_);
  if (table_fd_ >= 0) close(table_fd_);
}

uint64_t SessionPages::generation() const {
  return reinterpret_cast<const shm::TableHeader*>(table_)->generation.load(std::memory_order_acquire);
}

void SessionPages::BumpGeneration() {
  reinterpret_cast<shm::TableHeader*>(table_)->generation.fetch_add(1, std::memory_order_acq_rel);
}

const SequencePages* SessionPages::Find(uint64_t id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : &it->second;
}

void SessionPages::PublishSlot(const SequencePages& s, uint32_t from_page) {
  auto* slot = const_cast<shm::SequenceSlot*>(shm::Slots(table_)) + s.slot;
  // The refs' place by the daemon's own slot count, not the header's (which a client could rewrite
  // where the table is not sealed against writes: write_sealed()).
  auto* refs = const_cast<shm::PageRef*>(shm::Refs(table_, static_cast<uint32_t>(slot_used_.size()))) + s.first_ref;
  const uint32_t cap = s.layout.pages_capacity_per_layer();
  // Only the new refs: the published ones are being read by clients, without a lock.
  for (uint32_t l = 0; l < s.layout.n_layers; ++l) {
    for (uint32_t p = from_page; p < s.pages_per_layer; ++p) refs[size_t{l} * cap + p] = s.pages[l][p];
  }
  slot->pages_per_layer.store(s.pages_per_layer, std::memory_order_release);
}

Result<const SequencePages*> SessionPages::CreateSequence(uint64_t id, const PageLayout& layout) {
  SPECACHE_RETURN_IF_ERROR(ValidatePageLayout(layout, pool_->chunk_bytes()));
  if (sequences_.count(id)) return Status::AlreadyExists("sequence " + std::to_string(id));
  uint32_t slot = 0;
  while (slot < slot_used_.size() && slot_used_[slot]) ++slot;
  if (slot == slot_used_.size()) {
    return Status::ResourceExhausted("session has " + std::to_string(slot_used_.size()) +
                                     " sequences, the most its page table holds");
  }
  const uint64_t refs = uint64_t{layout.n_layers} * layout.pages_capacity_per_layer();
  std::optional<uint64_t> first = refs <= refs_.size() ? refs_.Allocate(refs) : std::nullopt;
  if (!first) {
    return Status::ResourceExhausted("page table has no room for " + std::to_string(refs) +
                                     " page refs (capacity_tokens too large for the session)");
  }
  slot_used_[slot] = true;
  SequencePages& s = sequences_[id];
  s.id = id;
  s.slot = slot;
  s.layout = layout;
  s.first_ref = static_cast<uint32_t>(*first);
  s.pages.assign(layout.n_layers, {});

  auto* sl = const_cast<shm::SequenceSlot*>(shm::Slots(table_)) + slot;
  sl->n_layers = layout.n_layers;
  sl->n_kv_heads = layout.n_kv_heads;
  sl->head_dim = layout.head_dim;
  sl->page_tokens = layout.page_tokens;
  sl->capacity_tokens = layout.capacity_tokens;
  sl->pages_capacity_per_layer = layout.pages_capacity_per_layer();
  sl->pages_per_layer.store(0, std::memory_order_relaxed);
  sl->sequence_id = id;
  sl->page_bytes = layout.page_bytes();
  sl->first_ref = s.first_ref;
  sl->row_format = layout.row_format;
  sl->state.store(shm::kSlotLive, std::memory_order_release);
  BumpGeneration();
  return &s;
}

Result<uint32_t> SessionPages::Extend(uint64_t id, uint32_t tokens) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(id));
  SequencePages& s = it->second;
  if (tokens > s.layout.capacity_tokens) {
    return Status::OutOfRange("extend to " + std::to_string(tokens) + " tokens exceeds the capacity of " +
                              std::to_string(s.layout.capacity_tokens));
  }
  const uint32_t want = (tokens + s.layout.page_tokens - 1) / s.layout.page_tokens;
  if (want <= s.pages_per_layer) return s.pages_per_layer;
  const uint64_t units = Units(s.layout.page_bytes());
  std::vector<std::pair<uint32_t, uint64_t>> placed;  // (session chunk index, unit offset)
  for (uint32_t l = 0; l < s.layout.n_layers; ++l) {
    for (uint32_t p = s.pages_per_layer; p < want; ++p) {
      std::optional<uint64_t> at;
      uint32_t c = 0;
      for (; c < chunk_space_.size() && !at; ++c) at = chunk_space_[c].Allocate(units);
      if (!at) {
        for (auto& [chunk, off] : placed) chunk_space_[chunk].Free(off, units);
        const std::string freeing = retired_bytes_ == 0 ? "" :
            " (" + std::to_string(retired_bytes_) + " bytes of released sequences are still being zeroed)";
        return Status::ResourceExhausted("session memory full: " + std::to_string(placed.size()) + " of " +
                                         std::to_string(uint64_t{want - s.pages_per_layer} * s.layout.n_layers) +
                                         " pages found" + freeing + "; open the session with a larger pool_bytes");
      }
      placed.emplace_back(c - 1, *at);
    }
  }
  size_t next = 0;
  for (uint32_t l = 0; l < s.layout.n_layers; ++l) {
    for (uint32_t p = s.pages_per_layer; p < want; ++p) {
      const auto [chunk, off] = placed[next++];
      s.pages[l].push_back(shm::PageRef{chunk, 0, off * kUnit});
    }
  }
  const uint64_t added = placed.size();
  const uint32_t published = s.pages_per_layer;
  s.pages_per_layer = want;
  used_bytes_ += added * units * kUnit;
  page_count_ += added;
  PublishSlot(s, published);
  BumpGeneration();
  return s.pages_per_layer;
}

Result<SessionPages::RetiredPages> SessionPages::Retire(uint64_t id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(id));
  SequencePages& s = it->second;
  // The lists first: nothing changes if they cannot be made.
  RetiredPages retired{s.layout.page_bytes(), {}, {}};
  retired.refs.reserve(size_t{s.layout.n_layers} * s.pages_per_layer);
  retired.data.reserve(retired.refs.capacity());
  for (const auto& layer : s.pages) {
    for (const shm::PageRef& r : layer) {
      retired.refs.push_back(r);
      retired.data.push_back(pool_->data(chunks_[r.chunk]) + r.offset);
    }
  }
  auto* sl = const_cast<shm::SequenceSlot*>(shm::Slots(table_)) + s.slot;
  sl->state.store(shm::kSlotFree, std::memory_order_release);
  sl->pages_per_layer.store(0, std::memory_order_release);
  retired_bytes_ += retired.refs.size() * Units(retired.page_bytes) * kUnit;
  refs_.Free(s.first_ref, uint64_t{s.layout.n_layers} * s.layout.pages_capacity_per_layer());
  slot_used_[s.slot] = false;
  sequences_.erase(it);
  BumpGeneration();
  return retired;
}

void SessionPages::RetiredPages::Zero() const {
  for (uint8_t* page : data) std::memset(page, 0, page_bytes);
}

void SessionPages::Free(const RetiredPages& zeroed) {
  const uint64_t units = Units(zeroed.page_bytes);
  for (const shm::PageRef& r : zeroed.refs) {
    chunk_space_[r.chunk].Free(r.offset / kUnit, units);
    used_bytes_ -= units * kUnit;
    retired_bytes_ -= units * kUnit;
    --page_count_;
  }
}

Status SessionPages::Release(uint64_t id) {
  SPECACHE_ASSIGN_OR_RETURN(const RetiredPages retired, Retire(id));
  retired.Zero();
  Free(retired);
  return Status::Ok();
}

}  // namespace specache
