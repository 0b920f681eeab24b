// FullPrecisionSource in this process's heap: one growing row array per (sequence, layer, head).
// For tests, benchmarks and runs without a daemon. Thread-safe: a reader-writer lock guards the
// sequence table and per-triple writes; reads of distinct triples proceed in parallel.
#pragma once

#include <map>
#include <memory>
#include <shared_mutex>
#include <vector>

#include "specache/full_precision_source.h"

namespace specache {

class InMemorySource final : public FullPrecisionSource {
 public:
  InMemorySource() = default;

  Status CreateSequence(SequenceId sequence, const SequenceLayout& layout) override;
  Status ReleaseSequence(SequenceId sequence) override;
  Status AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                    int32_t n) override;
  Status ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                  Half* out) const override;
  Result<int32_t> Length(SequenceId sequence, int layer, int kv_head) const override;
  int64_t stored_bytes() const override;

 private:
  struct Sequence {
    SequenceLayout layout;
    std::vector<std::vector<Half>> rows;  // [layer * n_kv_heads + head] -> [tokens][2][head_dim]
  };

  // Resolves (sequence, layer, head) or explains why not. Caller holds mutex_.
  Result<Sequence*> Find(SequenceId sequence, int layer, int kv_head) const;

  mutable std::shared_mutex mutex_;
  std::map<SequenceId, std::unique_ptr<Sequence>> sequences_;
};

}  // namespace specache
