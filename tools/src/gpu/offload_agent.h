// Full offload, FlexGen-style: the whole fp16 KV cache in pinned host memory and none of it kept on
// the device between layers. Every decode step copies each layer's K/V of every sequence to the
// device (two layers in flight on a copy stream, so layer L+1's copy overlaps layer L's compute)
// and attends over all of it exactly, with the agent's 16-bit decode kernel
// (cuda::AttendDecodeBatch over a replica view with no quantized part). Results equal `full`.
//
// The anchor row of specache-run bench: what fetching every row each step costs. It speaks the
// Agent API (one row per step, as `full`), so the same engine loop drives it; prefill is
// store-only (PrefillBatch::out must be null), and nothing is selected (SelectedTokens:
// UNIMPLEMENTED). Device tensors on options.stream, as the CUDA agent.
#pragma once

#include <cstdint>
#include <memory>

#include "specache/agent.h"

namespace specache::gpu {

struct OffloadOptions {
  int32_t capacity_tokens = 32768;  // most tokens per sequence (its host buffer is sized for it)
  void* stream = nullptr;           // the engine's cudaStream_t
};

// UNAVAILABLE without CUDA or a device; RESOURCE_EXHAUSTED when host or device memory runs out.
Result<std::unique_ptr<Agent>> CreateOffloadAgent(const ModelShape& shape, const OffloadOptions& options);

}  // namespace specache::gpu
