// Where the full-precision KV cache C lives: host memory the agent writes during prefill and
// decode and reads rows back from when it fetches the top-k.
//
// A row is one (sequence, layer, KV head, token): [K | V] = [2][head_dim] fp16, K first. The
// source stores it in the sequence's row format (SequenceLayout::row_format, host_rows.h: fp16 as
// it is, or int8 codes with two scales) and takes and returns it as fp16 (AppendRows, ReadRows).
// A stored row is exactly the row of a daemon page laid out [kv_head][token][row]
// (docs/architecture.md), so one fetched row is one contiguous read of HostRowBytes bytes.
//
// Implementations: InMemorySource (in_memory_source.h) for tests and the embedded demo; the
// daemon-backed source of client_lib maps the daemon's pages.
//
// Zero-copy access (optional): a source whose rows live in pages of fixed host memory exposes
// them, so an agent can read and write rows in place (the CUDA agent maps the memory into the
// GPU's address space and gathers with SM loads, never through a host copy; a source without
// pages, such as client_lib's RemoteSource, is read into pinned host memory with StartReadRows /
// FinishReadRows and written with AppendRows instead: the CUDA agent's staged path). A page holds
// page_tokens() tokens of one (sequence, layer), laid out [kv_head][token][stored row]; its
// address is fixed until the sequence is released, and lies inside one of host_regions(). Who
// reads or writes pages in place reads and writes stored rows (the layout's row format).
//
// Thread safety: implementations must allow concurrent calls on distinct (sequence, layer, head)
// triples; calls on one triple are serialised by the agent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "specache/half.h"
#include "specache/host_rows.h"
#include "specache/kv_config.h"
#include "specache/status.h"

namespace specache {

struct SequenceLayout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  HostRowFormat row_format = HostRowFormat::kFp16;  // how the source stores the rows

  // Bytes of one stored row.
  constexpr int64_t row_bytes() const { return HostRowBytes(row_format, head_dim); }
};

// Byte offset of a stored row within its page ([kv_head][token][row]): token `in_page` of the
// page (token % page_tokens) of KV head kv_head.
constexpr int64_t PageRowOffset(int kv_head, int32_t in_page, int32_t page_tokens, int64_t row_bytes) {
  return (int64_t{kv_head} * page_tokens + in_page) * row_bytes;
}

struct HostRegion {
  void* base = nullptr;
  size_t bytes = 0;
};

class FullPrecisionSource {
 public:
  virtual ~FullPrecisionSource() = default;

  // Errors: ALREADY_EXISTS if the id is in use; INVALID_ARGUMENT for a non-positive dimension;
  // RESOURCE_EXHAUSTED when the source has no room (quota, pool).
  virtual Status CreateSequence(SequenceId sequence, const SequenceLayout& layout) = 0;

  // Frees every row of the sequence. NOT_FOUND for an unknown id.
  virtual Status ReleaseSequence(SequenceId sequence) = 0;

  // Appends n rows ([n][2][head_dim] fp16, stored in the layout's row format) to (sequence, layer, kv_head) at token first_token,
  // which must equal the current length of that triple (FAILED_PRECONDITION otherwise: rows are
  // written in order, never with holes). NOT_FOUND / OUT_OF_RANGE for bad ids or indices;
  // RESOURCE_EXHAUSTED when no page can be added.
  virtual Status AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                            int32_t n) = 0;

  // Copies the rows of the n given tokens to out ([n][2][head_dim] fp16, decoded from the layout's
  // row format). Tokens need not be sorted; the agent sorts them because pages are then read in
  // address order. OUT_OF_RANGE if a token is not yet written; nothing is guaranteed about `out`
  // after an error.
  virtual Status ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                          Half* out) const = 0;

  // ReadRows in two halves, so the read runs while the agent computes (a source whose rows are
  // on another host, client_lib's RemoteSource). StartReadRows begins the read and returns a
  // handle; FinishReadRows(handle) waits for it and returns its status. Every started read must be
  // finished exactly once, and tokens and out must stay valid until then. Errors of either half
  // are ReadRows's. The default reads at the start (handle 0).
  virtual Result<uint64_t> StartReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                                         Half* out) {
    SPECACHE_RETURN_IF_ERROR(ReadRows(sequence, layer, kv_head, tokens, n, out));
    return uint64_t{0};
  }
  virtual Status FinishReadRows(uint64_t read) {
    (void)read;
    return Status::Ok();
  }

  // Rows written so far for (sequence, layer, kv_head).
  virtual Result<int32_t> Length(SequenceId sequence, int layer, int kv_head) const = 0;

  // Host bytes the source holds for all sequences (rows written, not capacity).
  virtual int64_t stored_bytes() const = 0;

  // ---- Zero-copy access (see the top of this file). Sources without it keep the defaults.

  // Tokens per page; 0 when the source has no zero-copy access.
  virtual int32_t page_tokens() const { return 0; }
  // Every block of host memory that pages are carved from. Blocks are only ever added, never
  // moved or freed while the source lives, so a caller may register each one once.
  virtual std::vector<HostRegion> host_regions() const { return {}; }
  // Makes pages exist for tokens [0, tokens) at every layer of the sequence (as AppendRows would),
  // then writes to `pages` the addresses of all of (sequence, layer)'s pages covering them.
  virtual Status HostPages(SequenceId sequence, int layer, int32_t tokens, std::vector<uint8_t*>* pages) {
    (void)sequence, (void)layer, (void)tokens, (void)pages;
    return Status::Unimplemented("this source has no zero-copy pages");
  }
  // Records n rows written in place at first_token of (sequence, layer, kv_head): AppendRows
  // without the copy, with its rules (first_token equals the length; the pages exist).
  virtual Status CommitRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, int32_t n) {
    (void)sequence, (void)layer, (void)kv_head, (void)first_token, (void)n;
    return Status::Unimplemented("this source has no zero-copy pages");
  }
  // CommitRows for every KV head of (sequence, layer), the same rows of each: the CUDA agent's
  // per-layer commit. The default commits head by head and stops at the first error (the heads
  // before it stay committed); a source may do it in one go.
  virtual Status CommitLayerRows(SequenceId sequence, int layer, int n_kv_heads, int32_t first_token, int32_t n) {
    for (int h = 0; h < n_kv_heads; ++h) SPECACHE_RETURN_IF_ERROR(CommitRows(sequence, layer, h, first_token, n));
    return Status::Ok();
  }
};

}  // namespace specache
