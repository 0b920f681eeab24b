// The pages of one session: sequences carved out of the session's chunks, and the session's page
// table published in a memfd (shm_layout.h) that the client maps read-only.
//
// The daemon's own bookkeeping lives here in ordinary memory; the shared table is written, never
// read back (but for its generation counter, bumped in place and reported to the session's own
// client), so nothing a client does to shared memory can mislead the daemon. Where the kernel
// refuses F_SEAL_FUTURE_WRITE (before Linux 5.1) the client can write its table (write_sealed()).
//
// Not thread-safe: the daemon's registry serialises calls per session.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "specache/chunk_pool.h"
#include "specache/extent_allocator.h"
#include "specache/shm_layout.h"
#include "specache/status.h"

namespace specache {

struct PageLayout {
  uint32_t n_layers = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t page_tokens = 0;
  uint32_t capacity_tokens = 0;
  uint32_t row_format = shm::kRowFp16;  // shm::RowFormat

  uint64_t page_bytes() const { return shm::PageBytes(row_format, n_kv_heads, page_tokens, head_dim); }
  uint64_t row_bytes() const { return shm::RowBytes(row_format, head_dim); }
  uint32_t pages_capacity_per_layer() const { return (capacity_tokens + page_tokens - 1) / page_tokens; }
};

// Checks a layout a client asked for against the limits (INVALID_ARGUMENT naming the field).
Status ValidatePageLayout(const PageLayout& layout, uint64_t chunk_bytes);

struct SequencePages {
  uint64_t id = 0;
  uint32_t slot = 0;
  PageLayout layout;
  uint32_t first_ref = 0;
  uint32_t pages_per_layer = 0;
  std::vector<std::vector<shm::PageRef>> pages;  // [layer][page]
};

class SessionPages {
 public:
  struct Limits {
    uint32_t max_sequences = 256;
    uint32_t max_page_refs = 1 << 20;
  };
  // The chunks must already belong to this session in `pool`.
  static Result<std::unique_ptr<SessionPages>> Create(uint64_t session_id, ChunkPool* pool,
                                                      std::vector<uint32_t> chunks, const Limits& limits);
  ~SessionPages();

  // RESOURCE_EXHAUSTED when the table has no free slot or page-ref room.
  Result<const SequencePages*> CreateSequence(uint64_t sequence_id, const PageLayout& layout);
  // Ensures tokens [0, tokens) have pages at every layer; returns pages per layer. All or
  // nothing: RESOURCE_EXHAUSTED leaves the sequence as it was. OUT_OF_RANGE beyond capacity.
  Result<uint32_t> Extend(uint64_t sequence_id, uint32_t tokens);
  // Release in three steps, so that a caller may zero a large sequence's pages without its own
  // lock. Retire: the sequence leaves the table (its slot and page refs are free, its id unknown
  // from here) while its pages stay held, given to no other sequence and counted in used_bytes(),
  // until Free. RetiredPages::Zero needs no lock of the caller's, as long as the session's chunks
  // stay its own meanwhile (the caller keeps the session from ending). Free (on this object, which
  // must outlive it), once they are zeroed: their space goes to the session's next sequences, which
  // thus start clean. Pages never freed go back with the session's chunks. Meanwhile an Extend that
  // finds no room says how many bytes are still being zeroed.
  struct RetiredPages {
    uint64_t page_bytes = 0;
    std::vector<shm::PageRef> refs;  // [layer * pages_per_layer + page]
    std::vector<uint8_t*> data;      // the daemon's mapping of each
    void Zero() const;
  };
  Result<RetiredPages> Retire(uint64_t sequence_id);
  void Free(const RetiredPages& zeroed);
  // Retire, Zero and Free in one call.
  Status Release(uint64_t sequence_id);

  const SequencePages* Find(uint64_t sequence_id) const;
  const std::map<uint64_t, SequencePages>& sequences() const { return sequences_; }
  const std::vector<uint32_t>& chunks() const { return chunks_; }
  int table_fd() const { return table_fd_; }
  // False where the kernel refused F_SEAL_FUTURE_WRITE (before Linux 5.1): the session's client
  // can then map its table writable and spoil it, for itself only (the caller says so in its log).
  bool write_sealed() const { return write_sealed_; }
  uint64_t table_bytes() const { return table_bytes_; }
  uint64_t generation() const;
  uint64_t used_bytes() const { return used_bytes_; }
  uint64_t page_count() const { return page_count_; }

 private:
  SessionPages() = default;
  // Writes the slot's refs of pages [from_page, pages_per_layer) of every layer, then publishes
  // pages_per_layer (release): a client that reads it (acquire) may use that many refs.
  void PublishSlot(const SequencePages& s, uint32_t from_page);
  void BumpGeneration();

  ChunkPool* pool_ = nullptr;
  std::vector<uint32_t> chunks_;
  std::vector<ExtentAllocator> chunk_space_;  // per session chunk, in 4 KiB units
  ExtentAllocator refs_{0};
  bool write_sealed_ = true;
  std::vector<bool> slot_used_;
  std::map<uint64_t, SequencePages> sequences_;
  int table_fd_ = -1;
  uint8_t* table_ = nullptr;
  uint64_t table_bytes_ = 0;
  uint64_t used_bytes_ = 0;
  uint64_t retired_bytes_ = 0;  // of used_bytes_: retired, not yet freed
  uint64_t page_count_ = 0;
};

}  // namespace specache
