// The agent's full-precision source backed by specached's pages: rows are written into and read
// from the session's mapped chunks directly (no copy through the daemon). Page-table lookups use
// the shared table; the only RPC on the decode path is one ExtendSequence per page_tokens tokens
// (for all layers at once), counted in extend_rpcs().
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "specache/client.h"
#include "specache/full_precision_source.h"

namespace specache::client {

class SPECACHE_CLIENT_API DaemonSource final : public FullPrecisionSource {
 public:
  // `session` must outlive the source. capacity_tokens bounds every sequence's length.
  DaemonSource(Session* session, uint32_t page_tokens, uint32_t capacity_tokens);
  ~DaemonSource() override;

  Status CreateSequence(SequenceId sequence, const SequenceLayout& layout) override;
  Status ReleaseSequence(SequenceId sequence) override;
  Status AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                    int32_t n) override;
  Status ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                  Half* out) const override;
  Result<int32_t> Length(SequenceId sequence, int layer, int kv_head) const override;
  int64_t stored_bytes() const override;

  int32_t page_tokens() const override { return static_cast<int32_t>(page_tokens_); }
  std::vector<HostRegion> host_regions() const override;  // the session's chunks
  Status HostPages(SequenceId sequence, int layer, int32_t tokens, std::vector<uint8_t*>* pages) override;
  Status CommitRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, int32_t n) override;
  // Every head checked first, then all committed: nothing changes on an error.
  Status CommitLayerRows(SequenceId sequence, int layer, int n_kv_heads, int32_t first_token, int32_t n) override;

  uint64_t extend_rpcs() const { return session_->extend_rpcs(); }
  // The daemon's sequence id behind an agent sequence (for specachectl cross-checks).
  Result<uint64_t> DaemonSequence(SequenceId sequence) const;
  // Keeps the sequence in the daemon past this session (parked for the tenant, then spillable):
  // from here on, releasing it here (or destroying the source) leaves it in the daemon. Returns
  // the daemon's id, which a later session claims it back with.
  Result<uint64_t> Keep(SequenceId sequence);

 private:
  // The session as the registry calls it: the sequences made here are held (Session::Release and
  // Keep refuse them to others), and released and kept as the holder.
  class HeldSession;
  // The sequences and their checks (sequence_registry.h), with each page's address in the chunks.
  struct Registry;

  Session* session_;
  uint32_t page_tokens_;
  std::unique_ptr<HeldSession> held_;  // before registry_, which releases through it when it goes
  std::unique_ptr<Registry> registry_;
};

}  // namespace specache::client
