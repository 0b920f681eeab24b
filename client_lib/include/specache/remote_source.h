// The agent's full-precision source in the pages of a daemon on another host (RemoteSession):
// appended rows are written over UCX, the top-k rows the agent selects are fetched over UCX (by
// the session's method, the server-side gather by default; StartReadRows / FinishReadRows let the
// agent's prefetch overlap the read with the engine's layers). No zero-copy access: the pages are
// not in this host's memory, so a CUDA agent reads fetched rows from host buffers. Rows travel
// in the sequence's row format (SequenceLayout::row_format): int8 rows move half the bytes, and
// are decoded here, when a read finishes.
//
// Lengths are tracked here; the daemon checks every row list against the sequence's pages. The
// only control call on the decode path is one ExtendSequence per page_tokens tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "specache/full_precision_source.h"
#include "specache/remote_session.h"

namespace specache::client {

class SPECACHE_CLIENT_API RemoteSource final : public FullPrecisionSource {
 public:
  // `session` must outlive the source. capacity_tokens bounds every sequence's length.
  RemoteSource(RemoteSession* session, uint32_t page_tokens, uint32_t capacity_tokens);
  ~RemoteSource() override;

  Status CreateSequence(SequenceId sequence, const SequenceLayout& layout) override;
  Status ReleaseSequence(SequenceId sequence) override;
  Status AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                    int32_t n) override;
  Status ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                  Half* out) const override;
  // The agent's prefetch: the gather's row list goes out here and the rows arrive while the
  // engine computes other layers (with the gets method the read happens at the start).
  Result<uint64_t> StartReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                                 Half* out) override;
  Status FinishReadRows(uint64_t read) override;
  Result<int32_t> Length(SequenceId sequence, int layer, int kv_head) const override;
  int64_t stored_bytes() const override;

  Result<uint64_t> DaemonSequence(SequenceId sequence) const;
  Result<uint64_t> Keep(SequenceId sequence);

 private:
  struct Registry;      // the sequences and their checks (sequence_registry.h)
  struct PendingReads;  // started reads whose rows are decoded when they finish

  RemoteSession* session_;
  std::unique_ptr<Registry> registry_;
  std::unique_ptr<PendingReads> pending_;
};

}  // namespace specache::client
