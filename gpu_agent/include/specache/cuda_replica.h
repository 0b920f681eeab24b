// The low-bit replica of one (sequence, layer, KV head) in device memory: the CUDA counterpart of
// HeadReplica (head_replica.h), with the same streaming rule and, through the bit-identical
// quantization kernels, byte-for-byte the same contents. view() feeds cuda::AttendDecodeRows.
//
// Capacity is fixed at creation (tokens); Append beyond it is RESOURCE_EXHAUSTED. Inputs are
// device pointers; all work is queued on `stream` (void* = cudaStream_t).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "specache/cuda_attention.h"
#include "specache/cuda_quantize.h"
#include "specache/head_replica.h"
#include "specache/status.h"

namespace specache::cuda {

class DeviceHeadReplica {
 public:
  // INVALID_ARGUMENT for parameters the kernels do not support; UNAVAILABLE without a device,
  // RESOURCE_EXHAUSTED when device memory runs out.
  static Result<std::unique_ptr<DeviceHeadReplica>> Create(const ReplicaParams& params, int32_t capacity_tokens,
                                                           void* stream);
  ~DeviceHeadReplica();
  DeviceHeadReplica(const DeviceHeadReplica&) = delete;
  DeviceHeadReplica& operator=(const DeviceHeadReplica&) = delete;

  // Appends n tokens' keys and values ([n][head_dim] fp16, device memory).
  Status Append(const Half* keys, const Half* values, int32_t n);
  // One token to each of many replicas (distinct, same parameters, same stream): keys[i] and
  // values[i] ([head_dim] fp16) go to replicas[i]. The same state as Append(.., 1) on each, in a
  // few launches for all of them (the decode step's path); the rare flushes (a full key group,
  // the window's compaction) run per replica.
  static Status AppendTokens(const std::vector<DeviceHeadReplica*>& replicas, const std::vector<const Half*>& keys,
                             const std::vector<const Half*>& values);

  int32_t length() const { return length_; }
  int32_t quantized_keys() const { return key_groups_ * params_.group_size; }
  int32_t quantized_values() const { return quantized_values_; }
  const ReplicaParams& params() const { return params_; }
  DeviceReplicaView view() const;
  // Bytes of device memory in use for this head (the same accounting as HeadReplica::device_bytes).
  int64_t device_bytes() const;
  // Bytes of device memory allocated for this head (its capacity), >= device_bytes().
  int64_t reserved_bytes() const;

 private:
  DeviceHeadReplica() = default;
  // The full key residual becomes R/G quantized (or fp16) key groups.
  Status FlushKeyGroups();
  // Where the window's oldest value and its quantized slot are.
  ValueTokenTask OldestValueTask() const;
  // Quantizes or moves the window's oldest m values into the quantized store (queued on stream_).
  Status RetireOldestValues(int32_t m);
  // The window's compaction when its start passed R.
  Status CompactWindow();
  struct Buffers;
  ReplicaParams params_;
  int32_t capacity_ = 0;
  void* stream_ = nullptr;
  int32_t length_ = 0, key_groups_ = 0, residual_ = 0, quantized_values_ = 0;
  int32_t window_begin_ = 0, window_count_ = 0;  // tokens of the window buffer in use
  std::unique_ptr<Buffers> b_;
};

}  // namespace specache::cuda
