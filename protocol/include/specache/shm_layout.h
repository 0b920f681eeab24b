// Shared-memory layouts published by specached (plain versioned structs; no pointers).
//
// Page table: one memfd region per session, mapped read-only by the client:
//   TableHeader | SequenceSlot[slot_count] | PageRef[ref_count]
// A live slot's page refs are refs[first_ref + layer * pages_capacity_per_layer + page]. The
// daemon writes refs first and then publishes pages_per_layer with release order, so a reader
// that loads pages_per_layer (acquire) may use that many refs per layer without a lock. Slots
// change state only under the session's owner calls (create/release), and `generation` bumps on
// every change.
//
// Page: one (sequence, layer) x page_tokens tokens, laid out [kv_head][token][row], inside a
// chunk (a memfd the client maps after attaching) at PageRef::offset. A row is one token's key
// and value of one KV head in the sequence's row format (RowFormat below).
//
// Every field read from shared memory is untrusted for the reader: ReadTable / ReadSlot check it
// against the region and chunk sizes before use. A slot is rewritten in place when its session
// reuses it, so a reader reads each of its fields once (ReadOnce) into a copy, checks the copy and
// uses the copy alone: a field read again after its check may hold another sequence's value. So
// for the header: its counts are read once, at ReadTable, and every later check and index uses
// that copy (TableCounts).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "specache/status.h"

namespace specache::shm {

inline constexpr uint32_t kTableMagic = 0x54435053;  // "SPCT" little-endian
inline constexpr uint32_t kTableVersion = 1;

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

struct TableHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t header_bytes;  // sizeof(TableHeader) of the writer
  uint32_t slot_bytes;    // sizeof(SequenceSlot) of the writer
  uint32_t slot_count;
  uint32_t ref_count;
  uint64_t total_bytes;   // size of the whole region
  uint64_t session_id;
  uint64_t chunk_bytes;
  uint32_t chunk_count;
  uint32_t reserved;
  std::atomic<uint64_t> generation;
};

enum SlotState : uint32_t { kSlotFree = 0, kSlotLive = 1 };

struct SequenceSlot {
  std::atomic<uint32_t> state;
  uint32_t n_layers;
  uint32_t n_kv_heads;
  uint32_t head_dim;
  uint32_t page_tokens;
  uint32_t capacity_tokens;
  uint32_t pages_capacity_per_layer;
  std::atomic<uint32_t> pages_per_layer;
  uint64_t sequence_id;
  uint64_t page_bytes;
  uint32_t first_ref;
  uint32_t row_format;  // RowFormat (0, fp16, in every table written before there were others)
};

struct PageRef {
  uint32_t chunk;   // index into the session's chunks (attach order)
  uint32_t reserved;
  uint64_t offset;  // bytes from the chunk's start
};

inline constexpr size_t TableBytes(uint32_t slots, uint32_t refs) {
  return sizeof(TableHeader) + size_t{slots} * sizeof(SequenceSlot) + size_t{refs} * sizeof(PageRef);
}

// The header's counts, read once when the table is mapped: a reader checks and indexes with this
// copy alone (the region is the writer's: a header rewritten after the check must not move a
// reader outside what was checked).
struct TableCounts {
  uint32_t slot_count = 0, ref_count = 0, chunk_count = 0;
  uint64_t chunk_bytes = 0;
};
// Checks a mapped table region of `bytes` bytes: magic, version, struct sizes, counts that fit;
// the counts as read.
Result<TableCounts> ReadTable(const void* region, size_t bytes);
// ReadTable's checks alone.
Status ValidateTable(const void* region, size_t bytes);

// A field of shared memory read once (the compiler may not read it again for a later use of the
// value, as it may for a plain read); atomics are loaded as they are.
template <typename T>
T ReadOnce(const T& field) {
  return *static_cast<const volatile T*>(&field);
}

// One live slot's fields as read once each, checked together.
struct SlotFields {
  uint64_t sequence_id = 0, page_bytes = 0;
  uint32_t n_layers = 0, n_kv_heads = 0, head_dim = 0, page_tokens = 0, capacity_tokens = 0;
  uint32_t pages_capacity_per_layer = 0, first_ref = 0, row_format = 0;
  uint32_t pages_per_layer = 0;  // published when it was read (acquire), <= pages_capacity_per_layer
};
// Reads one slot of a table ReadTable checked (`table`: its counts) and checks the copy: live,
// page geometry, refs inside the pool, and with `check_refs`, every published ref (each read
// once) inside a chunk.
Result<SlotFields> ReadSlot(const void* region, const TableCounts& table, uint32_t slot, bool check_refs);
// ReadSlot's checks alone.
Status ValidateSlot(const void* region, const TableCounts& table, uint32_t slot, bool check_refs);

inline const TableHeader* Header(const void* region) { return static_cast<const TableHeader*>(region); }
inline const SequenceSlot* Slots(const void* region) {
  return reinterpret_cast<const SequenceSlot*>(static_cast<const char*>(region) + sizeof(TableHeader));
}
// The refs of a table of `slot_count` slots: a reader's from its TableCounts, the writer's its own
// (never the header's count read back: where the table is not sealed against writes its client
// can rewrite it).
inline const PageRef* Refs(const void* region, uint32_t slot_count) {
  return reinterpret_cast<const PageRef*>(reinterpret_cast<const char*>(Slots(region)) +
                                          size_t{slot_count} * sizeof(SequenceSlot));
}

// The pages' geometry, the one place it is written down on this side (the agent's host_rows.h and
// full_precision_source.h state the same for its sources; client_lib checks they agree).
// A row: one token's key and value of one KV head, in one of two formats (the agent's
// host_rows.h has their bytes and the conversions; the daemon only moves whole rows):
//   kRowFp16: [K|V][head_dim] fp16                                       4 x head_dim bytes
//   kRowInt8: [K|V][head_dim] int8 codes, the K and V scales (fp16), zeros  2 x head_dim + 16 bytes
enum RowFormat : uint32_t { kRowFp16 = 0, kRowInt8 = 1 };
inline constexpr bool KnownRowFormat(uint32_t format) { return format == kRowFp16 || format == kRowInt8; }
inline constexpr uint64_t RowBytes(uint32_t row_format, uint32_t head_dim) {
  return row_format == kRowInt8 ? uint64_t{2} * head_dim + 16 : uint64_t{4} * head_dim;
}
// Bytes of one page: [kv_head][token][row].
inline constexpr uint64_t PageBytes(uint32_t row_format, uint32_t n_kv_heads, uint32_t page_tokens, uint32_t head_dim) {
  return uint64_t{n_kv_heads} * page_tokens * RowBytes(row_format, head_dim);
}
// Where token `in_page` of a page (token % page_tokens) of KV head kv_head starts in the page.
inline constexpr uint64_t RowOffsetInPage(uint32_t row_format, uint32_t kv_head, uint32_t in_page, uint32_t page_tokens,
                                          uint32_t head_dim) {
  return (uint64_t{kv_head} * page_tokens + in_page) * RowBytes(row_format, head_dim);
}

}  // namespace specache::shm
