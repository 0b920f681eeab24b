#include "specache/shm_layout.h"

#include <string>

namespace specache::shm {

Result<TableCounts> ReadTable(const void* region, size_t bytes) {
  if (!region) return Status::InvalidArgument("page table: no region");
  if (bytes < sizeof(TableHeader)) return Status::DataLoss("page table: region smaller than its header");
  const TableHeader* h = Header(region);
  if (ReadOnce(h->magic) != kTableMagic) return Status::DataLoss("page table: bad magic");
  if (const uint32_t version = ReadOnce(h->version); version != kTableVersion) {
    return Status::FailedPrecondition("page table: version " + std::to_string(version) + ", this client reads " +
                                      std::to_string(kTableVersion));
  }
  if (ReadOnce(h->header_bytes) != sizeof(TableHeader) || ReadOnce(h->slot_bytes) != sizeof(SequenceSlot)) {
    return Status::DataLoss("page table: struct sizes differ from this client's");
  }
  if (ReadOnce(h->total_bytes) != bytes) return Status::DataLoss("page table: total_bytes differs from the mapped size");
  TableCounts t;
  t.slot_count = ReadOnce(h->slot_count);
  t.ref_count = ReadOnce(h->ref_count);
  t.chunk_count = ReadOnce(h->chunk_count);
  t.chunk_bytes = ReadOnce(h->chunk_bytes);
  if (TableBytes(t.slot_count, t.ref_count) > bytes) return Status::DataLoss("page table: counts exceed the region");
  if (t.chunk_bytes == 0 && t.chunk_count != 0) return Status::DataLoss("page table: chunks of zero bytes");
  return t;
}

Status ValidateTable(const void* region, size_t bytes) { return ReadTable(region, bytes).status(); }

Result<SlotFields> ReadSlot(const void* region, const TableCounts& table, uint32_t slot, bool check_refs) {
  if (slot >= table.slot_count) return Status::OutOfRange("page table: slot " + std::to_string(slot) + " out of range");
  const SequenceSlot& shared = Slots(region)[slot];
  const uint32_t state = shared.state.load(std::memory_order_acquire);
  if (state == kSlotFree) return Status::NotFound("page table: slot " + std::to_string(slot) + " is free");
  if (state != kSlotLive) return Status::DataLoss("page table: slot state " + std::to_string(state));
  SlotFields s;
  s.sequence_id = ReadOnce(shared.sequence_id);
  s.page_bytes = ReadOnce(shared.page_bytes);
  s.n_layers = ReadOnce(shared.n_layers);
  s.n_kv_heads = ReadOnce(shared.n_kv_heads);
  s.head_dim = ReadOnce(shared.head_dim);
  s.page_tokens = ReadOnce(shared.page_tokens);
  s.capacity_tokens = ReadOnce(shared.capacity_tokens);
  s.pages_capacity_per_layer = ReadOnce(shared.pages_capacity_per_layer);
  s.first_ref = ReadOnce(shared.first_ref);
  s.row_format = ReadOnce(shared.row_format);
  s.pages_per_layer = shared.pages_per_layer.load(std::memory_order_acquire);
  if (s.n_layers == 0 || s.n_kv_heads == 0 || s.head_dim == 0 || s.page_tokens == 0) {
    return Status::DataLoss("page table: slot with a zero dimension");
  }
  // Within what any layout may have (and so PageBytes cannot wrap around).
  if (s.n_kv_heads > (1u << 16) || s.head_dim > (1u << 16) || s.page_tokens > (1u << 16)) {
    return Status::DataLoss("page table: slot dimension out of range");
  }
  if (!KnownRowFormat(s.row_format)) return Status::DataLoss("page table: slot row format " + std::to_string(s.row_format));
  if (s.page_bytes != PageBytes(s.row_format, s.n_kv_heads, s.page_tokens, s.head_dim) || s.page_bytes > table.chunk_bytes) {
    return Status::DataLoss("page table: slot page size inconsistent");
  }
  const uint64_t refs_needed = uint64_t{s.n_layers} * s.pages_capacity_per_layer;
  if (uint64_t{s.first_ref} + refs_needed > table.ref_count) return Status::DataLoss("page table: slot refs outside the pool");
  if (s.pages_per_layer > s.pages_capacity_per_layer) return Status::DataLoss("page table: more pages than capacity");
  if (check_refs) {
    const PageRef* refs = Refs(region, table.slot_count) + s.first_ref;
    for (uint32_t l = 0; l < s.n_layers; ++l) {
      for (uint32_t p = 0; p < s.pages_per_layer; ++p) {
        const PageRef& r = refs[size_t{l} * s.pages_capacity_per_layer + p];
        const uint32_t chunk = ReadOnce(r.chunk);
        const uint64_t offset = ReadOnce(r.offset);
        if (chunk >= table.chunk_count || offset > table.chunk_bytes || table.chunk_bytes - offset < s.page_bytes) {
          return Status::DataLoss("page table: page ref outside the chunks");
        }
      }
    }
  }
  return s;
}

Status ValidateSlot(const void* region, const TableCounts& table, uint32_t slot, bool check_refs) {
  return ReadSlot(region, table, slot, check_refs).status();
}

}  // namespace specache::shm
