#include "replica_store.h"

#include "lowbit_decode.h"
#include "mma_codes.h"

#include <algorithm>
#include <string>
#include <utility>

namespace specache::cuda {

ReplicaStore::ReplicaStore(const ModelShape& shape, const ReplicaParams& params, int32_t capacity_tokens,
                           cudaStream_t stream, bool mma_codes)
    : shape_(shape), params_(params), capacity_tokens_(capacity_tokens), stream_(stream),
      // The lean decode path takes items of at most kLeanMaxQueries queries: a KV head's GQA heads
      // times the step's two rows (the real and the speculative token).
      mma_codes_(mma_codes && MmaCodesEligible(params) && LowBitDecodeAvailable() &&
                 2 * shape.group_size() <= kLeanMaxQueries) {}

Status ReplicaStore::Init(int64_t pool_bytes) {
  SPECACHE_ASSIGN_OR_RETURN(pool_, DeviceBlockPool::Create(params_, pool_bytes));
  return Status::Ok();
}

Status ReplicaStore::AddSequence(SequenceId id) {
  Sequence replicas;
  replicas.layers.resize(shape_.n_layers);
  for (auto& layer : replicas.layers) {
    layer.resize(shape_.n_kv_heads);
    for (auto& r : layer) {
      SPECACHE_ASSIGN_OR_RETURN(
          r, DeviceHeadReplica::Create(params_, capacity_tokens_, stream_, pool_.get(), mma_codes_, &tasks_));
    }
  }
  replicas_.emplace(id, std::move(replicas));
  return Status::Ok();
}

void ReplicaStore::RemoveSequence(SequenceId id) { replicas_.erase(id); }

Result<int32_t> ReplicaStore::Length(SequenceId id, int layer) const {
  auto it = replicas_.find(id);
  if (it == replicas_.end()) return Status::NotFound("sequence " + std::to_string(id) + " is not registered");
  return it->second.layers[layer][0]->length();
}

bool ReplicaStore::Empty(SequenceId id) const { return Longest(replicas_.at(id)) == 0; }

int32_t ReplicaStore::Longest(const Sequence& s) {
  int32_t longest = 0;
  for (const auto& layer : s.layers) longest = std::max(longest, layer[0]->length());
  return longest;
}

Status ReplicaStore::Reserve(std::span<const SequenceId> ids, int32_t tokens) {
  std::vector<DeviceHeadReplica*> all;
  for (size_t i = 0; i < ids.size(); ++i) {
    Sequence& seq = replicas_.at(ids[i]);
    if (tokens >= 0 && int64_t{Longest(seq)} + tokens <= seq.covered) continue;  // its blocks hold them already
    all.clear();
    for (auto& layer : seq.layers) {
      for (auto& r : layer) all.push_back(r.get());
    }
    const Status s = DeviceHeadReplica::Reserve(all, tokens);
    if (!s.ok()) {  // all or nothing per sequence; the ones reserved before it give theirs back too
      ReleaseUnused(ids.first(i));
      return s.WithContext("sequence " + std::to_string(ids[i]) + ": device blocks for " + std::to_string(tokens) +
                           " more tokens");
    }
    int32_t covered = all.empty() ? 0 : all[0]->reserved_tokens();
    for (const DeviceHeadReplica* r : all) covered = std::min(covered, r->reserved_tokens());
    seq.covered = covered;
  }
  return Status::Ok();
}

void ReplicaStore::ReleaseUnused(std::span<const SequenceId> ids) {
  for (SequenceId id : ids) {
    Sequence& seq = replicas_.at(id);
    seq.covered = 0;
    for (auto& layer : seq.layers) {
      for (auto& r : layer) r->ReleaseUnused();
    }
  }
}

void ReplicaStore::AddStats(AgentStats* s) const {
  const int64_t row = 2 * int64_t{shape_.head_dim} * static_cast<int64_t>(sizeof(Half));
  s->device_pool_bytes = pool_->reserved_bytes();
  s->device_pool_used_bytes = pool_->used_bytes();
  s->device_bytes_reserved += s->device_pool_bytes;
  for (const auto& [id, replicas] : replicas_) {
    for (const auto& layer : replicas.layers) {
      for (const auto& r : layer) {
        s->device_bytes += r->device_bytes();
        s->device_bytes_reserved += r->fixed_bytes();  // its blocks are in the pool's figure
        s->full_precision_bytes += int64_t{r->length()} * row;
      }
    }
  }
}

}  // namespace specache::cuda
