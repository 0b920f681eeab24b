// The low-bit replica of one (sequence, layer, KV head) in device memory: the CUDA counterpart of
// HeadReplica (head_replica.h), with the same streaming rule and, through the bit-identical
// quantization kernels, byte-for-byte the same contents. view() feeds cuda::AttendDecodeRows.
//
// Paged: the quantized tokens live in fixed-size blocks (ReplicaBlockLayout, cuda_attention.h)
// taken from a DeviceBlockPool as the replica grows and given back when it is destroyed; a
// replica's own allocation is only its key residual, its value window and its block table.
// Inputs are device pointers; all work is queued on `stream` (void* = cudaStream_t).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "specache/cuda_attention.h"
#include "specache/cuda_quantize.h"
#include "specache/cuda_tensors.h"
#include "specache/head_replica.h"
#include "specache/status.h"

namespace specache::cuda {

struct MmaGroupTask;  // mma_codes.h

// The block layout of replicas with these parameters: block_tokens = lcm(R, 128) tokens (whole
// residual flushes and whole 32-token decode blocks), parts 16-byte aligned, blocks 256-byte.
// interleave_groups: the parts interleaved per 32-token group (ReplicaBlockLayout::group_bytes),
// as replicas with mma codes keep them; only for packed keys and values with G = 32 (otherwise
// the layout is not interleaved). Both layouts of one ReplicaParams have the same block bytes,
// so their replicas can share a pool.
ReplicaBlockLayout MakeReplicaBlockLayout(const ReplicaParams& params, bool interleave_groups = false);

// Device memory for the blocks of replicas of one ReplicaParams: one pool per agent, shared by
// all its sequences. Not thread-safe (an agent is used from one thread).
class DeviceBlockPool {
 public:
  // Slab size of a growing pool.
  static constexpr int64_t kSlabBytes = int64_t{64} << 20;

  // limit_bytes > 0: a pool of that many bytes (whole blocks), allocated now, so that running out
  // of device memory shows at start and not mid-decode (RESOURCE_EXHAUSTED if the device has
  // less). 0: a pool that grows by slabs of kSlabBytes as blocks are taken, until the device has
  // no more memory. Slabs are kept until the pool is destroyed.
  static Result<std::unique_ptr<DeviceBlockPool>> Create(const ReplicaParams& params, int64_t limit_bytes);
  // Every block must have been given back, and no queued work may still read one.
  ~DeviceBlockPool();
  DeviceBlockPool(const DeviceBlockPool&) = delete;
  DeviceBlockPool& operator=(const DeviceBlockPool&) = delete;

  const ReplicaBlockLayout& layout() const { return layout_; }
  // Appends n blocks to *out, all or none: RESOURCE_EXHAUSTED when a fixed pool has fewer free
  // (or a growing one cannot get a slab).
  Status Take(int n, std::vector<uint8_t*>* out);
  void Give(uint8_t* block);

  int64_t reserved_bytes() const { return reserved_; }  // allocated from the device
  int64_t used_bytes() const { return used_; }          // in blocks taken
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }

 private:
  DeviceBlockPool() = default;
  Status AddSlab(int64_t blocks);
  ReplicaBlockLayout layout_;
  bool fixed_ = false;
  std::vector<void*> slabs_;
  std::vector<uint8_t*> free_;
  int64_t reserved_ = 0, used_ = 0;
};

class DeviceHeadReplica {
 public:
  // At most capacity_tokens tokens (the block table's length). `pool` (shared, must outlive the
  // replica, made for the same parameters) gives the blocks; null: the replica makes a pool of
  // its own for its whole capacity (tests, tools). mma_codes: keep the groups whose keys and
  // values are both quantized in the low-bit decode's mma layout (mma_codes.h; only for
  // MmaCodesEligible parameters, and only where every item decoded from it has at most 8 queries:
  // the lean path reads those groups, and only it can). INVALID_ARGUMENT for parameters the
  // kernels do not support; UNAVAILABLE without a device, RESOURCE_EXHAUSTED when device memory
  // runs out. `tasks` (must outlive the replica; one per thread of calls, cuda_attention.h) is the
  // plan through which its launches' task lists go (the appends' copies, quantization and packing);
  // null: each such launch makes a plan of its own and waits for it (tests, tools).
  static Result<std::unique_ptr<DeviceHeadReplica>> Create(const ReplicaParams& params, int32_t capacity_tokens,
                                                           void* stream, DeviceBlockPool* pool = nullptr,
                                                           bool mma_codes = false, DecodePlan* tasks = nullptr);
  // Gives its blocks back to the pool: no queued work may still read them.
  ~DeviceHeadReplica();
  DeviceHeadReplica(const DeviceHeadReplica&) = delete;
  DeviceHeadReplica& operator=(const DeviceHeadReplica&) = delete;

  // Takes from the pool the blocks each replica needs to hold extra_tokens more tokens, all or
  // none (same pool and stream): RESOURCE_EXHAUSTED, and nothing taken, when the pool has too
  // few or a replica's capacity would be passed. Append and AppendTokens reserve for themselves;
  // an engine reserves ahead (the agent's BeginStep) so that a step never fails half-way.
  static Status Reserve(const std::vector<DeviceHeadReplica*>& replicas, int32_t extra_tokens);
  // Gives back the blocks beyond what length() needs (a reservation that is not used).
  void ReleaseUnused();

