// FullPrecisionSource in this process's heap, laid out like the daemon's pages: each (sequence,
// layer) owns pages of page_tokens tokens ([kv_head][token][K|V][head_dim] fp16), carved from
// slabs that live as long as the source (released pages are reused, never freed), so it offers
// the zero-copy access of full_precision_source.h. For tests, benchmarks and runs without a
// daemon.
//
// Thread safety: a reader-writer lock guards the sequence table and the page lists; appends to
// distinct (sequence, layer, head) triples and all reads proceed in parallel.
#pragma once

#include <map>
#include <memory>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "specache/full_precision_source.h"
#include "specache/host_mapping.h"

namespace specache {

class InMemorySource final : public FullPrecisionSource {
 public:
  // Pages are carved from slabs of slab_bytes (or one page, if larger). With huge_pages, slabs of
  // 2 MiB or more are 2 MiB-aligned and asked for transparent huge pages (madvise(MADV_HUGEPAGE),
  // a hint: base pages where the kernel declines): a fetch reads random rows across the whole
  // source, and each 4 KiB page it touches is a TLB miss for the host's gather threads and a
  // translation for the GPU's zero-copy reads.
  // page_tokens: at least 1 (smaller is taken as 1) and at most kMaxPageTokens, the daemon's
  // bound (CreateSequence refuses every sequence of a source made with more).
  explicit InMemorySource(int32_t page_tokens = 64, size_t slab_bytes = size_t{4} << 20, bool huge_pages = true);
  static constexpr int32_t kMaxPageTokens = 65536;
  ~InMemorySource() override;
  InMemorySource(const InMemorySource&) = delete;
  InMemorySource& operator=(const InMemorySource&) = delete;

  // Carves pages for `sequences` sequences of `layout` of up to `tokens` tokens each (all their
  // layers) out of new slabs now, unless free pages of that layout cover them already, so that sequences created later take them without allocating. A CUDA agent registers the
  // slabs that exist when it is created and, later, each new slab when a sequence first reaches
  // it: cudaHostRegister costs ~0.5 s per GB, so a source reserved before the agent is created
  // keeps that cost out of prefills. std::bad_alloc as for any growth.
  void Reserve(const SequenceLayout& layout, int sequences, int32_t tokens);

  Status CreateSequence(SequenceId sequence, const SequenceLayout& layout) override;
  Status ReleaseSequence(SequenceId sequence) override;
  Status AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                    int32_t n) override;
  Status ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                  Half* out) const override;
  Result<int32_t> Length(SequenceId sequence, int layer, int kv_head) const override;
  int64_t stored_bytes() const override;

  int32_t page_tokens() const override { return page_tokens_; }
  std::vector<HostRegion> host_regions() const override;
  // How the kernel maps the slabs now: their resident bytes and, of them, those in huge pages
  // (what the huge_pages advice was granted), from /proc/self/smaps: the kernel walks every page
  // of the process (~10 ms per GiB of base pages), so for a report, not for a loop.
  HostMapping mapping() const;
  Status HostPages(SequenceId sequence, int layer, int32_t tokens, std::vector<uint8_t*>* pages) override;
  Status CommitRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, int32_t n) override;
  // Every head checked first, then all committed: nothing changes on an error.
  Status CommitLayerRows(SequenceId sequence, int layer, int n_kv_heads, int32_t first_token, int32_t n) override;

 private:
  struct Sequence {
    SequenceLayout layout;
    size_t page_bytes = 0;
    std::vector<std::vector<uint8_t*>> pages;  // [layer][page]
    std::vector<int32_t> lengths;              // [layer * n_kv_heads + head]
  };
  // Resolves (sequence, layer, head) or explains why not. Caller holds mutex_.
  Result<Sequence*> Find(SequenceId sequence, int layer, int kv_head) const;
  // Gives every layer of `seq` pages for tokens [0, tokens). Caller holds mutex_ exclusively.
  void GrowLocked(Sequence* seq, int32_t tokens);
  // Page bytes for `layout`, and one more slab of such pages on their free list. Caller holds
  // mutex_ exclusively.
  size_t PageBytes(const SequenceLayout& layout) const;
  void AddSlabLocked(size_t page_bytes);
  // Pages every layer holds now. Caller holds mutex_.
  int32_t PagesOf(const Sequence& seq) const { return static_cast<int32_t>(seq.pages[0].size()); }
  // Pages that hold `tokens` tokens (in 64 bits: tokens near INT32_MAX would overflow in 32).
  int64_t PagesFor(int32_t tokens) const { return (int64_t{tokens} + page_tokens_ - 1) / page_tokens_; }
  Status EnsurePages(Sequence* seq, int32_t tokens, std::shared_lock<std::shared_mutex>* lock);
  uint8_t* RowAddress(const Sequence& seq, int layer, int kv_head, int32_t token) const;
  // Checks an append/commit of n rows at first_token against the triple's length.
  static Status CheckAppend(const Sequence& seq, int layer, int kv_head, int32_t first_token, int32_t n);
  // Commits n rows at first_token to heads [first_head, first_head + heads) of a layer: every head
  // and the pages checked first, then all committed. Caller holds mutex_.
  Status CommitHeadsLocked(Sequence* seq, int layer, int first_head, int heads, int32_t first_token, int32_t n) const;

  int32_t page_tokens_;
  size_t slab_bytes_;
  bool huge_pages_;
  mutable std::shared_mutex mutex_;
  std::unordered_map<SequenceId, std::unique_ptr<Sequence>> sequences_;  // hashed: per (sequence, layer) commits
  std::vector<HostRegion> slabs_;
  std::map<size_t, std::vector<uint8_t*>> free_pages_;  // by page bytes
};

}  // namespace specache
