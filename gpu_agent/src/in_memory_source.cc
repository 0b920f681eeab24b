#include "specache/in_memory_source.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>

namespace specache {

Status InMemorySource::CreateSequence(SequenceId sequence, const SequenceLayout& layout) {
  if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0) {
    return Status::InvalidArgument("sequence layout needs positive n_layers, n_kv_heads and head_dim");
  }
  std::unique_lock lock(mutex_);
  if (sequences_.count(sequence)) {
    return Status::AlreadyExists("sequence " + std::to_string(sequence) + " already exists");
  }
  auto seq = std::make_unique<Sequence>();
  seq->layout = layout;
  seq->rows.resize(static_cast<size_t>(layout.n_layers) * layout.n_kv_heads);
  sequences_.emplace(sequence, std::move(seq));
  return Status::Ok();
}

Status InMemorySource::ReleaseSequence(SequenceId sequence) {
  std::unique_lock lock(mutex_);
  if (sequences_.erase(sequence) == 0) {
    return Status::NotFound("sequence " + std::to_string(sequence) + " does not exist");
  }
  return Status::Ok();
}

Result<InMemorySource::Sequence*> InMemorySource::Find(SequenceId sequence, int layer, int kv_head) const {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return Status::NotFound("sequence " + std::to_string(sequence) + " does not exist");
  const SequenceLayout& l = it->second->layout;
  if (layer < 0 || layer >= l.n_layers || kv_head < 0 || kv_head >= l.n_kv_heads) {
    return Status::OutOfRange("layer " + std::to_string(layer) + " / kv head " + std::to_string(kv_head) +
                              " outside the layout (" + std::to_string(l.n_layers) + " layers, " +
                              std::to_string(l.n_kv_heads) + " kv heads)");
  }
  return it->second.get();
}

Status InMemorySource::AppendRows(SequenceId sequence, int layer, int kv_head, int32_t first_token, const Half* rows,
                                  int32_t n) {
  if (n < 0) return Status::InvalidArgument("negative row count");
  // Writers of distinct triples may run together: the table is only read here, and each triple's
  // vector is touched by one agent thread at a time (the interface's contract).
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(Sequence* seq, Find(sequence, layer, kv_head));
  auto& store = seq->rows[static_cast<size_t>(layer) * seq->layout.n_kv_heads + kv_head];
  const size_t row_halves = 2 * static_cast<size_t>(seq->layout.head_dim);
  const auto length = static_cast<int32_t>(store.size() / row_halves);
  if (first_token != length) {
    return Status::FailedPrecondition("append at token " + std::to_string(first_token) + " but " +
                                      std::to_string(length) + " rows are written");
  }
  store.insert(store.end(), rows, rows + static_cast<size_t>(n) * row_halves);
  return Status::Ok();
}

Status InMemorySource::ReadRows(SequenceId sequence, int layer, int kv_head, const int32_t* tokens, int32_t n,
                                Half* out) const {
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(const Sequence* seq, Find(sequence, layer, kv_head));
  const auto& store = seq->rows[static_cast<size_t>(layer) * seq->layout.n_kv_heads + kv_head];
  const size_t row_halves = 2 * static_cast<size_t>(seq->layout.head_dim);
  const auto length = static_cast<int32_t>(store.size() / row_halves);
  for (int32_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= length) {
      return Status::OutOfRange("token " + std::to_string(tokens[i]) + " not written (length " +
                                std::to_string(length) + ")");
    }
    std::memcpy(out + i * row_halves, store.data() + tokens[i] * row_halves, row_halves * sizeof(Half));
  }
  return Status::Ok();
}

Result<int32_t> InMemorySource::Length(SequenceId sequence, int layer, int kv_head) const {
  std::shared_lock lock(mutex_);
  SPECACHE_ASSIGN_OR_RETURN(const Sequence* seq, Find(sequence, layer, kv_head));
  return static_cast<int32_t>(seq->rows[static_cast<size_t>(layer) * seq->layout.n_kv_heads + kv_head].size() /
                              (2 * static_cast<size_t>(seq->layout.head_dim)));
}

int64_t InMemorySource::stored_bytes() const {
  std::shared_lock lock(mutex_);
  int64_t bytes = 0;
  for (const auto& [id, seq] : sequences_) {
    for (const auto& r : seq->rows) bytes += static_cast<int64_t>(r.size() * sizeof(Half));
  }
  return bytes;
}

}  // namespace specache
