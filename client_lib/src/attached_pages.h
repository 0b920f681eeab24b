// A session's shared memory as this process maps it after the attach handshake
// (attach_protocol.h): the daemon's page table, read-only, and the session's chunks, read-write,
// with the sequences whose slots the daemon named.
//
// Everything here comes from the daemon and is checked before it is used (shm_layout.h):
//   - each descriptor is at least as long as the attach reply says and sealed against shrinking
//     (a mapping of a file cut short later faults the engine with SIGBUS);
//   - the table's header agrees with the reply and with OpenSession's chunk count;
//   - a sequence's slot is checked once, when the daemon names it (AddSlot), against the layout
//     the engine asked for; after that a page lookup reads only the slot's state and page count
//     from the table, so a slot the daemon rewrites (released and reused) cannot move a lookup
//     outside the table or a page outside its chunk.
// Errors: DATA_LOSS when the daemon's descriptors or table disagree with what it said or with
// the layout asked for, NOT_FOUND for a sequence not added here (or gone from the table),
// OUT_OF_RANGE for a layer or a page not mapped yet. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "specache/attach_protocol.h"
#include "specache/client.h"
#include "specache/shm_layout.h"

namespace specache::client {

class AttachedPages {
 public:
  // A sequence's slot and its geometry as checked by AddSlot.
  struct SlotView {
    uint32_t slot = 0;
    uint32_t n_layers = 0, page_tokens = 0;
    uint32_t capacity = 0;  // pages per layer
    uint32_t first_ref = 0;
    uint64_t page_bytes = 0;
  };

  // Maps what the daemon passed with `reply` (the first message's): fds[0] the page table, then
  // the chunks in order; `expected_chunks` is OpenSession's count. The descriptors stay the
  // caller's (the mappings outlive them).
  static Result<std::unique_ptr<AttachedPages>> Map(const attach::AttachReply& reply, std::span<const int> fds,
                                                    uint32_t expected_chunks);
  ~AttachedPages();  // unmaps the chunks and the table
  AttachedPages(const AttachedPages&) = delete;
  AttachedPages& operator=(const AttachedPages&) = delete;

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t chunk_count() const { return static_cast<uint32_t>(chunks_.size()); }
  uint8_t* chunk(uint32_t i) const { return i < chunks_.size() ? chunks_[i] : nullptr; }

  // A sequence the daemon placed in table slot `slot` (CreateSequence, ClaimSequence) with layout
  // `want`: the slot must be live, hold `sequence` and describe exactly that layout (a page of
  // another size would be written past). Then the sequence is known here with that geometry.
  Status AddSlot(uint64_t sequence, uint32_t slot, const PageLayoutSpec& want);
  void Forget(uint64_t sequence);
  Result<SlotView> SlotOf(uint64_t sequence) const;

  // The slot's pages per layer now (the daemon publishes them as it extends), at most its capacity.
  uint32_t LivePages(const SlotView& v) const;
  // The slot checked again, every published page ref included (after the daemon extended it).
  Status Recheck(const SlotView& v) const;
  // Where page `page` of (sequence, layer) is mapped: page_bytes bytes.
  Result<uint8_t*> PageData(uint64_t sequence, uint32_t layer, uint32_t page) const;

 private:
  AttachedPages() = default;

  const uint8_t* table_ = nullptr;
  uint64_t table_bytes_ = 0;
  shm::TableCounts counts_;  // the header's counts as read and checked at Map: the only ones used
  const shm::PageRef* refs_ = nullptr;  // the table's refs (after counts_.slot_count slots)
  std::vector<uint8_t*> chunks_;
  uint64_t chunk_bytes_ = 0;
  mutable std::mutex mu_;
  std::map<uint64_t, SlotView> slots_;  // sequence -> its slot
};

}  // namespace specache::client