  // Appends n tokens' keys and values ([n][head_dim] fp16, device memory). RESOURCE_EXHAUSTED
  // (nothing appended) when the blocks or the capacity are missing.
  Status Append(const Half* keys, const Half* values, int32_t n);
  // One token to each of many replicas (distinct, same parameters, same stream): keys[i] and
  // values[i] ([head_dim] fp16) go to replicas[i]. The same state as Append(.., 1) on each, in a
  // few launches for all of them (the decode step's path), their task lists through the first
  // replica's plan (Create); the rare flushes (a full key group, the window's compaction) run per replica.
  static Status AppendTokens(const std::vector<DeviceHeadReplica*>& replicas, const std::vector<const Half*>& keys,
                             const std::vector<const Half*>& values);

  int32_t length() const { return length_; }
  // Tokens its blocks hold: up to this length, appends take no block from the pool.
  int32_t reserved_tokens() const;
  int32_t quantized_keys() const { return key_groups_ * params_.group_size; }
  int32_t quantized_values() const { return quantized_values_; }
  const ReplicaParams& params() const { return params_; }
  // The view's block table is in device memory; block_addresses() is its host copy (tests and
  // tools reading the blocks back).
  DeviceReplicaView view() const;
  // A hint for the CPU to start loading what view() and the appends read of this replica: a loop
  // over thousands of replicas (a decode step's) calls it a few replicas ahead, so that their
  // cache misses overlap instead of stalling one after another.
  void Prefetch() const;
  const std::vector<uint8_t*>& block_addresses() const { return blocks_; }
  // Bytes of device memory in use for this head (the same accounting as HeadReplica::device_bytes).
  int64_t device_bytes() const;
  // Bytes of device memory this head holds: its own buffers (fixed_bytes) and its blocks.
  int64_t reserved_bytes() const;
  // Its own allocation: key residual, value window and block table.
  int64_t fixed_bytes() const;

 private:
  DeviceHeadReplica() = default;
  int32_t BlocksFor(int32_t tokens) const;
  uint8_t* BlockAt(int32_t token) const;
  // Where the replica's parts for a key group or a token are (device addresses, host arithmetic).
  uint32_t* KeyCodesAt(int32_t group) const;
  Half* KeyScaleAt(int32_t group, int32_t part_offset) const;  // the scales' or the zeros' part (a layout offset)
  Half* KeyHalfAt(int32_t token) const;
  ValueTokenTask ValueSlot(int32_t token, const Half* value) const;
  Half* ValueHalfAt(int32_t token) const;
  // The full key residual becomes R/G quantized (or fp16) key groups.
  Status FlushKeyGroups();
  // `groups` whole key groups at `keys` ([groups * G][d] fp16, device) become the next quantized
  // (or fp16) groups: one launch for all the replica blocks they fall in (a run per block; fp16
  // groups: a copy per block). key_groups_ must be a multiple of R/G and `groups` too (groups are
  // made R tokens at a time, as the residual would).
  Status StoreKeyGroups(const Half* keys, int32_t groups);
  // StoreKeyGroups without its launch: the quantization runs are added to `runs`, for the caller's
  // one launch over many replicas (fp16 groups are still copied here, a copy per block).
  Status AddKeyGroupRuns(const Half* keys, int32_t groups, std::vector<KeyGroupRun>* runs);
  // `m` value rows at `values` ([m][d] fp16, device) become the next quantized (or fp16) values:
  // one launch for all the replica blocks they fall in (fp16 values: a copy per block).
  Status StoreValues(const Half* values, int32_t m);
  // Quantizes or moves the window's oldest m values into the quantized store (queued on stream_).
  Status RetireOldestValues(int32_t m);
  // The window's compaction when its start passed R.
  Status CompactWindow();
  // CompactWindow's copy as one span of the returned number of rows ([rows][d] fp16, to the
  // window's start), for the caller's one launch over many replicas; the window's start moves now.
  int32_t TakeWindowCompaction(RowCopy* span);
  // With mma codes: the groups that became whole in keys and values since the last call
  // (packed_groups_ .. min(quantized keys, quantized values) / 32), as PackMmaGroups tasks.
  void TakeWholeGroups(std::vector<MmaGroupTask>* tasks);
  Status PackWholeGroups();
  // Its own device allocation (one cudaMalloc): key residual, value window, block table and key
  // scale bound. Held in the replica, not behind a pointer: view() reads it for every item of every
  // decode step (at 99 x 8K, 25K replicas a step; the extra pointer chase was ~5% of the host's
  // step time).
  struct Buffers {
    void* memory = nullptr;
    int64_t bytes = 0;
    Half* key_residual = nullptr;      // [R][d]
    Half* window = nullptr;            // [3R][d]: window_begin .. +window_count in use
    uint8_t** table = nullptr;         // [max_blocks] device addresses of the blocks
    float* key_scale_bound = nullptr;  // with mma codes: DeviceReplicaView::key_scale_bound
    Buffers() = default;
    Buffers(const Buffers&) = delete;
    Buffers& operator=(const Buffers&) = delete;
    ~Buffers();  // frees `memory`
  };
  ReplicaParams params_;
  int32_t capacity_ = 0, max_blocks_ = 0;
  void* stream_ = nullptr;
  DecodePlan* tasks_ = nullptr;  // Create's `tasks`
  int32_t length_ = 0, key_groups_ = 0, residual_ = 0, quantized_values_ = 0;
  int32_t window_begin_ = 0, window_count_ = 0;  // tokens of the window buffer in use
  bool mma_codes_ = false;
  ReplicaBlockLayout layout_;  // the pool's blocks, interleaved by group with mma codes
  int32_t packed_groups_ = 0;  // with mma codes: the groups [0, packed_groups_) are in the mma layout
  std::unique_ptr<DeviceBlockPool> own_pool_;    // when none was given; destroyed after the blocks go back
  DeviceBlockPool* pool_ = nullptr;
  std::vector<uint8_t*> blocks_;                 // host copy of the block table
  Buffers b_;
};

}  // namespace specache::cuda
