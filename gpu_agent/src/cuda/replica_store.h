// The low-bit replicas of the CUDA agent's sequences: one DeviceHeadReplica per (sequence, layer,
// KV head), their blocks taken from one DeviceBlockPool that all sequences share (cuda_replica.h).
//
// Blocks are taken as the replicas grow; Reserve takes ahead what a batch of sequences will need,
// all or nothing, so that a step never runs out half-way, and a reservation that goes unused is
// given back (ReleaseUnused). A removed sequence gives all its blocks back.
//
// Not thread-safe (the agent is used from one thread).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "specache/agent.h"
#include "specache/cuda_replica.h"
#include "specache/status.h"

namespace specache::cuda {

class ReplicaStore {
 public:
  // Replicas of `params`, up to capacity_tokens tokens each, their work queued on `stream`; in the
  // mma layout (DeviceHeadReplica::Create) when mma_codes and the parameters, the device and the
  // GQA group allow it.
  ReplicaStore(const ModelShape& shape, const ReplicaParams& params, int32_t capacity_tokens, cudaStream_t stream,
               bool mma_codes = true);
  // Makes the pool (DeviceBlockPool::Create: pool_bytes > 0 fixed, 0 growing).
  Status Init(int64_t pool_bytes);

  bool Contains(SequenceId id) const { return replicas_.count(id) > 0; }
  // An empty replica for each layer and KV head of a new sequence; nothing added on error.
  Status AddSequence(SequenceId id);
  // Destroys the sequence's replicas, which give their blocks back: no queued work may still
  // read them.
  void RemoveSequence(SequenceId id);

  // Tokens of the sequence at a layer; NOT_FOUND for a sequence not registered.
  Result<int32_t> Length(SequenceId id, int layer) const;
  // Whether the sequence holds no token at any layer.
  bool Empty(SequenceId id) const;
  // The replicas of a registered sequence's layer, one per KV head.
  using Heads = std::vector<std::unique_ptr<DeviceHeadReplica>>;
  Heads& Layer(SequenceId id, int layer) { return replicas_.at(id).layers[layer]; }
  const Heads& Layer(SequenceId id, int layer) const { return replicas_.at(id).layers[layer]; }

  // Takes the pool blocks each sequence needs for `tokens` more tokens at every layer and KV head,
  // all or nothing: RESOURCE_EXHAUSTED naming the first sequence that cannot have them, and no
  // sequence keeps a block it took here. A sequence whose blocks already hold that many is not
  // walked replica by replica (the decode step's case: a block lasts block_tokens steps).
  Status Reserve(std::span<const SequenceId> ids, int32_t tokens);
  // Gives back the blocks that these sequences' replicas hold beyond their length.
  void ReleaseUnused(std::span<const SequenceId> ids);

  // Adds the replicas' and the pool's memory to the stats (device_bytes, device_bytes_reserved,
  // device_pool_*) and the full-precision rows they stand for (full_precision_bytes).
  void AddStats(AgentStats* stats) const;

 private:
  struct Sequence {
    std::vector<Heads> layers;  // [layer][kv_head]
    // Every replica of the sequence has blocks for at least this many tokens: a lower bound, set
    // by Reserve and cleared by ReleaseUnused (blocks taken elsewhere, e.g. by Append, only raise
    // the truth above it).
    int32_t covered = 0;
  };
  // The most tokens any replica of the sequence holds. Reads head 0 of each layer: the heads of a
  // layer are appended together, head 0 first (the agent's prefill and decode), so no head of a
  // layer is longer than its head 0, even after an append that failed part-way.
  static int32_t Longest(const Sequence& s);

  ModelShape shape_;
  ReplicaParams params_;
  int32_t capacity_tokens_;
  cudaStream_t stream_;
  // Whether the replicas keep their whole groups in the lean decode path's mma layout.
  bool mma_codes_ = false;
  std::unique_ptr<DeviceBlockPool> pool_;  // before replicas_: they give blocks back to it
  // The task lists of the replicas' launches (appends, packing), read in place (a copy could queue
  // behind the fetch's on the copy engine). Before replicas_, which point to it.
  DecodePlan tasks_{DecodePlan::SlotReads::kInPlace};
  std::unordered_map<SequenceId, Sequence> replicas_;  // hashed: looked up per (sequence, layer) in the decode loop
};

}  // namespace specache::cuda
