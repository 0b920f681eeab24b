// KIVI quantization on the GPU (prefill and residual flushes), bit-identical to the CPU reference
// in quantizer.h: same (s, z) rounding to fp16, same round-half-up codes, same packed layout.
// Device pointers; streams as void* (cudaStream_t). UNAVAILABLE without CUDA.
#pragma once

#include <cstdint>

#include "specache/half.h"
#include "specache/status.h"

namespace specache::cuda {

class DecodePlan;          // cuda_attention.h
struct DeviceReplicaView;  // cuda_attention.h
struct RowCopy;            // cuda_tensors.h

// keys: [n_groups][group_size][head_dim] fp16 (token-major groups, one after another).
// codes: [n_groups][head_dim][group_size*bits/32], scale/zero: [n_groups][head_dim].
Status QuantizeKeyGroups(const Half* keys, int n_groups, int group_size, int head_dim, int bits, uint32_t* codes,
                         Half* scale, Half* zero, void* stream);

// values: [n_tokens][head_dim] fp16. codes: [n_tokens][head_dim/group_size][group_size*bits/32],
// scale/zero: [n_tokens][head_dim/group_size].
Status QuantizeValueTokens(const Half* values, int n_tokens, int head_dim, int group_size, int bits,
                           uint32_t* codes, Half* scale, Half* zero, void* stream);

// Runs of key groups (or value tokens), each quantized into its own contiguous destination (one
// replica block's, or one 32-token group's when the block is interleaved by group): what
// QuantizeKeyGroups (QuantizeValueTokens) does for one run, for many runs in one launch per
// kMaxQuantizeRuns runs (an 8K prompt's 256 groups, not a launch per block or group; ~11 KB of
// kernel parameters). Runs of 0 are skipped; one launch holds at most 2^30 groups (tokens).
struct KeyGroupRun {
  const Half* keys = nullptr;  // [n_groups][group_size][head_dim]
  uint32_t* codes = nullptr;   // [n_groups][head_dim][group_size*bits/32]
  Half* scale = nullptr;       // [n_groups][head_dim]
  Half* zero = nullptr;
  int32_t n_groups = 0;
};
struct ValueTokenRun {
  const Half* values = nullptr;  // [n_tokens][head_dim]
  uint32_t* codes = nullptr;     // [n_tokens][head_dim/group_size][group_size*bits/32]
  Half* scale = nullptr;         // [n_tokens][head_dim/group_size]
  Half* zero = nullptr;
  int32_t n_tokens = 0;
};
constexpr int kMaxQuantizeRuns = 256;
Status QuantizeKeyGroupRuns(const KeyGroupRun* runs, int n_runs, int group_size, int head_dim, int bits, void* stream);
Status QuantizeValueTokenRuns(const ValueTokenRun* runs, int n_runs, int head_dim, int group_size, int bits,
                              void* stream);
// What QuantizeKeyGroupRuns does, in one launch for any number of runs: a task per key group
// through a slot of `plan` (cuda_attention.h; null: a plan of the call's own, which waits for the
// kernel), not the runs by value in the launch's parameters. The decode step's appends (a run per
// replica whose residual filled, every replica of a layer in the same step) go this way.
Status QuantizeKeyGroupTasks(const KeyGroupRun* runs, int n_runs, int group_size, int head_dim, int bits, void* stream,
                             DecodePlan* plan = nullptr);

// Where one value token's quantized parts go: codes [head_dim/group_size][group_size*bits/32],
// scales and zeros [head_dim/group_size] (DeviceHeadReplica::ValueSlot finds them on the host).
struct ValueTokenTask {
  const Half* value = nullptr;  // [head_dim]
  uint32_t* codes = nullptr;
  Half* scale = nullptr;
  Half* zero = nullptr;
};

// One value token of some replica quantized into the replica's blocks, its place found on the
// device from the replica's block table (so the host reads none): token `token` of the replica's
// quantized values (the accessors of cuda_attention.h: ValueCodes, ValueScales, ValueZeros).
struct ValueRetireTask {
  const Half* value = nullptr;           // [head_dim]
  const uint8_t* const* blocks = nullptr;  // the replica's block table, device memory (DeviceReplicaView::blocks)
  int32_t token = 0;
};
// What QuantizeValueTokens does for n_tokens = 1, for many replicas in one launch (the decode
// step's appends, a value leaving each replica's window), the tasks through a slot of `plan`
// (cuda_attention.h; null: a plan of the call's own, which waits for the kernel). `geometry`: what
// the tasks' replicas share (head_dim, group_size, value_bits, layout); its other fields unused.
Status QuantizeValueTokensInBlocks(const ValueRetireTask* tasks, int n_tasks, const DeviceReplicaView& geometry,
                                   void* stream, DecodePlan* plan = nullptr);
// CopyRows(copies, n_copies, row_bytes) (cuda_tensors.h) and QuantizeValueTokensInBlocks(tasks,
// n_tasks, geometry) in one launch, both lists through one slot of `plan` (a decode step's
// appends: the new rows into the replicas' residuals and windows, the oldest values out of the
// windows; a launch fewer a layer). No copy may write what a task reads: the two run at once.
Status CopyRowsAndQuantizeValueTokensInBlocks(const RowCopy* copies, int n_copies, int row_bytes,
                                              const ValueRetireTask* tasks, int n_tasks,
                                              const DeviceReplicaView& geometry, void* stream,
                                              DecodePlan* plan = nullptr);

}  // namespace specache::cuda
