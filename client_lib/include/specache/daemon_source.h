// The agent's full-precision source backed by specached's pages: rows are written into and read
// from the session's mapped chunks directly (no copy through the daemon). Page-table lookups use
// the shared table; the only RPC on the decode path is one ExtendSequence per page_tokens tokens
// (for all layers at once), counted in extend_rpcs().
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
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

  uint64_t extend_rpcs() const { return session_->extend_rpcs(); }
  // The daemon's sequence id behind an agent sequence (for specachectl cross-checks).
  Result<uint64_t> DaemonSequence(SequenceId sequence) const;
  // Keeps the sequence in the daemon past this session (parked for the tenant, then spillable):
  // from here on, releasing it here (or destroying the source) leaves it in the daemon. Returns
  // the daemon's id, which a later session claims it back with.
  Result<uint64_t> Keep(SequenceId sequence);

 private:
  struct Sequence {
    uint64_t daemon_id = 0;
    SequenceLayout layout;
    std::vector<std::atomic<int32_t>> lengths;  // [layer * n_kv_heads + head]
    std::atomic<uint32_t> pages_per_layer{0};
    std::mutex extend_mu;
    std::vector<std::vector<uint8_t*>> pages;  // [layer][page]: entries below published_pages are set
    std::atomic<uint32_t> published_pages{0};  // pages usable by readers
    bool kept = false;                         // left in the daemon on release
  };
  Result<Sequence*> Find(SequenceId sequence) const;
  Status EnsurePages(Sequence* s, int32_t tokens);
  uint8_t* RowAddress(const Sequence& s, int layer, int kv_head, int32_t token) const;
  // The triple's length, after checking layer and head against the layout.
  Result<std::atomic<int32_t>*> LengthOf(Sequence* s, int layer, int kv_head) const;
  // Rows are added in order: n >= 0 rows starting at the current length (`what`: the caller).
  static Status CheckNextRows(const char* what, const std::atomic<int32_t>& length, int32_t first_token, int32_t n);

  Session* session_;
  uint32_t page_tokens_, capacity_tokens_;
  mutable std::mutex mu_;
  std::map<SequenceId, std::unique_ptr<Sequence>> sequences_;
};

}  // namespace specache::client
