// A FullPrecisionSource over an InMemorySource that forwards every call, for tests that change one
// behaviour of a source (refuse some commits, finish reads later): derive and override those.
// Without pages (`zero_copy` false) it offers no zero-copy access, as a source whose rows are on
// another host: the agents then take their staged path.
#pragma once

#include <cstdint>
#include <vector>

#include "specache/in_memory_source.h"

namespace specache::testing {

class ForwardingSource : public FullPrecisionSource {
 public:
  explicit ForwardingSource(bool zero_copy, int32_t page_tokens = 64) : zero_copy_(zero_copy), rows_(page_tokens) {}

  Status CreateSequence(SequenceId id, const SequenceLayout& layout) override { return rows_.CreateSequence(id, layout); }
  Status ReleaseSequence(SequenceId id) override { return rows_.ReleaseSequence(id); }
  Status AppendRows(SequenceId id, int layer, int kv_head, int32_t first, const Half* rows, int32_t n) override {
    return rows_.AppendRows(id, layer, kv_head, first, rows, n);
  }
  Status ReadRows(SequenceId id, int layer, int kv_head, const int32_t* tokens, int32_t n, Half* out) const override {
    return rows_.ReadRows(id, layer, kv_head, tokens, n, out);
  }
  Result<int32_t> Length(SequenceId id, int layer, int kv_head) const override { return rows_.Length(id, layer, kv_head); }
  int64_t stored_bytes() const override { return rows_.stored_bytes(); }

  int32_t page_tokens() const override { return zero_copy_ ? rows_.page_tokens() : 0; }
  std::vector<HostRegion> host_regions() const override {
    return zero_copy_ ? rows_.host_regions() : std::vector<HostRegion>{};
  }
  Status HostPages(SequenceId id, int layer, int32_t tokens, std::vector<uint8_t*>* pages) override {
    return zero_copy_ ? rows_.HostPages(id, layer, tokens, pages) : FullPrecisionSource::HostPages(id, layer, tokens, pages);
  }
  Status CommitRows(SequenceId id, int layer, int kv_head, int32_t first, int32_t n) override {
    return zero_copy_ ? rows_.CommitRows(id, layer, kv_head, first, n)
                      : FullPrecisionSource::CommitRows(id, layer, kv_head, first, n);
  }
  Status CommitLayerRows(SequenceId id, int layer, int n_kv_heads, int32_t first, int32_t n) override {
    return zero_copy_ ? rows_.CommitLayerRows(id, layer, n_kv_heads, first, n)
                      : FullPrecisionSource::CommitLayerRows(id, layer, n_kv_heads, first, n);
  }

 protected:
  const InMemorySource& rows() const { return rows_; }

 private:
  const bool zero_copy_;
  InMemorySource rows_;
};

}  // namespace specache::testing
